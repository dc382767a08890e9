import { type TlsSide, tlsFailure } from '../config/tls.js';
import { describe, FatalConnectError, UnavailableError } from '../errors.js';

// amqplib reports a refused handshake as a bare Error whose text carries the AMQP reply code, and
// socket failures as Node errors with a `code`. This is the one place that reads them.

/** AMQP reply codes that mean "retrying will not help". */
const FATAL_REPLY_CODES = new Set([403, 530, 402, 501, 503, 540]);

export function replyCodeOf(error: unknown): number | undefined {
  if (error && typeof error === 'object') {
    const code = (error as { code?: unknown }).code;
    if (typeof code === 'number') return code;
    const message = (error as { message?: unknown }).message;
    if (typeof message === 'string') {
      const match = /Handshake terminated by server: (\d{3})|Connection closed: (\d{3})/.exec(message);
      if (match) return Number(match[1] ?? match[2]);
      // RabbitMQ answers connection.open with connection.close only to refuse the virtual host
      // (NOT_ALLOWED: it does not exist, or the user may not use it); amqplib says just this.
      if (/Expected ConnectionOpenOk; got <ConnectionClose/.test(message)) return 530;
    }
  }
  return undefined;
}

/**
 * Turns a failed connect into an operator's error: fatal (wrong credentials, a missing vhost, a
 * certificate refused), or undefined when it is worth retrying (network, broker starting up).
 */
export function classifyConnectError(
  error: unknown,
  where: string,
  side: TlsSide,
  vhost?: string,
): FatalConnectError | undefined {
  const reply = replyCodeOf(error);
  if (reply === 403) {
    return new FatalConnectError(
      `${where}: login refused (ACCESS_REFUSED); check the user name and password in the URL`,
    );
  }
  if (reply === 530) {
    const named = vhost === undefined ? 'the virtual host' : `the virtual host "${vhost}"`;
    return new FatalConnectError(
      `${where}: ${named} does not exist or the user may not use it (NOT_ALLOWED); check the vhost in the URL (%2F is "/") and the user's permissions on it (rabbitmqctl list_permissions -p <vhost>)`,
    );
  }
  if (reply !== undefined && FATAL_REPLY_CODES.has(reply)) {
    return new FatalConnectError(
      `${where}: the broker refused the connection (AMQP ${reply}); check the URL`,
    );
  }
  const tls = tlsFailure(error, side);
  if (tls) return new FatalConnectError(`${where}: ${tls}`);
  return undefined;
}

/**
 * A channel closed with ACCESS_REFUSED: the user lacks a permission. The broker's text names the
 * resource ("access to exchange 'amq.default' in vhost '/' refused for user 'bridge'").
 */
export function accessRefused(where: string, error: unknown, permission: string): FatalConnectError {
  const text = describe(error);
  const detail = /ACCESS_REFUSED - ([^"]*)/.exec(text)?.[1] ?? text;
  return new FatalConnectError(`${where}: ${detail}; grant the user ${permission} permission on it`);
}

export function unreachable(where: string, error: unknown, retriedMs: number): UnavailableError {
  const code = (error as { code?: unknown } | undefined)?.code;
  const reason = typeof code === 'string' ? code : describe(error);
  return new UnavailableError(
    `${where} is unreachable (${reason}) after retrying for ${Math.round(retriedMs / 1000)}s; check that it runs and the host and port in the URL`,
  );
}
