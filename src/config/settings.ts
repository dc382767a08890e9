import { z } from 'zod';
import { ConfigError } from '../errors.js';
import { LOG_LEVELS, type LogLevel } from '../log.js';
import { FOREVER, parseDuration, parseRetryFor, parseTimerDuration } from './duration.js';
import { DEFAULT_ID_FROM, type IdStrategy, parseIdFrom } from './id-from.js';
import { hasHiddenPassword, redactUrl } from './redact.js';
import { parseRedisUrl } from './redis-url.js';
import { parseSize } from './size.js';
import { isStreamUrl, parseStreamUrl, type StreamStart } from './stream-url.js';
import { resolveTlsSettings, type TlsRawOptions, type TlsSettings } from './tls.js';

/**
 * What the bridge does with each message it cannot forward (--on-unforwardable): unroutable at the
 * target, nacked or refused by it, too large for it, without an ID, with an unreadable header, or
 * a loop back into its own source. `retry` holds it unacked and tries it again after a backoff
 * (one that can never go, without an ID say, stays held until the route stops).
 */
export type UnforwardablePolicy = 'park' | 'dead-letter' | 'retry';

/** The defaults, documented in docs/cli.md; change both together. */
export const DEFAULTS = {
  redis: 'redis://127.0.0.1:6379',
  redisPrefix: 'dedup',
  redisWaitReplicas: 0,
  idFrom: DEFAULT_ID_FROM,
  dedupWindow: '7d',
  prefetch: 500,
  /** Per route; fits the example Kubernetes manifests (docs/kubernetes) with room to spare. */
  maxInFlightBytes: '32MiB',
  batchSize: 200,
  cacheShards: 'auto',
  lease: '15s',
  onUnforwardable: 'retry' as UnforwardablePolicy,
  requeueDelay: '1s',
  requeueDelayMax: '30s',
  shutdownTimeout: '30s',
  runRetryFor: FOREVER,
  migrateRetryFor: '60s',
  idleTimeout: '2s',
  logLevel: 'info' as LogLevel,
};

/** The options as the CLI collects them (flags, then environment), all optional strings. */
export interface RawOptions extends TlsRawOptions {
  source?: string;
  sourceQueue?: string;
  sourceStream?: string;
  sourceStart?: string;
  target?: string;
  targetQueue?: string;
  targetExchange?: string;
  targetRoutingKey?: string;
  targetStream?: string;
  targetProducer?: string;
  redis?: string;
  redisPrefix?: string;
  redisWaitReplicas?: string;
  scope?: string;
  idFrom?: string;
  dedupWindow?: string;
  prefetch?: string;
  maxInFlightBytes?: string;
  batchSize?: string;
  cacheShards?: string;
  lease?: string;
  onUnforwardable?: string;
  /** The old name of onUnforwardable (--on-unroutable), read as it; see readOldPolicyName. */
  onUnroutable?: string;
  parkQueue?: string;
  stripCc?: boolean;
  retryFor?: string;
  shutdownTimeout?: string;
  logLevel?: string;
  idleTimeout?: string;
  maxMessages?: string;
  report?: string;
  metricsPort?: string;
  metricsHost?: string;
}

/** What the management API said of a source queue's delivery limit (a quorum queue's). */
export interface SourceDeliveryLimit {
  /** The lower of x-delivery-limit and the policy's delivery-limit; null: neither is set. */
  limit: number | null;
  /** What set it, for the log line. */
  from: string;
  /** Where the broker puts a message past it ('' the default exchange); undefined: it drops it. */
  deadLetterExchange: string | undefined;
}

