import { hash } from 'node:crypto';
import { InFlightBytes } from '../amqp/in-flight-bytes.js';
import { AmqpLink } from '../amqp/link.js';
import { QueueTarget } from '../amqp/queue-target.js';
import { SourceQueue } from '../amqp/source.js';
import { sleep } from '../backoff.js';
import type { IdStrategy } from '../config/id-from.js';
import { redactUrl } from '../config/redact.js';
import { describeRedis, parseRedisUrl } from '../config/redis-url.js';
import type { BridgeSettings } from '../config/settings.js';
import { loopMessage } from '../config/settings.js';
import { streamTlsOptions } from '../config/tls.js';
import { DedupCache, type DedupCacheOptions, newOwnerToken } from '../dedup/cache.js';
import { PositionStore } from '../dedup/position.js';
import { ProducerStore } from '../dedup/producer.js';
import {
  closeRedis,
  connectRedis,
  type RedisClient,
  redisRefusalOf,
  replyText,
  untilRedisAnswers,
} from '../dedup/redis.js';
import { BridgeError, ConfigError, RuntimeFailure } from '../errors.js';
import type { Logger } from '../log.js';
import type { SourceSide, TargetSide } from '../ports.js';
import { StreamSource } from '../stream/source.js';
import { StreamTarget } from '../stream/target.js';
import { MessageBudget } from './limits.js';
import { Pipeline } from './pipeline.js';

// A broker under a resource alarm may never answer a channel close: then the connection's own
// close (with its timeout) takes over.
const CLOSE_CONSUMER_MS = 3000;

/** Which connections of a route are up, for health checks and metrics. */
interface RouteStatus {
  source: boolean;
  target: boolean;
  redis: boolean;
  /**
   * Our consumer is live and the broker, asked within the last 10 s on the same connection, lists
   * a consumer on the queue (see SourceQueue.consumption).
   */
  consuming: boolean;
  /** The bridge paused its consumer itself: the bodies it holds reached --max-in-flight-bytes. */
  paused: boolean;
  /** The target broker blocked publishing (a memory or disk alarm). */
  targetBlocked: boolean;
}

/** A server that does not do its part: unreachable, or answering with errors, or blocking us. */
export interface Outage {
  /** The server ("Redis at redis://…", "target broker at amqp://…"). */
  what: string;
  ms: number;
  /** What it does: "unreachable", or e.g. "refused writes" with the reason, when it answers. */
  how: string;
  /** Why, in the server's words, when it answers (a Redis error reply, the alarm's reason). */
  reason?: string;
  /** What to do, beyond bringing it back. */
  advice?: string;
}

/**
 * The line an outage past --retry-for ends a run with: e.g. "Redis at redis://…:6379 refused
 * writes for 5s (OOM command not allowed …), past --retry-for: raise its maxmemory …; nothing
 * unforwarded was acked".
 */
export function outageLine(outage: Outage): string {
  const seconds = Math.round(outage.ms / 1000);
  if (outage.reason === undefined) {
    return `${outage.what} ${outage.how} for ${seconds}s (--retry-for); nothing unforwarded was acked`;
  }
  const advice = outage.advice === undefined ? '' : `: ${outage.advice}`;
  return `${outage.what} ${outage.how} for ${seconds}s (${outage.reason}), past --retry-for${advice}; nothing unforwarded was acked`;
}

/**
 * The route's stream producer is named after the route (source cluster, vhost and queue), the same
 * for every replica and every run: its publishing IDs continue where the last owner's ended.
 */
function producerName(route: string): string {
  const name = `dedup-bridge ${route}`;
  return Buffer.byteLength(name) <= 255 ? name : `dedup-bridge ${hash('sha256', route, 'hex')}`;
}

/**
 * The owner token of a stream route's claims: tagged with its producer, so that a claim an earlier
 * owner of the same producer left is told from another route's (see claim.lua's 'reclaimed').
 */
function streamOwnerToken(producer: string): string {
  const tag = hash('sha256', producer, 'base64url').slice(0, 8).replace(/[-_]/g, 'x');
  return `${tag}.${newOwnerToken()}`;
}

function streamTarget(
  settings: BridgeSettings,
  producer: string,
  parts: { redis: RedisClient; cache: DedupCache; token: string; log: Logger; stop: AbortSignal | undefined },
): StreamTarget {
  const record = new ProducerStore(
    parts.redis,
    ProducerStore.baseOf(settings.redisPrefix, settings.scope, producer),
    parts.token,
    settings.leaseMs,
  );
  const tls = streamTlsOptions(settings.targetUrl, settings.tls.target);
  return new StreamTarget(
    {
      url: settings.targetUrl,
      stream: settings.targetStream as string,
      producer,
      tls,
      leaseMs: settings.leaseMs,
      retryForMs: settings.retryForMs,
      stop: parts.stop,
    },
    record,
    parts.cache,
    parts.log,
  );
}

