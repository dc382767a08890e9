import { rmSync } from 'node:fs';
import amqp, { type Channel, type ChannelModel } from 'amqplib';
import { Redis } from 'ioredis';
import type { RouteCounters } from '../../src/bridge/counters.js';
import { createIdempotentConsumer } from '../../src/client/consumer.js';
import { FaultProxy } from '../harness/proxy.js';
import { cleanLeftovers, haveLocalServers, newRunDir, RabbitNode, RedisServer } from '../harness/servers.js';
import { CLI, type RunningCli, startCli } from '../helpers.js';

/** Full run (`npm run chaos`) or the short one inside `npm test`. */
export const FULL = process.env.CHAOS_FULL === '1';

export const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
export const randomBetween = (low: number, high: number) => low + Math.floor(Math.random() * (high - low));

/**
 * The link to the target carries at most this many bytes a second (each way, all connections
 * together): about 500 of the suite's messages a second. A fault must land inside the transfer,
 * and an unpaced transfer of thousands of messages over loopback can end before a broker has
 * finished stopping; a slow line sets the pace whatever else the CPU is doing (a busier CPU only
 * slows it further). The bridge and Shovel both publish through it.
 */
export const TARGET_LINK_BYTES_PER_S = 250_000;

/**
 * Servers the chaos suite owns, so it may stop, kill and restart them: a source node (with the
 * Shovel plugin, for the comparison), a target node, a Redis with AOF and one without, and a
 * fault proxy in front of each; the one in front of the target is a slow line (above).
 */
export class ChaosWorld {
  readonly source: RabbitNode;
  readonly target: RabbitNode;
  readonly redisAof: RedisServer;
  readonly redisVolatile: RedisServer;
  proxies!: { source: FaultProxy; target: FaultProxy; redis: FaultProxy; redisVolatile: FaultProxy };

  private constructor(readonly runDir: string) {
    this.source = new RabbitNode(runDir, 'chaos-source', { plugins: ['rabbitmq_shovel'] });
    this.target = new RabbitNode(runDir, 'chaos-target');
    this.redisAof = new RedisServer(runDir, 'chaos-redis-aof', true);
    this.redisVolatile = new RedisServer(runDir, 'chaos-redis', false);
  }

  static async create(): Promise<ChaosWorld> {
    if (!haveLocalServers()) {
      throw new Error('chaos: needs rabbitmq-server and redis-server installed, to stop and restart them');
    }
    cleanLeftovers();
    const world = new ChaosWorld(newRunDir());
    await Promise.all([
      world.source.start(),
      world.target.start(),
      world.redisAof.start(),
      world.redisVolatile.start(),
    ]);
    world.proxies = {
      source: FaultProxy.forUrl(world.source.url),
      target: FaultProxy.forUrl(world.target.url),
      redis: FaultProxy.forUrl(world.redisAof.url),
      redisVolatile: FaultProxy.forUrl(world.redisVolatile.url),
    };
    await Promise.all(Object.values(world.proxies).map((proxy) => proxy.start()));
    world.proxies.target.setRate(TARGET_LINK_BYTES_PER_S);
    return world;
  }

  /** Bridge URLs, through the proxies; short AMQP heartbeats so a partition is noticed in seconds. */
  bridgeUrls(volatileRedis = false) {
    const heartbeat = (url: string) => `${url.replace(/\/$/, '')}/?heartbeat=2`;
    return {
      source: heartbeat(this.proxies.source.urlFor(this.source.url)),
      target: heartbeat(this.proxies.target.urlFor(this.target.url)),
      redis: volatileRedis
        ? this.proxies.redisVolatile.urlFor(this.redisVolatile.url)
        : this.proxies.redis.urlFor(this.redisAof.url),
    };
  }

  /** Sets the slow line's rate for one scenario; `undefined` puts back TARGET_LINK_BYTES_PER_S. */
  paceTarget(bytesPerSecond = TARGET_LINK_BYTES_PER_S): void {
    this.proxies.target.setRate(bytesPerSecond);
  }

  /** The target node's URL through the slow line, for Shovel's dest-uri. */
  pacedTargetUrl(): string {
    return this.proxies.target.urlFor(this.target.url);
  }

