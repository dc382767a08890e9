import { backoffDelay, sleepUnlessStopped } from '../backoff.js';
import { tlsFailure } from '../config/tls.js';
import {
  BridgeError,
  ConfigError,
  describe,
  FatalConnectError,
  RuntimeFailure,
  StopRequested,
  UnavailableError,
} from '../errors.js';
import type { Logger } from '../log.js';
import { StreamAuthenticationError, StreamResponseError } from './client.js';

// Connecting to a stream endpoint at start, the same for a stream source and a stream target: a
// refusal (login, vhost, permission, certificate) is the user's error at once; an endpoint that
// does not answer is retried for --retry-for (0: for ever), as an AMQP broker is.

export interface StreamEnd {
  side: 'source' | 'target';
  /** `source stream "<name>" at <url>`, password hidden. */
  where: string;
  /** The URL, password hidden. */
  shown: string;
  retryForMs: number;
  stop: AbortSignal | undefined;
  log: Logger;
}

/** What a failed connect or start means: the user's error, or a RuntimeFailure to retry. */
export function streamStartError(error: unknown, end: StreamEnd): BridgeError {
  if (error instanceof BridgeError) return error;
  if (error instanceof StreamAuthenticationError) {
    return new ConfigError(`${end.shown}: the broker refused the user name or password (${error.codeName})`);
  }
  if (error instanceof StreamResponseError && error.codeName === 'ACCESS_REFUSED') {
    const permission = end.side === 'source' ? 'read' : 'write';
    return new ConfigError(
      `${end.where}: ${error.codeName}; grant the user ${permission} permission on the stream`,
    );
  }
  if (error instanceof StreamResponseError && error.codeName === 'VIRTUAL_HOST_ACCESS_FAILURE') {
    return new ConfigError(
      `${end.shown}: no access to the vhost (${error.codeName}); check the URL's vhost and the user's permissions`,
    );
  }
  const tlsProblem = tlsFailure(error, end.side);
  if (tlsProblem !== undefined) return new FatalConnectError(`${end.where}: ${tlsProblem}`);
  return new RuntimeFailure(`${end.where} unreachable: ${describe(error)}`);
}

/** Connects for the first time, retrying an endpoint that does not answer (see above). */
export async function connectAtStart<T>(connect: () => Promise<T>, end: StreamEnd): Promise<T> {
  const started = Date.now();
  for (let attempt = 1; ; attempt++) {
    try {
      return await connect();
    } catch (error) {
      const refused = streamStartError(error, end);
      if (!(refused instanceof RuntimeFailure)) throw refused;
      const waited = Date.now() - started;
      if (end.retryForMs > 0 && waited >= end.retryForMs) {
        throw new UnavailableError(
          `${end.where} did not answer for ${Math.round(waited / 1000)}s (${describe(error)}), past --retry-for; nothing was moved`,
        );
      }
      end.log.warn({ attempt, error: describe(error) }, `${end.where} not reachable; retrying`);
      await sleepUnlessStopped(backoffDelay(attempt, 200, 5000), end.stop);
      if (end.stop?.aborted) throw new StopRequested(end.where);
    }
  }
}
