import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { fileURLToPath } from 'node:url';
import amqp, { type ChannelModel, type ConfirmChannel, type GetMessage, type Options } from 'amqplib';
import { expect, inject } from 'vitest';
import { connectAmqp, vhostOf } from '../src/amqp/connect.js';
import { clusterNameOf } from '../src/amqp/internals.js';
import { routeToken } from '../src/bridge/route-mark.js';
import { parseDuration } from '../src/config/duration.js';
import { DEFAULTS } from '../src/config/settings.js';
import { sliceLengthFor } from '../src/dedup/cache.js';
import { closeRedis, connectRedis } from '../src/dedup/redis.js';
import { createLogger } from '../src/observe/log.js';
import { contentHeaderOf } from '../src/wire/properties.js';
import { field, longString } from './wire.js';

export const CLI = fileURLToPath(new URL('../bin/dedup-bridge.js', import.meta.url));

export function servers() {
  return inject('harness');
}

/** A random name per test, so tests never see each other's queues or dedup scopes. */
export function uniqueName(prefix: string): string {
  return `t-${prefix}-${randomBytes(4).toString('hex')}`;
}

export interface Broker {
  connection: ChannelModel;
  channel: ConfirmChannel;
  close(): Promise<void>;
}

export async function openBroker(url: string): Promise<Broker> {
  const connection = await amqp.connect(url);
  connection.on('error', () => {});
  const channel = await connection.createConfirmChannel();
  channel.on('error', () => {});
  return {
    connection,
    channel,
    close: async () => {
      await connection.close().catch(() => {});
    },
  };
}

export async function declareQueue(
  url: string,
  queue: string,
  options: Options.AssertQueue = {},
): Promise<void> {
  const broker = await openBroker(url);
  try {
    await broker.channel.assertQueue(queue, { durable: true, ...options });
  } finally {
    await broker.close();
  }
}

/** A fresh source queue and target queue on the harness's brokers. */
export async function queuePair(): Promise<{
  sourceUrl: string;
  targetUrl: string;
  source: string;
  target: string;
}> {
  const { sourceUrl, targetUrl } = servers();
  const source = uniqueName('src');
  const target = uniqueName('dst');
  await declareQueue(sourceUrl, source);
  await declareQueue(targetUrl, target);
  return { sourceUrl, targetUrl, source, target };
}

export interface OutgoingMessage {
  body: Buffer | string;
  options?: Options.Publish;
  exchange?: string;
  routingKey?: string;
}

/** Publishes with confirms to a queue (through the default exchange) or to an exchange. */
export async function publishAll(url: string, queue: string, messages: OutgoingMessage[]): Promise<void> {
  const broker = await openBroker(url);
  try {
    for (const [index, message] of messages.entries()) {
      const body = Buffer.isBuffer(message.body) ? message.body : Buffer.from(message.body);
      const ok = broker.channel.publish(message.exchange ?? '', message.routingKey ?? queue, body, {
        persistent: true,
        ...message.options,
      });
      if (!ok || index % 500 === 499) await broker.channel.waitForConfirms();
    }
    await broker.channel.waitForConfirms();
  } finally {
    await broker.close();
  }
}

/** A message per ID, with the ID in the dedup header (`_HQ_DUPL_ID`) and as its body. */
export function withIds(ids: readonly string[]): OutgoingMessage[] {
  return ids.map((id) => ({ body: id, options: { headers: { _HQ_DUPL_ID: id } } }));
}

/** `count` messages with IDs `<prefix>-<n>` (n from `from` on), as `withIds` makes them. */
export function numbered(
  prefix: string,
  count: number,
  from = 0,
): { ids: string[]; messages: OutgoingMessage[] } {
  const ids = Array.from({ length: count }, (_, i) => `${prefix}-${from + i}`);
  return { ids, messages: withIds(ids) };
}