  /**
   * Cheap reads of the source's ready count and the target's depth (see DepthProbe), for the
   * waits that poll while a transfer runs: `rabbitmqctl` starts an Erlang VM for each call.
   */
  readonly probes = {
    source: new DepthProbe(() => this.source.url),
    target: new DepthProbe(() => this.target.url),
  };

  /** Killed, not stopped: they are thrown away, and a graceful stop of a node takes seconds. */
  async stop(): Promise<void> {
    await Promise.allSettled([this.probes.source.close(), this.probes.target.close()]);
    await Promise.allSettled(Object.values(this.proxies ?? {}).map((proxy) => proxy.stop()));
    await Promise.allSettled([
      this.source.stop(true),
      this.target.stop(true),
      this.redisAof.stop(true),
      this.redisVolatile.stop(true),
    ]);
    rmSync(this.runDir, { recursive: true, force: true });
  }
}

export async function declare(url: string, queue: string): Promise<void> {
  const connection = await amqp.connect(url);
  const channel = await connection.createChannel();
  await channel.assertQueue(queue, { durable: true });
  await connection.close();
}

/** Publishes `count` persistent messages with IDs `<prefix>-<i>` straight to the source node. */
export async function publishWorkload(
  url: string,
  queue: string,
  prefix: string,
  count: number,
): Promise<string[]> {
  const connection = await amqp.connect(url);
  const channel = await connection.createConfirmChannel();
  const ids: string[] = [];
  const body = Buffer.alloc(256, 'x');
  for (let i = 0; i < count; i++) {
    const id = `${prefix}-${i}`;
    ids.push(id);
    if (!channel.sendToQueue(queue, body, { persistent: true, headers: { _HQ_DUPL_ID: id } })) {
      await channel.waitForConfirms();
    }
    if (i % 1000 === 999) await channel.waitForConfirms();
  }
  await channel.waitForConfirms();
  await connection.close();
  return ids;
}

/** Ready + unacked messages of a queue, from the node itself; -1 while the node is down. */
export async function totalMessages(node: RabbitNode, queue: string): Promise<number> {
  try {
    const out = await node.ctl('list_queues', '-q', '--no-table-headers', 'name', 'messages');
    for (const line of out.split('\n')) {
      const [name, count] = line.trim().split(/\s+/);
      if (name === queue) return Number(count);
    }
    return 0;
  } catch {
    return -1;
  }
}

export interface Copy {
  id: string;
  inDoubt: boolean;
}

/**
 * Takes every message from a queue, in the queue's order: its `_HQ_DUPL_ID` and whether it was
 * flagged in-doubt. What the queue holds when called comes through one consumer (a round trip per
 * message, as basic.get takes, is a second or more for a scenario's thousands); then basic.get
 * until the queue is empty takes whatever came after.
 */
export async function drainTarget(url: string, queue: string): Promise<Copy[]> {
  const connection = await amqp.connect(url);
  const channel = await connection.createChannel();
  const copies: Copy[] = [];
  const take = (message: { properties: { headers?: Record<string, unknown> } }) => {
    const headers = message.properties.headers ?? {};
    copies.push({ id: String(headers._HQ_DUPL_ID), inDoubt: headers['x-dedup-in-doubt'] === true });
  };
  const { messageCount } = await channel.checkQueue(queue);
  if (messageCount > 0) {
    let delivered = () => {};
    const { consumerTag } = await channel.consume(
      queue,
      (message) => {
        if (message) take(message);
        delivered();
      },
      { noAck: true },
    );
    // Until the count is in, or nothing came for a while (a message may expire or be taken).
    for (let got = -1; copies.length < messageCount && copies.length > got; ) {
      got = copies.length;
      await new Promise<void>((resolve) => {
        const quiet = setTimeout(resolve, 2000);
        delivered = () => {
          if (copies.length >= messageCount) {
            clearTimeout(quiet);
            resolve();
          }
        };
      });
    }
    await channel.cancel(consumerTag);
  }
  for (;;) {
    const message = await channel.get(queue, { noAck: true });
    if (message === false) break;
    take(message);
  }
  await connection.close();
  return copies;
}

