import type { BridgeSettings } from '../config/settings.js';
import { BridgeError, ExitCode, UnavailableError } from '../errors.js';
import type { Logger } from '../log.js';
import { type Bridge, type BridgeLimits, outageLine, startBridge } from './bridge.js';

// `run` with a config file runs several routes in one process, each a bridge with its own
// connections. They start together and stop together: one route failing stops them all.

/** Names the route in an error when the process runs several, so the operator knows which. */
function forRoute(error: unknown, settings: BridgeSettings, routes: number): unknown {
  if (routes <= 1 || !(error instanceof BridgeError)) return error;
  return new BridgeError(`route ${settings.route}: ${error.message}`, error.exitCode, { cause: error });
}

/**
 * Starts one bridge per route, telling `onStarted` of each as it starts (it forwards from then on).
 * When one cannot start, stops those already started (finishing their in-flight messages) and throws.
 */
export async function startRoutes(
  routes: BridgeSettings[],
  log: Logger,
  limits: BridgeLimits = {},
  onStarted: (bridge: Bridge) => void = () => {},
): Promise<Bridge[]> {
  const bridges: Bridge[] = [];
  try {
    for (const settings of routes) {
      const bridge = await startBridge(settings, log, limits);
      bridges.push(bridge);
      onStarted(bridge);
    }
  } catch (error) {
    await Promise.allSettled(
      bridges.map(async (bridge, index) => {
        await bridge.stop((routes[index] as BridgeSettings).shutdownTimeoutMs);
        await bridge.close();
      }),
    );
    throw forRoute(error, routes[bridges.length] as BridgeSettings, routes.length);
  }
  return bridges;
}

/**
 * Forwards until the stop signal (then finishes in-flight work on every route and returns exit 0),
 * or until one route fails for good or stays unreachable past --retry-for: then stops every route
 * and throws that route's error.
 */
export async function superviseRoutes(
  bridges: Bridge[],
  routes: BridgeSettings[],
  stop: Promise<unknown>,
  log: Logger,
): Promise<number> {
  const outages = bridges.map((bridge, index) =>
    watchOutage(bridge, (routes[index] as BridgeSettings).retryForMs),
  );
  const failures = bridges.map((bridge, index) =>
    Promise.race([bridge.failure, (outages[index] as Outage).failed]).then((error) => ({ error, index })),
  );
  const first = await Promise.race([stop.then(() => 'signal' as const), ...failures]);
  for (const outage of outages) outage.stop();
  const timeoutMs = (routes[0] as BridgeSettings).shutdownTimeoutMs;
  if (first === 'signal') {
    for (const settings of routes) {
      log.info({ route: settings.route, timeoutMs }, 'stopping: finishing in-flight messages');
    }
  }
  const unfinished = await Promise.all(bridges.map((bridge) => bridge.stop(timeoutMs)));
  await Promise.allSettled(bridges.map((bridge) => bridge.close()));
  if (first === 'signal') {
    for (const [index, bridge] of bridges.entries()) {
      log.info(
        { route: routes[index]?.route, unfinished: unfinished[index], counters: bridge.pipeline.counters },
        'stopped',
      );
    }
    return ExitCode.ok;
  }
  // Retrying cannot fix this (a queue deleted, credentials revoked): released above; report it.
  throw forRoute(first.error, routes[first.index] as BridgeSettings, routes.length);
}

interface Outage {
  failed: Promise<BridgeError>;
  stop(): void;
}

/** With --retry-for, `run` gives up when a server stays unreachable that long (default: never). */
function watchOutage(bridge: Bridge, retryForMs: number): Outage {
  let timer: NodeJS.Timeout | undefined;
  const failed = new Promise<BridgeError>((resolve) => {
    if (retryForMs <= 0) return;
    timer = setInterval(() => {
      const outage = bridge.outage();
      if (outage && outage.ms >= retryForMs) {
        resolve(new UnavailableError(outageLine(outage)));
      }
    }, 500);
  });
  return { failed, stop: () => clearInterval(timer) };
}
