import type { ChannelModel, ConfirmChannel, Message } from 'amqplib';
import { BoundedMap } from '../bounded-map.js';
import type { BridgeError } from '../errors.js';
import { DUPLICATE_ID_HEADER } from '../headers.js';
import type { Logger } from '../log.js';
import type { Publish, PublishOutcome, Target } from '../ports.js';
import { ContentHeaderError, contentHeaderOf } from '../wire/properties.js';
import { accessRefused, replyCodeOf } from './errors.js';
import { ChannelGoneError, gateWrites, publishRaw, resetConnection } from './internals.js';
import { ClosedOverSize, refusalOfClose, tooLargeDetail } from './refusal.js';
import { checkExchangeExists, checkQueueExists, openChannel } from './source.js';

/** A body this many times the largest the target took is tried alone (see untried). */
const UNTRIED_GROWTH = 1.25;

/** The reply code with which a broker closes a channel over one message it refuses. */
const MESSAGE_REFUSED = 406;

/**
 * What one write said, before the target sorts it into a PublishOutcome: 'killed' is a close of
 * its channel by the broker with a 406 while it was in flight, perhaps for this very message.
 */
type Answer = PublishOutcome | 'killed';

/** Remembered IDs that were in flight at such a close (see suspects). */
const MAX_SUSPECT_MEMORY = 10_000;

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
export class TargetPublisher implements Target {
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
  /**
   * IDs in flight when the broker closed a channel over a message, or refused for their size:
   * each goes alone on the trial channel, one at a time, so that a close there is that message's
   * doing and a poison message closes the ordinary channel once, not at each retry.
   */
  private readonly suspects = new BoundedMap<string, true>(MAX_SUSPECT_MEMORY);
  private suspectTurn: Promise<void> = Promise.resolve();
  /** Publishes waiting in ready(), not yet in `pending`. */
  private waitingReady = 0;
  private quietWaiters: (() => void)[] = [];
  /** Per channel: whether it has closed (then a failed confirm means "lost", not "nacked"). */
  private readonly closedFlags = new WeakMap<ConfirmChannel, ChannelEnd>();
  /** Called when the channel closes under us: the owner reconnects. */
  onBroken: (reason: string) => void = () => {};
  /** Called when the target refuses us for good (no write permission): the owner stops. */
  onFatal: (error: BridgeError) => void = () => {};
  /** Told when a write gate reset the connection (see gate): frames outlived their writeBy here. */
  onStaleWrites: () => void = () => {};
  /** Per connection: the publishes handed to amqplib since its last write cycle emptied its buffers. */
  private readonly unwritten = new WeakMap<ChannelModel, Publish[]>();
  /** Each channel's connection's list in `unwritten`: one lookup per publish. */
  private readonly unwrittenOf = new WeakMap<ConfirmChannel, Publish[]>();