export interface ScenarioResult {
  scenario: string;
  system: 'dedup-bridge' | 'Shovel';
  sent: number;
  received: number;
  lost: number;
  /** Extra copies on the target, flagged or not. */
  duplicates: number;
  /** Extra copies that carried `x-dedup-in-doubt: true`. */
  flagged: number;
  /** Extra copies without the flag. */
  unflagged: number;
  unexpected: number;
  faults: number;
  /** Where each fault landed: the percentage of the messages on the target when it started. */
  landed: number[];
  seconds: number;
  /**
   * Extra handler calls when an idempotent consumer read the target: the application's view. That
   * consumer dedups whatever the bridge did, so this is reported, never evidence about the bridge.
   */
  afterConsumer: number | undefined;
  note: string;
}

export function score(
  scenario: string,
  system: ScenarioResult['system'],
  ids: string[],
  copies: Copy[],
  faults: number,
  started: number,
  note = '',
): ScenarioResult {
  const expected = new Set(ids);
  const byId = new Map<string, { total: number; flagged: number }>();
  let unexpected = 0;
  for (const copy of copies) {
    if (!expected.has(copy.id)) {
      unexpected++;
      continue;
    }
    const seen = byId.get(copy.id) ?? { total: 0, flagged: 0 };
    seen.total++;
    if (copy.inDoubt) seen.flagged++;
    byId.set(copy.id, seen);
  }
  let duplicates = 0;
  let unflagged = 0;
  for (const seen of byId.values()) {
    duplicates += seen.total - 1;
    // One unflagged copy is the original; any other unflagged copy is an unflagged duplicate.
    unflagged += Math.max(0, seen.total - seen.flagged - 1);
  }
  return {
    scenario,
    system,
    sent: ids.length,
    received: copies.length,
    lost: ids.length - byId.size,
    duplicates,
    flagged: duplicates - unflagged,
    unflagged,
    unexpected,
    faults,
    landed: [],
    seconds: Math.round((Date.now() - started) / 100) / 10,
    afterConsumer: undefined,
    note,
  };
}

/**
 * Puts the copies that reached the target into a fresh queue and reads them with the library's
 * idempotent consumer; returns how many times its handler saw an ID more than once.
 */
export async function duplicatesAfterConsumer(world: ChaosWorld, copies: Copy[]): Promise<number> {
  const queue = `chaos-consumer-${process.pid}-${Date.now()}`;
  const connection = await amqp.connect(world.target.url);
  const channel = await connection.createConfirmChannel();
  await channel.assertQueue(queue, { durable: false, autoDelete: false });
  for (const copy of copies) {
    channel.sendToQueue(queue, Buffer.from(copy.id), {
      headers: { _HQ_DUPL_ID: copy.id, ...(copy.inDoubt ? { 'x-dedup-in-doubt': true } : {}) },
    });
  }
  await channel.waitForConfirms();
  const redis = new Redis(world.redisAof.url);
  const seen = new Map<string, number>();
  const consumerChannel = await connection.createChannel();
  const consumer = await createIdempotentConsumer({
    channel: consumerChannel,
    queue,
    redis,
    scope: queue,
    prefetch: 500,
    handler: (message) => {
      const id = message.content.toString();
      seen.set(id, (seen.get(id) ?? 0) + 1);
    },
  });
  for (let i = 0; i < 1200 && consumer.counts.processed + consumer.counts.duplicates < copies.length; i++) {
    await sleep(100);
  }
  await consumer.stop();
  await channel.deleteQueue(queue);
  await connection.close();
  await redis.quit();
  let extra = 0;
  for (const times of seen.values()) extra += times - 1;
  return extra;
}

export function formatTable(results: ScenarioResult[]): string {
  const head = [
    'scenario',
    'system',
    'sent',
    'lost',
    'dup',
    'flagged',
    'unflagged',
    'unexpected',
    'after consumer',
    'faults',
    'landed at',
    's',
  ];
  const rows = results.map((r) => [
    r.scenario,
    r.system,
    String(r.sent),
    String(r.lost),
    String(r.duplicates),
    String(r.flagged),
    String(r.unflagged),
    String(r.unexpected),
    r.afterConsumer === undefined ? '-' : String(r.afterConsumer),
    String(r.faults),
    formatLanded(r.landed),
    String(r.seconds),
  ]);
  const widths = head.map((h, i) => Math.max(h.length, ...rows.map((row) => (row[i] as string).length)));
  const line = (cells: string[]) => `| ${cells.map((c, i) => c.padEnd(widths[i] as number)).join(' | ')} |`;
  return [line(head), `|${widths.map((w) => '-'.repeat(w + 2)).join('|')}|`, ...rows.map(line)].join('\n');
}

