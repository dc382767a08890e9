import { request as httpRequest } from 'node:http';
import { request as httpsRequest } from 'node:https';
import { connectAmqp } from '../amqp/connect.js';
import { describe, replyCodeOf } from '../amqp/errors.js';
import { redactSecrets, redactUrl, secretsOf } from '../config/redact.js';
import type { BridgeSettings } from '../config/settings.js';
import { readCaFile, tlsFailure } from '../config/tls.js';
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

/** The management API's answer: its status and its JSON body ({} when it has none). */
interface ApiAnswer {
  status: number;
  body: unknown;
}

/**
 * One GET of the management API. Over https, the server's certificate is checked against `ca` (a
 * PEM file, from --source-management-ca) or else the system's CAs, and its host name always.
 */
function getJson(url: URL, authorization: string, ca: Buffer | undefined): Promise<ApiAnswer> {
  const send = url.protocol === 'https:' ? httpsRequest : httpRequest;
  const tls = url.protocol === 'https:' ? { rejectUnauthorized: true, ...(ca ? { ca } : {}) } : {};
  return new Promise((resolve, reject) => {
    const request = send(url, { headers: { authorization }, timeout: 10_000, ...tls }, (response) => {
      const chunks: Buffer[] = [];
      response.on('data', (chunk: Buffer) => chunks.push(chunk));
      response.on('error', reject);
      response.on('end', () => {
        let body: unknown = {};
        try {
          body = JSON.parse(Buffer.concat(chunks).toString('utf8'));
        } catch {
          // Not JSON (an HTML error page): the status says enough.
        }
        resolve({ status: response.statusCode ?? 0, body });
      });
    });
    request.on('timeout', () => request.destroy(new Error('no answer within 10s')));
    request.on('error', reject);
    request.end();
  });
}

/**
 * Reads a queue's durability, type, arguments and policy from the source broker's management API;
 * `caFile` is the CA to trust for an https URL (default: the system's).
 */
export async function readQueueShape(
  managementUrl: string,
  sourceUrl: string,
  queue: string,
  caFile?: string,
): Promise<QueueShape> {
  const api = new URL(managementUrl);
  const user = decodeURIComponent(api.username);
  const password = decodeURIComponent(api.password);
  api.username = '';
  api.password = '';
  const vhost = decodeURIComponent(new URL(sourceUrl).pathname.replace(/^\//, '')) || '/';
  const path = new URL(
    `${api.toString().replace(/\/$/, '')}/api/queues/${encodeURIComponent(vhost)}/${encodeURIComponent(queue)}`,
  );
  const ca = caFile === undefined ? undefined : readCaFile('--source-management-ca', caFile);
  let response: ApiAnswer;
  try {
    response = await getJson(path, `Basic ${Buffer.from(`${user}:${password}`).toString('base64')}`, ca);
  } catch (error) {
    const tlsProblem = tlsFailure(error, 'source', '--source-management');
    if (tlsProblem) {
      throw new FatalConnectError(`--source-management: ${redactUrl(managementUrl)}: ${tlsProblem}`);
    }
    throw new UnavailableError(
      `--source-management: ${redactUrl(managementUrl)} did not answer (${redactSecrets((error as Error).message, secretsOf(managementUrl))}); check the URL and that the management plugin runs`,
    );
  }
  if (response.status === 401) {
    // A user without a management tag is refused like a wrong password; the body says which.
    const reason = (response.body as { reason?: unknown }).reason;
    throw new FatalConnectError(
      `--source-management: login refused by ${redactUrl(managementUrl)}${typeof reason === 'string' ? ` (${reason})` : ''}; check the user and password, and that the user has the management tag`,
    );
  }
  if (response.status === 404) {
    throw new ConfigError(
      `--source-queue: queue "${queue}" not found through the management API of ${redactUrl(managementUrl)}`,
    );
  }
  if (response.status < 200 || response.status >= 300) {
    throw new UnavailableError(
      `--source-management: ${redactUrl(managementUrl)} answered HTTP ${response.status}`,
    );
  }
  const body = response.body as {
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
 * Queue arguments under which the target queue itself drops (or dead-letters) what the bridge
 * forwards to it, before anyone consumes it: the bridge acks the source once the target confirms,
 * so those messages would be gone from both. `x-max-length: 0` would empty every message at once.
 * Not here: x-overflow (acts only with a length limit), dead-letter targets, x-delivery-limit (it
 * acts on consumers that fail a message, the source queue's own behaviour), priorities, modes.
 */
export const DISCARDING_ARGUMENTS: Readonly<Record<string, string>> = {
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