/** Takes every message from a queue (basic.get until empty) and acks them. */
export async function takeAll(url: string, queue: string): Promise<GetMessage[]> {
  const broker = await openBroker(url);
  const out: GetMessage[] = [];
  try {
    for (;;) {
      const message = await broker.channel.get(queue, { noAck: true });
      if (message === false) break;
      out.push(message);
    }
  } finally {
    await broker.close();
  }
  return out;
}

/**
 * Takes every message from a queue with its content header exactly as the broker delivered it
 * (read through the bridge's own connection, which keeps the raw header), and its dedup header as
 * text.
 */
export async function takeRaw(
  url: string,
  queue: string,
): Promise<{ id: string; header: Buffer; body: Buffer }[]> {
  const connection = await connectAmqp(url, {
    side: 'target',
    retryForMs: 5000,
    log: createLogger('silent'),
  });
  const out: { id: string; header: Buffer; body: Buffer }[] = [];
  try {
    const channel = await connection.createChannel();
    for (;;) {
      const message = await channel.get(queue, { noAck: true });
      if (message === false) break;
      out.push({
        id: String(message.properties.headers?._HQ_DUPL_ID),
        header: Buffer.from(contentHeaderOf(message.properties).bytes),
        body: message.content,
      });
    }
  } finally {
    await connection.close();
  }
  return out;
}

export async function depthOf(url: string, queue: string): Promise<number> {
  const broker = await openBroker(url);
  try {
    return (await broker.channel.checkQueue(queue)).messageCount;
  } finally {
    await broker.close();
  }
}

export interface CliResult {
  code: number | null;
  stdout: string;
  stderr: string;
}

/** Runs the built CLI as a user would; `env` adds to (or with undefined removes from) the environment. */
export function runCli(
  args: string[],
  options: { env?: Record<string, string | undefined>; timeoutMs?: number } = {},
): Promise<CliResult> {
  const env: NodeJS.ProcessEnv = { ...process.env };
  for (const name of Object.keys(env)) if (name.startsWith('DEDUP_BRIDGE_')) delete env[name];
  for (const [name, value] of Object.entries(options.env ?? {})) {
    if (value === undefined) delete env[name];
    else env[name] = value;
  }
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [CLI, ...args], { env, stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (chunk: Buffer) => {
      stdout += chunk.toString();
    });
    child.stderr.on('data', (chunk: Buffer) => {
      stderr += chunk.toString();
    });
    const timer = setTimeout(() => child.kill('SIGKILL'), options.timeoutMs ?? 90_000);
    child.on('error', reject);
    child.on('close', (code) => {
      clearTimeout(timer);
      resolve({ code, stdout, stderr });
    });
  });
}

export interface DeliveryCount {
  expected: number;
  received: number;
  lost: number;
  duplicated: number;
  unexpected: number;
}

/** Counts lost, duplicated and unexpected messages by ID, and prints the figures. */
export function countDelivery(
  label: string,
  expectedIds: Iterable<string>,
  receivedIds: string[],
): DeliveryCount {
  const expected = new Set(expectedIds);
  const seen = new Map<string, number>();
  for (const id of receivedIds) seen.set(id, (seen.get(id) ?? 0) + 1);
  let lost = 0;
  for (const id of expected) if (!seen.has(id)) lost++;
  let duplicated = 0;
  let unexpected = 0;
  for (const [id, times] of seen) {
    if (!expected.has(id)) unexpected += times;
    else duplicated += times - 1;
  }
  const count = { expected: expected.size, received: receivedIds.length, lost, duplicated, unexpected };
  process.stdout.write(
    `delivery ${label}: expected ${count.expected} · received ${count.received} · lost ${lost} · duplicated ${duplicated} · unexpected ${unexpected}\n`,
  );
  return count;
}

/** The text form of a header value, for comparing IDs (Buffers by their bytes). */
export function idText(value: unknown): string {
  if (Buffer.isBuffer(value)) return `bytes:${value.toString('hex')}`;
  return String(value);
}