export interface BridgeSettings {
  /** Names the route in logs and metrics: the source queue, or the route's name in a config file. */
  route: string;
  /** The first of sourceUrls: the one named in messages and job names. */
  sourceUrl: string;
  /** Nodes of the source cluster, tried in turn (the next one on each failure or lost connection). */
  sourceUrls: string[];
  /** The source broker's management API, when a config file names one (for the queue TTL check). */
  sourceManagementUrl?: string;
  /** The CA file to trust for an https sourceManagementUrl (default: the system's CAs). */
  sourceManagementCa?: string;
  /**
   * The source queue's delivery limit as its management API showed it at start (set by the start
   * checks, see bridge/source-ttl.ts); undefined when not read (no management API, a classic queue).
   */
  sourceDeliveryLimit?: SourceDeliveryLimit;
  /** The queue consumed; for a stream source, the stream's name. */
  sourceQueue: string;
  /** The stream a rabbitmq-stream:// source reads; undefined for a queue source. */
  sourceStream?: string | undefined;
  /** Where a stream source route with no stored position starts (--source-start). */
  sourceStart: StreamStart;
  /** The first of targetUrls. */
  targetUrl: string;
  /** The nodes of the target cluster; for a stream target (rabbitmq-stream://), its one URL. */
  targetUrls: string[];
  /** '' is the default exchange (and the value for a stream target). */
  targetExchange: string;
  /** Set for --target-queue (the queue name) and --target-routing-key; else each message's own key. */
  targetRoutingKey: string | undefined;
  targetQueue: string | undefined;
  /** The stream a rabbitmq-stream:// target writes to; undefined for a queue or exchange target. */
  targetStream: string | undefined;
  /** The stream producer's name (publisher reference, <= 255 bytes) if set with --target-producer; undefined: derived from the route. */
  targetProducer: string | undefined;
  /** The target URL's user (guest when it names none). */
  targetUser: string;
  redisUrl: string;
  redisPrefix: string;
  /**
   * Replicas that must hold each commit before its messages are acked (Redis WAIT); 0: ack as soon
   * as the master answers. See DedupCache and docs/redis.md.
   */
  redisWaitReplicas: number;
  scope: string;
  idFrom: IdStrategy[];
  dedupWindowMs: number;
  prefetch: number;
  /** Bytes of source bodies the route holds at most (a body at least this big passes alone). */
  maxInFlightBytes: number;
  batchSize: number;
  /** Slot shards of a new scope (see DedupCache); 'auto' is 16 on a Redis Cluster, else 1. */
  cacheShards: number | 'auto';
  leaseMs: number;
  onUnforwardable: UnforwardablePolicy;
  parkQueue: string | undefined;
  /**
   * Remove the `CC` and `BCC` headers on forward: RabbitMQ routes a copy to each routing key they
   * list (sender-selected distribution), on the target too. Default false, as Shovel.
   */
  stripCc: boolean;
  requeueDelay: { initialMs: number; maxMs: number };
  retryForMs: number;
  shutdownTimeoutMs: number;
  logLevel: LogLevel;
  /** CA and client certificate files per server; empty for plain URLs. */
  tls: TlsSettings;
}

/** A dedup scope goes inside the key's {hash tag}: no braces, no spaces. */
export const SCOPE_PATTERN = /^[^{}\s]+$/;

/**
 * Which flag (and variable) sets each field, for error messages; a field not here is set by the
 * flag of its name (see flagOf). The variables are those of src/cli/options.ts.
 */
const FLAG: Record<string, string> = {
  source: '--source (or DEDUP_BRIDGE_SOURCE)',
  sourceQueue: '--source-queue (or DEDUP_BRIDGE_SOURCE_QUEUE)',
  sourceStream: '--source-stream (or DEDUP_BRIDGE_SOURCE_STREAM)',
  sourceStart: '--source-start (or DEDUP_BRIDGE_SOURCE_START)',
  target: '--target (or DEDUP_BRIDGE_TARGET)',
  targetQueue: '--target-queue',
  targetExchange: '--target-exchange',
  targetRoutingKey: '--target-routing-key',
  targetStream: '--target-stream (or DEDUP_BRIDGE_TARGET_STREAM)',
  targetProducer: '--target-producer (or DEDUP_BRIDGE_TARGET_PRODUCER)',
  redis: '--redis (or DEDUP_BRIDGE_REDIS)',
  redisPrefix: '--redis-prefix',
  redisWaitReplicas: '--redis-wait-replicas (or DEDUP_BRIDGE_REDIS_WAIT_REPLICAS)',
  scope: '--scope',
  prefetch: '--prefetch',
  maxInFlightBytes: '--max-in-flight-bytes (or DEDUP_BRIDGE_MAX_IN_FLIGHT_BYTES)',
  batchSize: '--batch-size',
  cacheShards: '--cache-shards',
  onUnforwardable: '--on-unforwardable',
  parkQueue: '--park-queue',
  stripCc: '--strip-cc (or DEDUP_BRIDGE_STRIP_CC)',
  logLevel: '--log-level',
  sourceCa: '--source-ca (or DEDUP_BRIDGE_SOURCE_CA)',
  sourceCert: '--source-cert (or DEDUP_BRIDGE_SOURCE_CERT)',
  sourceKey: '--source-key (or DEDUP_BRIDGE_SOURCE_KEY)',
  targetCa: '--target-ca (or DEDUP_BRIDGE_TARGET_CA)',
  targetCert: '--target-cert (or DEDUP_BRIDGE_TARGET_CERT)',
  targetKey: '--target-key (or DEDUP_BRIDGE_TARGET_KEY)',
};

