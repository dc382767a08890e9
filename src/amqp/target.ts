import type { ChannelModel, ConfirmChannel, Message } from 'amqplib';
import type { BridgeError } from '../errors.js';
import { DUPLICATE_ID_HEADER } from '../headers.js';
import type { Logger } from '../log.js';
import { accessRefused, replyCodeOf } from './errors.js';
import { ChannelGoneError, publishRaw, resetConnection } from './internals.js';
import { ContentHeaderError, contentHeaderOf } from './properties.js';
import { ClosedOverSize, refusalOfClose, tooLargeDetail } from './refusal.js';
import { checkExchangeExists, checkQueueExists, openChannel } from './source.js';

/** Where a publish that cannot be sent says why. */
interface Refusal {
  refusal?: string;
  /** The broker's words when it closed the channel this publish was in flight on. */
  closedBy?: string;
  /**
   * performance.now() past which this message must not be written: checked at the write itself,
   * after any wait for the connection, an alarm or a full buffer (undefined: no limit).
   */
  writeBy?: number;
  /** Set while it is written (handed to the connection) and unanswered, not merely waiting. */
  written?: boolean;
}

/** A body this many times the largest the target took is tried alone (see untried). */
const UNTRIED_GROWTH = 1.25;

/** The reply code with which a broker closes a channel over one message it refuses. */
const MESSAGE_REFUSED = 406;

/** What the target said about one publish. */
export type PublishOutcome =
  | 'confirmed' // stored (and routed) by the target
  | 'returned' // unroutable: no queue bound for it (basic.return, then confirmed)
  | 'nacked' // the target refused it (e.g. a queue over its length limit with reject-publish)
  | 'lost' // the connection went away before the confirm: the target may or may not hold it
  | 'killed' // the broker closed the channel with an error while this was in flight (maybe for it)
  | 'unpublishable' // the bridge cannot publish it as it is (never sent; see lastRefusal)
  | 'fenced' // not sent: its `writeBy` had passed (the lease it goes under is not known live)
  | 'too-large' // over the target's max_message_size: refused by the broker, or known to be (see refusal)
  | 'discarded'; // never stored: not sent (its channel was gone), or dropped unread after a close

/** How a channel ended: whether it closed, and whether the broker closed it with an error. */
interface ChannelEnd {
  closed: boolean;
  byServer: boolean;
  /** The broker's close text, when it closed the channel over a message. */
  reason?: string;
  /** When the close was over a message's size: sorts the publishes it left unconfirmed. */
  overSize?: ClosedOverSize;
}

interface Pending {
  returned: boolean;
}

/**
 * The target side: one confirm channel, publishing with `mandatory`, attached to each new
 * connection. Publishing waits while the target is disconnected or has blocked us (a memory or
 * disk alarm), and whenever amqplib's write buffer is full ('drain'). A returned message is matched
 * to its publish by its `_HQ_DUPL_ID`: one publish per ID is in flight at a time.
 *
 * A message suspected of making the broker close the channel (over its max_message_size, say) is
 * tried alone on a trial channel of its own, one at a time, so that a close there can only be that
 * message's doing, and the ordinary publishes go on meanwhile.
 */
export class TargetPublisher {
  private channel: ConfirmChannel | undefined;
  private connection: ChannelModel | undefined;
  private trial: Promise<ConfirmChannel> | undefined;
  private blocked = false;
  private blockedAt: { since: number; reason: string } | undefined;
  private closed = false;
  private wakeReady: (() => void)[] = [];
  private drained: Promise<void> | undefined;
  private readonly pending = new Map<string, Pending>();
  /** The target's max_message_size, once it closed a channel over a message larger than that. */
  sizeLimit: number | undefined;
  /** The largest body the target took (confirmed or returned): its size limit is at least that. */
  private provenSize = 0;
  /** Publishes waiting, in order, for a message of an untried size to be answered (see tryAlone). */
  private behindTrial: (() => void)[] | undefined;
  /** Publishes waiting in ready(), not yet in `pending`. */
  private waitingReady = 0;
  private quietWaiters: (() => void)[] = [];
  /** Per channel: whether it has closed (then a failed confirm means "lost", not "nacked"). */
  private readonly closedFlags = new WeakMap<ConfirmChannel, ChannelEnd>();
  /** Called when the channel closes under us: the owner reconnects. */
  onBroken: (reason: string) => void = () => {};
  /** Called when the target refuses us for good (no write permission): the owner stops. */
  onFatal: (error: BridgeError) => void = () => {};

