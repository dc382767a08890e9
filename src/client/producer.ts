import { randomUUID } from 'node:crypto';
import type { ConfirmChannel, Options } from 'amqplib';
import { backoffDelay, sleep } from '../backoff.js';
import { DUPLICATE_ID_HEADER } from '../headers.js';

/** A new duplicate-detection ID: a random UUID. */
export function newDedupId(): string {
  return randomUUID();
}

/**
 * Publish options with `_HQ_DUPL_ID` set to `id` (a string, or bytes as HornetQ's byte[]); the
 * other options and headers are kept. The same bytes are the same ID, as a string or a Buffer.
 */
export function withDedupId(
  options: Options.Publish = {},
  id: string | Buffer = newDedupId(),
): Options.Publish {
  if ((typeof id === 'string' && id.length === 0) || (Buffer.isBuffer(id) && id.length === 0)) {
    throw new TypeError('withDedupId: the ID must not be empty');
  }
  return { ...options, headers: { ...(options.headers ?? {}), [DUPLICATE_ID_HEADER]: id } };
}

/** A publish that the broker never confirmed: re-send it with the same `dedupId` (and a new channel). */
export class DedupPublishError extends Error {
  constructor(
    message: string,
    readonly dedupId: string | Buffer,
  ) {
    super(message);
    this.name = 'DedupPublishError';
  }
}

interface DedupPublisherOptions {
  /** Attempts per message on a nack before giving up (default 5). */
  attempts?: number;
}

/**
 * Publishes on a confirm channel with an ID on every message, and re-sends a message the broker
 * refused (nack) with the same ID: the bridge, or an idempotent consumer, drops the extra copy if
 * the first one arrived after all. Resolves with the ID once the broker confirmed the message.
 */
export class DedupPublisher {
  private readonly attempts: number;
  private closed = false;

  constructor(
    private readonly channel: ConfirmChannel,
    options: DedupPublisherOptions = {},
  ) {
    this.attempts = options.attempts ?? 5;
    channel.on('close', () => {
      this.closed = true;
    });
  }

  async publish(
    exchange: string,
    routingKey: string,
    content: Buffer,
    options: Options.Publish & { dedupId?: string | Buffer } = {},
  ): Promise<string | Buffer> {
    const { dedupId = newDedupId(), ...rest } = options;
    const publishOptions = withDedupId(rest, dedupId);
    for (let attempt = 1; ; attempt++) {
      const error = await new Promise<Error | null>((resolve) => {
        try {
          this.channel.publish(exchange, routingKey, content, publishOptions, (err: Error | null) =>
            resolve(err ?? null),
          );
        } catch (thrown) {
          resolve(thrown as Error);
        }
      });
      if (!error) return dedupId;
      // A closed channel cannot send again; a nack can, after a pause.
      if (this.closed || attempt >= this.attempts) {
        throw new DedupPublishError(
          `publish not confirmed (${error.message}); re-send it with the same dedupId`,
          dedupId,
        );
      }
      await sleep(backoffDelay(attempt, 50, 2000));
    }
  }
}