/** The flag (and variable) that sets an option of RawOptions: `sourceQueue` is --source-queue. */
export function flagOf(option: string): string {
  return FLAG[option] ?? `--${option.replace(/[A-Z]/g, (letter) => `-${letter.toLowerCase()}`)}`;
}

function urlWith(protocols: string[], example: string) {
  return z.string().superRefine((value, ctx) => {
    // "localhost:5701" parses as a URL of scheme "localhost": say what is missing instead.
    if (!value.includes('//')) {
      ctx.addIssue({
        code: 'custom',
        message: `"${redactUrl(value)}" has no scheme; add ${protocols[0]}//, e.g. ${redactUrl(`${protocols[0]}//${value}`)}`,
      });
      return;
    }
    let parsed: URL;
    try {
      parsed = new URL(value);
    } catch {
      ctx.addIssue({ code: 'custom', message: `"${redactUrl(value)}" is not a URL; use ${example}` });
      return;
    }
    if (!protocols.includes(parsed.protocol)) {
      ctx.addIssue({
        code: 'custom',
        message: `"${redactUrl(value)}" has scheme ${parsed.protocol.replace(':', '')}; use ${protocols.map((p) => p.replace(':', '')).join(' or ')}, e.g. ${example}`,
      });
    } else if (parsed.hostname === '') {
      ctx.addIssue({ code: 'custom', message: `"${redactUrl(value)}" has no host; use ${example}` });
    } else if (hasHiddenPassword(value)) {
      // amqp://bob:12?x@host is host "bob", port 12 to a URL parser: the bridge would go there.
      ctx.addIssue({
        code: 'custom',
        message: `"${redactUrl(value)}" has an @ after its host, so its password is read as a host, path or query; percent-encode / ? # @ in a password (%2F %3F %23 %40)`,
      });
    } else if (!decodable(parsed.username, parsed.password, parsed.pathname)) {
      ctx.addIssue({
        code: 'custom',
        message: `"${redactUrl(value)}" has a % that is not percent-encoding in its user, password or path; write a literal % as %25`,
      });
    } else {
      const problem = amqpQueryProblem(parsed.searchParams);
      if (problem !== undefined)
        ctx.addIssue({ code: 'custom', message: `"${redactUrl(value)}": ${problem}` });
    }
  });
}

// The parameters amqplib reads from a URL's query, and their ranges (AMQP's tune fields; a frame
// below 4096 bytes is refused by the broker). amqplib sends a malformed one as it is, and the
// connection then fails as if the broker were down.
const AMQP_QUERY: Record<string, [number, number] | undefined> = {
  heartbeat: [0, 65535],
  channelMax: [0, 65535],
  frameMax: [4096, 4294967295],
  maxFrameSize: [4096, 4294967295],
  locale: undefined,
};

function amqpQueryProblem(query: URLSearchParams): string | undefined {
  for (const [name, value] of query) {
    if (!Object.hasOwn(AMQP_QUERY, name)) {
      return `unknown URL parameter ${name}; an amqp URL takes ${Object.keys(AMQP_QUERY).join(', ')}`;
    }
    const range = AMQP_QUERY[name];
    if (range === undefined) continue;
    const [least, most] = range;
    if (!/^\d+$/.test(value) || Number(value) < least || Number(value) > most) {
      return `URL parameter ${name} must be a whole number from ${least} to ${most}`;
    }
  }
  return undefined;
}

/** Whether each part is valid percent-encoding (decodeURIComponent throws on "%zz"). */
export function decodable(...parts: string[]): boolean {
  try {
    for (const part of parts) decodeURIComponent(part);
    return true;
  } catch {
    return false;
  }
}

