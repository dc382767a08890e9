import { type ConnectionOptions, connect as tlsConnect } from 'node:tls';
import { Cluster, Redis } from 'ioredis';
import { backoffDelay, sleepUnlessStopped } from '../backoff.js';
import { redactSecrets, secretsOf } from '../config/redact.js';
import {
  describeRedis,
  parseRedisUrl,
  type RedisNodeAddress,
  type RedisTopology,
} from '../config/redis-url.js';
import { redisNodeTlsOptions, redisTlsOptions, type TlsFiles, tlsFailure } from '../config/tls.js';
import { ConfigError, describe, FatalConnectError, StopRequested, UnavailableError } from '../errors.js';
import type { Logger } from '../log.js';

/** What the rest of the code talks to: one server (alone or found through Sentinel) or a Cluster. */
export type RedisClient = Redis | Cluster;

/** The servers that hold keys: every master of a Cluster, or the one server otherwise. */
export function masterNodes(redis: RedisClient): Redis[] {
  return redis instanceof Cluster ? redis.nodes('master') : [redis];
}

// Replies that mean the URL's credentials or database are wrong: retrying cannot fix them.
const FATAL_REPLY = /^(WRONGPASS|NOAUTH|NOPERM|ERR invalid password|ERR AUTH|ERR DB index is out of range)/;

/**
 * The line for credentials or a database Redis refused. At start the bridge exits; on a reconnect
 * it keeps retrying, so that fixing Redis's side resumes it without a restart.
 */
function refusal(where: string, error: Error, reconnecting: boolean): string {
  let code = FATAL_REPLY.exec(error.message)?.[1] ?? error.message;
  let what = 'authentication or database refused; check the user, password and database in the URL';
  if (code === 'NOPERM') {
    // Redis names the command (SELECT for a database other than 0): say which grant is missing.
    code = error.message.split('\n')[0] as string;
    what =
      'a command ioredis sends on connecting is not granted to the user; add it (docs/security.md, Least privilege, lists the ACL per topology)';
  }
  return reconnecting
    ? `${where}: ${code} on reconnecting — ${what} against Redis (retrying meanwhile; messages wait unacked in the source)`
    : `${where}: ${code} — ${what}`;
}

// ioredis reports sentinels that all refused us as one error ending in the last reply.
const SENTINELS_REFUSED = /Last error: (WRONGPASS|NOAUTH|NOPERM|ERR invalid password|ERR AUTH)/;

/** The line for credentials the sentinels refused (their own, not the master's). */
function sentinelRefusal(where: string, code: string): string {
  return `${where}: ${code} from the sentinels — they refused their credentials; check sentinelUsername and sentinelPassword in the URL's query (the sentinels' own, which may differ from the master's)`;
}

/**
 * An ACL refusal (NOPERM: Redis names the command) as what it is, a grant missing from the user:
 * one line and exit 2, since retrying cannot fix it. Any other error is returned unchanged.
 */
export function asMissingGrant(error: unknown, what: string): unknown {
  const message = error instanceof Error ? (error.message.split('\n')[0] as string) : String(error);
  if (!/^NOPERM/.test(message)) return error;
  return new ConfigError(
    `Redis refused ${what} (${message}); give the user the ACL that docs/security.md, Least privilege, lists`,
  );
}

/**
 * A Redis error reply as one line: its first, without the script location Redis adds to an error
 * inside a script (". script: <sha>, on @user_script:12.") and without a closing full stop.
 */
export function replyText(error: unknown): string {
  return describe(error)
    .replace(/\.? script: .*$/, '')
    .replace(/\.$/, '');
}

/** How a Redis that answers with errors is described, by the reply's code, and what to do about it. */
const REFUSALS: [RegExp, string, string][] = [
  [
    /^OOM/,
    'refused writes',
    'it is full (maxmemory with maxmemory-policy noeviction): raise its maxmemory or free memory (docs/redis.md sizes it); keep noeviction, an evicted key is a forgotten ID',
  ],
  [
    /^READONLY/,
    'refused writes',
    'the URL names a replica: give the master (or the Sentinel or Cluster URL)',
  ],
  [/^MISCONF/, 'refused writes', 'it cannot save its data to disk: see its log'],
  [/^LOADING/, 'answered that it is loading its data', 'give it time to load, with a longer --retry-for'],
  [/^BUSY/, 'answered that it is busy with a script', 'see SCRIPT KILL and its slow log'],
];

/** What a Redis that keeps answering `reply` does ("refused writes"), and what to do. */
export function redisRefusalOf(reply: string): { how: string; advice: string } {
  for (const [code, how, advice] of REFUSALS) if (code.test(reply)) return { how, advice };
  return { how: 'failed every call', advice: 'see its log' };
}