  constructor(
    private readonly exchange: string,
    private readonly queue: string | undefined,
    private readonly where: string,
    private readonly log: Logger,
  ) {}

  async attach(connection: ChannelModel): Promise<void> {
    await this.checkDestination(connection);
    const channel = await this.openPublishing(connection, 'target channel');
    channel.on('close', () => {
      if (this.channel === channel) this.onBroken('target channel closed');
    });
    this.connection = connection;
    this.trial = undefined;
    connection.on('blocked', (reason: string) => {
      this.blocked = true;
      this.blockedAt ??= { since: Date.now(), reason };
      this.log.warn({ reason }, `${this.where}: blocked publishing (resource alarm); waiting`);
    });
    connection.on('unblocked', () => {
      this.blocked = false;
      this.blockedAt = undefined;
      this.log.info(`${this.where}: unblocked publishing`);
      this.wake();
    });
    this.blocked = false;
    this.blockedAt = undefined;
    this.drained = undefined;
    this.channel = channel;
    this.wake();
  }

  detach(): void {
    this.channel = undefined;
    this.connection = undefined;
    this.trial = undefined;
    this.drained = undefined;
  }

  /** A confirm channel whose closes and returns are tracked (the main one, or a trial channel). */
  private async openPublishing(connection: ChannelModel, name: string): Promise<ConfirmChannel> {
    const channel = await connection.createConfirmChannel();
    const flag: ChannelEnd = { closed: false, byServer: false };
    this.closedFlags.set(channel, flag);
    channel.on('error', (error: Error) => {
      // Only PRECONDITION_FAILED can be one message's doing (over max_message_size, a bad
      // expiration, a user_id that is not ours): such a close makes the messages in flight suspects.
      // Any other code (access refused, an exchange deleted) is about the route, never a message:
      // those publishes are lost and go again, or the route stops.
      if (replyCodeOf(error) === MESSAGE_REFUSED) {
        flag.byServer = true;
        flag.reason = error.message;
        const { sizeLimit } = refusalOfClose(error.message);
        if (sizeLimit !== undefined) {
          this.sizeLimit = sizeLimit;
          flag.overSize = new ClosedOverSize(sizeLimit);
        }
      }
      this.log.warn({ error: error.message }, `${name} error`);
      if (replyCodeOf(error) === 403) this.onFatal(accessRefused(this.where, error, 'write'));
    });
    channel.on('return', (message: Message) => this.markReturned(message));
    channel.on('close', () => {
      flag.closed = true;
    });
    return channel;
  }

  /** The trial channel on the current connection, opened on first use and after each close. */
  private trialChannel(): Promise<ConfirmChannel> | undefined {
    const connection = this.connection;
    if (!connection) return undefined;
    if (!this.trial) {
      const opening = this.openPublishing(connection, 'target trial channel');
      this.trial = opening;
      opening.then(
        (channel) =>
          channel.on('close', () => {
            if (this.trial === opening) this.trial = undefined;
          }),
        () => {
          if (this.trial === opening) this.trial = undefined;
        },
      );
    }
    return this.trial;
  }

  /** Checks that the destination exists, so a typo fails before anything moves. */
  private async checkDestination(connection: ChannelModel): Promise<void> {
    const probe = await openChannel(connection, this.log);
    try {
      if (this.queue !== undefined) {
        await checkQueueExists(probe, this.queue, this.where, '--target-queue');
      } else if (this.exchange !== '') {
        await checkExchangeExists(probe, this.exchange, this.where);
      }
    } finally {
      await probe.close().catch(() => {});
    }
  }

  /**
   * Whether a body this large is untried: no size limit is known and it is over a quarter larger
   * than anything the target took. Such a message is tried alone (see tryAlone): sizes that only
   * creep up cost a trial at each quarter's growth, not one each.
   */
  private untried(size: number): boolean {
    return this.sizeLimit === undefined && size > this.provenSize * UNTRIED_GROWTH;
  }

  get isBlocked(): boolean {
    return this.blocked;
  }

  /** Since when the target has blocked publishing, and the broker's reason ("low on memory"). */
  get blockedSince(): { since: number; reason: string } | undefined {
    return this.blockedAt;
  }

