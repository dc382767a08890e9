import { connectAmqp } from '../amqp/connect.js';
import { replyCodeOf } from '../amqp/errors.js';
import { readQueueShape } from '../amqp/management.js';
import type { BridgeSettings } from '../config/settings.js';
import { ConfigError, describe, FatalConnectError } from '../errors.js';
import type { Logger } from '../log.js';

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