/**
 * Whether a failed Redis call is an error reply that may pass (OOM, READONLY, LOADING …): retried
 * with `untilRedisAnswers`. Not a refused grant (NOPERM), which retrying cannot fix, nor an error
 * of ours.
 */
function isPassingReply(error: unknown): boolean {
  return (
    error instanceof Error &&
    error.name === 'ReplyError' &&
    !FATAL_REPLY.test(error.message) &&
    !/can't run this command/.test(error.message)
  );
}

/**
 * Runs a start-up call (the job lock, opening the dedup scope) until Redis stops answering it with
 * an error reply such as OOM, for up to `retryForMs` (0: until stopped); then one line, exit 1.
 * Other errors are thrown at once.
 */
export async function untilRedisAnswers<T>(
  where: string,
  what: string,
  retryForMs: number,
  log: Logger,
  call: () => Promise<T>,
  stop?: AbortSignal,
): Promise<T> {
  const started = Date.now();
  for (let attempt = 1; ; attempt++) {
    try {
      return await call();
    } catch (error) {
      if (!isPassingReply(error)) throw error;
      const reply = replyText(error);
      const { how, advice } = redisRefusalOf(reply);
      const waited = Date.now() - started;
      if (retryForMs > 0 && waited >= retryForMs) {
        throw new UnavailableError(
          `${where} ${how} for ${Math.round(waited / 1000)}s (${reply}) ${what}, past --retry-for: ${advice}; nothing was moved: run again when it is back`,
        );
      }
      if (attempt === 1) log.warn({ error: reply }, `${where} ${how} ${what}; retrying (--retry-for)`);
      const delay = backoffDelay(attempt, 100, 5000);
      await sleepUnlessStopped(retryForMs > 0 ? Math.min(delay, retryForMs - waited) : delay, stop);
      if (stop?.aborted) throw new StopRequested(where);
    }
  }
}

const retryStrategy = (attempt: number) => backoffDelay(attempt, 100, 5000);

/** Clients closed by closeRedis: any other end of a client from connectRedis is reconnected. */
const closedOnPurpose = new WeakSet<RedisClient>();

/** Closes a client from connectRedis for good (it would otherwise be reconnected). */
export function closeRedis(redis: RedisClient): void {
  closedOnPurpose.add(redis);
  redis.disconnect();
}

/** The same after the replies still due (QUIT). */
export async function quitRedis(redis: RedisClient): Promise<void> {
  closedOnPurpose.add(redis);
  await redis.quit().catch(() => {});
  // QUIT closes the connection, not the sentinel connections of ioredis's failoverDetector.
  redis.disconnect();
}

/**
 * Connects `redis` again whenever it ends but through closeRedis or quitRedis. ioredis can give a
 * client up for good: a failover that Sentinel announces while the client is asking a sentinel
 * for the master makes that reconnect throw, and the client ends (6.0.0; every later command then
 * fails at once). Each end is followed by a new connect after the usual backoff, and the calls
 * that failed meanwhile are retried by their callers; `onGaveUp` hears of the first of a series.
 */
export function reconnectWhenEnded(redis: RedisClient, onGaveUp: () => void = () => {}): void {
  let ended = 0;
  redis.on('ready', () => {
    ended = 0;
  });
  redis.on('end', () => {
    if (closedOnPurpose.has(redis)) return;
    ended += 1;
    if (ended === 1) onGaveUp();
    // Unref'd: a client left ended is never what keeps a process alive.
    setTimeout(() => {
      if (closedOnPurpose.has(redis) || redis.status !== 'end') return;
      redis.connect().catch(() => {
        // 'error' and 'end' report it; this handler tries again.
      });
    }, retryStrategy(ended)).unref();
  });
}

/** Builds the ioredis client for a topology, not yet connected. */
function newClient(topology: RedisTopology, tls: TlsFiles | undefined): RedisClient {
  const common = {
    maxRetriesPerRequest: null,
    connectionName: 'dedup-bridge',
    connectTimeout: 5000,
    // CLIENT SETINFO (library name and version) would need a grant of its own in a minimal ACL.
    disableClientInfo: true,
  };
  if (topology.kind === 'standalone')
    return new Redis(topology.url, {
      ...common,
      lazyConnect: true,
      retryStrategy,
      ...redisTlsOptions(topology.url, tls),
    });
  const { username, password } = topology;
  // The same CA and client certificate for every server of the set (see redisNodeTlsOptions).
  const nodeTls = topology.tls ? redisNodeTlsOptions(tls) : undefined;
  if (topology.kind === 'sentinel') {
    return new Redis({
      ...common,
      lazyConnect: true,
      sentinels: topology.sentinels,
      name: topology.masterName,
      db: topology.db,
      username,
      password,
      sentinelUsername: topology.sentinelUsername,
      sentinelPassword: topology.sentinelPassword,
      // TLS to the sentinels (sentinelTLS) and to the master they name (tls, with the mode flag).
      ...(nodeTls ? { tls: nodeTls, sentinelTLS: nodeTls, enableTLSForSentinelMode: true } : {}),
      retryStrategy,
      sentinelRetryStrategy: retryStrategy,
      // Reconnect as soon as Sentinel announces a new master, not only when the old one drops us.
      failoverDetector: true,
    });
  }
  return new Cluster(topology.nodes, {
    lazyConnect: true,
    redisOptions: { ...common, username, password, ...(nodeTls ? { tls: nodeTls } : {}) },
    clusterRetryStrategy: retryStrategy,
    // While a replica takes over a dead master's slots, commands wait and retry rather than fail.
    retryDelayOnFailover: 200,
    retryDelayOnClusterDown: 300,
    maxRedirections: 50,
  });
}

