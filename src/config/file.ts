import { readFileSync } from 'node:fs';
import { z } from 'zod';
import { ConfigError } from '../errors.js';
import { LOG_LEVELS } from '../log.js';
import { FOREVER, formatDuration, formatRetryFor, parseDuration, parseRetryFor } from './duration.js';
import { describeStrategy, parseIdFrom } from './id-from.js';
import { checkManagementCa, checkManagementUrl } from './migrate-settings.js';
import { redactUrl } from './redact.js';
import { urlOrReference } from './secret-source.js';
import {
  type BridgeSettings,
  brokerUrl as brokerUrlText,
  count,
  DEFAULTS,
  exchangeName,
  flagOf,
  MAX_WAIT_REPLICAS,
  name,
  type RawOptions,
  REDIS_PREFIX_PATTERN,
  readOldPolicyName,
  redisUrl,
  resolveBridgeSettings,
  SCOPE_PATTERN,
  type UnforwardablePolicy,
  unforwardablePolicy,
} from './settings.js';
import { formatSize, parseSize } from './size.js';
import { isStreamUrl } from './stream-url.js';
import { parseYaml } from './yaml.js';

// A config file describes many routes for one `run` process. This module validates it with paths
// (`routes[2].target.exchange: …`) and turns each route into RawOptions, so that resolveBridgeSettings
// stays the one place that fills in defaults and builds BridgeSettings.

/** Client certificate and CA files for one connection (fed to the TLS options). */
const tlsFiles = z
  .object({
    ca: z.string().min(1, 'must not be empty').optional(),
    cert: z.string().min(1, 'must not be empty').optional(),
    key: z.string().min(1, 'must not be empty').optional(),
  })
  .strict();

// URLs travel to resolveBridgeSettings comma-joined, like the --source flag. Each URL may be given
// as { file: <path> } or { env: <VARIABLE> } instead (see secret-source.ts).
// A rabbitmq-stream:// endpoint too, for a route's target (with target.stream).
const brokerUrl = urlOrReference(
  brokerUrlText.refine((value) => !value.includes(','), 'must not contain a comma; write it as %2C'),
);

// The broker's management API (for the source queue TTL check), checked like --source-management.
const managementUrl = urlOrReference(
  z.string().superRefine((value, ctx) => {
    try {
      checkManagementUrl(value);
    } catch (error) {
      ctx.addIssue({
        code: 'custom',
        message: (error as Error).message.replace(/^--source-management: /, ''),
      });
    }
  }),
);

const broker = z
  .object({
    url: brokerUrl.optional(),
    urls: z.array(brokerUrl).min(1, 'list at least one URL').optional(),
    tls: tlsFiles.optional(),
    management: managementUrl.optional(),
    /** The CA to trust for an https management API (default: the system's CAs). */
    managementCa: z.string().min(1, 'must not be empty').optional(),
  })
  .strict()
  .superRefine((value, ctx) => {
    if ((value.url === undefined) === (value.urls === undefined)) {
      ctx.addIssue({
        code: 'custom',
        path: ['url'],
        message: 'give url (one node) or urls (the nodes of a cluster), not both and not neither',
      });
    }
  });

function millis(text: string): number | undefined {
  try {
    return parseDuration(text, '');
  } catch {
    return undefined;
  }
}

// As the flags take them: "500ms", "2s", "1h30m", or a bare number of milliseconds (500 or "500").
const duration = z
  .union([z.number(), z.string()], { error: 'must be a duration, e.g. 500ms, 2s, 5m, 1h30m, 7d' })
  .transform(String)
  .superRefine((value, ctx) => {
    if (millis(value) === undefined) {
      ctx.addIssue({
        code: 'custom',
        message: `"${value}" is not a duration; use e.g. 500ms, 2s, 5m, 1h30m, 7d`,
      });
    }
  });

/** Like --retry-for: a duration, or `forever`; 0 is refused with the flag's reason. */
const retryFor = z
  .union([z.number(), z.string()], { error: `must be a duration, e.g. 60s, or ${FOREVER}` })
  .transform(String)
  .superRefine((value, ctx) => {
    try {
      parseRetryFor(value, '');
    } catch (error) {
      ctx.addIssue({ code: 'custom', message: (error as Error).message.replace(/^: /, '') });
    }
  });

/** A YAML number or a string of digits, checked like the flag. */
const whole = (min: number, max: number) =>
  z
    .union([z.number(), z.string()], { error: 'must be a whole number' })
    .transform(String)
    .pipe(count(min, max));