  private wake(): void {
    for (const wake of this.wakeReady.splice(0)) wake();
  }

  /** Resolves with a channel once connected and not blocked; undefined once closed for good. */
  private async ready(): Promise<ConfirmChannel | undefined> {
    for (;;) {
      if (this.closed) return undefined;
      if (this.channel && !this.blocked && !this.drained) return this.channel;
      if (this.drained && this.channel && !this.blocked) {
        await this.drained;
        continue;
      }
      await new Promise<void>((resolve) => this.wakeReady.push(resolve));
    }
  }

  /**
   * Publishes a message with `mandatory` and tells `answered` what the target said (a callback,
   * not a promise: the hot path holds one promise per batch, not one per message). `header` is the
   * raw content header (property flags and list) to send; `matchKey` is the wire value of its
   * `_HQ_DUPL_ID` field (see matchKeyOf), by which a returned message is matched to its publish.
   */
  send(
    exchange: string,
    routingKey: string | Buffer,
    header: Buffer,
    content: Buffer,
    matchKey: string,
    note: Refusal,
    answered: (outcome: PublishOutcome) => void,
  ): void {
    if (this.behindTrial) {
      // In order behind a message being tried alone (see untried).
      this.behindTrial.push(() => this.send(exchange, routingKey, header, content, matchKey, note, answered));
      return;
    }
    // Known to be refused: sent here, it would close the ordinary channel and put every publish in
    // flight on it in doubt. (Alone on the trial channel it may still go: see publishAlone.)
    if (this.sizeLimit !== undefined && content.length > this.sizeLimit) {
      note.refusal = tooLargeDetail(content.length, this.sizeLimit);
      answered('too-large');
      return;
    }
    if (this.untried(content.length)) {
      this.tryAlone(exchange, routingKey, header, content, matchKey, note, answered);
      return;
    }
    // The usual case, connected and not held back, without waiting a turn for ready().
    const channel = this.channel;
    if (channel && !this.blocked && !this.drained && !this.closed) {
      this.publishOn(channel, exchange, routingKey, header, content, matchKey, note, answered);
      return;
    }
    this.waitingReady++;
    void this.ready().then((ready) => {
      this.waitingReady--;
      if (ready) this.publishOn(ready, exchange, routingKey, header, content, matchKey, note, answered);
      else answered('lost');
      this.wakeIfQuiet();
    });
  }

  /**
   * Publishes a message of an untried size alone on the trial channel, and the publishes sent
   * after it once it is answered, in their order: a broker that refuses it for its size closes
   * the trial channel, not the ordinary one with every publish in flight on it (whose unconfirmed
   * ones would all be in doubt), and its answer tells the size limit. Sizes grow in few records
   * (see untried), so this costs a round trip now and then, and the order stays the source's.
   */
  private tryAlone(
    exchange: string,
    routingKey: string | Buffer,
    header: Buffer,
    content: Buffer,
    matchKey: string,
    note: Refusal,
    answered: (outcome: PublishOutcome) => void,
  ): void {
    this.behindTrial = [];
    // After every publish before it was answered: the broker runs each channel on its own, so a
    // message on the trial channel could otherwise be stored ahead of earlier ones.
    void this.quiet()
      .then(() => this.publishAlone(exchange, routingKey, header, content, matchKey, note))
      .then((outcome) => {
        const waiting = this.behindTrial ?? [];
        this.behindTrial = undefined;
        answered(outcome);
        // Each may be untried too: it then holds the rest behind it in turn.
        for (const next of waiting) next();
      });
  }

  /** Resolves once every publish sent so far was answered. */
  private quiet(): Promise<void> {
    if (this.pending.size === 0 && this.waitingReady === 0) return Promise.resolve();
    return new Promise((resolve) => this.quietWaiters.push(resolve));
  }

  private wakeIfQuiet(): void {
    if (this.pending.size > 0 || this.waitingReady > 0) return;
    for (const wake of this.quietWaiters.splice(0)) wake();
  }