const amqpUrl = urlWith(['amqp:', 'amqps:'], 'amqp://user:password@host:5672/vhost');

/** The URLs of a comma-separated list, trimmed, empty items dropped. */
function urlItems(value: string): string[] {
  return value
    .split(',')
    .map((item) => item.trim())
    .filter((item) => item.length > 0);
}

/** One URL, or several comma-separated (the nodes of a cluster, tried in turn). */
const amqpUrlList = z.string().transform(urlItems).pipe(z.array(amqpUrl).min(1, 'give at least one URL'));

/**
 * A side's brokers: AMQP URLs (a cluster's nodes), or one stream URL, rabbitmq-stream:// or
 * rabbitmq-stream+tls:// (checked by parseStreamUrl; a list of them is not taken yet).
 */
function brokerUrlList(side: 'source' | 'target') {
  return z
    .string()
    .superRefine((value, ctx) => {
      const items = urlItems(value);
      if (!items.some(isStreamUrl)) {
        const parsed = amqpUrlList.safeParse(value);
        for (const issue of parsed.error?.issues ?? [])
          ctx.addIssue({ code: 'custom', message: issue.message });
        return;
      }
      if (items.length > 1) {
        ctx.addIssue({
          code: 'custom',
          message: `a stream ${side} is one rabbitmq-stream:// URL; a list of ${items.length} URLs is not supported for a stream (yet): give one node`,
        });
        return;
      }
      try {
        parseStreamUrl(items[0] as string);
      } catch (error) {
        ctx.addIssue({ code: 'custom', message: (error as Error).message });
      }
    })
    .transform(urlItems);
}

const sourceUrlList = brokerUrlList('source');
const targetUrlList = brokerUrlList('target');

/** A list's check on the text as given (a job file's source or target), for urlOrReference. */
function checkedText(list: z.ZodType<unknown, string>) {
  return z.string().superRefine((value, ctx) => {
    const parsed = list.safeParse(value);
    for (const issue of parsed.error?.issues ?? []) ctx.addIssue({ code: 'custom', message: issue.message });
  });
}
export const sourceUrlsText = checkedText(sourceUrlList);
export const targetUrlsText = checkedText(targetUrlList);

/**
 * A config file's broker URL: an AMQP URL, or a stream endpoint (rabbitmq-stream://), which only a
 * route's target may use (resolveBridgeSettings says so of a source).
 */
export const brokerUrl = z.string().superRefine((value, ctx) => {
  if (!isStreamUrl(value)) {
    for (const issue of amqpUrl.safeParse(value).error?.issues ?? [])
      ctx.addIssue({ code: 'custom', message: issue.message });
    return;
  }
  try {
    parseStreamUrl(value);
  } catch (error) {
    ctx.addIssue({ code: 'custom', message: (error as Error).message });
  }
});

/** Whether a checked target list is a stream target (one rabbitmq-stream:// URL). */
function isStreamTarget(urls: readonly string[]): boolean {
  return urls.length === 1 && isStreamUrl(urls[0] as string);
}
// One server, a Sentinel set or a Cluster: src/config/redis-url.ts reads all three forms.
export const redisUrl = z.string().superRefine((value, ctx) => {
  try {
    parseRedisUrl(value);
  } catch (error) {
    ctx.addIssue({ code: 'custom', message: (error as Error).message });
  }
});
// RabbitMQ limits names to 255 bytes.
export const name = z
  .string()
  .min(1, 'must not be empty')
  .refine((value) => Buffer.byteLength(value) <= 255, 'is longer than 255 bytes');
// '' is the default exchange.
export const exchangeName = z.string().refine((value) => Buffer.byteLength(value) <= 255, 'is too long');
/** `requeue`, the old name of `retry`, is still taken (and read as `retry`). */
export const unforwardablePolicy = z
  .enum(['retry', 'dead-letter', 'park', 'requeue'], { error: 'must be retry, dead-letter or park' })
  .transform((policy): UnforwardablePolicy => (policy === 'requeue' ? 'retry' : policy));