const idFrom = z
  .union([z.string(), z.array(z.string())], {
    error: 'must be a list of strategies, e.g. [header:_HQ_DUPL_ID, message-id]',
  })
  .transform((value) => (Array.isArray(value) ? value.join(',') : value))
  .superRefine((value, ctx) => {
    try {
      parseIdFrom(value);
    } catch (error) {
      ctx.addIssue({ code: 'custom', message: (error as Error).message.replace(/^--id-from: /, '') });
    }
  });

// As --max-in-flight-bytes takes it: "64MiB", "512KiB", or a number of bytes.
const size = z
  .union([z.number(), z.string()], { error: 'must be a size, e.g. 64MiB' })
  .transform(String)
  .superRefine((value, ctx) => {
    try {
      parseSize(value, '');
    } catch (error) {
      ctx.addIssue({ code: 'custom', message: (error as Error).message.replace(/^: /, '') });
    }
  });

/** Settings a route may set, and `defaults` may set for every route. */
const routeSettings = {
  idFrom: idFrom.optional(),
  dedupWindow: duration.optional(),
  prefetch: whole(1, 65535).optional(),
  maxInFlightBytes: size.optional(),
  batchSize: whole(1, 5000).optional(),
  cacheShards: z
    .union([z.literal('auto'), whole(1, 1024)], { error: 'must be auto or a whole number from 1 to 1024' })
    .optional(),
  lease: duration.optional(),
  onUnforwardable: unforwardablePolicy.optional(),
  /** The old name of onUnforwardable, read as it (see withOldPolicyName). */
  onUnroutable: unforwardablePolicy.optional(),
  parkQueue: name.optional(),
  stripCc: z.boolean().optional(),
};

type PolicyKeys = {
  onUnforwardable?: UnforwardablePolicy | undefined;
  onUnroutable?: UnforwardablePolicy | undefined;
};

/**
 * A route's (or defaults') settings with onUnroutable, the old name of onUnforwardable, read as the
 * new one, each level on its own: a route's policy beats its defaults' whichever name each uses.
 * Both names in one place, meaning different policies, are refused: one of them would be ignored.
 */
function withOldPolicyName<S extends PolicyKeys>(schema: z.ZodType<S>) {
  return schema
    .superRefine(({ onUnforwardable, onUnroutable }, ctx) => {
      if (onUnforwardable !== undefined && onUnroutable !== undefined && onUnforwardable !== onUnroutable) {
        ctx.addIssue({
          code: 'custom',
          path: ['onUnroutable'],
          message: `is the old name of onUnforwardable, which is set here too (to ${onUnforwardable}); give only onUnforwardable`,
        });
      }
    })
    .transform(({ onUnroutable, ...settings }) => {
      const onUnforwardable = settings.onUnforwardable ?? onUnroutable;
      return onUnforwardable === undefined ? settings : { ...settings, onUnforwardable };
    });
}

const route = z
  .object({
    name: z.string().regex(/^[\w.:-]+$/, 'must be non-empty: letters, digits, and . _ : -'),
    source: z
      .object({
        broker: z.string(),
        queue: name.optional(),
        /** The stream to read, on a broker whose url is rabbitmq-stream:// (--source-stream). */
        stream: name.optional(),
        /** Where a new route starts reading the stream (--source-start). */
        start: z.string().optional(),
        tls: tlsFiles.optional(),
      })
      .strict(),
    target: z
      .object({
        broker: z.string(),
        queue: name.optional(),
        exchange: exchangeName.optional(),
        routingKey: z.string().optional(),
        /** The stream to write to, on a broker whose url is rabbitmq-stream://. */
        stream: name.optional(),
        /** The stream producer's name (--target-producer). */
        producer: name.optional(),
        tls: tlsFiles.optional(),
      })
      .strict(),
    scope: z.string().regex(SCOPE_PATTERN, 'must be non-empty, without braces or spaces').optional(),
    ...routeSettings,
  })
  .strict();
const routeWithOldPolicyName = withOldPolicyName(route);