/**
 * Why a TLS handshake with the first of `nodes` that answers fails, or undefined. ioredis loses
 * this for a Sentinel set (it reports only "All sentinels are unreachable") and a Cluster (it
 * reads the slots over a throwaway connection), so a handshake of our own names the certificate
 * problem instead of retrying it for the whole --retry-for.
 */
async function tlsProblemOf(
  nodes: readonly RedisNodeAddress[],
  options: ConnectionOptions,
): Promise<string | undefined> {
  for (const node of nodes) {
    const error = await new Promise<unknown>((resolve) => {
      const socket = tlsConnect({ ...options, host: node.host, port: node.port }, () => {
        socket.destroy();
        resolve(undefined);
      });
      socket.once('error', resolve);
      socket.setTimeout(5000, () => {
        socket.destroy();
        resolve(undefined);
      });
    });
    const problem = tlsFailure(error, 'redis');
    if (problem) return problem;
  }
  return undefined;
}

/**
 * For a TLS URL that got no answer: a plain Redis port reads the TLS greeting as a command that
 * never ends and says nothing, so the attempts time out as if nothing ran there.
 */
function tlsPortHint(topology: RedisTopology, reason: string): string {
  const tls = topology.kind === 'standalone' ? topology.url.startsWith('rediss:') : topology.tls;
  if (!tls || !/no answer|ETIMEDOUT|timed? ?out/i.test(reason)) return '';
  return ', and that the port speaks TLS (a plain Redis port never answers the TLS greeting)';
}

/**
 * Connects to Redis and waits until it answers, retrying with backoff for up to `retryForMs`
 * (0: forever). Once connected, commands wait through later outages instead of failing
 * (`maxRetriesPerRequest: null`): the pipeline holds its messages unacked meanwhile.
 */