export const REDIS_PREFIX_PATTERN = /^[^{}:\s]+$/;
/** The most replicas --redis-wait-replicas may ask for (a Redis master with more is unusual). */
export const MAX_WAIT_REPLICAS = 64;
/** A whole number from min to max; every refusal says the range. */
export const count = (min: number, max: number) =>
  z
    .string()
    .regex(/^\d+$/, `must be a whole number from ${min} to ${max}`)
    .transform(Number)
    .pipe(
      z
        .number()
        .min(min, `must be at least ${min} (a whole number from ${min} to ${max})`)
        .max(max, `must be at most ${max} (a whole number from ${min} to ${max})`),
    );

const rawSchema = z
  .object({
    source: sourceUrlList,
    sourceQueue: name.optional(),
    sourceStream: name.optional(),
    target: targetUrlList,
    targetQueue: name.optional(),
    targetExchange: exchangeName.optional(),
    targetRoutingKey: z.string().optional(),
    targetStream: name.optional(),
    // The stream protocol takes a publisher reference of up to 256 bytes; 255 as for every name.
    targetProducer: name.optional(),
    redis: redisUrl,
    redisPrefix: z
      .string()
      .regex(REDIS_PREFIX_PATTERN, 'must be non-empty, without braces, colons or spaces'),
    redisWaitReplicas: count(0, MAX_WAIT_REPLICAS),
    scope: z.string().regex(SCOPE_PATTERN, 'must be non-empty, without braces or spaces').optional(),
    prefetch: count(1, 65535),
    batchSize: count(1, 5000),
    cacheShards: z.union([z.literal('auto'), count(1, 1024)], {
      error: 'must be auto or a whole number from 1 to 1024',
    }),
    onUnforwardable: unforwardablePolicy,
    parkQueue: name.optional(),
    logLevel: z.enum(LOG_LEVELS as [LogLevel, ...LogLevel[]], {
      error: `must be one of ${LOG_LEVELS.join(', ')}`,
    }),
  })
  .superRefine((options, ctx) => {
    for (const [field, message] of sourceIssues(options))
      ctx.addIssue({ code: 'custom', path: [field], message });
    if (isStreamTarget(options.target)) {
      for (const [field, message] of streamTargetIssues(options)) {
        ctx.addIssue({ code: 'custom', path: [field], message });
      }
      return;
    }
    for (const field of ['targetStream', 'targetProducer'] as const) {
      if (options[field] !== undefined) {
        ctx.addIssue({
          code: 'custom',
          path: [field],
          message:
            'goes with a stream target, --target rabbitmq-stream://… (or rabbitmq-stream+tls://); with an amqp:// target give --target-queue or --target-exchange',
        });
      }
    }
    if (options.targetQueue === undefined && options.targetExchange === undefined) {
      ctx.addIssue({
        code: 'custom',
        path: ['targetQueue'],
        message: 'give --target-queue <name>, or --target-exchange <name> (with --target-routing-key <key>)',
      });
    }
    if (options.targetQueue !== undefined && options.targetExchange !== undefined) {
      ctx.addIssue({
        code: 'custom',
        path: ['targetQueue'],
        message: 'give either --target-queue or --target-exchange, not both',
      });
    }
    if (options.targetRoutingKey !== undefined && options.targetExchange === undefined) {
      ctx.addIssue({
        code: 'custom',
        path: ['targetRoutingKey'],
        message: 'goes with --target-exchange; with --target-queue the routing key is the queue name',
      });
    }
    if (options.onUnforwardable === 'park' && options.parkQueue === undefined) {
      ctx.addIssue({
        code: 'custom',
        path: ['parkQueue'],
        message: '--on-unforwardable park needs --park-queue <name>',
      });
    }
    if (options.parkQueue !== undefined && options.onUnforwardable !== 'park') {
      ctx.addIssue({
        code: 'custom',
        path: ['parkQueue'],
        message: `cannot be combined with --on-unforwardable ${options.onUnforwardable}`,
      });
    }
  });

