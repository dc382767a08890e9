import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { z } from 'zod';
import { ConfigError } from '../errors.js';
import { parseTimerDuration } from './duration.js';
import { urlOrReference } from './secret-source.js';
import {
  type BridgeSettings,
  DEFAULTS,
  decodable,
  type RawOptions,
  redisUrl,
  resolveBridgeSettings,
  sourceUrlsText,
  targetUrlsText,
} from './settings.js';
import { isStreamUrl } from './stream-url.js';
import { readCaFile } from './tls.js';
import { parseYaml } from './yaml.js';

/** What `migrate` collects: the bridge options, with repeatable queues and the job's own options. */
export interface MigrateRawOptions extends Omit<RawOptions, 'sourceQueue'> {
  sourceQueue?: string[];
  map?: string[];
  jobFile?: string;
  jobName?: string;
  jobLockLease?: string;
  parallel?: string;
  deleteSourceWhenEmpty?: boolean;
  declareTarget?: boolean;
  declareTargetForce?: boolean;
  sourceManagement?: string;
  sourceManagementCa?: string;
  maxDuration?: string;
  maxRate?: string;
  dryRun?: boolean;
  progressInterval?: string;
  quiet?: boolean;
}

export interface MigrateSettings {
  /** One route per source queue, each with its target queue and dedup scope. */
  routes: BridgeSettings[];
  jobName: string;
  /** How long the job lock outlives a crashed run. */
  jobLockLeaseMs: number;
  parallel: number;
  idleTimeoutMs: number;
  maxMessages: number | undefined;
  maxDurationMs: number | undefined;
  maxRate: number | undefined;
  dryRun: boolean;
  deleteSourceWhenEmpty: boolean;
  declareTarget: boolean;
  /** Copy also the arguments that make the target queue discard messages (x-max-length, …). */
  declareTargetForce: boolean;
  sourceManagementUrl: string | undefined;
  sourceManagementCa: string | undefined;
  reportPath: string | undefined;
  progressIntervalMs: number;
  quiet: boolean;
}

export const MIGRATE_DEFAULTS = {
  parallel: 4,
  progressInterval: '10s',
  jobLockLease: '30s',
};

const queueName = z.string().min(1, 'must not be empty');
const jobFileSchema = z
  .object({
    // A URL, or { file: <path> } / { env: <VARIABLE> } that holds it (checked like the flags).
    source: urlOrReference(sourceUrlsText, 'later').optional(),
    // A rabbitmq-stream:// URL too: then --target-stream names the stream.
    target: urlOrReference(targetUrlsText, 'later').optional(),
    redis: urlOrReference(redisUrl, 'later').optional(),
    queues: z
      .array(
        z.union([queueName, z.object({ source: queueName, target: queueName.optional() }).strict()], {
          error: 'each queue is a name, or { source: name, target: name }',
        }),
      )
      .min(1, 'list at least one queue'),
  })
  .strict();

type JobFile = z.infer<typeof jobFileSchema>;

function readJobFile(path: string): JobFile {
  let text: string;
  try {
    text = readFileSync(path, 'utf8');
  } catch (error) {
    const code = (error as NodeJS.ErrnoException).code ?? 'unreadable';
    throw new ConfigError(`--job-file: cannot read "${path}" (${code})`);
  }
  let data: unknown;
  try {
    data = parseYaml(text);
  } catch (error) {
    throw new ConfigError(
      `--job-file: "${path}" is not valid YAML: ${(error as Error).message.split('\n')[0]}`,
    );
  }
  const parsed = jobFileSchema.safeParse(data);
  if (!parsed.success) {
    const issue = parsed.error.issues[0];
    const where = (issue?.path ?? [])
      .map((part) => (typeof part === 'number' ? `[${part}]` : `.${String(part)}`))
      .join('')
      .replace(/^\./, '');
    const message =
      issue?.code === 'unrecognized_keys' ? `unknown key(s) ${issue.keys.join(', ')}` : issue?.message;
    throw new ConfigError(`--job-file ${path}: ${where || 'top level'}: ${message}`);
  }
  return parsed.data;
}

/**
 * A migrate to a stream (rabbitmq-stream://) moves one source queue into the stream that
 * --target-stream names: several queues into one stream would share its producer and dedup
 * scope, and --map or a job file's target would name queues, not streams.
 */
function checkStreamJob(queues: string[], raw: MigrateRawOptions, file: JobFile | undefined): void {
  if (queues.length !== 1) {
    throw new ConfigError(
      `--source-queue: with a stream target (rabbitmq-stream://) a migrate moves exactly one source queue, into the stream --target-stream names; ${queues.length} are listed: run one migrate per queue`,
    );
  }
  if (raw.map !== undefined && raw.map.length > 0) {
    throw new ConfigError(
      '--map: does not go with a stream target (rabbitmq-stream://); --target-stream names the stream',
    );
  }
  const index = file?.queues.findIndex((item) => typeof item !== 'string' && item.target !== undefined);
  if (index !== undefined && index >= 0) {
    throw new ConfigError(
      `--job-file ${raw.jobFile}: queues[${index}].target: does not go with a stream target (rabbitmq-stream://); --target-stream names the stream`,
    );
  }
}

