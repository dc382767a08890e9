import type { Channel, ConsumeMessage } from 'amqplib';
import type { ChainableCommander, Cluster, Redis } from 'ioredis';
import { installLosslessReaderFor } from '../amqp/internals.js';
import { backoffDelay } from '../backoff.js';
import { REDIS_PREFIX_PATTERN, SCOPE_PATTERN } from '../config/settings.js';
import { DedupCache, type DedupCacheOptions, newOwnerToken } from '../dedup/cache.js';
import { keyOfField } from '../dedup/id.js';
import { quitRedis, type RedisClient, reconnectWhenEnded } from '../dedup/redis.js';
import { ConfigError } from '../errors.js';
import { DUPLICATE_ID_HEADER, IN_DOUBT_HEADER } from '../headers.js';
import type { ClaimState } from '../ports.js';
import { type ContentHeader, ContentHeaderError, contentHeaderOf } from '../wire/properties.js';

export interface HandlerContext {
  /** The message's ID, as the cache keys it (the same bytes give the same ID, string or Buffer). */
  dedupId: string;
  /** The bridge flagged this copy in-doubt: an earlier copy may have been delivered too. */
  inDoubt: boolean;
  /**
   * A MULTI on one of the consumer's own Redis connections. Queue the handler's own writes on it and
   * return (do not call `exec`): the consumer adds the ID's mark and runs it only while its claim on
   * the ID holds, so the effect and the mark land together or not at all.
   */
  transaction(): ChainableCommander;
}

export interface IdempotentConsumerOptions {
  channel: Channel;
  queue: string;
  /** Claims and renewals go over it; the consumer opens a few connections like it for its commits. */
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
  /**
   * First backoff before a message is returned to the queue after a failure, the handler's or
   * Redis's (default 1 s, doubling to 30 s).
   */
  retryDelayMs?: number;
  /** Told of handler and Redis failures (the message is retried). */
  onError?: (error: unknown, message: ConsumeMessage) => void;
  /**
   * Handle only messages RabbitMQ vouched for. RabbitMQ refuses a publish whose `user_id` is not
   * the publishing connection's user, so `user_id` is the one property a producer cannot forge.
   * `true`: a message without `user_id` is refused; a list of user names: so is one whose
   * `user_id` is not in it. A refused message is not handled and its ID not recorded: it is
   * nacked without requeue (the queue's dead-letter exchange gets it, if it has one), counted in
   * `counts.refused` and told to `onRefused`.
   */
  requireUserId?: boolean | readonly string[];
  /** Told of each message `requireUserId` refused, with why. */
  onRefused?: (message: ConsumeMessage, reason: string) => void;
}

export interface IdempotentConsumer {
  /**
   * `lost`: handlers whose claim another consumer took over while they ran (their lease lapsed: a
   * stalled process or Redis link); their transaction was dropped and the other owner's outcome
   * stands.
   */
  readonly counts: {
    processed: number;
    duplicates: number;
    failures: number;
    withoutId: number;
    lost: number;
    /** Refused by `requireUserId`: nacked without requeue, not handled. */
    refused: number;
  };
  /** Stops consuming, waits for the messages in hand, and closes the consumer's own Redis connections. */
  stop(): Promise<void>;
}

const BUSY_RECHECK_MS = 250;
/**
 * How long, once stop() began, a wait of a message in hand on Redis (its claim, renewal, commit or
 * release) may last before it is given up and the message goes back to the queue.
 */
const STOP_WAIT_MS = 5000;
/** How long a commit connection's QUIT may wait for Redis when the consumer stops. */
const LANE_QUIT_WAIT_MS = 2000;
/** How long the look-up after a commit whose reply was lost may take before the message is retried. */
const LOOKUP_WAIT_MS = 2000;
const MAX_RETRY_DELAY_MS = 30_000;
/** Redis connections for commits: a WATCH belongs to a connection, so each commit holds one. */
const COMMIT_CONNECTIONS = 4;

/**
 * A connection of the consumer's own for commits, used by one commit at a time: WATCH, check the
 * claim, MULTI … EXEC. Another EXEC on the connection in between would drop the WATCH.
 */
interface CommitLane {
  redis: RedisClient;
  /** The cache's scripts defined on this connection (a MULTI queues them from its own client). */
  cache: DedupCache;
  tail: Promise<unknown>;
}