/** A running route: its connections and its pipeline. */
export interface Bridge {
  /** The route's name in logs and metrics. */
  route: string;
  pipeline: Pipeline;
  source: SourceSide;
  /** Resolves when something fails that retrying cannot fix (a queue deleted, credentials revoked). */
  failure: Promise<BridgeError>;
  /**
   * The server that has been out longest (unreachable, refusing every Redis call, or blocking
   * publishing), and for how long; undefined when all work.
   */
  outage(): Outage | undefined;
  status(): RouteStatus;
  /** Stops consuming, finishes in-flight work within the timeout; returns how many were unfinished. */
  stop(timeoutMs: number): Promise<number>;
  close(): Promise<void>;
}

/**
 * Connects to Redis, source and target (checking that the queues exist), and starts forwarding.
 * Lost connections are re-opened with backoff for as long as the bridge runs; what the pipeline
 * holds meanwhile stays unacked. Anything left open by a failed start is closed again.
 */
export interface BridgeLimits {
  /** Shared by a job's routes (migrate --max-messages). */
  budget?: MessageBudget;
  /** Called before each batch is published (migrate --max-rate). */
  throttle?: (count: number) => Promise<void>;
  /** Test hook between confirms and commit. */
  afterConfirm?: () => void;
  /** A stop signal: waiting for a server at start ends at once with StopRequested. */
  stop?: AbortSignal;
  /** migrate: a stream source reads up to the stream's end as it was at start, then stops. */
  toEnd?: boolean;
}