/** A queue source names its queue; a stream source its stream, and holds what it cannot forward. */
function sourceIssues(options: {
  source: string[];
  sourceQueue?: string | undefined;
  sourceStream?: string | undefined;
  onUnforwardable: UnforwardablePolicy;
}): [string, string][] {
  if (!isStreamTarget(options.source)) {
    if (options.sourceStream !== undefined) {
      return [
        [
          'sourceStream',
          'goes with a stream source, --source rabbitmq-stream://… (or rabbitmq-stream+tls://); with an amqp:// source give --source-queue',
        ],
      ];
    }
    return options.sourceQueue === undefined ? [['sourceQueue', 'is required']] : [];
  }
  if (options.sourceQueue !== undefined) {
    return [
      [
        'sourceQueue',
        'does not go with a stream source (rabbitmq-stream://); --source-stream names the stream to read',
      ],
    ];
  }
  if (options.sourceStream === undefined) {
    return [
      [
        'sourceStream',
        'a stream source (rabbitmq-stream://) needs --source-stream <name>, the stream to read',
      ],
    ];
  }
  if (options.onUnforwardable !== 'retry') {
    return [
      [
        'onUnforwardable',
        `${options.onUnforwardable} is not for a stream source: a stream has no dead-lettering and keeps its messages, so a message that cannot be forwarded is held and retried (retry, the default), and the route's position waits for it`,
      ],
    ];
  }
  return [];
}

/** What a stream target refuses: a queue, exchange or routing key beside it, or no stream named. */
function streamTargetIssues(options: {
  targetQueue?: string | undefined;
  targetExchange?: string | undefined;
  targetRoutingKey?: string | undefined;
  targetStream?: string | undefined;
}): [string, string][] {
  const issues: [string, string][] = [];
  for (const field of ['targetQueue', 'targetExchange', 'targetRoutingKey'] as const) {
    if (options[field] !== undefined) {
      issues.push([
        field,
        'does not go with a stream target (rabbitmq-stream://); --target-stream names the stream to write to',
      ]);
    }
  }
  if (options.targetStream === undefined) {
    issues.push([
      'targetStream',
      'a stream target (rabbitmq-stream://) needs --target-stream <name>, the stream to write to',
    ]);
  }
  return issues;
}

function userOf(url: string): string {
  const raw = new URL(url).username;
  try {
    return decodeURIComponent(raw) || 'guest';
  } catch {
    throw new ConfigError(
      `--target (or DEDUP_BRIDGE_TARGET): the user name "${raw}" is not valid percent-encoding`,
    );
  }
}

function firstIssue(error: z.ZodError): ConfigError {
  const issue = error.issues[0];
  const field = String(issue?.path[0] ?? '');
  const flag = FLAG[field] ?? field;
  let message = issue?.message ?? 'invalid';
  if (issue?.code === 'invalid_type' && issue.input === undefined) message = 'is required';
  return new ConfigError(`${flag}: ${message}`);
}

/**
 * The options with --on-unroutable, the old name of --on-unforwardable, read as the new one. Both
 * given with values that mean different policies are refused: one of them would be ignored.
 */
export function readOldPolicyName(raw: RawOptions): RawOptions {
  const { onUnroutable: old, ...options } = raw;
  if (old === undefined) return raw;
  const oldPolicy = unforwardablePolicy.safeParse(old);
  if (!oldPolicy.success) throw new ConfigError(`--on-unroutable: ${oldPolicy.error.issues[0]?.message}`);
  if (options.onUnforwardable === undefined) return { ...options, onUnforwardable: old };
  const policy = unforwardablePolicy.safeParse(options.onUnforwardable);
  // A bad new value is refused by resolveBridgeSettings, naming --on-unforwardable.
  if (policy.success && policy.data !== oldPolicy.data) {
    throw new ConfigError(
      `--on-unforwardable: is ${options.onUnforwardable}, but --on-unroutable (its old name) is ${old}; give only --on-unforwardable`,
    );
  }
  return options;
}