export interface BridgeOptions {
  world: ChaosWorld;
  sourceQueue: string;
  targetQueue: string;
  volatileRedis?: boolean;
  prefetch?: number;
  /** The bridge's own links (see ReplicaLinks) instead of the world's shared proxies. */
  urls?: { source: string; target: string; redis: string };
}

/**
 * A replica's own three links, each through a proxy of its own, so that one replica can be cut
 * off while the others go on. The source link has a short heartbeat, so that its broker hands a
 * stalled replica's messages to the others within seconds; the target link keeps RabbitMQ's
 * default (60 s), so the target connection outlives a stall of seconds, as it does in production.
 */
export class ReplicaLinks {
  readonly source: FaultProxy;
  readonly target: FaultProxy;
  readonly redis: FaultProxy;

  constructor(private readonly world: ChaosWorld) {
    this.source = FaultProxy.forUrl(world.source.url);
    this.target = FaultProxy.forUrl(world.target.url);
    this.redis = FaultProxy.forUrl(world.redisAof.url);
  }

  async start(): Promise<void> {
    await Promise.all([this.source.start(), this.target.start(), this.redis.start()]);
  }

  urls() {
    const heartbeat = (url: string) => `${url.replace(/\/$/, '')}/?heartbeat=2`;
    return {
      source: heartbeat(this.source.urlFor(this.world.source.url)),
      target: this.target.urlFor(this.world.target.url),
      redis: this.redis.urlFor(this.world.redisAof.url),
    };
  }

  /** Blackholes (or lets through again) all three links at once: a partition of this replica. */
  setMode(mode: 'pass' | 'blackhole'): void {
    for (const proxy of [this.source, this.target, this.redis]) proxy.setMode(mode);
  }

  async stop(): Promise<void> {
    await Promise.allSettled([this.source.stop(), this.target.stop(), this.redis.stop()]);
  }
}

/**
 * Copies that came after the first copy of their ID without the in-doubt flag, in the order the
 * target holds them. A consumer may skip nothing unflagged: every copy after an ID's first must be
 * flagged, whichever process sent it (score's `unflagged` counts copies, not their order).
 */
export function lateUnflagged(copies: Copy[]): number {
  const seen = new Set<string>();
  let late = 0;
  for (const copy of copies) {
    if (seen.has(copy.id) && !copy.inDoubt) late++;
    seen.add(copy.id);
  }
  return late;
}

/**
 * What the clients of one proxy sent, with when it reached the proxy: to tell, for a copy on the
 * target, when the process that sent it let it go (a stalled replica's copy that comes second was
 * either written before its stall and held up on the way, or written when it woke).
 */
export class SentBytes {
  private readonly chunks: Buffer[] = [];
  private readonly times: { end: number; at: number }[] = [];
  private length = 0;

  constructor(proxy: FaultProxy) {
    proxy.onClientData = (data) => {
      this.chunks.push(data);
      this.length += data.length;
      this.times.push({ end: this.length, at: Date.now() });
    };
  }

  /** When each message with `_HQ_DUPL_ID` `id` went by (Date.now()), in order; [] if none did. */
  whenSent(id: string): number[] {
    const all = Buffer.concat(this.chunks);
    const needle = Buffer.from(id, 'utf8');
    const found: number[] = [];
    for (let at = all.indexOf(needle); at >= 0; at = all.indexOf(needle, at + 1)) {
      // The ID is a long string in the headers (its length before it): "x-1" is not "x-12".
      if (at < 4 || all.readUInt32BE(at - 4) !== needle.length) continue;
      const end = at + needle.length;
      found.push((this.times.find((chunk) => chunk.end >= end) as { at: number }).at);
    }
    return found;
  }
}