export async function startBridge(
  settings: BridgeSettings,
  log: Logger,
  limits: BridgeLimits = {},
): Promise<Bridge> {
  const routeLog = log.child({ route: settings.route });
  // No window larger than --max-messages lets this run take (a queue consumer also reserves what
  // the broker may send it against the budget: see MessageBudget).
  const prefetch = Math.max(1, Math.min(settings.prefetch, limits.budget?.remaining ?? settings.prefetch));
  const sourceLink = sourceLinkOf(settings, prefetch, routeLog, limits);
  const source = sourceLink.source;
  // A stream target is made once the source link is up: its producer is named after the route.
  let target: TargetSide | undefined =
    settings.targetStream === undefined
      ? new QueueTarget(
          {
            urls: settings.targetUrls,
            exchange: settings.targetExchange,
            routingKey: settings.targetRoutingKey,
            queue: settings.targetQueue,
            retryForMs: settings.retryForMs,
            tls: settings.tls.target,
            stop: limits.stop,
          },
          routeLog,
        )
      : undefined;
  const budget = limits.budget ?? new MessageBudget(undefined);
  let redis: RedisClient | undefined;
  // --redis-wait-replicas: commits go on a connection of their own (see DedupCacheOptions).
  let commitRedis: RedisClient | undefined;
  let cache: DedupCache;
  let started: TargetSide;
  const closeAll = async () => {
    // Close the consuming channel first, held acks sent: its close-ok comes after the broker took
    // every ack on it. A connection closed at once could leave acks buffered on the channel behind
    // the close, and those messages would come back as duplicates to the next run.
    await Promise.race([source.closeConsumer(), sleep(CLOSE_CONSUMER_MS)]);
    await Promise.allSettled([sourceLink.close(), target?.close()]);
    if (redis) closeRedis(redis);
    if (commitRedis) closeRedis(commitRedis);
  };
  try {
    redis = await connectRedis(
      settings.redisUrl,
      settings.retryForMs,
      routeLog,
      settings.tls.redis,
      limits.stop,
    );
    const waitReplicas = settings.redisWaitReplicas;
    if (waitReplicas > 0) {
      commitRedis = await connectRedis(
        settings.redisUrl,
        settings.retryForMs,
        routeLog.child({ connection: 'commits' }),
        settings.tls.redis,
        limits.stop,
      );
    }
    // A stream route's producer is named after the source (its cluster), and tags the claims.
    let producer: string | undefined;
    if (settings.targetStream !== undefined) {
      await sourceLink.start(redis);
      producer = settings.targetProducer ?? producerName(`${sourceLink.identity}/${settings.sourceQueue}`);
    }
    const token = producer === undefined ? newOwnerToken() : streamOwnerToken(producer);
    const cacheOptions: DedupCacheOptions = {
      token,
      leaseMs: settings.leaseMs,
      windowMs: settings.dedupWindowMs,
      prefix: settings.redisPrefix,
      scope: settings.scope,
      shards: settings.cacheShards,
      waitReplicas,
      commitRedis,
      onReplicas: (event) => {
        if (event.behind) {
          routeLog.warn({ wanted: waitReplicas, acked: event.acked }, 'Redis replicas behind; holding acks');
        } else {
          routeLog.info(
            { wanted: waitReplicas, heldMs: event.heldMs },
            'Redis replicas caught up; acking again',
          );
        }
      },
    };
    const openedRedis = redis;
    // A full Redis (OOM) refuses the scope's layout write: waited for as for an unreachable one.
    cache = await untilRedisAnswers(
      describeRedis(parseRedisUrl(settings.redisUrl)),
      'when opening the dedup scope',
      settings.retryForMs,
      routeLog,
      () => DedupCache.open(openedRedis, cacheOptions),
      limits.stop,
    );
    if (producer === undefined) await sourceLink.start(redis);
    // A new scope's first slice of committed IDs is sized for the backlog about to be forwarded
    // (no more than --max-messages lets this run take).
    cache.expectedIds = Math.min((await source.depth()) ?? 0, budget.remaining);
    target ??= streamTarget(settings, producer as string, {
      redis,
      cache,
      token,
      log: routeLog,
      stop: limits.stop,
    });
    await target.start();
    // The same cluster is the same broker, whichever of its nodes or URLs each side named.
    if (target.feeds(sourceLink.identity, settings.sourceQueue)) {
      throw new ConfigError(
        loopMessage(settings.sourceQueue, target.where.replace(/^target broker at /, '')),
      );
    }
    started = target;
  } catch (error) {
    await closeAll();
    throw error;
  }

  let redisDownSince: number | undefined;
  redis.on('close', () => {
    redisDownSince ??= Date.now();
  });
  redis.on('ready', () => {
    redisDownSince = undefined;
  });

  const pipeline = new Pipeline(
    {
      targetUser: settings.targetUser,
      idFrom: settings.idFrom,
      batchSize: settings.batchSize,
      leaseMs: settings.leaseMs,
      onUnforwardable: settings.onUnforwardable,
      parkQueue: settings.parkQueue,
      stripCc: settings.stripCc,
      requeueDelay: settings.requeueDelay,
      routeMark: `${sourceLink.identity}/${settings.sourceQueue}`,
      budget,
      throttle: limits.throttle,
      afterConfirm: limits.afterConfirm,
    },
    source,
    started,
    cache,
    routeLog,
  );
  // After a source reconnect, consume again only once the deliveries of the lost channel are
  // settled, so that what the bridge holds never exceeds one prefetch window.
  if (source instanceof SourceQueue) source.beforeConsume = () => pipeline.whenIdle();

  let reportFailure: (error: BridgeError) => void = () => {};
  const failure = new Promise<BridgeError>((resolve) => {
    reportFailure = resolve;
  });
  sourceLink.onFatal = reportFailure;
  source.onFatal = reportFailure;
  started.onFatal = reportFailure;
  try {
    await pipeline.start((error) =>
      reportFailure(
        error instanceof BridgeError ? error : new RuntimeFailure(`internal error: ${error.message}`),
      ),
    );
  } catch (error) {
    // e.g. basic.consume refused (an exclusive consumer holds the queue): nothing may keep running.
    await pipeline.stop(0);
    await closeAll();
    throw error;
  }
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
  const connectedRedis = redis;
  // Named once: migrate asks for outages every poll.
  const redisLabel = `Redis at ${redactUrl(settings.redisUrl)}`;
  return {
    route: settings.route,
    pipeline,
    source,
    failure,
    outage() {
      const now = Date.now();
      const down: [Omit<Outage, 'ms'>, number | undefined][] = [
        [{ what: sourceLink.where, how: 'unreachable' }, sourceLink.downSince],
        [{ what: started.where, how: 'unreachable' }, started.downSince],
        [{ what: redisLabel, how: 'unreachable' }, redisDownSince],
        // Commits wait for replicas that are not there: an outage of what --redis-wait-replicas asks.
        [
          {
            what: `${settings.redisWaitReplicas} Redis replica(s) for --redis-wait-replicas`,
            how: 'unreachable',
          },
          cache.replicasBehindSince,
        ],
      ];
      // Redis answers, but every call fails (OOM, READONLY …): as much an outage as no answer.
      const failing = pipeline.redisFailingSince;
      if (failing) {
        const reply = replyText(failing.error);
        down.push([{ what: redisLabel, reason: reply, ...redisRefusalOf(reply) }, failing.since]);
      }
      // A memory or disk alarm: nothing is published until the target broker clears it.
      const blocked = started.blockedSince;
      if (blocked) {
        down.push([
          {
            what: started.where,
            how: 'blocked publishing',
            reason: `resource alarm: ${blocked.reason}`,
            advice:
              'free memory or disk on the target broker, or raise its vm_memory_high_watermark or lower its disk_free_limit',
          },
          blocked.since,
        ]);
      }
      let worst: Outage | undefined;
      for (const [what, since] of down) {
        if (since !== undefined && (!worst || now - since > worst.ms)) worst = { ...what, ms: now - since };
      }
      return worst;
    },
    status: () => ({
      source: sourceLink.isUp,
      target: started.isUp,
      redis: connectedRedis.status === 'ready',
      ...source.consumption(),
      targetBlocked: started.blockedSince !== undefined,
    }),
    stop: (timeoutMs: number) => pipeline.stop(timeoutMs),
    close: closeAll,
  };
}