/**
 * Runs `handler` once per `_HQ_DUPL_ID`: claim → handler → commit → ack, with leases, as the
 * bridge does for forwarding. Duplicates and in-doubt copies of an ID it already processed are
 * acked without calling the handler. A handler that throws has its claim released and its message
 * returned to the queue after a backoff: retried, never lost. Messages without an ID are handled
 * every time they arrive (counted as `withoutId`).
 *
 * The handler's transaction and the ID's mark commit only while this consumer's claim holds (a
 * WATCH on the claim key): if the lease lapsed and another consumer took the ID over, nothing of
 * this handler commits; the message waits for the other owner and is acked as a duplicate once it
 * committed, or is retried after a backoff if it gave up. No ack or nack throws: on a closed
 * channel the broker redelivers.
 */
export async function createIdempotentConsumer(
  options: IdempotentConsumerOptions,
): Promise<IdempotentConsumer> {
  const { channel, queue, redis, scope, handler } = options;
  // As the CLI checks them: a brace would end the scope's hash tag early, so "billing}x" would
  // write into billing's keys and make billing skip messages it never handled.
  if (!SCOPE_PATTERN.test(scope)) {
    throw new ConfigError(
      `createIdempotentConsumer: scope "${scope}" must be non-empty, without braces or spaces`,
    );
  }
  if (options.prefix !== undefined && !REDIS_PREFIX_PATTERN.test(options.prefix)) {
    throw new ConfigError(
      `createIdempotentConsumer: prefix "${options.prefix}" must be non-empty, without braces, colons or spaces`,
    );
  }
  const vouched = senderCheck(options.requireUserId);
  // IDs are keyed by their bytes on the wire, as the bridge keys them (amqplib's decoded headers
  // lose 64-bit precision and bytes that are not UTF-8): read this connection's headers raw.
  installLosslessReaderFor(channel);
  const leaseMs = options.leaseMs ?? 30_000;
  const retryDelayMs = options.retryDelayMs ?? 1000;
  const prefetch = options.prefetch ?? 50;
  const cacheOptions: DedupCacheOptions = {
    token: newOwnerToken(),
    leaseMs,
    windowMs: options.windowMs ?? 7 * 86_400_000,
    prefix: options.prefix ?? 'dedup',
    scope,
    // One slot for the scope, so that a handler's transaction can share it on a Redis Cluster:
    // its own keys carry the hash tag {<scope>}.
    shards: 1,
  };
  const cache = await DedupCache.open(redis, cacheOptions);
  const lanes = await openCommitLanes(
    redis,
    cacheOptions,
    Math.max(1, Math.min(COMMIT_CONNECTIONS, prefetch)),
  );
  let nextLane = 0;
  const takeLane = (): CommitLane => lanes[nextLane++ % lanes.length] as CommitLane;

  const counts = { processed: 0, duplicates: 0, failures: 0, withoutId: 0, lost: 0, refused: 0 };
  const attempts = new Map<string, number>();
  const inFlight = new Map<string, Promise<void>>();
  // Consecutive Redis failures, whatever the message: the backoff grows while Redis is unwell.
  let redisFailures = 0;
  let stopping = false;
  const wakers = new Set<() => void>();
  // Waits on Redis that a stop may give up (the app's client waits for an absent Redis without
  // end, and a silent one holds the commit connections too): each is let go STOP_WAIT_MS after it
  // began or the stop began, whichever is later, so that stop() returns. Each leaves the set when
  // it settles: nothing is kept per message.
  const giveUps = new Set<{ since: number; giveUp: () => void }>();
  let stopBegan = 0;
  // Once one wait went unanswered that long, Redis is taken to be away for the rest of the stop:
  // every wait, and every one after, is given up at once (copies of an ID, each waiting for the
  // one before, would otherwise take 5 s each).
  let redisAwayAtStop = false;
  /** `work`, or what `giveUp` gives once a stop has waited STOP_WAIT_MS for it. */
  const unlessStopped = <T>(work: Promise<T>, giveUp: () => T): Promise<T> => {
    if (redisAwayAtStop) {
      work.catch(() => {});
      return Promise.resolve().then(giveUp);
    }
    return new Promise<T>((resolve, reject) => {
      const entry = {
        since: performance.now(),
        giveUp: () => {
          giveUps.delete(entry);
          try {
            resolve(giveUp());
          } catch (error) {
            reject(error);
          }
        },
      };
      giveUps.add(entry);
      work.then(
        (value) => {
          giveUps.delete(entry);
          resolve(value);
        },
        (error: unknown) => {
          giveUps.delete(entry);
          reject(error);
        },
      );
    });
  };
  const giveUpWaits = () => {
    const now = performance.now();
    const away = [...giveUps].some((entry) => now - Math.max(entry.since, stopBegan) >= STOP_WAIT_MS);
    if (!away) return;
    redisAwayAtStop = true;
    for (const entry of [...giveUps]) entry.giveUp();
  };

  /** Sleeps, or returns at once when the consumer stops. */
  const pause = (ms: number): Promise<void> =>
    stopping
      ? Promise.resolve()
      : new Promise((resolve) => {
          const wake = () => {
            clearTimeout(timer);
            wakers.delete(wake);
            resolve();
          };
          const timer = setTimeout(wake, ms);
          wakers.add(wake);
        });

  // A closed channel cannot ack or nack (amqplib throws); the broker returns every unacked message
  // then, so there is nothing more to do for it.
  const ack = (message: ConsumeMessage) => {
    try {
      channel.ack(message);
    } catch {}
  };
  const requeue = (message: ConsumeMessage) => {
    try {
      channel.nack(message, false, true);
    } catch {}
  };

  const report = (error: unknown, message: ConsumeMessage) => {
    try {
      options.onError?.(error, message);
    } catch {}
  };

  /** Returns the message to the queue after a backoff that grows with `attempt`. */
  const retryLater = async (message: ConsumeMessage, attempt: number) => {
    await pause(backoffDelay(attempt, retryDelayMs, MAX_RETRY_DELAY_MS));
    requeue(message);
  };

  const nextAttempt = (idKey: string | undefined) => {
    const attempt = (attempts.get(idKey ?? '') ?? 0) + 1;
    attempts.set(idKey ?? '', attempt);
    if (attempts.size > 10_000) attempts.delete(attempts.keys().next().value as string);
    return attempt;
  };

  const claim = async (key: string): Promise<ClaimState> => {
    // A claim given up to a stop counts as busy: the message goes back to the queue unhandled.
    const [state] = await unlessStopped(cache.claim([key]), () => ['busy' as ClaimState]);
    redisFailures = 0;
    return state as ClaimState;
  };

  /** Never throws: every way out acks the message, or returns it to the queue after a backoff. */
  const handle = async (message: ConsumeMessage): Promise<void> => {
    try {
      await claimAndRun(message);
    } catch (error) {
      // Redis failed (a claim, or the check after a lost claim): the message goes back to the
      // queue after a backoff that grows while Redis keeps failing.
      counts.failures++;
      report(error, message);
      redisFailures++;
      await retryLater(message, redisFailures);
    }
  };

  const claimAndRun = async (message: ConsumeMessage): Promise<void> => {
    // Before the ID is looked at: a forged ID must not claim anything, nor mark a genuine one.
    const refusal = vouched(message);
    if (refusal !== undefined) {
      counts.refused++;
      try {
        channel.nack(message, false, false);
      } catch {}
      try {
        options.onRefused?.(message, refusal);
      } catch {}
      return;
    }
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
      const state = await untilNotBusy(key);
      if (state === 'busy') {
        requeue(message); // stopping
      } else if (state === 'dup') {
        counts.duplicates++;
        ack(message);
      } else {
        await runHandler(message, key, idKey);
      }
    } finally {
      inFlight.delete(key);
      done();
    }
  };

  /**
   * Whether the ID is committed now: false when Redis cannot tell within LOOKUP_WAIT_MS (the app's
   * client may wait for Redis without end, and the message must not wait with it).
   */
  const committedNow = (key: string): Promise<boolean> => {
    let timer: NodeJS.Timeout | undefined;
    const gaveUp = new Promise<boolean>((resolve) => {
      timer = setTimeout(() => resolve(false), LOOKUP_WAIT_MS);
    });
    const looked = cache.lookup([key]).then(
      ([record]) => record?.state === 'committed',
      () => false,
    );
    return Promise.race([looked, gaveUp]).finally(() => clearTimeout(timer));
  };

  /** Claims the ID, waiting while another consumer handles it; 'busy' only when stopping. */
  const untilNotBusy = async (key: string): Promise<ClaimState> => {
    for (;;) {
      const state = await claim(key);
      if (state !== 'busy' || stopping) return state;
      await pause(BUSY_RECHECK_MS);
    }
  };

  const runHandler = async (message: ConsumeMessage, key: string | undefined, idKey: string | undefined) => {
    let lane: CommitLane | undefined;
    let transaction: ChainableCommander | undefined;
    const context: HandlerContext = {
      dedupId: idKey ?? '',
      inDoubt: message.properties.headers?.[IN_DOUBT_HEADER] === true,
      transaction: () => {
        lane ??= takeLane();
        transaction ??= lane.redis.multi();
        return transaction;
      },
    };
    let renewing: Promise<unknown> = Promise.resolve();
    const renew = key
      ? setInterval(
          () => {
            renewing = cache.renew([key]).catch(() => 0);
          },
          Math.floor(leaseMs / 3),
        )
      : undefined;
    let outcome: 'committed' | 'lost';
    const commit: CommitProgress = { execSent: false };
    try {
      try {
        await handler(message, context);
      } finally {
        if (renew) clearInterval(renew);
        // A renewal landing after the WATCH below would abort the commit for nothing.
        await unlessStopped(renewing, () => 0);
      }
      if (key) {
        lane ??= takeLane();
        // Given up to a stop, the commit's outcome is unknown: the message goes back, and a copy
        // finds the ID committed (acked as a duplicate) if the EXEC ran after all.
        outcome = await unlessStopped(
          commitWhileClaimed(lane, key, transaction ?? lane.redis.multi(), message, commit),
          () => {
            throw new Error('the commit had no answer from Redis when the consumer stopped');
          },
        );
      } else {
        if (lane && transaction) {
          await unlessStopped(
            exclusive(lane, () => execOrThrow(transaction as ChainableCommander)),
            () => {
              throw new Error('the transaction had no answer from Redis when the consumer stopped');
            },
          );
        }
        outcome = 'committed';
      }
    } catch (error) {
      // The commit connection closed after our EXEC left and before Redis answered it: Redis may
      // have run it (a CLIENT KILL after the EXEC, before its reply was written). Our claim held at
      // the WATCH, so the ID committed now is, but for a takeover within those milliseconds, our
      // commit: the effect landed, once, and the message is done (a retry would find the ID
      // committed and count it a duplicate, never processed).
      if (key && commit.execSent && error instanceof CommitConnectionClosed && (await committedNow(key))) {
        counts.processed++;
        if (idKey) attempts.delete(idKey);
        ack(message);
        return;
      }
      // The handler's MULTI is dropped unsent (ioredis sends it on exec only), or its EXEC failed.
      counts.failures++;
      report(error, message);
      if (key)
        await unlessStopped(
          cache.release([key]).catch(() => 0),
          () => 0,
        );
      await retryLater(message, nextAttempt(idKey));
      return;
    }
    if (outcome === 'committed') {
      counts.processed++;
      if (idKey) attempts.delete(idKey);
      ack(message);
      return;
    }
    // Another consumer took the ID over while the handler ran; its outcome stands. This copy is a
    // duplicate of whatever it does: acked once it committed, retried later if it gave up.
    counts.lost++;
    const state = await untilNotBusy(key as string);
    if (state === 'dup') {
      counts.duplicates++;
      ack(message);
      return;
    }
    // It gave up (released the claim, or its lease lapsed too): the claim we just got is not for
    // now; the message comes back after a backoff.
    if (state !== 'busy')
      await unlessStopped(
        cache.release([key as string]).catch(() => 0),
        () => 0,
      );
    await retryLater(message, nextAttempt(idKey));
  };

  /**
   * Runs the handler's transaction with the ID's commit, only if our claim still holds: WATCH the
   * claim key, read it, and EXEC; a claim taken over (or gone) before the EXEC aborts it.
   */
  const commitWhileClaimed = (
    lane: CommitLane,
    key: string,
    transaction: ChainableCommander,
    message: ConsumeMessage,
    progress: CommitProgress,
  ): Promise<'committed' | 'lost'> =>
    exclusive(lane, async () => {
      const replies = await lane.redis.pipeline().watch(key).get(key).exec();
      const [watchError] = replies?.[0] ?? [new Error('WATCH got no reply')];
      const [getError, claimValue] = replies?.[1] ?? [new Error('GET got no reply')];
      if (watchError || getError || !ownsClaim(claimValue, cache.token)) {
        await unwatch(lane, key);
        if (watchError || getError) throw watchError ?? getError;
        return 'lost';
      }
      const queued = transaction.length;
      lane.cache.commitIn(transaction, [key]);
      if (transaction.length === queued) {
        await unwatch(lane, key);
        throw new Error('the commit script is not defined on the commit connection');
      }
      progress.execSent = true;
      const results = await transaction.exec();
      if (results === null) return 'lost'; // the claim changed after the WATCH
      const failed = results.find(([error]) => error);
      if (failed) throw failed[0];
      const reply = results.at(-1)?.[1] as unknown[] | undefined;
      if (reply?.[0] !== 1) {
        // Under the WATCH the commit must find our claim; anything else means the claim key
        // changed unseen (a redirect to another Cluster node): report it, the mark is in.
        report(
          new Error(`the commit of ${key} found no claim of ours (reply ${String(reply?.[0])}) under WATCH`),
          message,
        );
      }
      return 'committed';
    });

  const running = new Set<Promise<void>>();
  let closing: Promise<void> | undefined;
  /** Stops taking messages, waits for those in hand, closes the commit connections. Once. */
  const shutdown = (cancel: boolean): Promise<void> => {
    closing ??= (async () => {
      stopping = true;
      stopBegan = performance.now();
      const giveUpTimer = setInterval(giveUpWaits, 250);
      for (const wake of [...wakers]) wake();
      if (cancel) {
        try {
          await channel.cancel(consumerTag);
        } catch {}
      }
      try {
        while (running.size > 0) await Promise.allSettled([...running]);
      } finally {
        clearInterval(giveUpTimer);
      }
      await Promise.all(lanes.map((lane) => closeLane(lane)));
    })();
    return closing;
  };

  let consumerTag = '';
  try {
    await channel.prefetch(prefetch);
    ({ consumerTag } = await channel.consume(
      queue,
      (message) => {
        if (!message) return; // cancelled by the broker (the queue was deleted)
        const work = handle(message).catch((error: unknown) => report(error, message));
        running.add(work);
        void work.finally(() => running.delete(work));
      },
      { noAck: false },
    ));
  } catch (error) {
    await Promise.all(lanes.map((lane) => closeLane(lane)));
    throw error;
  }
  // The channel is gone (closed by us, the broker or a lost connection): the broker requeues what
  // was unacked; finish what is in hand and let the commit connections go.
  channel.once('close', () => void shutdown(false));
  return {
    counts,
    stop: () => shutdown(true),
  };
}