/** The dedup header (`_HQ_DUPL_ID`) of each message, as text (`idText`). */
export function idsOf(messages: readonly { properties: { headers?: Record<string, unknown> } }[]): string[] {
  return messages.map((message) => idText(message.properties.headers?._HQ_DUPL_ID));
}

/** Takes every message from a queue and counts it against `expected` by its dedup header. */
export async function delivered(
  label: string,
  url: string,
  queue: string,
  expected: Iterable<string>,
): Promise<{ messages: GetMessage[]; count: DeliveryCount }> {
  const messages = await takeAll(url, queue);
  return { messages, count: countDelivery(label, expected, idsOf(messages)) };
}

/** `dedup-bridge migrate` between the harness's brokers, with a short idle timeout. */
export function migrateArgs(sourceQueue: string, target: string[], ...extra: string[]): string[] {
  const { sourceUrl, targetUrl, redisUrl } = servers();
  return [
    'migrate',
    '--source',
    sourceUrl,
    '--source-queue',
    sourceQueue,
    '--target',
    targetUrl,
    ...target,
    '--redis',
    redisUrl,
    '--idle-timeout',
    '300ms',
    ...extra,
  ];
}

/** The `--report` JSON of a migrate run, written to a temp file. */
export async function migrateWithReport(
  args: string[],
): Promise<CliResult & { report: Record<string, unknown> | undefined }> {
  const { mkdtempSync, readFileSync, existsSync } = await import('node:fs');
  const { join } = await import('node:path');
  const { tmpdir } = await import('node:os');
  const path = join(mkdtempSync(join(tmpdir(), 'dedup-report-')), 'report.json');
  const result = await runCli([...args, '--report', path]);
  const report = existsSync(path)
    ? (JSON.parse(readFileSync(path, 'utf8')) as Record<string, unknown>)
    : undefined;
  return { ...result, report };
}

/** The lines of a command's output, without the empty one after the last newline. */
export function lines(text: string): string[] {
  return text.split('\n').filter((line) => line.length > 0);
}

/** Fails if the output holds any piece of any of these secrets (a password cut in two shows). */
export function expectNoSecret(output: string, secrets: readonly { pieces: readonly string[] }[]): void {
  for (const secret of secrets) {
    for (const piece of secret.pieces) expect(output, `"${piece}" printed`).not.toContain(piece);
  }
}

/** What `fn` throws; fails if it returns. */
export function catchError(fn: () => unknown): unknown {
  try {
    fn();
  } catch (error) {
    return error;
  }
  throw new Error('expected the function to throw');
}

export interface RunningCli {
  pid: number;
  /** Resolves with the exit code and output once the process ends. */
  done: Promise<CliResult>;
  signal(name: NodeJS.Signals): void;
  output(): string;
}

/** Starts the CLI in the background (e.g. `run`), for tests that signal or kill it; `env` adds variables. */
export function startCli(args: string[], env: Record<string, string> = {}): RunningCli {
  const child = spawn(process.execPath, [CLI, ...args], {
    stdio: ['ignore', 'pipe', 'pipe'],
    env: { ...process.env, ...env },
  });
  let stdout = '';
  let stderr = '';
  child.stdout.on('data', (chunk: Buffer) => {
    stdout += chunk.toString();
  });
  child.stderr.on('data', (chunk: Buffer) => {
    stderr += chunk.toString();
  });
  const done = new Promise<CliResult>((resolve) => {
    child.on('close', (code, signal) => resolve({ code: code ?? (signal ? -1 : null), stdout, stderr }));
  });
  return {
    pid: child.pid ?? 0,
    done,
    signal: (name) => child.kill(name),
    output: () => stdout + stderr,
  };
}

/** Polls until `check` is true or the time is up; returns the last value of `check`. */
export async function waitFor(
  check: () => Promise<boolean> | boolean,
  timeoutMs = 30_000,
  intervalMs = 100,
): Promise<boolean> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    if (await check()) return true;
    if (Date.now() > deadline) return false;
    await new Promise((resolve) => setTimeout(resolve, intervalMs));
  }
}