/** `dedup-bridge run` through the proxies, with a short lease so a killed owner's claims run out fast. */
export function startBridgeProcess(options: BridgeOptions): RunningCli {
  const urls = options.urls ?? options.world.bridgeUrls(options.volatileRedis);
  return startCli([
    'run',
    '--source',
    urls.source,
    '--source-queue',
    options.sourceQueue,
    '--target',
    urls.target,
    '--target-queue',
    options.targetQueue,
    '--redis',
    urls.redis,
    '--lease',
    '3s',
    '--prefetch',
    String(options.prefetch ?? 500),
    '--shutdown-timeout',
    '20s',
  ]);
}

/**
 * Waits until the source holds nothing (ready or unacked) and the target has all `count` IDs.
 * Polls the cheap probes until they say so (the source's ready count is 0, the target holds
 * `count`), and only then asks rabbitmqctl, which also counts the source's unacked messages: each
 * call starts an Erlang VM, a second or two of CPU that would otherwise be spent every poll, while
 * the transfer runs, on a machine of two cores.
 */
export async function waitForTransfer(
  world: ChaosWorld,
  sourceQueue: string,
  targetQueue: string,
  count: number,
  timeoutMs: number,
): Promise<boolean> {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    const [ready, depth] = await Promise.all([
      world.probes.source.depth(sourceQueue),
      world.probes.target.depth(targetQueue),
    ]);
    if (ready === 0 && depth >= count) {
      const [left, arrived] = await Promise.all([
        totalMessages(world.source, sourceQueue),
        totalMessages(world.target, targetQueue),
      ]);
      if (left === 0 && arrived >= count) return true;
    }
    await sleep(100);
  }
  return false;
}

/** Waits until the source queue holds nothing, ready or unacked: probed cheaply, confirmed by rabbitmqctl. */
export async function untilSourceEmpty(
  world: ChaosWorld,
  queue: string,
  timeoutMs: number,
): Promise<boolean> {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    if ((await world.probes.source.depth(queue)) === 0 && (await totalMessages(world.source, queue)) === 0) {
      return true;
    }
    await sleep(100);
  }
  return false;
}

/**
 * A queue's depth read cheaply: a passive declare (checkQueue) on one channel kept open, a few
 * milliseconds a read where `rabbitmqctl list_queues` takes about a second. It counts the ready
 * messages only (not those delivered and unacked), which on the target, where nothing consumes,
 * is all of them. Reconnects on the next read after its node went away; -1 while it is down.
 */
export class DepthProbe {
  private connection: ChannelModel | undefined;
  /** The channel, or the promise of it while one is being opened (reads may come at once). */
  private channel: Promise<Channel> | undefined;

  /** A URL, or a function that gives it when first needed (a node's port is known once it started). */
  constructor(private readonly url: string | (() => string)) {}

  async depth(queue: string): Promise<number> {
    try {
      this.channel ??= this.open();
      return (await (await this.channel).checkQueue(queue)).messageCount;
    } catch {
      this.drop();
      return -1;
    }
  }

  private async open(): Promise<Channel> {
    if (!this.connection) {
      const url = typeof this.url === 'string' ? this.url : this.url();
      const connection = await amqp.connect(url, { timeout: 2000 });
      connection.on('error', () => {});
      connection.on('close', () => {
        if (this.connection === connection) this.drop();
      });
      this.connection = connection;
    }
    const channel = await this.connection.createChannel();
    channel.on('error', () => {});
    return channel;
  }

  /** Forgets the connection (gone, or its channel closed by a failed read) to open a new one. */
  private drop(): void {
    const connection = this.connection;
    this.connection = undefined;
    this.channel = undefined;
    void connection?.close().catch(() => {});
  }

  async close(): Promise<void> {
    const connection = this.connection;
    this.connection = undefined;
    this.channel = undefined;
    await connection?.close().catch(() => {});
  }
}

/**
 * Reads a target queue's depth every `everyMs` for as long as a scenario runs, so that the moment a
 * log line was written can be matched to how much of the transfer was done then.
 */
export class DepthWatch {
  private readonly samples: { at: number; depth: number }[] = [];
  private running = true;
  private readonly loop: Promise<void>;

