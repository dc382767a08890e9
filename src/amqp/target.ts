import type { ChannelModel, ConfirmChannel, Message, Options } from 'amqplib';
import { keyOfValue } from '../dedup/id.js';
import { FatalConnectError } from '../errors.js';
import type { Logger } from '../observe/log.js';
import { replyCodeOf } from './errors.js';
import { checkQueueExists, openChannel } from './source.js';

/** What the target said about one publish. */
export type PublishOutcome =
  | 'confirmed' // stored (and routed) by the target
  | 'returned' // unroutable: no queue bound for it (basic.return, then confirmed)
  | 'nacked' // the target refused it (e.g. a queue over its length limit with reject-publish)
  | 'lost'; // the channel went away before the confirm: the target may or may not hold it

interface Pending {
  returned: boolean;
}

/**
 * The target side: one confirm channel, publishing with `mandatory`. A returned message is matched
 * to its publish by its `_HQ_DUPL_ID` (one publish per ID is in flight at a time), and a publish
 * waits for 'drain' whenever amqplib's buffer is full.
 */
export class TargetPublisher {
  private closed = false;
  private drained: Promise<void> | undefined;
  private readonly pending = new Map<string, Pending>();
  onLost: (reason: string) => void = () => {};
  onBlocked: (blocked: boolean, reason?: string) => void = () => {};

  private constructor(
    private readonly connection: ChannelModel,
    private readonly channel: ConfirmChannel,
    private readonly log: Logger,
  ) {}

  static async open(connection: ChannelModel, log: Logger): Promise<TargetPublisher> {
    const channel = await connection.createConfirmChannel();
    const target = new TargetPublisher(connection, channel, log);
    channel.on('error', (error: Error) => log.warn({ error: error.message }, 'target channel error'));
    channel.on('return', (message: Message) => target.markReturned(message));
    channel.on('drain', () => {
      target.drained = undefined;
    });
    const lost = (reason: string) => {
      if (target.closed) return;
      target.closed = true;
      target.onLost(reason);
    };
    channel.on('close', () => lost('target channel closed'));
    connection.on('close', () => lost('target connection closed'));
    connection.on('blocked', (reason: string) => target.onBlocked(true, reason));
    connection.on('unblocked', () => target.onBlocked(false));
    return target;
  }

  /** Checks that the destination exists, so a typo fails before anything moves. */
  async checkDestination(exchange: string, queue: string | undefined, where: string): Promise<void> {
    const probe = await openChannel(this.connection, this.log);
    try {
      if (queue !== undefined) {
        await checkQueueExists(probe, queue, where, '--target-queue');
      } else if (exchange !== '') {
        try {
          await probe.checkExchange(exchange);
        } catch (error) {
          if (replyCodeOf(error) === 404) {
            throw new FatalConnectError(
              `--target-exchange: exchange "${exchange}" does not exist on the ${where}; declare it first or fix the name`,
            );
          }
          throw error;
        }
      }
    } finally {
      await probe.close().catch(() => {});
    }
  }

  get isOpen(): boolean {
    return !this.closed;
  }

  /**
   * Publishes with `mandatory` and resolves with what the target said. `idKey` must be the cache
   * key of the `_HQ_DUPL_ID` header value, so a return can be matched to this publish.
   */
  async publish(
    exchange: string,
    routingKey: string,
    content: Buffer,
    options: Options.Publish,
    idKey: string,
  ): Promise<PublishOutcome> {
    while (this.drained && !this.closed) await this.drained;
    if (this.closed) return 'lost';
    const pending: Pending = { returned: false };
    this.pending.set(idKey, pending);
    return new Promise<PublishOutcome>((resolve) => {
      const settle = (outcome: PublishOutcome) => {
        if (this.pending.get(idKey) === pending) this.pending.delete(idKey);
        resolve(outcome);
      };
      try {
        const ok = this.channel.publish(
          exchange,
          routingKey,
          content,
          { ...options, mandatory: true },
          (error) => {
            if (!error) {
              settle(pending.returned ? 'returned' : 'confirmed');
              return;
            }
            // amqplib calls back with an error both for a nack and for a closed channel; its close
            // handlers run synchronously, so by the next microtask we know which one it was.
            queueMicrotask(() => settle(this.closed ? 'lost' : 'nacked'));
          },
        );
        if (!ok && !this.drained) {
          this.drained = new Promise((wake) => {
            const done = () => {
              this.channel.off('drain', done);
              this.channel.off('close', done);
              wake();
            };
            this.channel.on('drain', done);
            this.channel.on('close', done);
          });
        }
      } catch (error) {
        if (error instanceof RangeError) {
          // amqplib refuses headers that do not fit its encoding buffer: the target cannot take it.
          settle('nacked');
        } else {
          settle('lost');
        }
      }
    });
  }

  private markReturned(message: Message): void {
    const key = keyOfValue(message.properties.headers?._HQ_DUPL_ID);
    const pending = key === undefined ? undefined : this.pending.get(key);
    if (pending) pending.returned = true;
    else this.log.warn('target returned a message the bridge cannot match to a publish');
  }

  async close(): Promise<void> {
    this.closed = true;
    await this.connection.close().catch(() => {});
  }
}
