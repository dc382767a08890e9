import amqp, { type ChannelModel } from 'amqplib';
import { backoffDelay, sleepUnlessStopped } from '../backoff.js';
import { redactSecrets, redactUrl, secretsOf } from '../config/redact.js';
import { amqpTlsOptions, type TlsFiles } from '../config/tls.js';
import { describe, StopRequested } from '../errors.js';
import type { Logger } from '../log.js';
import { classifyConnectError, unreachable } from './errors.js';
import { AmqplibInternalsError, coalesceWrites, installLosslessReader } from './internals.js';

interface ConnectOptions {
  /** Names the side in messages and in the broker's connection list: "source" or "target". */
  side: 'source' | 'target';
  /** CA and client certificate for an amqps:// URL. */
  tls?: TlsFiles;
  /** Give up after retrying this long; 0 retries forever. */
  retryForMs: number;
  log: Logger;
  /** Stop retrying when this returns true (the bridge is shutting down). */
  cancelled?: () => boolean;
  /** A stop signal: the wait for the broker ends at once with StopRequested. */
  stop?: AbortSignal;
}

export class ConnectCancelled extends Error {}

/**
 * Opens an AMQP connection, retrying network failures with backoff until `retryForMs`, and
 * failing at once on errors that retrying cannot fix (wrong credentials, a missing vhost).
 */
export async function connectAmqp(url: string, options: ConnectOptions): Promise<ChannelModel> {
  return (await connectAmqpAny([url], 0, options)).connection;
}

/**
 * Like connectAmqp, for the nodes of a cluster: starts at `urls[startAt]` and moves to the next URL
 * after each failed attempt, backing off only once every URL of a round has failed. Returns the
 * connection and the index of the URL it reached.
 */
export async function connectAmqpAny(
  urls: readonly string[],
  startAt: number,
  options: ConnectOptions,
): Promise<{ connection: ChannelModel; index: number }> {
  const started = Date.now();
  for (let attempt = 1; ; attempt++) {
    const index = (startAt + attempt - 1) % urls.length;
    const url = urls[index] as string;
    const where = `${options.side} broker at ${redactUrl(url)}`;
    try {
      const connection = await amqp.connect(url, {
        clientProperties: { connection_name: `dedup-bridge ${options.side}` },
        timeout: 10_000,
        // amqplib leaves Nagle's algorithm on: small frames would wait for the peer's delayed ACK.
        noDelay: true,
        ...amqpTlsOptions(options.side, url, options.tls),
      });
      // amqplib rethrows 'error' events that nobody listens to; the caller attaches its own too.
      connection.on('error', () => {});
      // Lossless content headers and coalesced writes rely on amqplib internals (pinned version).
      installLosslessReader(connection);
      coalesceWrites(connection);
      return { connection, index };
    } catch (error) {
      if (error instanceof AmqplibInternalsError) throw error;
      const fatal = classifyConnectError(error, where, options.side, vhostOf(url));
      if (fatal) throw fatal;
      if (options.cancelled?.()) throw new ConnectCancelled('connect cancelled');
      if (options.stop?.aborted) throw new StopRequested(`the ${options.side} broker`);
      const elapsed = Date.now() - started;
      if (options.retryForMs > 0 && elapsed >= options.retryForMs) {
        const all = urls.length > 1 ? `${options.side} broker at ${urls.map(redactUrl).join(', ')}` : where;
        throw unreachable(all, error, elapsed);
      }
      const round = Math.ceil(attempt / urls.length);
      const delay = attempt % urls.length === 0 ? backoffDelay(round) : 0;
      // One line when retrying starts; further attempts only at debug level (state changes, not noise).
      options.log[attempt === 1 ? 'warn' : 'debug'](
        {
          side: options.side,
          attempt,
          delayMs: delay,
          error: redactSecrets(describe(error), secretsOf(url)),
        },
        urls.length > 1 ? `${where} not reachable; trying the next URL` : `${where} not reachable; retrying`,
      );
      if (delay > 0) await sleepUnlessStopped(delay, options.stop);
      if (options.cancelled?.()) throw new ConnectCancelled('connect cancelled');
      if (options.stop?.aborted) throw new StopRequested(`the ${options.side} broker`);
    }
  }
}

/** The virtual host a URL names, as amqplib reads it ("/" when the URL has no path). */
export function vhostOf(url: string): string {
  try {
    const path = new URL(url).pathname;
    return path ? decodeURIComponent(path.slice(1)) || '/' : '/';
  } catch {
    return '/';
  }
}