/** Validates what the CLI collected and fills in the defaults; throws ConfigError naming the flag. */
export function resolveBridgeSettings(given: RawOptions, mode: 'run' | 'migrate'): BridgeSettings {
  const raw = readOldPolicyName(given);
  // An option given explicitly (including by `park-queue`) implies its policy.
  const onUnforwardable =
    raw.onUnforwardable ?? (raw.parkQueue !== undefined ? 'park' : DEFAULTS.onUnforwardable);
  const parsed = rawSchema.safeParse({
    source: raw.source,
    sourceQueue: raw.sourceQueue,
    sourceStream: raw.sourceStream,
    target: raw.target,
    targetQueue: raw.targetQueue,
    targetExchange: raw.targetExchange,
    targetRoutingKey: raw.targetRoutingKey,
    targetStream: raw.targetStream,
    targetProducer: raw.targetProducer,
    redis: raw.redis ?? DEFAULTS.redis,
    redisPrefix: raw.redisPrefix ?? DEFAULTS.redisPrefix,
    redisWaitReplicas: raw.redisWaitReplicas ?? String(DEFAULTS.redisWaitReplicas),
    scope: raw.scope,
    prefetch: raw.prefetch ?? String(DEFAULTS.prefetch),
    batchSize: raw.batchSize ?? String(DEFAULTS.batchSize),
    cacheShards: raw.cacheShards ?? DEFAULTS.cacheShards,
    onUnforwardable,
    parkQueue: raw.parkQueue,
    logLevel: raw.logLevel ?? DEFAULTS.logLevel,
  });
  if (!parsed.success) throw firstIssue(parsed.error);
  const options = parsed.data;
  const stream = isStreamTarget(options.target) ? options.targetStream : undefined;
  const sourceStream = isStreamTarget(options.source) ? options.sourceStream : undefined;
  const sourceQueue = (sourceStream ?? options.sourceQueue) as string;
  if (raw.sourceStart !== undefined && sourceStream === undefined) {
    throw new ConfigError(`${FLAG.sourceStart}: goes with a stream source (--source rabbitmq-stream://…)`);
  }
  const sourceStart = parseStart(raw.sourceStart ?? 'first');
  if (
    sourceStream !== undefined &&
    stream === sourceStream &&
    sameStreamEndpoint(options.source[0] as string, options.target[0] as string)
  ) {
    throw new ConfigError(loopMessage(sourceStream, redactUrl(options.target[0] as string)));
  }

  const targetExchange = options.targetExchange ?? '';
  const targetRoutingKey = options.targetQueue ?? options.targetRoutingKey;
  if (
    stream === undefined &&
    targetExchange === '' &&
    targetRoutingKey === sourceQueue &&
    options.source.some((source) => options.target.some((target) => sameBroker(source, target)))
  ) {
    throw new ConfigError(loopMessage(sourceQueue, redactUrl(options.target[0] as string)));
  }
  const scope =
    options.scope ??
    (stream !== undefined
      ? `stream:${stream}`
      : options.targetQueue !== undefined
        ? `queue:${options.targetQueue}`
        : `exchange:${targetExchange}`);
  if (/[{}\s]/.test(scope)) {
    throw new ConfigError(
      `--scope: the target name "${scope}" has braces or spaces; give a --scope without them`,
    );
  }
  const leaseMs = parseTimerDuration(raw.lease ?? DEFAULTS.lease, '--lease');
  if (leaseMs < 1000) throw new ConfigError('--lease: must be at least 1s');
  const dedupWindowMs = parseDuration(raw.dedupWindow ?? DEFAULTS.dedupWindow, '--dedup-window');
  if (dedupWindowMs <= leaseMs) throw new ConfigError('--dedup-window: must be longer than --lease');
  // A stream URL was read by parseStreamUrl already: its user, decoded, or guest.
  const targetUser =
    stream !== undefined
      ? parseStreamUrl(options.target[0] as string).username || 'guest'
      : userOf(options.target[0] as string);
  // The user must be the same on every node: it is stamped on each message as its user-id.
  if (stream === undefined && options.target.some((url) => userOf(url) !== targetUser)) {
    throw new ConfigError('--target (or DEDUP_BRIDGE_TARGET): all URLs of a cluster must use the same user');
  }
  const tls = resolveTlsSettings(raw, options);
  const maxInFlightBytes = parseSize(
    raw.maxInFlightBytes ?? DEFAULTS.maxInFlightBytes,
    FLAG.maxInFlightBytes as string,
  );
  if (maxInFlightBytes < 1) {
    throw new ConfigError(
      `${FLAG.maxInFlightBytes}: must be at least 1 byte (a body bigger than the bound still passes, alone)`,
    );
  }

  return {
    route: sourceQueue,
    sourceUrl: options.source[0] as string,
    sourceUrls: options.source,
    sourceQueue,
    sourceStream,
    sourceStart,
    targetUrl: options.target[0] as string,
    targetUrls: options.target,
    targetExchange,
    targetRoutingKey,
    targetQueue: options.targetQueue,
    targetStream: stream,
    targetProducer: stream !== undefined ? options.targetProducer : undefined,
    targetUser,
    redisUrl: options.redis,
    redisPrefix: options.redisPrefix,
    redisWaitReplicas: options.redisWaitReplicas,
    scope,
    // A stream's entries are each their own message, whatever IDs they carry: their offsets.
    idFrom: parseIdFrom(
      raw.idFrom ?? (sourceStream !== undefined ? 'offset' : DEFAULTS.idFrom),
      sourceStream !== undefined,
    ),
    dedupWindowMs,
    prefetch: options.prefetch,
    maxInFlightBytes,
    batchSize: options.batchSize,
    cacheShards: options.cacheShards,
    leaseMs,
    onUnforwardable: options.onUnforwardable,
    parkQueue: options.parkQueue,
    stripCc: raw.stripCc === true,
    requeueDelay: {
      initialMs: parseDuration(DEFAULTS.requeueDelay, 'requeue delay'),
      maxMs: parseDuration(DEFAULTS.requeueDelayMax, 'requeue delay'),
    },
    retryForMs: parseRetryFor(
      raw.retryFor ?? (mode === 'run' ? DEFAULTS.runRetryFor : DEFAULTS.migrateRetryFor),
      '--retry-for',
    ),
    shutdownTimeoutMs: parseTimerDuration(
      raw.shutdownTimeout ?? DEFAULTS.shutdownTimeout,
      '--shutdown-timeout',
    ),
    logLevel: options.logLevel,
    tls,
  };
}

