import { connectAmqp } from '../amqp/connect.js';
import { describe, replyCodeOf } from '../amqp/errors.js';
import { redactUrl } from '../config/redact.js';
import type { BridgeSettings } from '../config/settings.js';
import { ConfigError, FatalConnectError, UnavailableError } from '../errors.js';
import type { Logger } from '../observe/log.js';

/** A source queue's shape, as the management API reports it. */
export interface QueueShape {
  durable: boolean;
  type: string;
  arguments: Record<string, unknown>;
  /** What the policies that apply to it set (the broker merges a policy and an operator policy). */
  policy: Record<string, unknown>;
}

/** Reads a queue's durability, type, arguments and policy from the source broker's management API. */
export async function readQueueShape(
  managementUrl: string,
  sourceUrl: string,
  queue: string,
): Promise<QueueShape> {
  const api = new URL(managementUrl);
  const user = decodeURIComponent(api.username);
  const password = decodeURIComponent(api.password);
  api.username = '';
  api.password = '';
  const vhost = decodeURIComponent(new URL(sourceUrl).pathname.replace(/^\//, '')) || '/';
  const path = `${api.toString().replace(/\/$/, '')}/api/queues/${encodeURIComponent(vhost)}/${encodeURIComponent(queue)}`;
  let response: Response;
  try {
    response = await fetch(path, {
      headers: { authorization: `Basic ${Buffer.from(`${user}:${password}`).toString('base64')}` },
      signal: AbortSignal.timeout(10_000),
    });
  } catch (error) {
    throw new UnavailableError(
      `--source-management: ${redactUrl(managementUrl)} did not answer (${(error as Error).message}); check the URL and that the management plugin runs`,
    );
  }
  if (response.status === 401) {
    // A user without a management tag is refused like a wrong password; the body says which.
    const reason = ((await response.json().catch(() => ({}))) as { reason?: unknown }).reason;
    throw new FatalConnectError(
      `--source-management: login refused by ${redactUrl(managementUrl)}${typeof reason === 'string' ? ` (${reason})` : ''}; check the user and password, and that the user has the management tag`,
    );
  }
  if (response.status === 404) {
    throw new ConfigError(
      `--source-queue: queue "${queue}" not found through the management API of ${redactUrl(managementUrl)}`,
    );
  }
  if (!response.ok) {
    throw new UnavailableError(
      `--source-management: ${redactUrl(managementUrl)} answered HTTP ${response.status}`,
    );
  }
  const body = (await response.json()) as {
    durable?: boolean;
    type?: string;
    arguments?: Record<string, unknown>;
    effective_policy_definition?: unknown;
  };
  // Without a policy the API sends an empty list here, not an object.
  const policy = body.effective_policy_definition;
  return {
    durable: body.durable !== false,
    type: body.type ?? 'classic',
    arguments: body.arguments ?? {},
    policy:
      policy && typeof policy === 'object' && !Array.isArray(policy)
        ? (policy as Record<string, unknown>)
        : {},
  };
}

/**
 * Creates each target queue with its source queue's durability, type and arguments (DLX, TTL,
 * max-length …). A target queue that already exists with other arguments is an error, named.
 */
export async function declareTargetQueues(
  routes: BridgeSettings[],
  managementUrl: string,
  log: Logger,
): Promise<void> {
  const first = routes[0];
  if (!first) return;
  const shapes = await Promise.all(
    routes.map(
      async (route) =>
        [route, await readQueueShape(managementUrl, route.sourceUrl, route.sourceQueue)] as const,
    ),
  );
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
        log.info(
          { queue, type: shape.type, durable: shape.durable, arguments: args },
          'target queue declared',
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