  constructor(
    private readonly probe: DepthProbe,
    private readonly queue: string,
    everyMs = 50,
  ) {
    this.loop = (async () => {
      while (this.running) {
        const at = Date.now();
        const depth = await this.probe.depth(this.queue);
        if (depth >= 0) this.samples.push({ at, depth });
        await sleep(everyMs);
      }
    })();
  }

  /** The first depth read after `time`; undefined when there was none (the depth now, say). */
  after(time: number): number | undefined {
    return this.samples.find((sample) => sample.at > time)?.depth;
  }

  /** The depth read last at or before `time` (ms since the epoch); undefined before the first. */
  at(time: number): number | undefined {
    let found: number | undefined;
    for (const sample of this.samples) {
      if (sample.at > time) break;
      found = sample.depth;
    }
    return found;
  }

  async stop(): Promise<void> {
    this.running = false;
    await this.loop;
  }
}

/** A fault's landing counts when it started with this share of the transfer done, in percent. */
export const LANDING_RANGE = { min: 5, max: 95 } as const;

/** Messages on the target as a percentage of those sent, to one decimal. */
export function percentOf(depth: number, total: number): number {
  return Math.round((depth / total) * 1000) / 10;
}

/** "31%" for one fault, "12–64%" for several, "-" for none. */
export function formatLanded(percents: number[]): string {
  if (percents.length === 0) return '-';
  const round = (value: number) => `${Math.round(value)}`;
  const low = Math.min(...percents);
  const high = Math.max(...percents);
  return round(low) === round(high) ? `${round(low)}%` : `${round(low)}–${round(high)}%`;
}

/** Polls the probe until the queue holds at least `atLeast`; false when the time is up. */
export async function untilDepth(
  probe: DepthProbe,
  queue: string,
  atLeast: number,
  timeoutMs = 120_000,
): Promise<boolean> {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    if ((await probe.depth(queue)) >= atLeast) return true;
    await sleep(10);
  }
  return false;
}

/** One JSON log line of the bridge (pino): `time` as ms since the epoch. */
export interface LogLine {
  time: number;
  level: string;
  msg: string;
  [field: string]: unknown;
}

/** The bridge's JSON log lines in a process's output; other lines are skipped. */
export function logLines(output: string): LogLine[] {
  const lines: LogLine[] = [];
  for (const text of output.split('\n')) {
    if (!text.startsWith('{')) continue;
    try {
      const parsed = JSON.parse(text) as Record<string, unknown>;
      if (typeof parsed.msg !== 'string') continue;
      lines.push({
        ...parsed,
        msg: parsed.msg,
        level: String(parsed.level),
        time: Date.parse(String(parsed.time)),
      });
    } catch {
      // not a log line
    }
  }
  return lines;
}

/** What the bridge logs when it notices each kind of fault (src/amqp/link.ts, target.ts, pipeline.ts, dedup/redis.ts). */
export const SEEN = {
  /** The connection to `side` dropped: a broker stopped, a connection reset, a heartbeat missed. */
  lost: (side: 'source' | 'target') => (line: LogLine) =>
    line.side === side && line.msg.endsWith(': lost; reconnecting'),
  /**
   * Redis went away: the client's one warning for the drop, whether the connection ended with an
   * error (a reset) or closed cleanly (Redis stopped, the proxy cutting it); or the pipeline's own
   * line, for a call that failed.
   */
  redisDown: (line: LogLine) =>
    /^Redis at .*: (lost; reconnecting.*|connection error; reconnecting)$/.test(line.msg) ||
    line.msg === 'Redis call failed; holding the messages unacked and retrying',
  /** The target's resource alarm blocked publishing. */
  blocked: (line: LogLine) => line.msg.endsWith(': blocked publishing (resource alarm); waiting'),
};

/** The counters a bridge process logged when SIGTERM stopped it (one route). */
export function stoppedCounters(output: string): RouteCounters | undefined {
  const line = logLines(output).find((entry) => entry.msg === 'stopped');
  return line?.counters as RouteCounters | undefined;
}

/** Copies on the target that carry `x-dedup-in-doubt: true`, first copies included. */
export function flaggedCopies(copies: Copy[]): number {
  return copies.filter((copy) => copy.inDoubt).length;
}

export { CLI };