/** Validates a Redis URL on its own (the cache tools); throws ConfigError naming --redis. */
export function checkRedisUrl(value: string): string {
  const parsed = redisUrl.safeParse(value);
  if (!parsed.success)
    throw new ConfigError(`--redis (or DEDUP_BRIDGE_REDIS): ${parsed.error.issues[0]?.message}`);
  return value;
}

/** Validates a dedup scope name on its own (the cache tools). */
export function checkScope(value: string): string {
  if (!SCOPE_PATTERN.test(value))
    throw new ConfigError('--scope: must be non-empty, without braces or spaces');
  return value;
}

/**
 * Why a route whose target is its own source queue is refused: each message would be forwarded
 * onto the queue it came from, then consumed again as a duplicate and acked, so every message
 * would be deleted while the bridge reported it forwarded.
 */
export function loopMessage(queue: string, where: string): string {
  return `--target-queue: the target is the source queue itself (queue "${queue}" on the broker at ${where}); each message would come back and be deleted as a duplicate. Name another target queue or broker`;
}

/** Whether two AMQP URLs name the same broker and virtual host (by host, port and path). */
function sameBroker(a: string, b: string): boolean {
  const parse = (text: string) => {
    try {
      const url = new URL(text);
      const port = url.port || (url.protocol === 'amqps:' ? '5671' : '5672');
      const vhost = url.pathname ? decodeURIComponent(url.pathname.slice(1)) || '/' : '/';
      return `${url.hostname.toLowerCase()}:${port}/${vhost}`;
    } catch {
      return text;
    }
  };
  return parse(a) === parse(b);
}

/** --source-start: first, last, next, an offset, or an ISO 8601 time with its zone. */
function parseStart(text: string): StreamStart {
  const value = text.trim();
  if (value === 'first' || value === 'last' || value === 'next') return value;
  if (/^\d+$/.test(value) && BigInt(value) < 2n ** 63n) return { offset: BigInt(value) };
  if (/^\d{4}-\d{2}-\d{2}T.*(Z|[+-]\d{2}:?\d{2})$/.test(value) && !Number.isNaN(Date.parse(value))) {
    return { timestamp: BigInt(Date.parse(value)) };
  }
  throw new ConfigError(
    `${FLAG.sourceStart}: "${text}" is not a start; give first, last, next, an offset (a whole number) or a time such as 2026-12-01T00:00:00Z`,
  );
}

/** Whether two stream URLs name the same endpoint and vhost. */
function sameStreamEndpoint(a: string, b: string): boolean {
  const x = parseStreamUrl(a);
  const y = parseStreamUrl(b);
  return x.host === y.host && x.port === y.port && x.vhost === y.vhost;
}