/** How far a commit got: whether its EXEC was handed to the connection. */
interface CommitProgress {
  execSent: boolean;
}

/** The commit connection closed before Redis answered: whether the commit ran is unknown. */
class CommitConnectionClosed extends Error {
  constructor() {
    super('the commit connection closed before Redis answered');
    this.name = 'CommitConnectionClosed';
  }
}

/** Connections like `redis` for commits, each with the cache's scripts defined on it. */
async function openCommitLanes(
  redis: RedisClient,
  cacheOptions: DedupCacheOptions,
  count: number,
): Promise<CommitLane[]> {
  const lanes: CommitLane[] = [];
  try {
    for (let i = 0; i < count; i++) {
      const connection = commitConnection(redis);
      lanes.push({ redis: connection, cache: undefined as unknown as DedupCache, tail: Promise.resolve() });
      connection.on('error', () => {}); // ioredis retries; a commit meanwhile fails and is retried
      // Ours to keep up: a copy of a Sentinel client may be given up by ioredis after a failover.
      reconnectWhenEnded(connection);
      await connection.connect();
      (lanes.at(-1) as CommitLane).cache = await DedupCache.open(connection, cacheOptions);
    }
  } catch (error) {
    await Promise.all(lanes.map((lane) => closeLane(lane)));
    throw error;
  }
  return lanes;
}

