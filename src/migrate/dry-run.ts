import type { ConsumeMessage } from 'amqplib';
import { connectAmqp } from '../amqp/connect.js';
import { routingBytesOf } from '../amqp/internals.js';
import { checkQueueExists, countsDeliveries, sourceQueueTypeOf } from '../amqp/source.js';
import { newCounters } from '../bridge/counters.js';
import { redactUrl } from '../config/redact.js';
import type { BridgeSettings } from '../config/settings.js';
import { DedupCache } from '../dedup/cache.js';
import { deriveId } from '../dedup/id.js';
import type { RedisClient } from '../dedup/redis.js';
import type { Logger } from '../log.js';
import { type ContentHeader, ContentHeaderError, contentHeaderOf } from '../wire/properties.js';
import { buildQueueReport, type QueueReport } from './report.js';

/**
 * Reads each message of a source queue (up to `limit`), decides forward or duplicate against the
 * cache without claiming anything, and gives every message back by closing the channel: nothing is
 * published, acked or claimed. Holds the messages it read until then, so `limit` bounds memory.
 * A queue that counts each return toward a delivery limit (quorum) is not read: the dry run would
 * bring every message one delivery nearer to being dropped, and drop it at a limit of 0.
 */
export async function dryRunQueue(
  settings: BridgeSettings,
  redis: RedisClient,
  limit: number | undefined,
  log: Logger,
): Promise<QueueReport> {
  const started = Date.now();
  const counters = newCounters();
  const where = `source broker at ${redactUrl(settings.sourceUrl)}`;
  const connection = await connectAmqp(settings.sourceUrl, {
    side: 'source',
    retryForMs: settings.retryForMs,
    log,
    tls: settings.tls.source,
  });
  try {
    const channel = await connection.createChannel();
    channel.on('error', () => {});
    await checkQueueExists(channel, settings.sourceQueue, where, '--source-queue');
    const { messageCount } = await channel.checkQueue(settings.sourceQueue);
    const type = await sourceQueueTypeOf(connection, settings.sourceQueue, where, log);
    if (countsDeliveries(type)) {
      await channel.close();
      return buildQueueReport({
        outcome: 'dry-run',
        settings,
        counters,
        remaining: messageCount,
        deleted: false,
        problem: `${settings.sourceQueue}: not read by the dry run: it is ${type === 'unknown' ? 'a queue of a type the bridge cannot tell, which may count' : `a ${type} queue, which counts`} each message given back toward its delivery limit (x-delivery-limit 0 drops it); its ${messageCount} message(s) are left as they were, and what would be forwarded is not known`,
        elapsedMs: Date.now() - started,
        active: { from: started, to: Date.now() },
      });
    }
    const wanted = Math.min(messageCount, limit ?? messageCount);
    const messages: ConsumeMessage[] = [];
    if (wanted > 0) {
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, 30_000);
        void channel.consume(
          settings.sourceQueue,
          (message) => {
            if (message) messages.push(message);
            if (messages.length >= wanted) {
              clearTimeout(timer);
              resolve();
            }
          },
          { noAck: false },
        );
      });
    }
    const cache = await DedupCache.existing(redis, {
      prefix: settings.redisPrefix,
      scope: settings.scope,
      windowMs: settings.dedupWindowMs,
    });
    const seen = new Set<string>();
    const unreadable = new Set<ConsumeMessage>();
    const keys: (string | undefined)[] = messages.map((message) => {
      let header: ContentHeader;
      try {
        header = contentHeaderOf(message.properties);
      } catch (error) {
        if (!(error instanceof ContentHeaderError)) throw error;
        unreadable.add(message);
        return undefined;
      }
      if (header.tableError !== undefined) {
        unreadable.add(message);
        return undefined;
      }
      const routing = routingBytesOf(message.fields);
      const { id, rejected } = deriveId(
        {
          content: message.content,
          exchange: routing?.exchange ?? message.fields.exchange,
          routingKey: routing?.routingKey ?? message.fields.routingKey,
          header,
        },
        settings.idFrom,
      );
      if (rejected.length > 0) counters.badIdHeader++;
      return id && cache ? cache.keyOf(id.key) : id?.key;
    });
    // Only real keys go to Redis; a scope never written has nothing committed.
    const withId = keys.filter((key): key is string => key !== undefined);
    const records = cache && withId.length > 0 ? await cache.lookup(withId) : [];
    const committed = new Set(withId.filter((_, index) => records[index]?.state === 'committed'));
    keys.forEach((key, index) => {
      counters.consumed++;
      if (unreadable.has(messages[index] as ConsumeMessage)) counters.unforwardable++;
      else if (key === undefined) counters.noId++;
      else if (committed.has(key) || seen.has(key)) counters.duplicates++;
      else counters.forwarded++;
      if (key !== undefined) seen.add(key);
    });
    // Closing the channel gives every message back to the queue, in its order.
    await channel.close();
    const report = buildQueueReport({
      outcome: 'dry-run',
      settings,
      counters,
      remaining: messageCount,
      deleted: false,
      elapsedMs: Date.now() - started,
      active: { from: started, to: Date.now() },
    });
    // Here "forwarded" means "would be forwarded"; every message read was given back.
    report.accounted =
      counters.consumed === counters.forwarded + counters.duplicates + counters.noId + counters.unforwardable;
    return report;
  } finally {
    await connection.close().catch(() => {});
  }
}