  constructor(
    /** '' is the default exchange (then the routing key names the target queue). */
    private readonly exchange: string,
    /** The routing key of every publish (the target queue's name); undefined: each message's own. */
    private readonly routingKey: string | undefined,
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

  /**
   * A publish checked against its writeBy still waits in amqplib's buffers for the connection's
   * next write cycle: if the process stalled in between (SIGSTOP, a paused VM), its frames would
   * leave on waking, after another owner took the ID over and sent a flagged copy. So the cycle
   * checks them again, as they are then (a renewal moves writeBy on), and resets the connection
   * instead of writing when one is past it. A publish already answered has left and is not looked at.
   */
  private gate(connection: ChannelModel): Publish[] {
    const unwritten: Publish[] = [];
    this.unwritten.set(connection, unwritten);
    gateWrites(connection, {
      mayWrite: () => {
        if (unwritten.length === 0) return true;
        const now = performance.now();
        let stale = false;
        let kept = 0;
        for (const publish of unwritten) {
          if (!publish.written) continue;
          if (publish.writeBy < now) stale = true;
          unwritten[kept++] = publish;
        }
        unwritten.length = kept;
        if (!stale) return true;
        unwritten.length = 0;
        this.onStaleWrites();
        const reason = 'publishes past their writeBy were still on this host (the process stalled)';
        this.log.warn({ reason }, `${this.where}: resetting the connection`);
        resetConnection(connection, reason);
        return false;
      },
      wrote: (all) => {
        if (all) unwritten.length = 0;
      },
    });
    return unwritten;
  }

  /** A confirm channel whose closes and returns are tracked (the main one, or a trial channel). */
  private async openPublishing(connection: ChannelModel, name: string): Promise<ConfirmChannel> {
    const channel = await connection.createConfirmChannel();
    this.unwrittenOf.set(channel, this.unwritten.get(connection) ?? this.gate(connection));
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
   * Publishes a message with `mandatory` and tells `answered` what became of it (a callback, not
   * a promise: the hot path holds one promise per batch, not one per message). A message that was
   * in flight when the broker closed the channel over a message, or that was refused for its size,
   * goes alone on the trial channel from then on (see suspects).
   */
  send(publish: Publish, answered: (outcome: PublishOutcome) => void): void {
    if (this.suspects.has(publish.id)) {
      // Should it ever fail, nothing says whether it was stored: sent again, flagged.
      this.alone(() => this.publishAlone(publish)).then(answered, () => answered('unknown'));
      return;
    }
    this.sendOrdinary(publish, answered);
  }

  private sendOrdinary(publish: Publish, answered: (outcome: PublishOutcome) => void): void {
    if (this.behindTrial) {
      // In order behind a message being tried alone (see untried).
      this.behindTrial.push(() => this.sendOrdinary(publish, answered));
      return;
    }
    const size = publish.content.length;
    // Known to be refused: sent here, it would close the ordinary channel and put every publish in
    // flight on it in doubt. (Retried, it goes alone on the trial channel, and may go through.)
    if (this.sizeLimit !== undefined && size > this.sizeLimit) {
      publish.refusal = tooLargeDetail(size, this.sizeLimit);
      this.suspects.set(publish.id, true);
      answered('too-large');
      return;
    }
    if (this.untried(size)) {
      this.tryAlone(publish, answered);
      return;
    }
    const onAnswer = (answer: Answer) => answered(this.sorted(publish, answer, false));
    // The usual case, connected and not held back, without waiting a turn for ready().
    const channel = this.channel;
    if (channel && !this.blocked && !this.drained && !this.closed) {
      this.publishOn(channel, publish, onAnswer);
      return;
    }
    this.waitingReady++;
    void this.ready().then((ready) => {
      this.waitingReady--;
      if (ready) this.publishOn(ready, publish, onAnswer);
      else answered('unknown');
      this.wakeIfQuiet();
    });
  }

  /**
   * The outcome of one write. A close by the broker (406) while it was in flight: on the trial
   * channel, alone, it was this message's doing, and its words say why; on the ordinary channel
   * it may have been any message's, so this one is in doubt and goes alone when it comes back.
   */
  private sorted(publish: Publish, answer: Answer, alone: boolean): PublishOutcome {
    if (answer === 'stored') {
      if (this.suspects.has(publish.id)) this.suspects.delete(publish.id);
      return answer;
    }
    if (answer === 'too-large') this.suspects.set(publish.id, true);
    if (answer !== 'killed') return answer;
    // Its retry, or a copy redelivered, goes alone again: were it tried at a size proven since,
    // on the ordinary channel, it would close that one and put every publish in flight in doubt.
    this.suspects.set(publish.id, true);
    if (!alone) {
      // The broker's words may be about another message: not this one's refusal, if it gets one.
      publish.refusal = undefined;
      return 'unknown';
    }
    const refusal = refusalOfClose(publish.refusal);
    publish.refusal = refusal.detail;
    return refusal.sizeLimit === undefined ? 'rejected' : 'too-large';
  }

  /** Runs publishes of suspect messages one at a time, each alone on the trial channel. */
  private alone<T>(work: () => Promise<T>): Promise<T> {
    const turn = this.suspectTurn.then(work, work);
    this.suspectTurn = turn.then(
      () => undefined,
      () => undefined,
    );
    return turn;
  }

  /**
   * Publishes a message of an untried size alone on the trial channel, and the publishes sent
   * after it once it is answered, in their order: a broker that refuses it for its size closes
   * the trial channel, not the ordinary one with every publish in flight on it (whose unconfirmed
   * ones would all be in doubt), and its answer tells the size limit. Sizes grow in few records
   * (see untried), so this costs a round trip now and then, and the order stays the source's.
   */
  private tryAlone(publish: Publish, answered: (outcome: PublishOutcome) => void): void {
    this.behindTrial = [];
    // After every publish before it was answered: the broker runs each channel on its own, so a
    // message on the trial channel could otherwise be stored ahead of earlier ones.
    // Then in turn with the suspects: one publish at a time on the trial channel, so that a close
    // there is the doing of the one message on it (see sorted).
    void this.quiet()
      .then(() => this.alone(() => this.publishAlone(publish)))
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
   * Publishes one message alone on the trial channel (the callers send one at a time): a close
   * then is this very message's doing.
   */
  private async publishAlone(publish: Publish): Promise<PublishOutcome> {
    if (!(await this.ready())) return 'unknown';
    let channel: ConfirmChannel | undefined;
    try {
      channel = await this.trialChannel();
    } catch {
      channel = undefined;
    }
    if (!channel) return 'unknown';
    const trial = channel;
    return new Promise((resolve) =>
      this.publishOn(trial, publish, (answer) => resolve(this.sorted(publish, answer, true)), false),
    );
  }

  private publishOn(
    channel: ConfirmChannel,
    publish: Publish,
    answered: (answer: Answer) => void,
    watchDrain = true,
  ): void {
    if (performance.now() > publish.writeBy) {
      answered('fenced');
      return;
    }
    const closed = this.closedFlags.get(channel) as ChannelEnd;
    const { id, content } = publish;
    publish.written = true;
    const pending: Pending = { returned: false };
    this.pending.set(id, pending);
    const settle = (answer: Answer) => {
      if (this.pending.get(id) === pending) this.pending.delete(id);
      // Answered: nothing of it is on its way any more.
      publish.written = false;
      answered(answer);
      if (this.quietWaiters.length > 0) this.wakeIfQuiet();
    };
    const routingKey = this.routingKey ?? publish.routingKey;
    try {
      const ok = publishRaw(channel, this.exchange, routingKey, publish.properties, content, (error) => {
        if (!error) {
          if (content.length > this.provenSize) this.provenSize = content.length;
          // Taken above the limit it told: the operator raised it. Unknown again until it refuses.
          if (this.sizeLimit !== undefined && content.length > this.sizeLimit) this.sizeLimit = undefined;
          settle(pending.returned ? 'unroutable' : 'stored');
          return;
        }
        // amqplib calls back with an error both for a nack and for a closed channel; the close
        // listeners run synchronously, so by the next microtask we know which one it was.
        queueMicrotask(() => {
          if (closed.closed && closed.overSize) {
            // amqplib fails the unconfirmed publishes in the order they were sent.
            const side = closed.overSize.next(content.length);
            if (side === 'refused') publish.refusal = tooLargeDetail(content.length, closed.overSize.limit);
            settle(side === 'refused' ? 'too-large' : side === 'not-stored' ? 'unsent' : 'unknown');
            return;
          }
          if (closed.closed && closed.byServer) {
            // The broker's words, for sorted() to read.
            publish.refusal = closed.reason;
            settle('killed');
            return;
          }
          settle(closed.closed ? 'unknown' : 'rejected');
        });
      });
      // Its frames are in amqplib's buffers now, until the next write cycle (see gate).
      this.unwrittenOf.get(channel)?.push(publish);
      if (!ok && watchDrain && !this.drained) this.waitForDrain(channel);
    } catch (error) {
      if (error instanceof ChannelGoneError) {
        settle('unsent');
        return;
      }
      // Nothing was sent: this message cannot go as it is (a header over frame_max, say).
      publish.refusal = error instanceof Error ? error.message : String(error);
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
    resetConnection(connection, reason);
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
