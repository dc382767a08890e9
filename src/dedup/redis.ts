import { Redis } from 'ioredis';
import { backoffDelay } from '../amqp/backoff.js';
import { describe } from '../amqp/errors.js';
import { passwordOf, redactSecrets, redactUrl } from '../config/redact.js';
import { redisTlsOptions, type TlsFiles, tlsFailure } from '../config/tls.js';
import { FatalConnectError, UnavailableError } from '../errors.js';
import type { Logger } from '../observe/log.js';

// Replies that mean the URL's credentials or database are wrong: retrying cannot fix them.
const FATAL_REPLY = /^(WRONGPASS|NOAUTH|NOPERM|ERR invalid password|ERR AUTH|ERR DB index is out of range)/;

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
): Promise<Redis> {
  const where = `Redis at ${redactUrl(url)}`;
  const secret = passwordOf(url);
  let lastError: unknown;
  const redis = new Redis(url, {
    lazyConnect: true,
    maxRetriesPerRequest: null,
    connectionName: 'dedup-bridge',
    connectTimeout: 5000,
    retryStrategy: (attempt) => backoffDelay(attempt, 100, 5000),
    ...redisTlsOptions(url, tls),
  });
  let connected = false;
  // ioredis reports every failed reconnect attempt; log the first as "lost", the others at debug.
  let down = false;
  redis.on('error', (error: Error) => {
    lastError = error;
    if (connected) {
      log[down ? 'debug' : 'warn'](
        { error: redactSecrets(describe(error), [secret]) },
        `${where}: connection error; reconnecting`,
      );
      down = true;
    }
  });
  redis.on('ready', () => {
    if (connected) log.info(`${where}: connected again`);
    down = false;
  });
  const started = Date.now();
  try {
    await new Promise<void>((resolve, reject) => {
      const timer =
        retryForMs > 0
          ? setTimeout(() => {
              const reason = lastError ? redactSecrets(describe(lastError), [secret]) : 'no answer';
              reject(
                new UnavailableError(
                  `${where} is unreachable (${reason}) after retrying for ${Math.round((Date.now() - started) / 1000)}s; check that it runs and the host and port in the URL`,
                ),
              );
            }, retryForMs)
          : undefined;
      const onError = (error: Error) => {
        const tlsProblem = tlsFailure(error, 'redis');
        if (tlsProblem) {
          clearTimeout(timer);
          reject(new FatalConnectError(`${where}: ${tlsProblem}`));
        } else if (FATAL_REPLY.test(error.message)) {
          clearTimeout(timer);
          reject(
            new FatalConnectError(
              `${where}: ${error.message.split(' ')[0]} — authentication or database refused; check the user, password and database in the URL`,
            ),
          );
        }
      };
      redis.on('error', onError);
      redis.once('ready', () => {
        clearTimeout(timer);
        redis.off('error', onError);
        resolve();
      });
      redis.connect().catch(() => {
        // The 'error' handler and retryStrategy take it from here.
      });
    });
  } catch (error) {
    redis.disconnect();
    throw error;
  }
  connected = true;
  return redis;
}

/**
 * What makes a Redis unsafe as the dedup record: it keeps nothing on disk (a restart forgets the
 * IDs), or it may evict keys under memory pressure (an evicted ID is a forgotten one).
 */
export async function redisSafetyWarnings(redis: Redis): Promise<string[]> {
  const warnings: string[] = [];
  const field = (info: string, name: string) => new RegExp(`^${name}:(.*)$`, 'm').exec(info)?.[1]?.trim();
  const persistence = await redis.info('persistence');
  if (field(persistence, 'aof_enabled') === '0') {
    warnings.push(
      'Redis runs without an append-only file: a restart loses the IDs written since its last snapshot, and messages resent after that are forwarded again; run it with appendonly yes',
    );
  }
  const memory = await redis.info('memory');
  const policy = field(memory, 'maxmemory_policy');
  if (Number(field(memory, 'maxmemory') ?? 0) > 0 && policy !== undefined && policy !== 'noeviction') {
    warnings.push(
      `Redis may evict keys (maxmemory-policy ${policy}): an evicted ID is forwarded again; set maxmemory-policy noeviction`,
    );
  }
  return warnings;
}
