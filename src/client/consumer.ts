import type { Channel, ConsumeMessage } from 'amqplib';
import type { ChainableCommander } from 'ioredis';
import { backoffDelay, sleep } from '../amqp/backoff.js';
import { installLosslessReaderFor } from '../amqp/internals.js';
import { type ContentHeader, ContentHeaderError, contentHeaderOf } from '../amqp/properties.js';
import { DedupCache, newOwnerToken } from '../dedup/cache.js';
import { DUPLICATE_ID_HEADER, keyOfField } from '../dedup/id.js';
import type { RedisClient } from '../dedup/redis.js';
import { IN_DOUBT_HEADER } from '../headers.js';

export interface HandlerContext {
  /** The message's ID, as the cache keys it (the same bytes give the same ID, string or Buffer). */
  dedupId: string;
  /** The bridge flagged this copy in-doubt: an earlier copy may have been delivered too. */
  inDoubt: boolean;
  /**
   * A MULTI on the consumer's Redis. Queue the handler's own writes on it and return; the consumer
   * adds the ID's mark and runs it, so the effect and the mark land together or not at all.
   */
  transaction(): ChainableCommander;
}

export interface IdempotentConsumerOptions {
  channel: Channel;
  queue: string;
  redis: RedisClient;
  /** The consumer's own scope, e.g. "billing": not the bridge's (which marks "on the target"). */
  scope: string;
  handler: (message: ConsumeMessage, context: HandlerContext) => Promise<void> | void;
  /** Key prefix in Redis (default "dedup"). */
  prefix?: string;
  /** How long a claim protects a message being handled; renewed while the handler runs (default 30 s). */
  leaseMs?: number;
  /** How long a processed ID is remembered (default 7 days). */
  windowMs?: number;
  prefetch?: number;
  /** First backoff before a failed message is returned to the queue (default 1 s, doubling to 30 s). */
  retryDelayMs?: number;
  /** Told of handler failures (the message is retried). */
  onError?: (error: unknown, message: ConsumeMessage) => void;
}

export interface IdempotentConsumer {
  readonly counts: { processed: number; duplicates: number; failures: number; withoutId: number };
  stop(): Promise<void>;
}

const BUSY_RECHECK_MS = 250;

/**
 * Runs `handler` once per `_HQ_DUPL_ID`: claim → handler → commit → ack, with leases, as the
 * bridge does for forwarding. Duplicates and in-doubt copies of an ID it already processed are
 * acked without calling the handler. A handler that throws has its claim released and its message
 * returned to the queue after a backoff: retried, never lost. Messages without an ID are handled
 * every time they arrive (counted as `withoutId`).
 */
export async function createIdempotentConsumer(
  options: IdempotentConsumerOptions,
): Promise<IdempotentConsumer> {
  const { channel, queue, redis, scope, handler } = options;
  // IDs are keyed by their bytes on the wire, as the bridge keys them (amqplib's decoded headers
  // lose 64-bit precision and bytes that are not UTF-8): read this connection's headers raw.
  installLosslessReaderFor(channel);
  const prefix = options.prefix ?? 'dedup';
  const leaseMs = options.leaseMs ?? 30_000;
  const cache = await DedupCache.open(redis, {
    token: newOwnerToken(),
    leaseMs,
    windowMs: options.windowMs ?? 7 * 86_400_000,
    prefix,
    scope,
    // One slot for the scope, so that a handler's transaction can share it on a Redis Cluster:
    // its own keys carry the hash tag {<scope>}.
    shards: 1,
  });
  const counts = { processed: 0, duplicates: 0, failures: 0, withoutId: 0 };
  const attempts = new Map<string, number>();
  const inFlight = new Map<string, Promise<void>>();
  let stopping = false;

  const handle = async (message: ConsumeMessage): Promise<void> => {
    const idKey = idKeyOf(message);
    if (idKey === undefined) {
      counts.withoutId++;
      await runHandler(message, undefined, idKey);
      return;
    }
    const key = cache.keyOf(idKey);
    // One copy of an ID at a time in this process: later copies wait for its outcome.
    for (let earlier = inFlight.get(key); earlier; earlier = inFlight.get(key)) await earlier;
    let done: () => void = () => {};
    inFlight.set(
      key,
      new Promise<void>((resolve) => {
        done = resolve;
      }),
    );
    try {
      for (;;) {
        const [state] = await cache.claim([key]);
        if (state === 'dup') {
          counts.duplicates++;
          channel.ack(message);
          return;
        }
        if (state === 'busy') {
          // Another consumer is handling this ID right now: wait for its outcome.
          await sleep(BUSY_RECHECK_MS);
          continue;
        }
        await runHandler(message, key, idKey);
        return;
      }
    } finally {
      inFlight.delete(key);
      done();
    }
  };

  const runHandler = async (message: ConsumeMessage, key: string | undefined, idKey: string | undefined) => {
    let transaction: ChainableCommander | undefined;
    const context: HandlerContext = {
      dedupId: idKey ?? '',
      inDoubt: message.properties.headers?.[IN_DOUBT_HEADER] === true,
      transaction: () => {
        transaction ??= redis.multi();
        return transaction;
      },
    };
    const renew = key
      ? setInterval(() => void cache.renew([key]).catch(() => 0), Math.floor(leaseMs / 3))
      : undefined;
    try {
      await handler(message, context);
      if (key) {
        if (transaction) {
          cache.commitIn(transaction, [key]);
          const results = await transaction.exec();
          const failed = results?.find(([error]) => error);
          if (!results || failed) throw failed?.[0] ?? new Error('transaction aborted');
        } else {
          await cache.commit([key]);
        }
      } else if (transaction) {
        await transaction.exec();
      }
      counts.processed++;
      if (idKey) attempts.delete(idKey);
      channel.ack(message);
    } catch (error) {
      // A MULTI the handler queued is dropped unsent (ioredis sends it on exec only).
      counts.failures++;
      options.onError?.(error, message);
      if (key) await cache.release([key]).catch(() => 0);
      const attempt = (attempts.get(idKey ?? '') ?? 0) + 1;
      attempts.set(idKey ?? '', attempt);
      if (attempts.size > 10_000) attempts.delete(attempts.keys().next().value as string);
      if (!stopping) await sleep(backoffDelay(attempt, options.retryDelayMs ?? 1000, 30_000));
      channel.nack(message, false, true);
    } finally {
      if (renew) clearInterval(renew);
    }
  };

  const running = new Set<Promise<void>>();
  await channel.prefetch(options.prefetch ?? 50);
  const { consumerTag } = await channel.consume(
    queue,
    (message) => {
      if (!message) return;
      const work = handle(message).catch((error: unknown) => {
        // The cache could not be reached: leave the message to come back.
        options.onError?.(error, message);
        channel.nack(message, false, true);
      });
      running.add(work);
      void work.finally(() => running.delete(work));
    },
    { noAck: false },
  );
  return {
    counts,
    async stop() {
      stopping = true;
      await channel.cancel(consumerTag).catch(() => {});
      await Promise.allSettled([...running]);
    },
  };
}

/** The cache key of a message's `_HQ_DUPL_ID`, from its bytes on the wire, as the bridge keys it. */
function idKeyOf(message: ConsumeMessage): string | undefined {
  let header: ContentHeader;
  try {
    header = contentHeaderOf(message.properties);
  } catch (error) {
    if (error instanceof ContentHeaderError) return undefined;
    throw error;
  }
  const span = header.field(DUPLICATE_ID_HEADER);
  return span ? keyOfField(header.valueOf(span)) : undefined;
}