/**
 * A connection like `redis` on which a WATCH cannot silently vanish: a command is never queued
 * while it is down nor sent again after it reconnected (either would run the MULTI on a fresh
 * connection, without the WATCH); it fails instead, and the message is retried.
 */
function commitConnection(redis: RedisClient): RedisClient {
  const guarded = { enableOfflineQueue: false, autoResendUnfulfilledCommands: false };
  if ((redis as { isCluster?: boolean }).isCluster === true) {
    const cluster = redis as Cluster;
    return cluster.duplicate([], { lazyConnect: true, enableOfflineQueue: false, redisOptions: guarded });
  }
  return (redis as Redis).duplicate({ ...guarded, lazyConnect: true });
}

/**
 * Drops the lane's WATCH when no EXEC follows. Not with UNWATCH: it names no key, and a Cluster
 * sends it to any node, while a WATCH left on the right one would abort the lane's next commit. An
 * EXEC of a MULTI that names the key goes where the WATCH went, and ends it, aborted or not.
 */
async function unwatch(lane: CommitLane, key: string): Promise<void> {
  await lane.redis
    .multi()
    .exists(key)
    .exec()
    .catch(() => {});
}

/** Closes a commit connection: by QUIT, or at once if Redis does not answer it (a stop must end). */
async function closeLane(lane: CommitLane): Promise<void> {
  let timer: NodeJS.Timeout | undefined;
  await Promise.race([
    quitRedis(lane.redis),
    new Promise<void>((resolve) => {
      timer = setTimeout(resolve, LANE_QUIT_WAIT_MS);
    }),
  ]);
  clearTimeout(timer);
  lane.redis.disconnect();
}

