import { type QueueShape, readQueueShape } from '../amqp/management.js';
import { formatDuration, parseDuration } from '../config/duration.js';
import { type BridgeSettings, DEFAULTS, type SourceDeliveryLimit } from '../config/settings.js';
import { ConfigError, UnavailableError } from '../errors.js';
import type { Logger } from '../log.js';

/** How long a message may stay in a queue, and what says so. */
interface MessageTtl {
  ms: number;
  from: string;
}

function millis(value: unknown): number | undefined {
  const ms = typeof value === 'string' ? Number(value) : value;
  return typeof ms === 'number' && Number.isFinite(ms) && ms >= 0 ? ms : undefined;
}

/**
 * The queue's message TTL: its x-message-ttl argument or its policy's message-ttl, the lower when
 * both are set (as RabbitMQ applies them); undefined when messages may stay forever.
 */
function messageTtlOf(shape: QueueShape): MessageTtl | undefined {
  const candidates: MessageTtl[] = [];
  const argument = millis(shape.arguments['x-message-ttl']);
  if (argument !== undefined) candidates.push({ ms: argument, from: 'x-message-ttl' });
  const policy = millis(shape.policy['message-ttl']);
  if (policy !== undefined) candidates.push({ ms: policy, from: 'policy message-ttl' });
  return candidates.sort((a, b) => a.ms - b.ms)[0];
}

/**
 * A copy of a message still in the source after its ID left the cache is forwarded again. That
 * can happen when the queue keeps messages longer than the dedup window, or keeps them forever and
 * the window was shortened below its default.
 */
function windowWarning(queue: string, ttl: MessageTtl | undefined, windowMs: number): string | undefined {
  const window = formatDuration(windowMs);
  if (ttl !== undefined && ttl.ms > windowMs) {
    return `source queue "${queue}" keeps messages up to ${formatDuration(ttl.ms)} (${ttl.from}), longer than --dedup-window ${window}: a copy delivered after its ID expired is forwarded again; raise --dedup-window to at least ${formatDuration(ttl.ms)}`;
  }
  const defaultMs = parseDuration(DEFAULTS.dedupWindow, '--dedup-window');
  if (ttl === undefined && windowMs < defaultMs) {
    return `source queue "${queue}" has no message TTL (messages may stay forever) and --dedup-window ${window} is shorter than the default ${DEFAULTS.dedupWindow}: a copy delivered after its ID expired is forwarded again; raise --dedup-window, or give the queue a message-ttl no longer than the window`;
  }
  return undefined;
}

/**
 * Compares each route's source queue TTL with its dedup window, through its source broker's
 * management API (the route's own from a config file, else `managementUrl`). Routes without one
 * are skipped, said once at info level. A management API that does not answer gives a warning; a
 * refused login or a missing queue is an error.
 */
export async function sourceTtlWarnings(
  routes: readonly BridgeSettings[],
  managementUrl: string | undefined,
  log: Logger,
  /** The CA for an https `managementUrl` (a route's own API comes with its own). */
  managementCa?: string,
): Promise<string[]> {
  const unchecked = routes.filter((route) => !(route.sourceManagementUrl ?? managementUrl));
  const deadLetterUnchecked = unchecked.filter((route) => route.onUnforwardable === 'dead-letter');
  if (deadLetterUnchecked.length > 0) {
    log.warn(
      `--on-unforwardable dead-letter: cannot check that ${deadLetterUnchecked.map((route) => `"${route.sourceQueue}"`).join(', ')} has a dead-letter exchange (RabbitMQ drops what it rejects otherwise); give --source-management to check it`,
    );
  }
  if (unchecked.length > 0) {
    // Routes left out while others are checked are likely an oversight: info. With no management API
    // at all it would be the same line on every run, telling nothing new: debug.
    const partial = unchecked.length < routes.length;
    const which = partial ? ` for ${unchecked.map((route) => route.route).join(', ')}` : '';
    log[partial ? 'info' : 'debug'](
      `source queue TTL not compared with --dedup-window${which}: give --source-management (or management: for the broker in a config file) to check it`,
    );
  }
  const warnings: string[] = [];
  const unreachable = new Set<string>();
  for (const route of routes) {
    const management = route.sourceManagementUrl ?? managementUrl;
    const ca = route.sourceManagementUrl ? route.sourceManagementCa : managementCa;
    if (!management || unreachable.has(management)) continue;
    try {
      const shape = await readQueueShape(management, route.sourceUrl, route.sourceQueue, ca);
      const ttl = messageTtlOf(shape);
      log.debug({ queue: route.sourceQueue, messageTtlMs: ttl?.ms ?? null }, 'source queue TTL read');
      const warning = windowWarning(route.sourceQueue, ttl, route.dedupWindowMs);
      if (warning) warnings.push(warning);
      // Kept for the bridge: what it gives back at a stop counts toward this limit (see SourceQueue).
      route.sourceDeliveryLimit = deliveryLimitOf(shape);
      const noDeadLetter = deadLetterProblem(route, shape);
      if (noDeadLetter) throw new ConfigError(noDeadLetter);
    } catch (error) {
      if (!(error instanceof UnavailableError)) throw error;
      // The other queues would wait for the same API: one warning for all of them.
      unreachable.add(management);
      warnings.push(`source queue TTL not compared with --dedup-window: ${error.message}`);
    }
  }
  return warnings;
}

/**
 * A quorum queue's delivery limit: its x-delivery-limit argument or its policy's delivery-limit,
 * the lower when both are set, and where a message past it goes. Undefined for a classic queue
 * (it counts no deliveries); a stream is refused at start.
 */
function deliveryLimitOf(shape: QueueShape): SourceDeliveryLimit | undefined {
  if (shape.type === 'classic' || shape.type === 'stream') return undefined;
  const candidates: { limit: number; from: string }[] = [];
  const argument = millis(shape.arguments['x-delivery-limit']);
  if (argument !== undefined) candidates.push({ limit: argument, from: 'x-delivery-limit' });
  const policy = millis(shape.policy['delivery-limit']);
  if (policy !== undefined) candidates.push({ limit: policy, from: 'policy delivery-limit' });
  const lowest = candidates.sort((a, b) => a.limit - b.limit)[0];
  const exchange = shape.arguments['x-dead-letter-exchange'] ?? shape.policy['dead-letter-exchange'];
  return {
    limit: lowest?.limit ?? null,
    from: lowest?.from ?? 'none set',
    deadLetterExchange: typeof exchange === 'string' ? exchange : undefined,
  };
}

/**
 * With `--on-unforwardable dead-letter` the bridge rejects what it cannot forward to the source
 * queue's dead-letter exchange; a queue without one (argument or policy) makes RabbitMQ drop it.
 */
function deadLetterProblem(route: BridgeSettings, shape: QueueShape): string | undefined {
  if (route.onUnforwardable !== 'dead-letter') return undefined;
  if (shape.arguments['x-dead-letter-exchange'] !== undefined) return undefined;
  if (shape.policy['dead-letter-exchange'] !== undefined) return undefined;
  return `--on-unforwardable dead-letter: source queue "${route.sourceQueue}" has no dead-letter exchange (no x-dead-letter-exchange argument or policy), so RabbitMQ would drop every message the bridge rejects; give the queue one, or use --park-queue or --on-unforwardable retry`;
}
