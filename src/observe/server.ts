import type { IncomingMessage, ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import type { Bridge } from '../bridge/bridge.js';
import { ConfigError } from '../errors.js';
import type { Logger } from '../log.js';
import type { BridgeMetrics } from './metrics.js';

/** Where `--metrics-port` / `--metrics-host` ask the metrics and health server to listen. */
interface MetricsEndpoint {
  host: string;
  /** 0: any free port (the log line `serving metrics` names it). */
  port: number;
}

export const DEFAULT_METRICS_HOST = '0.0.0.0';
const DEPTH_POLL_MS = 2000;

/** Validates the raw option values; undefined when no metrics port was asked for. */
export function resolveMetricsEndpoint(raw: {
  metricsPort?: string;
  metricsHost?: string;
}): MetricsEndpoint | undefined {
  if (raw.metricsPort === undefined) {
    if (raw.metricsHost !== undefined) {
      throw new ConfigError('--metrics-host: goes with --metrics-port <port>; give the port too');
    }
    return undefined;
  }
  if (!/^\d{1,5}$/.test(raw.metricsPort) || Number(raw.metricsPort) > 65535) {
    throw new ConfigError(
      `--metrics-port (or DEDUP_BRIDGE_METRICS_PORT): "${raw.metricsPort}" is not a port; give a number from 1 to 65535 (0: any free port)`,
    );
  }
  const host = raw.metricsHost ?? DEFAULT_METRICS_HOST;
  if (host.trim() === '') throw new ConfigError('--metrics-host: must not be empty');
  return { host, port: Number(raw.metricsPort) };
}

/** What the bridge runner tells the server: which routes are running. */
export interface RouteWatch {
  add(bridge: Bridge): void;
  remove(bridge: Bridge): void;
}

export interface ObserveServer extends RouteWatch {
  /** The address it listens on, e.g. http://0.0.0.0:9464 */
  url: string;
  close(): Promise<void>;
}

/**
 * Why the process is not ready; empty when every route is connected and consuming as the broker
 * sees it (or has paused its consumer at the byte bound).
 */
function notReady(routes: readonly Bridge[]): string[] {
  if (routes.length === 0) return ['no route is running'];
  const down: string[] = [];
  for (const bridge of routes) {
    const status = bridge.status();
    for (const side of ['source', 'target', 'redis'] as const) {
      if (!status[side]) down.push(`${bridge.route}: ${side} connection down`);
    }
    // Paused at --max-in-flight-bytes is the bridge keeping its memory bound, not a fault.
    if (!status.consuming && !status.paused) down.push(`${bridge.route}: not consuming`);
  }
  return down;
}

/**
 * Serves `/metrics` (Prometheus text), `/healthz` (200 while the process runs) and `/readyz`
 * (200 when every route's source, target and Redis connections are up and the source broker lists
 * its consumer, else 503 with what is down). `bridges` are the routes already running; the runner adds and
 * removes others as they start and stop. Listening fails with a ConfigError (exit 2) when the port
 * is taken or the host is not an address of this machine.
 */
export async function startObserveServer(
  endpoint: MetricsEndpoint,
  log: Logger,
  bridges: readonly Bridge[] = [],
): Promise<ObserveServer> {
  // prom-client is loaded only when metrics are served: it cost every start about 55 ms.
  const { BridgeMetrics: Metrics } = await import('./metrics.js');
  // node:http likewise: Node 24 builds its ES-module namespace by reading every export, and one of
  // them loads the bundled fetch client (undici), about 40 ms of every start.
  const { createServer } = await import('node:http');
  const metrics = new Metrics();
  for (const bridge of bridges) metrics.add(bridge);

  const server = createServer((request, response) => {
    void answer(request, response, metrics).catch((error: unknown) => {
      log.warn({ error: error instanceof Error ? error.message : String(error) }, 'metrics request failed');
      if (!response.headersSent) response.writeHead(500);
      response.end();
    });
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', (error: NodeJS.ErrnoException) => reject(listenError(error, endpoint)));
    server.listen(endpoint.port, endpoint.host, () => resolve());
  });
  server.on('error', (error: Error) => log.warn({ error: error.message }, 'metrics server error'));
  metrics.pollDepths(DEPTH_POLL_MS);

  const port = (server.address() as AddressInfo).port;
  const host = endpoint.host.includes(':') ? `[${endpoint.host}]` : endpoint.host;
  const url = `http://${host}:${port}`;
  log.info({ url, paths: ['/metrics', '/healthz', '/readyz'] }, 'serving metrics');
  return {
    url,
    add: (bridge) => metrics.add(bridge),
    remove: (bridge) => metrics.remove(bridge),
    close: async () => {
      metrics.stop();
      server.closeAllConnections();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
}

async function answer(request: IncomingMessage, response: ServerResponse, metrics: BridgeMetrics) {
  const path = (request.url ?? '/').split('?')[0];
  if (request.method !== 'GET' && request.method !== 'HEAD') {
    response.writeHead(405, { Allow: 'GET, HEAD' }).end();
    return;
  }
  if (path === '/metrics') {
    const body = await metrics.registry.metrics();
    response.writeHead(200, { 'Content-Type': metrics.registry.contentType }).end(body);
  } else if (path === '/healthz') {
    json(response, 200, { status: 'ok' });
  } else if (path === '/readyz') {
    const down = notReady(metrics.routes);
    if (down.length === 0)
      json(response, 200, { status: 'ready', routes: metrics.routes.map((b) => b.route) });
    else json(response, 503, { status: 'not ready', down });
  } else {
    json(response, 404, { error: 'not found; try /metrics, /healthz or /readyz' });
  }
}

function json(response: ServerResponse, status: number, body: unknown): void {
  response.writeHead(status, { 'Content-Type': 'application/json' }).end(`${JSON.stringify(body)}\n`);
}

function listenError(error: NodeJS.ErrnoException, endpoint: MetricsEndpoint): ConfigError {
  const where = `${endpoint.host}:${endpoint.port}`;
  if (error.code === 'EADDRINUSE') {
    return new ConfigError(
      `--metrics-port: port ${endpoint.port} is already in use on ${endpoint.host}; pick a free port or stop what listens there`,
    );
  }
  if (error.code === 'EACCES') {
    return new ConfigError(
      `--metrics-port: not allowed to listen on ${where}; use a port above 1023 or run with the needed privilege`,
    );
  }
  return new ConfigError(
    `--metrics-host: cannot listen on ${where} (${error.code ?? error.message}); give an address of this machine, e.g. 0.0.0.0`,
  );
}