const fileSchema = z
  .object({
    brokers: z.record(z.string(), broker),
    redis: z
      .object({
        url: urlOrReference(redisUrl).optional(),
        prefix: z
          .string()
          .regex(REDIS_PREFIX_PATTERN, 'must be non-empty, without braces, colons or spaces')
          .optional(),
        waitReplicas: whole(0, MAX_WAIT_REPLICAS).optional(),
        tls: tlsFiles.optional(),
      })
      .strict()
      .optional(),
    defaults: withOldPolicyName(z.object(routeSettings).strict()).optional(),
    retryFor: retryFor.optional(),
    shutdownTimeout: duration.optional(),
    logLevel: z.enum(LOG_LEVELS, { error: `must be one of ${LOG_LEVELS.join(', ')}` }).optional(),
    routes: z.array(routeWithOldPolicyName).min(1, 'list at least one route'),
  })
  .strict()
  .superRefine((file, ctx) => {
    const names = new Map<string, number>();
    const consumers = new Map<string, number>();
    for (const [index, item] of file.routes.entries()) {
      const at = (...path: (string | number)[]) => ['routes', index, ...path];
      const issue = (path: (string | number)[], message: string) =>
        ctx.addIssue({ code: 'custom', path: at(...path), message });
      const earlier = names.get(item.name);
      if (earlier !== undefined) issue(['name'], `"${item.name}" is already the name of routes[${earlier}]`);
      names.set(item.name, index);

      for (const side of ['source', 'target'] as const) {
        const wanted = item[side].broker;
        if (!Object.hasOwn(file.brokers, wanted)) {
          const known = Object.keys(file.brokers);
          issue(
            [side, 'broker'],
            `no broker "${wanted}" under brokers${known.length > 0 ? ` (there are: ${known.join(', ')})` : ''}`,
          );
        }
      }
      // Two routes on one queue would split its messages between them: say which one is meant.
      // Brokers are compared by URL: two names for one cluster (or one shared node) are one broker.
      const source = file.brokers[item.source.broker];
      // A stream is read, not consumed away: routes may share one (a scope's position is shared too).
      const keys =
        source && item.source.queue !== undefined
          ? urlsOf(source).map((url) => JSON.stringify([url, item.source.queue]))
          : [];
      const other = keys.map((key) => consumers.get(key)).find((found) => found !== undefined);
      if (other !== undefined) {
        issue(
          ['source', 'queue'],
          `routes[${other}] already consumes queue "${item.source.queue}" on this broker; one route per source queue`,
        );
      }
      for (const key of keys) if (!consumers.has(key)) consumers.set(key, index);

      const isStreamBroker = (broker: string) => {
        const found = file.brokers[broker];
        return found !== undefined && urlsOf(found).some(isStreamUrl);
      };
      for (const [path, message] of targetIssues(item, isStreamBroker)) issue(path, message);

      const merged = { ...file.defaults, ...item };
      const onUnforwardable = onUnforwardableOf(merged);
      if (onUnforwardable === 'park' && merged.parkQueue === undefined) {
        issue(['parkQueue'], 'onUnforwardable park needs parkQueue (here or under defaults)');
      }
      if (merged.parkQueue !== undefined && onUnforwardable !== 'park') {
        issue(['parkQueue'], `cannot be combined with onUnforwardable ${onUnforwardable}`);
      }
      // Zod runs this check even when a field failed: skip what did not parse (already reported).
      const leaseMs = millis(merged.lease ?? DEFAULTS.lease);
      const windowMs = millis(merged.dedupWindow ?? DEFAULTS.dedupWindow);
      if (leaseMs !== undefined && leaseMs < 1000) issue(['lease'], 'must be at least 1s');
      if (leaseMs !== undefined && windowMs !== undefined && windowMs <= leaseMs) {
        issue(['dedupWindow'], 'must be longer than the lease');
      }
    }
  });

type ConfigFile = z.infer<typeof fileSchema>;
type Broker = z.infer<typeof broker>;
type Route = z.infer<typeof routeWithOldPolicyName>;

function urlsOf(item: Broker): string[] {
  return item.urls ?? (item.url === undefined ? [] : [item.url]);
}

/**
 * What is wrong with a route's target (and a stream broker as its source): a queue, an exchange
 * (with a routing key), or on a rabbitmq-stream:// broker a stream, one of them.
 */
