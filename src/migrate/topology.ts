import { connectAmqp } from '../amqp/connect.js';
import { replyCodeOf } from '../amqp/errors.js';
import { readQueueShape } from '../amqp/management.js';
import { backoffDelay, sleepUnlessStopped } from '../backoff.js';
import { redactUrl } from '../config/redact.js';
import type { BridgeSettings } from '../config/settings.js';
import { streamTlsOptions, tlsFailure } from '../config/tls.js';
import { ConfigError, describe, FatalConnectError, StopRequested, UnavailableError } from '../errors.js';
import type { Logger } from '../log.js';
import { StreamClient, StreamResponseError } from '../stream/client.js';
import { missingStreamLine, streamExists } from '../stream/streams.js';

/**
 * Queue arguments under which the target queue itself drops (or dead-letters) what the bridge
 * forwards to it, before anyone consumes it: the bridge acks the source once the target confirms,
 * so those messages would be gone from both. `x-max-length: 0` would empty every message at once.
 * Not here: x-overflow (acts only with a length limit), dead-letter targets, x-delivery-limit (it
 * acts on consumers that fail a message, the source queue's own behaviour), priorities, modes.
 */
const DISCARDING_ARGUMENTS: Readonly<Record<string, string>> = {
  'x-max-length': 'drops (or refuses) messages past a count',
  'x-max-length-bytes': 'drops (or refuses) messages past a size',
  'x-message-ttl': 'drops (or dead-letters) messages not consumed in time',
  'x-expires': 'deletes itself, with its messages, when unused for a while',
  'x-max-age': 'deletes stream messages past an age',
};

/**
 * Creates each target queue with its source queue's durability, type and arguments (DLX, TTL,
 * max-length …). A target queue that already exists with other arguments is an error, named.
 * Arguments that discard messages (DISCARDING_ARGUMENTS) are refused unless `force`.
 */