function wholeNumber(text: string, flag: string, min: number): number {
  if (!/^\d+$/.test(text) || Number(text) < min) {
    throw new ConfigError(`${flag}: "${text}" must be a whole number of at least ${min}`);
  }
  return Number(text);
}

/** Validates migrate's options: flags over the job file, one route per source queue. */
export function resolveMigrateSettings(raw: MigrateRawOptions): MigrateSettings {
  // One list of queues: a job file's, or the flags'. Mixed, a stray DEDUP_BRIDGE_SOURCE_QUEUE in
  // a scheduled job's environment would silently add a queue to every run.
  if (raw.jobFile !== undefined && raw.sourceQueue !== undefined && raw.sourceQueue.length > 0) {
    throw new ConfigError(
      `--source-queue: does not go with --job-file, which lists the queues; list them all in ${raw.jobFile}, or give them all as --source-queue`,
    );
  }
  const file = raw.jobFile ? readJobFile(raw.jobFile) : undefined;
  const mapped = new Map<string, string>();
  const queues: string[] = [];
  for (const item of file?.queues ?? []) {
    const source = typeof item === 'string' ? item : item.source;
    queues.push(source);
    if (typeof item !== 'string' && item.target) mapped.set(source, item.target);
  }
  for (const queue of raw.sourceQueue ?? []) queues.push(queue);
  // A stream source is one route: its stream, read over the stream protocol.
  const sourceUrl = raw.source ?? file?.source;
  const streamSource = sourceUrl?.split(',').some((url) => isStreamUrl(url.trim())) === true;
  if (streamSource) {
    if (raw.dryRun) {
      throw new ConfigError(
        '--dry-run: reads a source queue and returns what it read; it does not go with a stream source',
      );
    }
    if (raw.deleteSourceWhenEmpty) {
      throw new ConfigError(
        '--delete-source-when-empty: a stream is read, not emptied; it does not go with a stream source',
      );
    }
    if (raw.sourceManagement) {
      throw new ConfigError(
        "--source-management: reads a source queue's settings; it does not go with a stream source",
      );
    }
    if (queues.length > 0 || raw.sourceStream === undefined) {
      return refuseStreamSourceJob(queues, file);
    }
    queues.push(raw.sourceStream);
  }
  for (const pair of raw.map ?? []) {
    const match = /^([^=]+)=([^=]+)$/.exec(pair);
    if (!match) throw new ConfigError(`--map: "${pair}" is not source=target`);
    mapped.set(match[1] as string, match[2] as string);
  }
  if (queues.length === 0) {
    throw new ConfigError(
      '--source-queue (or DEDUP_BRIDGE_SOURCE_QUEUE): is required; repeat it for several queues, or list them in --job-file',
    );
  }
  const seen = new Set<string>();
  for (const queue of queues) {
    if (seen.has(queue)) throw new ConfigError(`--source-queue: "${queue}" is listed twice`);
    seen.add(queue);
  }
  for (const source of mapped.keys()) {
    if (!seen.has(source)) throw new ConfigError(`--map: "${source}" is not one of the source queues`);
  }
  const target = raw.target ?? file?.target;
  const stream = target?.split(',').some((url) => isStreamUrl(url.trim())) === true;
  if (stream) checkStreamJob(queues, raw, file);
  if (queues.length > 1 && raw.targetQueue !== undefined) {
    throw new ConfigError(
      '--target-queue: names the target of a single source queue; with several, each goes to the queue of its own name, or use --map source=target',
    );
  }

  const base: RawOptions = {
    ...raw,
    source: raw.source ?? file?.source,
    target,
    redis: raw.redis ?? file?.redis,
    sourceQueue: undefined,
  };
  const routes = queues.map((queue) =>
    resolveBridgeSettings(
      {
        ...base,
        sourceQueue: streamSource ? undefined : queue,
        // A stream target takes no queue: one given is refused by resolveBridgeSettings, naming it.
        targetQueue:
          raw.targetExchange !== undefined || stream
            ? raw.targetQueue
            : (raw.targetQueue ?? mapped.get(queue) ?? queue),
      },
      'migrate',
    ),
  );
  const targets = new Set<string>();
  for (const route of routes) {
    if (route.targetQueue !== undefined && targets.has(route.targetQueue)) {
      throw new ConfigError(
        `--map: two source queues go to target queue "${route.targetQueue}"; give each its own`,
      );
    }
    if (route.targetQueue !== undefined) targets.add(route.targetQueue);
  }
  if (raw.declareTarget && raw.targetExchange !== undefined) {
    throw new ConfigError('--declare-target: declares target queues; it does not go with --target-exchange');
  }
  if (raw.declareTargetForce && !raw.declareTarget) {
    throw new ConfigError('--declare-target-force: goes with --declare-target; give both, or neither');
  }
  // A stream is created with no arguments unless the source queue, read there, is itself a stream.
  if (raw.declareTarget && !raw.sourceManagement && !stream) {
    if (streamSource) {
      throw new ConfigError(
        '--declare-target: for a stream source it creates a target stream; declare the target queue yourself',
      );
    }
    throw new ConfigError(
      '--declare-target: needs --source-management <url> (the source broker management API, e.g. http://user:password@host:15672)',
    );
  }
  if (raw.sourceManagement) checkManagementUrl(raw.sourceManagement);

  const first = routes[0] as BridgeSettings;
  return {
    routes,
    jobName: raw.jobName ?? defaultJobName(first, routes),
    jobLockLeaseMs: parseTimerDuration(raw.jobLockLease ?? MIGRATE_DEFAULTS.jobLockLease, '--job-lock-lease'),
    parallel:
      raw.parallel === undefined ? MIGRATE_DEFAULTS.parallel : wholeNumber(raw.parallel, '--parallel', 1),
    idleTimeoutMs: parseTimerDuration(raw.idleTimeout ?? DEFAULTS.idleTimeout, '--idle-timeout'),
    maxMessages:
      raw.maxMessages === undefined ? undefined : wholeNumber(raw.maxMessages, '--max-messages', 1),
    maxDurationMs:
      raw.maxDuration === undefined ? undefined : parseTimerDuration(raw.maxDuration, '--max-duration'),
    maxRate: raw.maxRate === undefined ? undefined : wholeNumber(raw.maxRate, '--max-rate', 1),
    dryRun: raw.dryRun === true,
    deleteSourceWhenEmpty: raw.deleteSourceWhenEmpty === true,
    declareTarget: raw.declareTarget === true,
    declareTargetForce: raw.declareTargetForce === true,
    sourceManagementUrl: raw.sourceManagement,
    sourceManagementCa: checkManagementCa(raw.sourceManagement, raw.sourceManagementCa),
    reportPath: raw.report,
    progressIntervalMs: parseTimerDuration(
      raw.progressInterval ?? MIGRATE_DEFAULTS.progressInterval,
      '--progress-interval',
    ),
    quiet: raw.quiet === true,
  };
}