function targetIssues(
  item: Pick<Route, 'source' | 'target' | 'scope'>,
  isStreamBroker: (broker: string) => boolean,
): [(string | number)[], string][] {
  const issues: [(string | number)[], string][] = [];
  const target = item.target;
  const source = item.source;
  if (isStreamBroker(source.broker)) {
    if (source.queue !== undefined) {
      issues.push([
        ['source', 'queue'],
        'does not go with a stream source; source.stream names the stream to read',
      ]);
    } else if (source.stream === undefined) {
      issues.push([
        ['source', 'stream'],
        `broker "${source.broker}" is a stream endpoint (rabbitmq-stream://): name the stream to read`,
      ]);
    }
  } else {
    for (const key of ['stream', 'start'] as const) {
      if (source[key] !== undefined) {
        issues.push([
          ['source', key],
          `goes with a broker whose url is rabbitmq-stream:// (or rabbitmq-stream+tls://); broker "${source.broker}" is not one`,
        ]);
      }
    }
    if (source.queue === undefined) issues.push([['source', 'queue'], 'is required']);
  }
  const named = (kind: string, value: string | undefined): void => {
    if (item.scope === undefined && value !== undefined && /[{}\s]/.test(value)) {
      issues.push([
        ['scope'],
        `the target ${kind} "${value}" has braces or spaces; give a scope without them`,
      ]);
    }
  };
  const streamTarget = isStreamBroker(target.broker);
  if (streamTarget || target.stream !== undefined) {
    for (const key of ['queue', 'exchange', 'routingKey'] as const) {
      if (target[key] !== undefined) {
        issues.push([['target', key], 'does not go with a stream target; target.stream names the stream']);
      }
    }
    if (!streamTarget) {
      issues.push([
        ['target', 'stream'],
        `goes with a broker whose url is rabbitmq-stream:// (or rabbitmq-stream+tls://); broker "${target.broker}" is not one`,
      ]);
    } else if (target.stream === undefined) {
      issues.push([
        ['target', 'stream'],
        `broker "${target.broker}" is a stream endpoint (rabbitmq-stream://): name the stream to write to`,
      ]);
    }
    named('stream', target.stream);
    return issues;
  }
  if (target.producer !== undefined) {
    issues.push([['target', 'producer'], 'goes with target.stream (a stream target)']);
  }
  if (target.queue === undefined && target.exchange === undefined) {
    issues.push([
      ['target'],
      'give queue, or exchange (with routingKey), or stream (on a rabbitmq-stream:// broker)',
    ]);
  }
  if (target.queue !== undefined && target.exchange !== undefined) {
    issues.push([['target', 'exchange'], 'give either queue or exchange, not both']);
  }
  if (target.routingKey !== undefined && target.exchange === undefined) {
    issues.push([
      ['target', 'routingKey'],
      'goes with exchange; with queue the routing key is the queue name',
    ]);
  }
  named('queue', target.queue);
  named('exchange', target.exchange);
  return issues;
}

/** A parkQueue alone implies the park policy, as --park-queue does. */
function onUnforwardableOf(settings: {
  onUnforwardable?: string | undefined;
  parkQueue?: string | undefined;
}) {
  return settings.onUnforwardable ?? (settings.parkQueue !== undefined ? 'park' : DEFAULTS.onUnforwardable);
}

/** `routes[2].target.exchange` from a zod path. */
function pathText(path: readonly PropertyKey[]): string {
  return path
    .map((part) => (typeof part === 'number' ? `[${part}]` : `.${String(part)}`))
    .join('')
    .replace(/^\./, '');
}

/** The value at a zod path of the parsed YAML (zod leaves it out of its issues). */
function valueAt(data: unknown, path: readonly PropertyKey[]): unknown {
  let value = data;
  for (const part of path) {
    if (value === null || typeof value !== 'object') return undefined;
    value = (value as Record<PropertyKey, unknown>)[part];
  }
  return value;
}

function describeIssue(issue: z.core.$ZodIssue, data: unknown): { path: string; message: string } {
  if (issue.code === 'unrecognized_keys') {
    return { path: pathText([...issue.path, issue.keys[0] as string]), message: 'is not a known key' };
  }
  let message = issue.message;
  if (issue.code === 'invalid_type') {
    const expected =
      issue.expected === 'array'
        ? 'a list'
        : issue.expected === 'object'
          ? 'a mapping'
          : issue.expected === 'boolean'
            ? 'true or false'
            : `a ${issue.expected}`;
    message = valueAt(data, issue.path) === undefined ? 'is required' : `must be ${expected}`;
  }
  return { path: pathText(issue.path), message };
}