export async function declareTargetQueues(
  routes: BridgeSettings[],
  managementUrl: string,
  log: Logger,
  force = false,
  managementCa?: string,
): Promise<void> {
  const first = routes[0];
  if (!first) return;
  const shapes = await Promise.all(
    routes.map(
      async (route) =>
        [
          route,
          await readQueueShape(managementUrl, route.sourceUrl, route.sourceQueue, managementCa),
        ] as const,
    ),
  );
  // All refused before any queue is created.
  for (const [route, shape] of shapes) {
    const found = Object.keys(shape.arguments).find((name) => Object.hasOwn(DISCARDING_ARGUMENTS, name));
    if (found === undefined || force) continue;
    throw new ConfigError(
      `--declare-target: source queue "${route.sourceQueue}" has ${found}=${JSON.stringify(shape.arguments[found])}, under which target queue "${route.targetQueue}" ${DISCARDING_ARGUMENTS[found]}; declare the target queue yourself, or give --declare-target-force to copy it anyway`,
    );
  }
  const connection = await connectAmqp(first.targetUrl, {
    side: 'target',
    retryForMs: first.retryForMs || 30_000,
    log,
    tls: first.tls.target,
  });
  try {
    for (const [route, shape] of shapes) {
      const queue = route.targetQueue as string;
      const args = { ...shape.arguments };
      if (shape.type !== 'classic' && args['x-queue-type'] === undefined) args['x-queue-type'] = shape.type;
      const channel = await connection.createChannel();
      channel.on('error', () => {});
      try {
        await channel.assertQueue(queue, { durable: shape.durable, arguments: args });
        // What was declared, arguments included, in the line itself (a terminal shows no fields).
        log.info(
          { queue, type: shape.type, durable: shape.durable, arguments: args },
          `target queue "${queue}" declared (${shape.type}, ${shape.durable ? 'durable' : 'transient'}) with arguments ${JSON.stringify(args)}`,
        );
      } catch (error) {
        if (replyCodeOf(error) === 406) {
          throw new ConfigError(
            `--declare-target: target queue "${queue}" exists with other settings than source queue "${route.sourceQueue}" (${(error as Error).message.split(' - ').pop()}); align or delete it`,
          );
        }
        if (replyCodeOf(error) === 403) {
          // The broker names what it refused: configure on the queue, or with a dead-letter
          // exchange also read on the queue and write on that exchange.
          const detail = /ACCESS_REFUSED - ([^"]*)/.exec(describe(error))?.[1] ?? describe(error);
          const dlx = args['x-dead-letter-exchange'];
          const withDlx =
            typeof dlx === 'string'
              ? ` (with dead-letter exchange "${dlx}" it also needs read permission on the queue and write permission on "${dlx || 'amq.default'}")`
              : '';
          throw new FatalConnectError(
            `--declare-target: creating target queue "${queue}" refused: ${detail}; grant the user configure permission on the queue${withDlx}, or declare the queue beforehand`,
          );
        }
        throw error;
      } finally {
        await channel.close().catch(() => {});
      }
    }
  } finally {
    await connection.close().catch(() => {});
  }
}

/**
 * A source stream queue's arguments as the stream protocol's Create takes them: its retention
 * (x-max-length-bytes, x-max-age) and segment size. Other arguments have no stream-protocol form.
 */
const STREAM_ARGUMENTS: Readonly<Record<string, string>> = {
  'x-max-length-bytes': 'max-length-bytes',
  'x-max-age': 'max-age',
  'x-stream-max-segment-size-bytes': 'stream-max-segment-size-bytes',
};

/** Where a route's target stream lives, for messages: the endpoint, password masked. */
function streamWhere(route: BridgeSettings): string {
  return `target stream endpoint at ${redactUrl(route.targetUrl)}`;
}

/**
 * Connects to a route's stream endpoint for a check before anything moves, retrying a connection
 * that fails for --retry-for (0: forever); a refusal by the broker (login, vhost) is fatal at once.
 */
async function connectTargetStream(
  route: BridgeSettings,
  log: Logger,
  stop?: AbortSignal,
): Promise<StreamClient> {
  const where = streamWhere(route);
  const started = Date.now();
  for (let attempt = 1; ; attempt++) {
    try {
      return await StreamClient.connect({
        url: route.targetUrl,
        tls: streamTlsOptions(route.targetUrl, route.tls.target),
        connectionName: `dedup-bridge ${route.route} (migrate checks)`,
      });
    } catch (error) {
      if (error instanceof ConfigError) throw error;
      const tlsProblem = tlsFailure(error, 'target');
      if (tlsProblem !== undefined) throw new FatalConnectError(`the ${where}: ${tlsProblem}`);
      if (error instanceof StreamResponseError) {
        throw new FatalConnectError(
          `--target (or DEDUP_BRIDGE_TARGET): the ${where} refused us: ${describe(error)}; check the user, password and virtual host`,
        );
      }
      if (stop?.aborted) throw new StopRequested(`the ${where}`);
      const waited = Date.now() - started;
      if (route.retryForMs > 0 && waited >= route.retryForMs) {
        throw new UnavailableError(
          `the ${where} did not answer for ${Math.round(waited / 1000)}s (${describe(error)}); run again when it is back`,
        );
      }
      log.warn(
        { target: redactUrl(route.targetUrl), error: describe(error) },
        'target stream endpoint not reachable; retrying',
      );
      await sleepUnlessStopped(backoffDelay(attempt, 200, 5000), stop);
      if (stop?.aborted) throw new StopRequested(`the ${where}`);
    }
  }
}

/** A missing target stream is an error before anything moves: one line naming it. */
export async function checkTargetStream(
  route: BridgeSettings,
  log: Logger,
  stop?: AbortSignal,
): Promise<void> {
  const stream = route.targetStream as string;
  const client = await connectTargetStream(route, log, stop);
  try {
    if (!(await streamExists(client, stream))) {
      throw new FatalConnectError(missingStreamLine(stream, streamWhere(route)));
    }
  } finally {
    await client.close().catch(() => {});
  }
}

/**
 * Creates a route's target stream when it is missing, over the stream protocol. With no arguments,
 * unless the source queue (read through the management API, when given) is itself a stream: then
 * with its retention and segment size, where retention, which discards messages, is refused as
 * for a queue unless `force`. A stream that exists is left as it is.
 */
export async function declareTargetStream(
  route: BridgeSettings,
  managementUrl: string | undefined,
  log: Logger,
  force = false,
  managementCa?: string,
): Promise<void> {
  const stream = route.targetStream as string;
  const args: Record<string, string> = {};
  if (managementUrl !== undefined) {
    const shape = await readQueueShape(managementUrl, route.sourceUrl, route.sourceQueue, managementCa);
    if (shape.type === 'stream') {
      for (const [name, value] of Object.entries(shape.arguments)) {
        const key = STREAM_ARGUMENTS[name];
        if (key === undefined || value === undefined || value === null) continue;
        if (Object.hasOwn(DISCARDING_ARGUMENTS, name) && !force) {
          throw new ConfigError(
            `--declare-target: source stream "${route.sourceQueue}" has ${name}=${JSON.stringify(value)}, under which target stream "${stream}" ${DISCARDING_ARGUMENTS[name]}; create the stream yourself, or give --declare-target-force to copy it anyway`,
          );
        }
        args[key] = String(value);
      }
    }
  }
  const client = await connectTargetStream(route, log);
  try {
    if (await streamExists(client, stream)) {
      log.info({ stream }, `target stream "${stream}" exists; left as it is`);
      return;
    }
    try {
      await client.create(stream, args);
    } catch (error) {
      if (!(error instanceof StreamResponseError)) throw error;
      // Created meanwhile (another run): what was asked for is there.
      if (error.codeName === 'STREAM_ALREADY_EXISTS') return;
      if (error.codeName === 'ACCESS_REFUSED') {
        throw new FatalConnectError(
          `--declare-target: creating target stream "${stream}" refused on the ${streamWhere(route)}; grant the user configure permission on it, or create the stream beforehand`,
        );
      }
      throw new FatalConnectError(
        `--declare-target: creating target stream "${stream}" on the ${streamWhere(route)} failed: ${describe(error)}`,
      );
    }
    log.info(
      { stream, arguments: args },
      `target stream "${stream}" declared with arguments ${JSON.stringify(args)}`,
    );
  } finally {
    await client.close().catch(() => {});
  }
}
