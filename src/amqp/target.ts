import type { ChannelModel, ConfirmChannel, Message, Options } from 'amqplib';
import { DUPLICATE_ID_HEADER, keyOfValue } from '../dedup/id.js';
import type { BridgeError } from '../errors.js';
import type { Logger } from '../observe/log.js';
import { accessRefused, replyCodeOf } from './errors.js';
import { checkExchangeExists, checkQueueExists, openChannel } from './source.js';

/** What the target said about one publish. */
export type PublishOutcome =
  | 'confirmed' // stored (and routed) by the target
  | 'returned' // unroutable: no queue bound for it (basic.return, then confirmed)
  | 'nacked' // the target refused it (e.g. a queue over its length limit with reject-publish)
  | 'lost' // the connection went away before the confirm: the target may or may not hold it
  | 'killed'; // the broker closed the channel with an error while this was in flight (maybe for it)

/** How a channel ended: whether it closed, and whether the broker closed it with an error. */
interface ChannelEnd {
  closed: boolean;
  byServer: boolean;
}

interface Pending {
  returned: boolean;
}

/**
 * The target side: one confirm channel, publishing with `mandatory`, attached to each new
 * connection. Publishing waits while the target is disconnected or has blocked us (a memory or
 * disk alarm), and whenever amqplib's write buffer is full ('drain'). A returned message is matched
 * to its publish by its `_HQ_DUPL_ID`: one publish per ID is in flight at a time.
 */
export class TargetPublisher {
  private channel: ConfirmChannel | undefined;
  private blocked = false;
  private closed = false;
  private wakeReady: (() => void)[] = [];
  private drained: Promise<void> | undefined;
  private readonly pending = new Map<string, Pending>();
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
    const channel = await connection.createConfirmChannel();
    const flag: ChannelEnd = { closed: false, byServer: false };
    this.closedFlags.set(channel, flag);
    channel.on('error', (error: Error) => {
      // The broker closes a channel with a reply code (e.g. 406 for a message over max_message_size).
      if (replyCodeOf(error) !== undefined) flag.byServer = true;
      this.log.warn({ error: error.message }, 'target channel error');
      if (replyCodeOf(error) === 403) this.onFatal(accessRefused(this.where, error, 'write'));
    });
    channel.on('return', (message: Message) => this.markReturned(message));
    channel.on('close', () => {
      flag.closed = true;
      if (this.channel === channel) this.onBroken('target channel closed');
    });
    connection.on('blocked', (reason: string) => {
      this.blocked = true;
      this.log.warn({ reason }, `${this.where}: blocked publishing (resource alarm); waiting`);
    });
    connection.on('unblocked', () => {
      this.blocked = false;
      this.log.info(`${this.where}: unblocked publishing`);
      this.wake();
    });
    this.blocked = false;
    this.drained = undefined;
    this.channel = channel;
    this.wake();
  }

  detach(): void {
    this.channel = undefined;
    this.drained = undefined;
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

  get isBlocked(): boolean {
    return this.blocked;
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
   * Publishes with `mandatory` and resolves with what the target said. The `_HQ_DUPL_ID` header
   * must be set: a return is matched to its publish by it. `options` is taken over (and changed).
   */
  publish(
    exchange: string,
    routingKey: string,
    content: Buffer,
    options: Options.Publish,
  ): Promise<PublishOutcome> {
    // The usual case, connected and not held back, without waiting a turn for ready().
    const channel = this.channel;
    if (channel && !this.blocked && !this.drained && !this.closed) {
      return this.publishOn(channel, exchange, routingKey, content, options);
    }
    return this.ready().then((ready) =>
      ready ? this.publishOn(ready, exchange, routingKey, content, options) : 'lost',
    );
  }

  private publishOn(
    channel: ConfirmChannel,
    exchange: string,
    routingKey: string,
    content: Buffer,
    options: Options.Publish,
  ): Promise<PublishOutcome> {
    const closed = this.closedFlags.get(channel) as ChannelEnd;
    // The same function reads the header of a returned message, so the keys always agree.
    const matchKey = keyOfValue(options.headers?.[DUPLICATE_ID_HEADER]) ?? '';
    const pending: Pending = { returned: false };
    this.pending.set(matchKey, pending);
    return new Promise<PublishOutcome>((resolve) => {
      const settle = (outcome: PublishOutcome) => {
        if (this.pending.get(matchKey) === pending) this.pending.delete(matchKey);
        resolve(outcome);
      };
      try {
        options.mandatory = true;
        const ok = channel.publish(exchange, routingKey, content, options, (error) => {
          if (!error) {
            settle(pending.returned ? 'returned' : 'confirmed');
            return;
          }
          // amqplib calls back with an error both for a nack and for a closed channel; the close
          // listeners run synchronously, so by the next microtask we know which one it was.
          queueMicrotask(() => settle(closed.closed ? (closed.byServer ? 'killed' : 'lost') : 'nacked'));
        });
        if (!ok && !this.drained) this.waitForDrain(channel);
      } catch (error) {
        // amqplib refuses headers that do not fit its encoding buffer: the target cannot take it.
        settle(error instanceof RangeError ? 'nacked' : 'lost');
      }
    });
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
    const key = keyOfValue(message.properties.headers?.[DUPLICATE_ID_HEADER]) ?? '';
    const pending = this.pending.get(key);
    if (pending) pending.returned = true;
    else this.log.warn('target returned a message the bridge cannot match to a publish');
  }

  /** Ends every wait for the target (publishes still waiting resolve as 'lost'). */
  close(): void {
    this.closed = true;
    this.wake();
  }
}