/** Reads and validates a config file; a problem is a ConfigError `<file>: <path>: <what is wrong>`. */
export function loadConfigFile(path: string, what = '--config'): ConfigFile {
  let text: string;
  try {
    text = readFileSync(path, 'utf8');
  } catch (error) {
    const code = (error as NodeJS.ErrnoException).code ?? 'unreadable';
    throw new ConfigError(`${what}: cannot read "${path}" (${code})`);
  }
  let data: unknown;
  try {
    data = parseYaml(text);
  } catch (error) {
    throw new ConfigError(`${path}: not valid YAML: ${(error as Error).message.split('\n')[0]}`);
  }
  data ??= {};
  const parsed = fileSchema.safeParse(data);
  if (!parsed.success) {
    const first = describeIssue(parsed.error.issues[0] as z.core.$ZodIssue, data);
    throw new ConfigError(`${path}: ${first.path || 'top level'}: ${first.message}`);
  }
  return parsed.data;
}

/** Options that belong to one route: with several routes in the file, giving one as a flag is an error. */
const ROUTE_OPTIONS = [
  'source',
  'sourceQueue',
  'target',
  'targetQueue',
  'targetExchange',
  'targetRoutingKey',
  'targetStream',
  'targetProducer',
  'scope',
  'idFrom',
  'dedupWindow',
  'prefetch',
  'maxInFlightBytes',
  'batchSize',
  'cacheShards',
  'lease',
  'onUnforwardable',
  'onUnroutable',
  'parkQueue',
  'stripCc',
  'sourceCa',
  'sourceCert',
  'sourceKey',
  'targetCa',
  'targetCert',
  'targetKey',
] as const;

function withoutUndefined<T extends object>(value: T): Partial<T> {
  return Object.fromEntries(Object.entries(value).filter(([, item]) => item !== undefined)) as Partial<T>;
}

/** One route of the file as the options the CLI would have collected for it. */
function routeOptions(file: ConfigFile, item: Route): RawOptions {
  const settings = { ...withoutUndefined(file.defaults ?? {}), ...withoutUndefined(item) };
  const source = file.brokers[item.source.broker] as Broker;
  const target = file.brokers[item.target.broker] as Broker;
  const sourceTls = item.source.tls ?? source.tls;
  const targetTls = item.target.tls ?? target.tls;
  return {
    source: urlsOf(source).join(','),
    sourceQueue: item.source.queue,
    sourceStream: item.source.stream,
    sourceStart: item.source.start,
    target: urlsOf(target).join(','),
    targetQueue: item.target.queue,
    targetExchange: item.target.exchange,
    targetRoutingKey: item.target.routingKey,
    targetStream: item.target.stream,
    targetProducer: item.target.producer,
    redis: file.redis?.url,
    redisPrefix: file.redis?.prefix,
    redisWaitReplicas: file.redis?.waitReplicas?.toString(),
    scope: item.scope,
    idFrom: settings.idFrom,
    dedupWindow: settings.dedupWindow,
    prefetch: settings.prefetch?.toString(),
    maxInFlightBytes: settings.maxInFlightBytes,
    batchSize: settings.batchSize?.toString(),
    cacheShards: settings.cacheShards?.toString(),
    lease: settings.lease,
    onUnforwardable: onUnforwardableOf(settings),
    parkQueue: settings.parkQueue,
    stripCc: settings.stripCc,
    retryFor: file.retryFor,
    shutdownTimeout: file.shutdownTimeout,
    logLevel: file.logLevel,
    sourceCa: sourceTls?.ca,
    sourceCert: sourceTls?.cert,
    sourceKey: sourceTls?.key,
    targetCa: targetTls?.ca,
    targetCert: targetTls?.cert,
    targetKey: targetTls?.key,
    redisCa: file.redis?.tls?.ca,
    redisCert: file.redis?.tls?.cert,
    redisKey: file.redis?.tls?.key,
  };
}

/**
 * Flags and environment over the file's one route. A flag naming the target or the unforwardable
 * policy replaces the file's whole choice, so that e.g. --target-exchange does not clash with the
 * file's target queue.
 */
function overlay(fromFile: RawOptions, flags: Partial<RawOptions>): RawOptions {
  const base = { ...fromFile };
  if (
    flags.targetQueue !== undefined ||
    flags.targetExchange !== undefined ||
    flags.targetStream !== undefined
  ) {
    base.targetQueue = undefined;
    base.targetExchange = undefined;
    base.targetRoutingKey = undefined;
    base.targetStream = undefined;
    base.targetProducer = undefined;
  }
  if (flags.onUnforwardable !== undefined && flags.parkQueue === undefined) base.parkQueue = undefined;
  if (flags.parkQueue !== undefined && flags.onUnforwardable === undefined) base.onUnforwardable = undefined;
  return { ...base, ...flags };
}

