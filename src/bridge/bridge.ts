import type { ChannelModel } from 'amqplib';
import type { Redis } from 'ioredis';
import { connectAmqp } from '../amqp/connect.js';
import { SourceQueue } from '../amqp/source.js';
import { TargetPublisher } from '../amqp/target.js';
import { redactUrl } from '../config/redact.js';
import type { BridgeSettings } from '../config/settings.js';
import { DedupCache, newOwnerToken } from '../dedup/cache.js';
import { connectRedis } from '../dedup/redis.js';
import { RuntimeFailure } from '../errors.js';
import type { Logger } from '../observe/log.js';
import { Pipeline } from './pipeline.js';

/** A running route: its connections and its pipeline. */
export interface Bridge {
  pipeline: Pipeline;
  source: SourceQueue;
  /** Resolves when something fails that this process cannot recover from. */
  failure: Promise<Error>;
  /** Stops consuming, finishes in-flight work within the timeout, closes everything. */
  stop(timeoutMs: number): Promise<number>;
  close(): Promise<void>;
}

/**
 * Connects to source, target and Redis, checks that the queues exist, and starts forwarding.
 * Anything left open by a failed start is closed again.
 */
export async function startBridge(settings: BridgeSettings, log: Logger): Promise<Bridge> {
  const routeLog = log.child({ route: settings.sourceQueue });
  const opened: { close(): Promise<void> | void }[] = [];
  const closeAll = async () => {
    for (const item of opened.reverse()) await Promise.resolve(item.close()).catch(() => {});
  };
  try {
    const retry = { retryForMs: settings.retryForMs, log: routeLog };
    const redis: Redis = await connectRedis(settings.redisUrl, settings.retryForMs, routeLog);
    opened.push({ close: () => redis.disconnect() });
    const sourceConnection: ChannelModel = await connectAmqp(settings.sourceUrl, {
      side: 'source',
      ...retry,
    });
    opened.push({ close: () => sourceConnection.close() });
    const targetConnection: ChannelModel = await connectAmqp(settings.targetUrl, {
      side: 'target',
      ...retry,
    });
    opened.push({ close: () => targetConnection.close() });

    const sourceWhere = `source broker at ${redactUrl(settings.sourceUrl)}`;
    const targetWhere = `target broker at ${redactUrl(settings.targetUrl)}`;
    const source = await SourceQueue.open(
      sourceConnection,
      settings.sourceQueue,
      settings.prefetch,
      sourceWhere,
      routeLog,
    );
    if (settings.parkQueue !== undefined) await source.enableParking(settings.parkQueue);
    const target = await TargetPublisher.open(targetConnection, routeLog);
    await target.checkDestination(settings.targetExchange, settings.targetQueue, targetWhere);

    const cache = new DedupCache(redis, {
      token: newOwnerToken(),
      leaseMs: settings.leaseMs,
      windowMs: settings.dedupWindowMs,
    });
    const pipeline = new Pipeline(
      {
        name: settings.sourceQueue,
        sourceQueue: settings.sourceQueue,
        targetExchange: settings.targetExchange,
        targetRoutingKey: settings.targetRoutingKey,
        targetUser: settings.targetUser,
        scope: settings.scope,
        redisPrefix: settings.redisPrefix,
        idFrom: settings.idFrom,
        batchSize: settings.batchSize,
        leaseMs: settings.leaseMs,
        onUnroutable: settings.onUnroutable,
        parkQueue: settings.parkQueue,
        requeueDelay: settings.requeueDelay,
        maxMessages: settings.maxMessages,
      },
      source,
      target,
      cache,
      routeLog,
    );

    let reportFailure: (error: Error) => void = () => {};
    const failure = new Promise<Error>((resolve) => {
      reportFailure = resolve;
    });
    let stopping = false;
    source.onLost = (reason) => {
      if (!stopping)
        reportFailure(new RuntimeFailure(`${sourceWhere}: ${reason}; unacked messages return to the queue`));
    };
    source.onCancelled = () => {
      if (!stopping)
        reportFailure(
          new RuntimeFailure(`${sourceWhere}: the broker cancelled the consumer (queue deleted?)`),
        );
    };
    target.onLost = (reason) => {
      if (!stopping)
        reportFailure(
          new RuntimeFailure(`${targetWhere}: ${reason}; unconfirmed messages stay in the source`),
        );
    };
    target.onBlocked = (blocked, reason) => {
      if (blocked) routeLog.warn({ reason }, 'target broker blocked publishing (resource alarm); waiting');
      else routeLog.info('target broker unblocked publishing');
    };
    await pipeline.start((error) =>
      reportFailure(new RuntimeFailure(`route ${settings.sourceQueue}: ${error.message}`)),
    );
    routeLog.info(
      {
        source: redactUrl(settings.sourceUrl),
        target: redactUrl(settings.targetUrl),
        redis: redactUrl(settings.redisUrl),
        scope: settings.scope,
        prefetch: settings.prefetch,
      },
      'forwarding',
    );
    return {
      pipeline,
      source,
      failure,
      async stop(timeoutMs: number) {
        stopping = true;
        return pipeline.stop(timeoutMs);
      },
      async close() {
        stopping = true;
        await closeAll();
      },
    };
  } catch (error) {
    await closeAll();
    throw error;
  }
}