/** Runs `work` alone on the lane's connection (commits queue behind each other). */
function exclusive<T>(lane: CommitLane, work: () => Promise<T>): Promise<T> {
  const guarded = () => unlessClosed(lane.redis, work());
  const run = lane.tail.then(guarded, guarded);
  lane.tail = run.catch(() => {});
  return run;
}

/**
 * `work`, or a failure once the connection closes before it settles. On a reconnect ioredis 6.0.0
 * drops the replies still due on a connection that does not resend them (as a commit connection
 * does not) without ever settling them: the lane, and every message waiting for it, would wait
 * for ever. Whether an EXEC in flight ran is then unknown: the caller looks the ID up (see
 * runHandler), and a retry finds out too (an ID committed comes back a duplicate).
 */
function unlessClosed<T>(redis: RedisClient, work: Promise<T>): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    const onClose = () => reject(new CommitConnectionClosed());
    redis.once('close', onClose);
    work.then(
      (value) => {
        redis.off('close', onClose);
        resolve(value);
      },
      (error: unknown) => {
        redis.off('close', onClose);
        reject(error);
      },
    );
  });
}

async function execOrThrow(transaction: ChainableCommander): Promise<void> {
  const results = await transaction.exec();
  const failed = results?.find(([error]) => error);
  if (!results || failed) throw failed?.[0] ?? new Error('transaction aborted');
}

