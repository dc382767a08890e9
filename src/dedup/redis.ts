import { Redis } from 'ioredis';
import { backoffDelay } from '../amqp/backoff.js';
import { describe } from '../amqp/errors.js';
import { passwordOf, redactSecrets, redactUrl } from '../config/redact.js';
import { FatalConnectError, UnavailableError } from '../errors.js';
import type { Logger } from '../observe/log.js';

// Replies that mean the URL's credentials or database are wrong: retrying cannot fix them.
const FATAL_REPLY = /^(WRONGPASS|NOAUTH|NOPERM|ERR invalid password|ERR AUTH|ERR DB index is out of range)/;

/**
 * Connects to Redis and waits until it answers, retrying with backoff for up to `retryForMs`
 * (0: forever). Once connected, commands wait through later outages instead of failing
 * (`maxRetriesPerRequest: null`): the pipeline holds its messages unacked meanwhile.
 */
export async function connectRedis(url: string, retryForMs: number, log: Logger): Promise<Redis> {
  const where = `Redis at ${redactUrl(url)}`;
  const secret = passwordOf(url);
  let lastError: unknown;
  const redis = new Redis(url, {
    lazyConnect: true,
    maxRetriesPerRequest: null,
    connectionName: 'dedup-bridge',
    connectTimeout: 5000,
    retryStrategy: (attempt) => backoffDelay(attempt, 100, 5000),
  });
  let connected = false;
  redis.on('error', (error: Error) => {
    lastError = error;
    if (connected)
      log.warn({ error: redactSecrets(describe(error), [secret]) }, `${where}: connection error`);
  });
  redis.on('ready', () => {
    if (connected) log.info(`${where}: connected again`);
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
        if (FATAL_REPLY.test(error.message)) {
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