/** The slices of a scope first written with the default --dedup-window (7d): 42 h each. */
export const DEFAULT_SLICE_MS = sliceLengthFor(parseDuration(DEFAULTS.dedupWindow, '--dedup-window'));

/**
 * For a test that runs the CLI, whose cache goes by the Redis server's clock, and asserts on the
 * slices of what it commits (how many, how long they live): when less than `marginMs` is left of
 * the current slice on that clock, waits until the next one begins. What the test commits within
 * `marginMs` from now then lands in one slice and lives at least the whole window, wherever the
 * wall clock was when the test started. With the defaults it waits in 1 run out of 2,520, at
 * most a minute.
 */
export async function clearOfSliceEnd(
  redisUrl: string,
  marginMs = 60_000,
  sliceMs = DEFAULT_SLICE_MS,
): Promise<void> {
  const redis = await connectRedis(redisUrl, 10_000, createLogger('silent'));
  try {
    const [seconds, micros] = (await redis.time()) as [number | string, number | string];
    const now = Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
    const left = sliceMs - (now % sliceMs);
    if (left < marginMs) await new Promise((resolve) => setTimeout(resolve, left + 100));
  } finally {
    closeRedis(redis);
  }
}

/** `dedup-bridge run` between the harness's brokers. */
/** The same command line with one option's value replaced (a proxy's URL, a closed port…). */
export function withOption(args: readonly string[], flag: string, value: string): string[] {
  const at = args.indexOf(flag);
  if (at < 0) throw new Error(`no ${flag} in the command line`);
  return [...args.slice(0, at + 1), value, ...args.slice(at + 2)];
}

export function runArgs(sourceQueue: string, target: string[], ...extra: string[]): string[] {
  return [
    'run',
    ...migrateArgs(sourceQueue, target, ...extra)
      .slice(1)
      .filter((_, i, all) => {
        // migrate's --idle-timeout does not exist for run
        return !(all[i] === '--idle-timeout' || all[i - 1] === '--idle-timeout');
      }),
  ];
}

/** The metrics server's address from its log line (`--metrics-port 0` picks a free port). */
export async function metricsUrl(bridge: RunningCli): Promise<string> {
  const found = await waitFor(() => /"msg":"serving metrics"/.test(bridge.output()), 30_000);
  expect(found, bridge.output()).toBe(true);
  const line = bridge
    .output()
    .split('\n')
    .find((text) => text.includes('"msg":"serving metrics"')) as string;
  const url = (JSON.parse(line) as { url: string }).url;
  return url.replace('0.0.0.0', '127.0.0.1');
}

/** The value of one series in a Prometheus text scrape, or undefined when it is absent. */
export function sample(text: string, name: string, labels: Record<string, string>): number | undefined {
  const wanted = Object.entries(labels).map(([key, value]) => `${key}="${value}"`);
  for (const line of text.split('\n')) {
    const match = /^([a-z_]+)\{([^}]*)\} (\S+)$/.exec(line);
    if (!match || match[1] !== name) continue;
    const have = (match[2] as string).split(',');
    if (wanted.every((pair) => have.includes(pair)) && have.length === wanted.length) return Number(match[3]);
  }
  return undefined;
}

/** The name a route from this source queue goes by in its `x-dedup-route` mark: `<cluster>/<vhost>/<queue>`. */
export async function routeNameOf(sourceUrl: string, queue: string): Promise<string> {
  const connection = await connectAmqp(sourceUrl, {
    side: 'source',
    retryForMs: 5000,
    log: createLogger('silent'),
  });
  try {
    return `${clusterNameOf(connection)}/${vhostOf(sourceUrl)}/${queue}`;
  } finally {
    await connection.close();
  }
}

/** The `x-dedup-route` field a route from this source queue appends to a message that had none. */
export async function routeMarkOf(sourceUrl: string, queue: string): Promise<Buffer> {
  return field('x-dedup-route', longString(routeToken(await routeNameOf(sourceUrl, queue))));
}