/** A claim value is `c:<owner token>:…` (see claim.lua); a token never contains ':'. */
function ownsClaim(value: unknown, token: string): boolean {
  return typeof value === 'string' && value.startsWith(`c:${token}:`);
}

/**
 * The check `requireUserId` asks for: why a message is refused, or undefined when RabbitMQ vouched
 * for a sender it trusts. Reads `user_id` from the bytes on the wire, as the broker checked it.
 */
function senderCheck(
  requireUserId: boolean | readonly string[] | undefined,
): (message: ConsumeMessage) => string | undefined {
  if (requireUserId === undefined || requireUserId === false) return () => undefined;
  if (requireUserId !== true && (!Array.isArray(requireUserId) || requireUserId.length === 0)) {
    throw new ConfigError(
      'createIdempotentConsumer: requireUserId must be true or a non-empty list of RabbitMQ user names',
    );
  }
  const trusted = requireUserId === true ? undefined : new Set(requireUserId);
  return (message) => {
    let userId: string | undefined;
    try {
      userId = contentHeaderOf(message.properties).userIdBytes?.toString('utf8');
    } catch (error) {
      if (!(error instanceof ContentHeaderError)) throw error;
      return 'its properties cannot be read';
    }
    if (userId === undefined) return 'no user_id: RabbitMQ did not vouch for the sender';
    if (trusted && !trusted.has(userId)) return `user_id "${userId}" is not a trusted sender`;
    return undefined;
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
