// The source broker's management API: what a queue's shape is (durability, type, arguments,
// policy), for the bridge's start-up checks and the migrate job's target declarations.
import { redactSecrets, redactUrl, secretsOf } from '../config/redact.js';
import { readCaFile, tlsFailure } from '../config/tls.js';
import { ConfigError, FatalConnectError, UnavailableError } from '../errors.js';

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
async function getJson(url: URL, authorization: string, ca: Buffer | undefined): Promise<ApiAnswer> {
  // Loaded when the API is asked: importing node:http loads Node's fetch client too (undici),
  // about 40 ms of every start, with or without --source-management.
  const { request: send } =
    url.protocol === 'https:' ? await import('node:https') : await import('node:http');
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
    const tlsProblem = tlsFailure(error, 'source', '--source-management', false);
    if (tlsProblem) {
      throw new FatalConnectError(`--source-management: ${redactUrl(managementUrl)}: ${tlsProblem}`);
    }
    throw new UnavailableError(
      `--source-management: ${redactUrl(managementUrl)} did not answer (${redactSecrets((error as Error).message.split('\n')[0] ?? '', secretsOf(managementUrl))}); check the URL and that the management plugin runs`,
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