  /**
   * Publishes one suspect message alone on the trial channel (the caller sends one at a time):
   * 'killed' then means the broker closed the channel for this very message.
   */
  async publishAlone(
    exchange: string,
    routingKey: string | Buffer,
    header: Buffer,
    content: Buffer,
    matchKey: string,
    note: Refusal = {},
  ): Promise<PublishOutcome> {
    if (!(await this.ready())) return 'lost';
    let channel: ConfirmChannel | undefined;
    try {
      channel = await this.trialChannel();
    } catch {
      channel = undefined;
    }
    if (!channel) return 'lost';
    const trial = channel;
    return new Promise((resolve) =>
      this.publishOn(trial, exchange, routingKey, header, content, matchKey, note, resolve, false),
    );
  }

  private publishOn(
    channel: ConfirmChannel,
    exchange: string,
    routingKey: string | Buffer,
    header: Buffer,
    content: Buffer,
    matchKey: string,
    note: Refusal,
    answered: (outcome: PublishOutcome) => void,
    watchDrain = true,
  ): void {
    if (note.writeBy !== undefined && performance.now() > note.writeBy) {
      answered('fenced');
      return;
    }
    const closed = this.closedFlags.get(channel) as ChannelEnd;
    note.written = true;
    const pending: Pending = { returned: false };
    this.pending.set(matchKey, pending);
    const settle = (outcome: PublishOutcome) => {
      if (this.pending.get(matchKey) === pending) this.pending.delete(matchKey);
      // Answered: nothing of it is on its way any more.
      note.written = false;
      answered(outcome);
      if (this.quietWaiters.length > 0) this.wakeIfQuiet();
    };
    try {
      const ok = publishRaw(channel, exchange, routingKey, header, content, (error) => {
        if (!error) {
          if (content.length > this.provenSize) this.provenSize = content.length;
          // Taken above the limit it told: the operator raised it. Unknown again until it refuses.
          if (this.sizeLimit !== undefined && content.length > this.sizeLimit) this.sizeLimit = undefined;
          settle(pending.returned ? 'returned' : 'confirmed');
          return;
        }
        // amqplib calls back with an error both for a nack and for a closed channel; the close
        // listeners run synchronously, so by the next microtask we know which one it was.
        queueMicrotask(() => {
          if (closed.closed && closed.byServer) note.closedBy = closed.reason;
          if (closed.closed && closed.overSize) {
            // amqplib fails the unconfirmed publishes in the order they were sent.
            const side = closed.overSize.next(content.length);
            if (side === 'refused') note.refusal = tooLargeDetail(content.length, closed.overSize.limit);
            settle(side === 'refused' ? 'too-large' : side === 'not-stored' ? 'discarded' : 'lost');
            return;
          }
          settle(closed.closed ? (closed.byServer ? 'killed' : 'lost') : 'nacked');
        });
      });
      if (!ok && watchDrain && !this.drained) this.waitForDrain(channel);
    } catch (error) {
      if (error instanceof ChannelGoneError) {
        settle('discarded');
        return;
      }
      // Nothing was sent: this message cannot go as it is (a header over frame_max, say).
      note.refusal = error instanceof Error ? error.message : String(error);
      settle('unpublishable');
    }
  }

  private waitForDrain(channel: ConfirmChannel): void {
    this.drained = new Promise((resolve) => {
      const done = () => {
        channel.off('drain', done);
        channel.off('close', done);
        if (this.channel === channel) this.drained = undefined;
        resolve();
      };
      channel.on('drain', done);
      channel.on('close', done);
    });
  }

  private markReturned(message: Message): void {
    const pending = this.pending.get(matchKeyOf(message));
    if (pending) pending.returned = true;
    else this.log.warn('target returned a message the bridge cannot match to a publish');
  }

  /**
   * Resets the target connection (see resetConnection): publishes not yet confirmed end as 'lost',
   * and what had not left this host is never sent. The link reconnects as after any loss.
   */
  reset(reason: string): void {
    const connection = this.connection;
    if (!connection) return;
    this.log.warn({ reason }, `${this.where}: resetting the connection`);
    resetConnection(connection);
  }

  /** Ends every wait for the target (publishes still waiting resolve as 'lost'). */
  close(): void {
    this.closed = true;
    this.wake();
  }
}

/** The wire value of a message's `_HQ_DUPL_ID` as a map key ('' when it has none). */
function matchKeyOf(message: Message): string {
  try {
    const header = contentHeaderOf(message.properties);
    const span = header.field(DUPLICATE_ID_HEADER);
    return span ? header.valueBytes(span).toString('latin1') : '';
  } catch (error) {
    if (error instanceof ContentHeaderError) return '';
    throw error;
  }
}