/**
 * The file's routes as BridgeSettings, one per route, named by the route. `flags` are what the CLI
 * collected from flags and environment: process-wide ones (Redis, log level, timeouts) override the
 * file; route ones only when the file has a single route, and are a usage error otherwise.
 */
export function resolveConfigRoutes(
  path: string,
  file: ConfigFile,
  flags: RawOptions,
  mode: 'run' | 'migrate',
): BridgeSettings[] {
  const given = withoutUndefined(flags);
  if (file.routes.length > 1) {
    const routeFlag = ROUTE_OPTIONS.find((option) => given[option] !== undefined);
    if (routeFlag !== undefined) {
      throw new ConfigError(
        `${flagOf(routeFlag)}: applies to a single route, but ${path} has ${file.routes.length} routes; set it per route in the file`,
      );
    }
  }
  // --on-unroutable as --on-unforwardable, before it replaces the file's policy.
  const overriding = readOldPolicyName(given);
  return file.routes.map((item, index) => {
    const raw = overlay(routeOptions(file, item), overriding);
    const broker = file.brokers[item.source.broker] as Broker;
    const management = broker.management;
    try {
      const settings: BridgeSettings = { ...resolveBridgeSettings(raw, mode), route: item.name };
      if (management !== undefined) settings.sourceManagementUrl = management;
      const keys = `brokers.${item.source.broker}`;
      const ca = checkManagementCa(management, broker.managementCa, {
        ca: `${keys}.managementCa`,
        url: `${keys}.management`,
      });
      if (ca !== undefined) settings.sourceManagementCa = ca;
      return settings;
    } catch (error) {
      if (error instanceof ConfigError) {
        throw new ConfigError(`${path}: routes[${index}] (${item.name}): ${error.message}`);
      }
      throw error;
    }
  });
}

/** Reads, validates and resolves a config file for `run --config`. */
export function loadConfigRoutes(path: string, flags: RawOptions, mode: 'run' | 'migrate'): BridgeSettings[] {
  return resolveConfigRoutes(path, loadConfigFile(path), flags, mode);
}

/** The effective config of resolved routes, passwords masked, for `config check` to print. */
export function describeConfig(file: ConfigFile, routes: BridgeSettings[]): Record<string, unknown> {
  const first = routes[0] as BridgeSettings;
  const tlsOf = (item: Route, side: 'source' | 'target') =>
    item[side].tls ?? (file.brokers[item[side].broker] as Broker).tls;
  return withoutUndefined({
    redis: withoutUndefined({
      url: redactUrl(first.redisUrl),
      prefix: first.redisPrefix,
      waitReplicas: first.redisWaitReplicas,
      tls: file.redis?.tls,
    }),
    logLevel: first.logLevel,
    retryFor: formatRetryFor(first.retryForMs),
    shutdownTimeout: formatDuration(first.shutdownTimeoutMs),
    routes: routes.map((settings, index) => {
      const item = file.routes[index] as Route;
      const queueOrStream = settings.targetQueue !== undefined || settings.targetStream !== undefined;
      return withoutUndefined({
        name: settings.route,
        source: withoutUndefined({
          urls: settings.sourceUrls.map(redactUrl),
          management: settings.sourceManagementUrl && redactUrl(settings.sourceManagementUrl),
          managementCa: settings.sourceManagementCa,
          queue: settings.sourceStream === undefined ? settings.sourceQueue : undefined,
          stream: settings.sourceStream,
          start: settings.sourceStream === undefined ? undefined : (item.source.start ?? 'first'),
          tls: tlsOf(item, 'source'),
        }),
        target: withoutUndefined({
          urls: settings.targetUrls.map(redactUrl),
          queue: settings.targetQueue,
          exchange: queueOrStream ? undefined : settings.targetExchange,
          routingKey: queueOrStream ? undefined : settings.targetRoutingKey,
          stream: settings.targetStream,
          producer: settings.targetProducer,
          tls: tlsOf(item, 'target'),
        }),
        scope: settings.scope,
        idFrom: settings.idFrom.map(describeStrategy),
        dedupWindow: formatDuration(settings.dedupWindowMs),
        prefetch: settings.prefetch,
        maxInFlightBytes: formatSize(settings.maxInFlightBytes),
        batchSize: settings.batchSize,
        cacheShards: settings.cacheShards,
        lease: formatDuration(settings.leaseMs),
        onUnforwardable: settings.onUnforwardable,
        parkQueue: settings.parkQueue,
        stripCc: settings.stripCc || undefined,
      });
    }),
  });
}