export async function connectRedis(
  url: string,
  retryForMs: number,
  log: Logger,
  tls?: TlsFiles,
  stop?: AbortSignal,
): Promise<RedisClient> {
  const topology = parseRedisUrl(url);
  const where = describeRedis(topology);
  const secret = [
    ...secretsOf(url),
    ...(topology.kind === 'standalone' ? [] : [topology.password ?? '']),
    ...(topology.kind === 'sentinel' ? [topology.sentinelPassword ?? ''] : []),
  ];
  let lastError: unknown;
  const redis = newClient(topology, tls);
  let connected = false;
  // ioredis reports every failed reconnect attempt; log the first as "lost", the others at debug.
  let down = false;
  // Credentials refused on a reconnect (a rotated password, a changed ACL): said once, as an error,
  // and retried, so that fixing Redis's side resumes the bridge without a restart.
  let refused = false;
  const onLaterError = (error: Error) => {
    lastError = error;
    if (!connected) return;
    const bySentinels = SENTINELS_REFUSED.exec(error.message)?.[1];
    if (FATAL_REPLY.test(error.message) || bySentinels) {
      if (!refused) {
        log.error(
          bySentinels
            ? `${sentinelRefusal(where, bySentinels)} (retrying meanwhile; messages wait unacked in the source)`
            : refusal(where, error, true),
        );
      }
      refused = true;
      down = true;
      return;
    }
    log[down ? 'debug' : 'warn'](
      { error: redactSecrets(describe(error), secret) },
      `${where}: connection error; reconnecting`,
    );
    down = true;
  };
  redis.on('error', onLaterError);
  // A Cluster reports a node's refusal (e.g. WRONGPASS) on 'node error' only; its other node
  // errors (a failover) are not an outage of the whole cache.
  if (redis instanceof Cluster) {
    redis.on('node error', (error: Error) => {
      if (FATAL_REPLY.test(error.message)) onLaterError(error);
    });
  }
  // A connection closed without an error (Redis stopped, a proxy or balancer cut it): say so once,
  // as for the brokers; commands wait meanwhile, so no call fails to say it. 'reconnecting' (not
  // 'close'): a disconnect() of ours ends the client without it.
  redis.on('reconnecting', () => {
    if (!connected || down) return;
    down = true;
    log.warn(`${where}: lost; reconnecting (messages wait unacked until it answers)`);
  });
  redis.on('ready', () => {
    if (connected) log.info(`${where}: connected again`);
    down = false;
    refused = false;
  });
  reconnectWhenEnded(redis, () => log.warn(`${where}: the Redis client gave up; connecting it again`));
  const started = Date.now();
  try {
    await new Promise<void>((resolve, reject) => {
      const timer =
        retryForMs > 0
          ? setTimeout(() => {
              const reason = lastError ? redactSecrets(describe(lastError), secret) : 'no answer';
              reject(
                new UnavailableError(
                  `${where} is unreachable (${reason}) after retrying for ${Math.round((Date.now() - started) / 1000)}s; check that it runs and the host and port in the URL${tlsPortHint(topology, reason)}`,
                ),
              );
            }, retryForMs)
          : undefined;
      let said = false;
      const onStop = () => {
        clearTimeout(timer);
        reject(new StopRequested(where));
      };
      if (stop?.aborted) onStop();
      stop?.addEventListener('abort', onStop, { once: true });
      const onError = (error: Error) => {
        const tlsProblem = tlsFailure(error, 'redis');
        if (tlsProblem) {
          clearTimeout(timer);
          reject(new FatalConnectError(`${where}: ${tlsProblem}`));
        } else if (FATAL_REPLY.test(error.message)) {
          clearTimeout(timer);
          reject(new FatalConnectError(refusal(where, error, false)));
        } else if (SENTINELS_REFUSED.test(error.message)) {
          clearTimeout(timer);
          const code = SENTINELS_REFUSED.exec(error.message)?.[1] as string;
          reject(new FatalConnectError(sentinelRefusal(where, code)));
        } else if (!said) {
          // Once per wait, as for the brokers; the attempts after it at debug level.
          said = true;
          if (topology.kind !== 'standalone' && topology.tls) {
            const nodes = topology.kind === 'sentinel' ? topology.sentinels : topology.nodes;
            void tlsProblemOf(nodes, redisNodeTlsOptions(tls)).then((problem) => {
              if (!problem) return;
              clearTimeout(timer);
              reject(new FatalConnectError(`${where}: ${problem}`));
            });
          }
          log.warn({ error: redactSecrets(describe(error), secret) }, `${where} not reachable; retrying`);
        }
      };
      redis.on('error', onError);
      // A Cluster reports a node's refusal (e.g. WRONGPASS) on 'node error'.
      redis.on('node error', onError);
      redis.once('ready', () => {
        clearTimeout(timer);
        stop?.removeEventListener('abort', onStop);
        redis.off('error', onError);
        redis.off('node error', onError);
        resolve();
      });
      redis.connect().catch(() => {
        // The 'error' handler and retryStrategy take it from here.
      });
    });
  } catch (error) {
    closeRedis(redis);
    throw error;
  }
  connected = true;
  return redis;
}

/**
 * What makes a Redis unsafe as the dedup record: it keeps nothing on disk (a restart forgets the
 * IDs), or it may evict keys under memory pressure (an evicted ID is a forgotten one). A Cluster
 * is checked master by master; a Sentinel-managed master also needs a replica to fail over to.
 */
export async function redisSafetyWarnings(redis: RedisClient): Promise<string[]> {
  const warnings: string[] = [];
  const field = (info: string, name: string) => new RegExp(`^${name}:(.*)$`, 'm').exec(info)?.[1]?.trim();
  const nodes = masterNodes(redis);
  for (const node of nodes) {
    const who = nodes.length > 1 ? `Redis master ${node.options.host}:${node.options.port}` : 'Redis';
    const persistence = await node.info('persistence');
    if (field(persistence, 'aof_enabled') === '0') {
      warnings.push(
        `${who} runs without an append-only file: a restart loses the IDs written since its last snapshot, and messages resent after that are forwarded again; run it with appendonly yes`,
      );
    }
    const memory = await node.info('memory');
    const policy = field(memory, 'maxmemory_policy');
    if (Number(field(memory, 'maxmemory') ?? 0) > 0 && policy !== undefined && policy !== 'noeviction') {
      warnings.push(
        `${who} may evict keys (maxmemory-policy ${policy}): an evicted ID is forwarded again; set maxmemory-policy noeviction`,
      );
    }
  }
  if (!(redis instanceof Cluster) && redis.options.sentinels) {
    const replication = await redis.info('replication');
    if (field(replication, 'connected_slaves') === '0') {
      warnings.push(
        'the Redis master Sentinel names has no replica connected: if it fails there is nothing to promote, and the bridge waits until it is back',
      );
    }
  }
  return warnings;
}