/** Validates --source-management (run and migrate): an http(s) URL. */
export function checkManagementUrl(value: string): string {
  let url: URL | undefined;
  try {
    url = new URL(value);
  } catch {
    url = undefined;
  }
  if (!url || !['http:', 'https:'].includes(url.protocol)) {
    throw new ConfigError(
      '--source-management: must be an http(s) URL, e.g. http://user:password@host:15672',
    );
  }
  if (!decodable(url.username, url.password)) {
    throw new ConfigError(
      '--source-management: the user or password has a % that is not percent-encoding; write a literal % as %25',
    );
  }
  return value;
}

/**
 * Validates --source-management-ca (or a config file's managementCa, named by `names`): it goes
 * with an https:// management URL, and is a readable PEM certificate.
 */
export function checkManagementCa(
  url: string | undefined,
  ca: string | undefined,
  names = { ca: '--source-management-ca', url: '--source-management' },
): string | undefined {
  if (ca === undefined) return undefined;
  if (url === undefined) throw new ConfigError(`${names.ca}: goes with ${names.url} (an https:// URL)`);
  const protocol = new URL(url).protocol;
  if (protocol !== 'https:') {
    throw new ConfigError(
      `${names.ca}: needs ${names.url} to be https://, not ${protocol}//; a CA is for a management API served over TLS`,
    );
  }
  readCaFile(names.ca, ca);
  return ca;
}

/** A job is its brokers and routes: the same migration started again gets the same name (and lock). */
function defaultJobName(first: BridgeSettings, routes: BridgeSettings[]): string {
  const where = (url: string) => {
    const parsed = new URL(url);
    return `${parsed.hostname}:${parsed.port}${parsed.pathname}`;
  };
  const description = JSON.stringify({
    source: where(first.sourceUrl),
    target: where(first.targetUrl),
    routes: routes.map((route) => `${route.sourceQueue}>${route.scope}`).sort(),
  });
  return `migrate-${createHash('sha256').update(description).digest('hex').slice(0, 12)}`;
}

/** A stream source names its one stream with --source-stream: a queue list is not for it. */
function refuseStreamSourceJob(queues: readonly string[], file: unknown): never {
  if (file !== undefined) {
    throw new ConfigError(
      '--job-file: lists source queues; a stream source is read with --source-stream <name>',
    );
  }
  if (queues.length > 0) {
    throw new ConfigError(
      '--source-queue: does not go with a stream source (rabbitmq-stream://); --source-stream names the stream to read',
    );
  }
  throw new ConfigError(
    '--source-stream (or DEDUP_BRIDGE_SOURCE_STREAM): a stream source (rabbitmq-stream://) needs the stream to read',
  );
}