/** The source's connection and adapter: a queue over AMQP 0-9-1, or a stream. */
interface SourceLink {
  source: SourceQueue | StreamSource;
  /** `<cluster>/<vhost>`, once started. */
  readonly identity: string | undefined;
  readonly where: string;
  readonly isUp: boolean;
  readonly downSince: number | undefined;
  onFatal: (error: BridgeError) => void;
  start(redis: RedisClient): Promise<void>;
  close(): Promise<void>;
}

function sourceLinkOf(
  settings: BridgeSettings,
  prefetch: number,
  log: Logger,
  limits: BridgeLimits,
): SourceLink {
  if (settings.sourceStream !== undefined) {
    const stream = settings.sourceStream;
    const source = new StreamSource(
      {
        url: settings.sourceUrl,
        stream,
        tls: streamTlsOptions(settings.sourceUrl, settings.tls.source),
        start: settings.sourceStart,
        prefetch,
        toEnd: limits.toEnd ?? false,
        storedBytes: settings.targetStream !== undefined,
        keysOnMessageId: keysOnMessageId(settings.idFrom),
        retryForMs: settings.retryForMs,
        stop: limits.stop,
      },
      log,
    );
    return {
      source,
      get identity() {
        return source.identity;
      },
      get where() {
        return source.where;
      },
      get isUp() {
        return source.isUp;
      },
      get downSince() {
        return source.downSince;
      },
      get onFatal() {
        return source.onFatal;
      },
      set onFatal(handler) {
        source.onFatal = handler;
      },
      // The position is kept in the route's scope, named after the stream and its cluster.
      start: (redis) =>
        source.start((name) => new PositionStore(redis, settings.redisPrefix, settings.scope, name)),
      close: () => source.close(),
    };
  }
  const source = new SourceQueue(
    settings.sourceQueue,
    prefetch,
    settings.parkQueue,
    `source broker at ${redactUrl(settings.sourceUrl)}`,
    log,
    new InFlightBytes(settings.maxInFlightBytes),
  );
  source.deliveryLimit = settings.sourceDeliveryLimit;
  if (limits.budget?.limited) source.budget = limits.budget;
  const amqp = new AmqpLink(
    settings.sourceUrls,
    { side: 'source', retryForMs: settings.retryForMs, log, tls: settings.tls.source, stop: limits.stop },
    (connection) => source.attach(connection),
    () => source.detach(),
  );
  source.onBroken = (reason) => amqp.reset(reason);
  return {
    source,
    get identity() {
      return amqp.identity;
    },
    get where() {
      return amqp.where;
    },
    get isUp() {
      return amqp.isUp;
    },
    get downSince() {
      return amqp.downSince;
    },
    get onFatal() {
      return amqp.onFatal;
    },
    set onFatal(handler) {
      amqp.onFatal = handler;
      source.onFatal = handler;
    },
    start: () => amqp.start(),
    close: () => amqp.close(),
  };
}

/**
 * Whether the route may key a stream entry on its message-id: `message-id` comes in --id-from
 * before `offset` (which every stream entry has). Then a message-id too long for a 0-9-1 header
 * cannot be left out of it: the next strategy (the content, say) would key the entry instead.
 */
function keysOnMessageId(idFrom: readonly IdStrategy[]): boolean {
  for (const strategy of idFrom) {
    if (strategy.kind === 'offset') return false;
    if (strategy.kind === 'message-id') return true;
  }
  return false;
}
