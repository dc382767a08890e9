// npm run bench: dedup-bridge against a hand-written amqplib loop, a plain deduplicating loop
// (bench/dedup-loop.ts) and RabbitMQ's Shovel, side by side on the same brokers in one run,
// alternating rounds; figures as ratios, never as pass/fail.
// Exits non-zero only when a run did not deliver every message exactly once.
import { type ChildProcess, spawn, spawnSync } from 'node:child_process';
import { readFileSync, rmSync, writeFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import amqp from 'amqplib';
import { Redis } from 'ioredis';
import { DedupCache } from '../src/dedup/cache.js';
import { cleanLeftovers, newRunDir, processCpuMs, RabbitNode, RedisServer } from '../test/harness/servers.js';

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const CLI = `${ROOT}bin/dedup-bridge.js`;

const args = process.argv.slice(2);
const option = (name: string, fallback: string) => {
  const index = args.indexOf(name);
  return index >= 0 ? (args[index + 1] ?? fallback) : fallback;
};
const ROUNDS = Number(option('--rounds', '3'));
const MESSAGES = Number(option('--messages', '50000'));
const JSON_PATH = option('--json', '');
const QUICK = args.includes('--quick');
// The peak RSS run's volume: memory grows with the messages moved, so it may need more than the rounds.
const RSS_MESSAGES = QUICK ? MESSAGES : Number(option('--rss-messages', '100000'));
const MEMORY_IDS = QUICK ? 20_000 : 200_000;
const CACHE_IDS = QUICK ? 100_000 : 1_000_000;
const PREFETCH = 1000;
// A mover process starts cold: V8 compiles its per-message code while the first messages go
// through, for the bridge over about its first 20,000 (Shovel runs in a broker long up). So each
// round is also measured between the arrival that brings the target to this share of it and the
// last: the messages and the CPU of every process in between, the mover's tail after it left out.
const STEADY_FROM = Number(option('--steady-from', '0.5'));
if (!(STEADY_FROM > 0 && STEADY_FROM < 1)) {
  process.stderr.write('bench: --steady-from takes a share of the round between 0 and 1, e.g. 0.5\n');
  process.exit(2);
}
const PIN = args.includes('--pin-brokers');
// --lazy-queues: source and target queues declared lazy, so the brokers keep their messages on disk
// and not in memory, as every classic queue does from RabbitMQ 3.12 on. On 3.10 a queue that holds
// its messages in memory makes each header of each message cost the broker garbage collection.
const LAZY_QUEUES = args.includes('--lazy-queues');
// --bridge-args '--batch-size 50': extra options for the bridge's throughput rounds (tuning runs).
const BRIDGE_ARGS = option('--bridge-args', '').split(' ').filter(Boolean);

/** Moves every thread of a process to the given CPUs (children started later inherit it). */
function pinTo(pid: number, cpus: string): void {
  const result = spawnSync('taskset', ['-a', '-p', '-c', cpus, String(pid)], { encoding: 'utf8' });
  if (result.status !== 0) throw new Error(`taskset failed for pid ${pid}: ${result.stderr.trim()}`);
}

type System = 'dedup-bridge' | 'dedup floor' | 'amqplib loop' | 'Shovel';
interface Profile {
  name: string;
  size: number;
  /** Share of messages that resend an earlier ID. */
  duplicates: number;
}
const PROFILES: Profile[] = [
  { name: '1 KiB persistent', size: 1024, duplicates: 0 },
  { name: '100 B persistent', size: 100, duplicates: 0 },
  { name: '64 KiB persistent', size: 65_536, duplicates: 0 },
  { name: '1 KiB, 10% duplicates', size: 1024, duplicates: 0.1 },
];

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
const median = (values: number[]) => {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.floor(sorted.length / 2)] ?? 0;
};
const say = (text: string) => process.stdout.write(`${text}\n`);

let failures = 0;

async function main(): Promise<void> {
  cleanLeftovers();
  const runDir = newRunDir();
  const source = new RabbitNode(runDir, 'bench-source', { plugins: ['rabbitmq_shovel'] });
  const target = new RabbitNode(runDir, 'bench-target');
  const redisServer = new RedisServer(runDir, 'bench-redis');
  say('bench: starting two RabbitMQ nodes and Redis…');
  await Promise.all([source.start(), target.start(), redisServer.start()]);
  if (PIN) {
    // Brokers on CPU 0, everything else (Redis, the mover, this process) on CPU 1: as if the
    // brokers ran on a host of their own. Shovel runs inside the source broker, so on CPU 0.
    for (const pid of [source.pid(), target.pid()]) pinTo(pid, '0');
    for (const pid of [redisServer.pid(), process.pid]) pinTo(pid, '1');
    say('bench: --pin-brokers: brokers on CPU 0; Redis, the movers and the bench on CPU 1');
  }
  const redis = new Redis(redisServer.url);
  try {
    const results: Record<string, Record<System, number[]>> = {};
    const steadyResults: Record<string, Record<System, number[]>> = {};
    const fromStartResults: Record<string, Record<System, number[]>> = {};
    const systems: System[] = ['dedup-bridge', 'dedup floor', 'amqplib loop', 'Shovel'];
    // One untimed round each first: in two runs of three, the run's first transfer (the bridge's,
    // first in the order) was 20-30% slower than its later rounds.
    const warmUp = PROFILES[0] as Profile;
    for (const system of systems) {
      await measure(system, warmUp, Math.min(MESSAGES, 2000), source, target, redisServer);
    }
    for (const key of Object.keys(cpuPerThousand)) delete cpuPerThousand[key];
    for (const key of Object.keys(steadyCpuPerThousand)) delete steadyCpuPerThousand[key];
    for (const key of Object.keys(tailCpuMs)) delete tailCpuMs[key];
    // --headline: only the 1 KiB persistent profile (the other three take most of a full run).
    const sizes = QUICK || args.includes('--headline') ? PROFILES.slice(0, 1) : PROFILES;
    for (const profile of sizes) {
      results[profile.name] = { 'dedup-bridge': [], 'dedup floor': [], 'amqplib loop': [], Shovel: [] };
      steadyResults[profile.name] = { 'dedup-bridge': [], 'dedup floor': [], 'amqplib loop': [], Shovel: [] };
      fromStartResults[profile.name] = {
        'dedup-bridge': [],
        'dedup floor': [],
        'amqplib loop': [],
        Shovel: [],
      };
      const count = profile.size > 10_000 ? Math.min(MESSAGES, 5000) : MESSAGES;
      for (let round = 1; round <= ROUNDS; round++) {
        // Each round starts with the next system, so that none always runs first or last.
        const order = systems.map((_, index) => systems[(index + round - 1) % systems.length] as System);
        for (const system of order) {
          const rate = await measure(system, profile, count, source, target, redisServer);
          const steady = lastSteadyRate;
          const fromStart = lastFromStartRate;
          results[profile.name]?.[system].push(rate);
          steadyResults[profile.name]?.[system].push(steady);
          fromStartResults[profile.name]?.[system].push(fromStart);
          say(
            `  ${profile.name} · round ${round} · ${system}: ${Math.round(rate)} msg/s, steady ${Math.round(steady)} msg/s, from its start ${Math.round(fromStart)} msg/s`,
          );
        }
      }
    }

    const roundsCpu = structuredClone(cpuPerThousand);
    const steadyCpu = structuredClone(steadyCpuPerThousand);
    // --rounds-only: the throughput rounds without the figures (for quick comparisons while tuning).
    const figures = args.includes('--rounds-only')
      ? undefined
      : {
          redisCommandsPerMessage: await redisCommandsPerMessage(source, target, redisServer, redis),
          redisBytesPerId: await redisBytesPerId(redis),
          peakRssMiB: await peakRss(source, target, redisServer),
          latency: await latency(source, target, redisServer),
          loopLatency: await latency(source, target, redisServer, 'amqplib loop'),
          shovelLatency: await latency(source, target, redisServer, 'Shovel'),
          parallel: await parallelMigration(source, target, redisServer),
          fullCache: await fullCacheThroughput(source, target, redisServer, redis),
        };

    say(
      `\nbench: medians of ${ROUNDS} alternating rounds, ${MESSAGES} messages (5,000 at 64 KiB), prefetch ${PREFETCH}${LAZY_QUEUES ? ', lazy queues' : ''}${PIN ? ', brokers pinned' : ''}`,
    );
    const table = rateTable('whole rounds, from the first arrival', results);
    const fromStartTable = rateTable(
      "whole rounds, from the mover's start (its process launched; Shovel's parameter set) to the last arrival",
      fromStartResults,
    );
    const steadyTable = rateTable(
      `steady: from the arrival of ${Math.round(STEADY_FROM * 100)}% of each round on`,
      steadyResults,
    );
    const cpuTable = cpuUseTable('over the whole transfer', roundsCpu);
    const steadyCpuTable = cpuUseTable(
      `steady, from the arrival of ${Math.round(STEADY_FROM * 100)}% on`,
      steadyCpu,
    );
    say(
      `mover CPU after the last arrival (its last acks and commits, idle wait, closing; counted above), ms, median: ${Object.entries(
        tailCpuMs,
      )
        .map(([run, values]) => `${run} ${median(values).toFixed(0)}`)
        .join(' · ')}`,
    );
    if (figures) {
      say(
        `Redis commands per forwarded message: ${figures.redisCommandsPerMessage.sent.toFixed(4)} sent by the bridge ` +
          `(script calls), ${figures.redisCommandsPerMessage.executed.toFixed(2)} executed by Redis (inside the scripts)`,
      );
      say(`Redis memory per committed ID: ${figures.redisBytesPerId.toFixed(1)} B (over ${MEMORY_IDS} IDs)`);
      say(
        `bridge peak RSS: ${figures.peakRssMiB.toFixed(1)} MiB (default prefetch, ${RSS_MESSAGES} messages)`,
      );
      const { latency: bridgeLatency, shovelLatency, loopLatency, parallel } = figures;
      say(
        `latency at 1,000 msg/s, published → delivered: bridge p50 ${bridgeLatency.p50.toFixed(1)} ms, p99 ${bridgeLatency.p99.toFixed(1)} ms; ` +
          `Shovel p50 ${shovelLatency.p50.toFixed(1)}, p99 ${shovelLatency.p99.toFixed(1)} ` +
          `(bridge/Shovel ${(bridgeLatency.p50 / shovelLatency.p50).toFixed(2)}× and ${(bridgeLatency.p99 / shovelLatency.p99).toFixed(2)}×); ` +
          `amqplib loop p50 ${loopLatency.p50.toFixed(1)}, p99 ${loopLatency.p99.toFixed(1)}`,
      );
      say(
        `migrate --parallel 8 over 8 queues: ${Math.round(parallel.parallel)} msg/s against ${Math.round(parallel.single)} for one queue alone ` +
          `(${(parallel.parallel / parallel.single).toFixed(2)}×); bridge CPU per 1,000 messages ${parallel.cpuParallel.toFixed(0)} ms against ${parallel.cpuSingle.toFixed(0)}`,
      );
      say(
        `throughput with ${CACHE_IDS} IDs in the cache: ${Math.round(figures.fullCache.full)} msg/s vs ${Math.round(figures.fullCache.empty)} empty (${(
          (1 - figures.fullCache.full / figures.fullCache.empty) * 100
        ).toFixed(1)}% cost)`,
      );
    }
    if (JSON_PATH) {
      writeFileSync(
        JSON_PATH,
        `${JSON.stringify({ date: new Date().toISOString(), messages: MESSAGES, rounds: ROUNDS, steadyFrom: STEADY_FROM, table, steadyTable, fromStartTable, raw: results, steadyRaw: steadyResults, fromStartRaw: fromStartResults, cpu: cpuTable, steadyCpu: steadyCpuTable, figures }, null, 2)}\n`,
      );
    }
  } finally {
    await redis.quit();
    await Promise.allSettled([source.stop(), target.stop(), redisServer.stop()]);
    rmSync(runDir, { recursive: true, force: true });
  }
  if (failures > 0) {
    say(`bench: ${failures} run(s) did not deliver every message exactly once`);
    process.exit(1);
  }
}

/** Prints the medians of the rounds' rates per profile, with the ratios; returns them. */
function rateTable(title: string, rates: Record<string, Record<System, number[]>>) {
  const table = Object.entries(rates).map(([profile, bySystem]) => {
    const bridge = median(bySystem['dedup-bridge']);
    const floor = median(bySystem['dedup floor']);
    const loop = median(bySystem['amqplib loop']);
    const shovel = median(bySystem.Shovel);
    return {
      profile,
      bridge,
      floor,
      loop,
      shovel,
      bridgeOverShovel: bridge / shovel,
      bridgeOverLoop: bridge / loop,
      bridgeOverFloor: bridge / floor,
    };
  });
  say(`\nmsg/s, ${title}`);
  say(
    '| profile | dedup-bridge | dedup floor | amqplib loop | Shovel | bridge/Shovel | bridge/loop | bridge/floor |',
  );
  say('|---|---|---|---|---|---|---|---|');
  for (const row of table) {
    say(
      `| ${row.profile} | ${Math.round(row.bridge)} | ${Math.round(row.floor)} | ${Math.round(row.loop)} | ${Math.round(row.shovel)} | ${row.bridgeOverShovel.toFixed(2)}× | ${row.bridgeOverLoop.toFixed(2)}× | ${row.bridgeOverFloor.toFixed(2)}× |`,
    );
  }
  return table;
}

/** Prints the medians of the rounds' CPU per 1,000 messages, per process; returns them. */
function cpuUseTable(title: string, rounds: Record<string, CpuUse[]>) {
  say(`\nCPU ms per 1,000 messages, ${title} (medians; Shovel runs inside the source broker)`);
  say('| run | mover | source broker | target broker | Redis | all |');
  say('|---|---|---|---|---|---|');
  const table = Object.entries(rounds).map(([run, uses]) => {
    const row = Object.fromEntries(
      (['mover', 'source broker', 'target broker', 'Redis'] as const).map((name) => [
        name,
        median(uses.map((use) => use[name])),
      ]),
    ) as CpuUse;
    return { run, ...row, all: row.mover + row['source broker'] + row['target broker'] + row.Redis };
  });
  for (const row of table) {
    say(
      `| ${row.run} | ${row.mover.toFixed(0)} | ${row['source broker'].toFixed(0)} | ${row['target broker'].toFixed(0)} | ${row.Redis.toFixed(0)} | ${row.all.toFixed(0)} |`,
    );
  }
  return table;
}

let queueSeq = 0;
async function queues(
  sourceUrl: string,
  targetUrl: string,
): Promise<{ sourceQueue: string; targetQueue: string }> {
  queueSeq++;
  const name = `bench-${process.pid}-${queueSeq}`;
  for (const url of [sourceUrl, targetUrl]) {
    const connection = await amqp.connect(url);
    const channel = await connection.createChannel();
    await channel.assertQueue(name, {
      durable: true,
      ...(LAZY_QUEUES ? { arguments: { 'x-queue-mode': 'lazy' } } : {}),
    });
    await connection.close();
  }
  return { sourceQueue: name, targetQueue: name };
}

/** Preloads `count` persistent messages; with duplicates, that share resend earlier IDs. */
async function preload(
  url: string,
  queue: string,
  profile: Profile,
  count: number,
): Promise<Map<string, number>> {
  const connection = await amqp.connect(url);
  const channel = await connection.createConfirmChannel();
  const body = Buffer.alloc(profile.size, 'x');
  const sent = new Map<string, number>();
  const prefix = `${queue}-`;
  let unique = 0;
  for (let i = 0; i < count; i++) {
    const resend = profile.duplicates > 0 && unique > 0 && i % Math.round(1 / profile.duplicates) === 0;
    const id = resend ? `${prefix}${Math.floor(unique / 2)}` : `${prefix}${unique++}`;
    sent.set(id, (sent.get(id) ?? 0) + 1);
    if (!channel.sendToQueue(queue, body, { persistent: true, headers: { _HQ_DUPL_ID: id } })) {
      await channel.waitForConfirms();
    }
    if (i % 2000 === 1999) await channel.waitForConfirms();
  }
  await channel.waitForConfirms();
  await connection.close();
  return sent;
}

async function depth(url: string, queue: string): Promise<number> {
  const connection = await amqp.connect(url);
  try {
    const channel = await connection.createChannel();
    return (await channel.checkQueue(queue)).messageCount;
  } finally {
    await connection.close();
  }
}

type CpuUse = Record<'mover' | 'source broker' | 'target broker' | 'Redis', number>;

/** Where the steady part of a round began: when, how many had arrived, and the CPU used by then. */
interface SteadyMark {
  at: number;
  arrived: number;
  cpu: CpuUse;
}

/**
 * Waits until the target holds `expected` messages; returns ms from the first to the last, the
 * CPU ms each process had used at the first arrival (see moverDone for the end), and the same
 * when the target first held `steadyFrom` or more.
 */
async function timeArrivals(
  url: string,
  queue: string,
  expected: number,
  steadyFrom: number,
  timeoutMs: number,
  pids: Record<keyof CpuUse, number | undefined>,
): Promise<{ ms: number; start: CpuUse; last: CpuUse; steady: SteadyMark; end: number }> {
  const connection = await amqp.connect(url);
  const channel = await connection.createChannel();
  const deadline = Date.now() + timeoutMs;
  let first: number | undefined;
  let start = cpuSample(pids);
  let steady: SteadyMark | undefined;
  try {
    for (;;) {
      const { messageCount } = await channel.checkQueue(queue);
      const now = cpuSample(pids);
      if (messageCount > 0 && first === undefined) {
        first = Date.now();
        start = now;
      }
      if (messageCount >= steadyFrom && steady === undefined) {
        steady = { at: Date.now(), arrived: messageCount, cpu: now };
      }
      if (messageCount >= expected) {
        const end = Date.now();
        return { ms: end - (first ?? end), start, last: now, steady: steady as SteadyMark, end };
      }
      if (Date.now() > deadline) throw new Error(`timed out with ${messageCount}/${expected} on the target`);
      await sleep(20);
    }
  } finally {
    await connection.close();
  }
}

function cpuSample(pids: Record<keyof CpuUse, number | undefined>): CpuUse {
  const names = Object.keys(pids) as (keyof CpuUse)[];
  return Object.fromEntries(names.map((name) => [name, processCpuMs(pids[name])])) as CpuUse;
}

/**
 * Waits for a mover process to finish on its own (its last acks sent, its connections closed),
 * sampling its CPU until then, so that the work it does after the last arrival counts too.
 */
async function moverDone(mover: ChildProcess, timeoutMs: number): Promise<boolean> {
  const deadline = Date.now() + timeoutMs;
  while (mover.exitCode === null && mover.signalCode === null) {
    processCpuMs(mover.pid);
    if (Date.now() > deadline) return false;
    await sleep(20);
  }
  return true;
}

/** Counts the target by ID: the bridge must hold each ID once, the others each message once. */
async function verify(
  url: string,
  queue: string,
  sent: Map<string, number>,
  deduplicates: boolean,
  label: string,
) {
  const connection = await amqp.connect(url);
  const channel = await connection.createChannel();
  await channel.prefetch(5000);
  const seen = new Map<string, number>();
  let total = 0;
  const expectedTotal = deduplicates ? sent.size : [...sent.values()].reduce((a, b) => a + b, 0);
  await new Promise<void>((resolve) => {
    const timer = setTimeout(resolve, 60_000);
    void channel.consume(
      queue,
      (message) => {
        if (!message) return;
        const id = String(message.properties.headers?._HQ_DUPL_ID);
        seen.set(id, (seen.get(id) ?? 0) + 1);
        total++;
        if (total >= expectedTotal) {
          clearTimeout(timer);
          setTimeout(resolve, 200);
        }
      },
      { noAck: true },
    );
  });
  await connection.close();
  let wrong = 0;
  for (const [id, times] of sent) if ((seen.get(id) ?? 0) !== (deduplicates ? 1 : times)) wrong++;
  for (const id of seen.keys()) if (!sent.has(id)) wrong++;
  if (wrong > 0) {
    failures++;
    say(`  ${label}: ${wrong} IDs not delivered exactly as sent`);
  }
}

function startMover(
  system: System,
  sourceUrl: string,
  targetUrl: string,
  redisUrl: string,
  queue: { sourceQueue: string; targetQueue: string },
  count: number,
  sourceNode: RabbitNode,
  scope?: string,
): ChildProcess | string {
  if (system === 'dedup-bridge') {
    return spawn(
      process.execPath,
      [
        CLI,
        'migrate',
        '--source',
        sourceUrl,
        '--source-queue',
        queue.sourceQueue,
        '--target',
        targetUrl,
        '--target-queue',
        queue.targetQueue,
        '--redis',
        redisUrl,
        '--prefetch',
        String(PREFETCH),
        '--idle-timeout',
        '200ms',
        '--log-level',
        'warn',
        ...(scope ? ['--scope', scope] : []),
        ...BRIDGE_ARGS,
        '--quiet',
        '--job-name',
        `bench-${queue.sourceQueue}`,
      ],
      { stdio: 'ignore' },
    );
  }
  if (system === 'amqplib loop' || system === 'dedup floor') {
    const script = system === 'amqplib loop' ? 'loop.ts' : 'dedup-loop.ts';
    return spawn(
      process.execPath,
      [
        '--import',
        'tsx',
        `${ROOT}bench/${script}`,
        sourceUrl,
        queue.sourceQueue,
        targetUrl,
        queue.targetQueue,
        String(PREFETCH),
        String(count),
        ...(system === 'dedup floor' ? [redisUrl] : []),
      ],
      { stdio: 'ignore', cwd: ROOT },
    );
  }
  const shovel = `bench-shovel-${queue.sourceQueue}`;
  shovelParameterSet = sourceNode
    .ctl(
      'set_parameter',
      'shovel',
      shovel,
      JSON.stringify({
        'src-protocol': 'amqp091',
        'src-uri': sourceUrl,
        'src-queue': queue.sourceQueue,
        'dest-protocol': 'amqp091',
        'dest-uri': targetUrl,
        'dest-queue': queue.targetQueue,
        'ack-mode': 'on-confirm',
        'src-prefetch-count': PREFETCH,
      }),
    )
    // A failed set_parameter still ends the bench with rabbitmqctl's message, as before.
    .then(() => Date.now());
  return shovel;
}

async function stopMover(mover: ChildProcess | string, sourceNode: RabbitNode): Promise<void> {
  if (typeof mover === 'string') {
    await sourceNode.ctl('clear_parameter', 'shovel', mover).catch(() => '');
    return;
  }
  if (mover.exitCode === null) {
    const exited = new Promise((resolve) => mover.once('exit', resolve));
    mover.kill('SIGTERM');
    await exited;
  }
}

/** CPU ms a process mover spent after the last arrival, for each round of `<profile> · <system>`. */
const tailCpuMs: Record<string, number[]> = {};

/** CPU ms per 1,000 messages by process, for each round of `<profile> · <system>`. */
const cpuPerThousand: Record<string, CpuUse[]> = {};
/** The same from the steady mark on (see STEADY_FROM), and the last round's steady rate. */
const steadyCpuPerThousand: Record<string, CpuUse[]> = {};
let lastSteadyRate = 0;
/** The last round's rate from the mover's start to the last arrival, and when Shovel's parameter was set. */
let lastFromStartRate = 0;
let shovelParameterSet: Promise<number> = Promise.resolve(0);

function cpuPer1000(from: CpuUse, to: CpuUse, messages: number): CpuUse {
  return Object.fromEntries(
    Object.entries(to).map(([name, used]) => [name, ((used - from[name as keyof CpuUse]) / messages) * 1000]),
  ) as CpuUse;
}

/** One round: preload, move, time the arrivals, verify; returns source messages per second. */
async function measure(
  system: System,
  profile: Profile,
  count: number,
  source: RabbitNode,
  target: RabbitNode,
  redis: RedisServer,
  scope?: string,
): Promise<number> {
  const queue = await queues(source.url, target.url);
  const sent = await preload(source.url, queue.sourceQueue, profile, count);
  const deduplicates = system === 'dedup-bridge' || system === 'dedup floor';
  const expected = deduplicates ? sent.size : count;
  const startedAt = Date.now();
  const mover = startMover(system, source.url, target.url, redis.url, queue, count, source, scope);
  const pids = {
    mover: typeof mover === 'string' ? undefined : mover.pid,
    'source broker': source.pid(),
    'target broker': target.pid(),
    Redis: redis.pid(),
  };
  const steadyFrom = Math.max(1, Math.ceil(expected * STEADY_FROM));
  const {
    ms,
    start,
    last,
    steady,
    end: lastArrival,
  } = await timeArrivals(target.url, queue.targetQueue, expected, steadyFrom, 300_000, pids);
  const label = `${profile.name} ${system}`;
  // A process mover starts when it is launched; Shovel when its parameter is set (rabbitmqctl's own
  // start is left out, which favours Shovel). rabbitmqctl may return after Shovel's first message
  // has arrived: then that arrival stands for the start.
  const moverStart =
    typeof mover === 'string' ? Math.min(await shovelParameterSet, lastArrival - ms) : startedAt;
  lastFromStartRate = count / (Math.max(lastArrival - moverStart, 1) / 1000);
  if (typeof mover === 'string') {
    // Shovel acks each message once the target confirmed it: give its last acks time to land.
    await sleep(300);
  } else if (!(await moverDone(mover, 60_000))) {
    failures++;
    say(`  ${label}: the mover did not finish within 60 s of the last arrival`);
  }
  const end = cpuSample(pids);
  const key = `${profile.name} · ${system}`;
  if (typeof mover !== 'string') {
    // What the mover spent finishing: its last acks and commits, its idle wait, closing.
    tailCpuMs[key] ??= [];
    tailCpuMs[key].push(end.mover - last.mover);
  }
  cpuPerThousand[key] ??= [];
  cpuPerThousand[key].push(cpuPer1000(start, end, count));
  // The source messages moved in the steady part: its share of the arrivals (a deduplicating
  // mover delivers fewer messages than it consumes when the profile resends IDs). When the mark
  // and the last arrival fell in one poll, there is no steady part: the whole round stands for it.
  const steadyShare = (expected - steady.arrived) / expected;
  const steadyMessages = steadyShare * count;
  steadyCpuPerThousand[key] ??= [];
  if (steadyShare > 0 && lastArrival > steady.at) {
    lastSteadyRate = steadyMessages / ((lastArrival - steady.at) / 1000);
    steadyCpuPerThousand[key].push(cpuPer1000(steady.cpu, last, steadyMessages));
  } else {
    lastSteadyRate = count / (Math.max(ms, 1) / 1000);
    steadyCpuPerThousand[key].push(cpuPer1000(start, end, count));
  }
  await stopMover(mover, source);
  // Every system must leave nothing behind: a message still in the source (unacked at the exit,
  // so given back) would be delivered again by the next run.
  const left = await depth(source.url, queue.sourceQueue);
  if (left !== 0) {
    failures++;
    say(`  ${label}: ${left} messages left in the source queue`);
  }
  await verify(target.url, queue.targetQueue, sent, deduplicates, label);
  return count / (Math.max(ms, 1) / 1000);
}

/** Calls counted by INFO commandstats: what clients sent (scripts as one call each), and all. */
function commandCalls(info: string): { sent: number; executed: number } {
  let sent = 0;
  let executed = 0;
  for (const line of info.split('\n')) {
    const match = /^cmdstat_(\w+):calls=(\d+)/.exec(line);
    if (!match || match[1] === 'info') continue;
    const calls = Number(match[2]);
    // Redis 7 also counts the commands a script runs; the bridge itself sends only script calls.
    if (match[1] === 'evalsha' || match[1] === 'eval') sent += calls;
    executed += calls;
  }
  return { sent, executed };
}

async function redisCommandsPerMessage(
  source: RabbitNode,
  target: RabbitNode,
  redisServer: RedisServer,
  redis: Redis,
) {
  const before = commandCalls(await redis.info('commandstats'));
  const rate = await measure('dedup-bridge', PROFILES[0] as Profile, MESSAGES, source, target, redisServer);
  const after = commandCalls(await redis.info('commandstats'));
  say(`  (headline bridge run for the Redis figure: ${Math.round(rate)} msg/s)`);
  return {
    sent: (after.sent - before.sent) / MESSAGES,
    executed: (after.executed - before.executed) / MESSAGES,
  };
}

/** Commits `MEMORY_IDS` 36-character IDs through the cache scripts and reads used_memory. */
async function redisBytesPerId(redis: Redis): Promise<number> {
  const used = async () => Number(/used_memory:(\d+)/.exec(await redis.info('memory'))?.[1]);
  const cache = await DedupCache.open(redis, {
    token: 'bench',
    leaseMs: 30_000,
    windowMs: 86_400_000,
    prefix: 'dedup',
    scope: `memory-${process.pid}`,
  });
  const before = await used();
  for (let i = 0; i < MEMORY_IDS; i += 500) {
    const keys = Array.from({ length: Math.min(500, MEMORY_IDS - i) }, (_, j) =>
      cache.keyOf(`${String(i + j).padStart(8, '0')}-0000-4000-8000-000000000000`),
    );
    await cache.claim(keys);
    await cache.commit(keys);
  }
  const after = await used();
  return (after - before) / MEMORY_IDS;
}

/** `dedup-bridge run|migrate` between the bench's servers, logging warnings only. */
function bridgeArgs(
  command: 'run' | 'migrate',
  source: RabbitNode,
  target: RabbitNode,
  redisServer: RedisServer,
  queue: { sourceQueue: string; targetQueue: string },
  ...extra: string[]
): string[] {
  return [
    CLI,
    command,
    '--source',
    source.url,
    '--source-queue',
    queue.sourceQueue,
    '--target',
    target.url,
    '--target-queue',
    queue.targetQueue,
    '--redis',
    redisServer.url,
    '--log-level',
    'warn',
    ...extra,
  ];
}

async function peakRss(source: RabbitNode, target: RabbitNode, redisServer: RedisServer): Promise<number> {
  const queue = await queues(source.url, target.url);
  const sent = await preload(source.url, queue.sourceQueue, PROFILES[0] as Profile, RSS_MESSAGES);
  // The default prefetch, as a user runs it.
  const mover = spawn(
    process.execPath,
    bridgeArgs('migrate', source, target, redisServer, queue, '--idle-timeout', '200ms', '--quiet'),
    {
      stdio: 'ignore',
    },
  );
  let peakKiB = 0;
  const timer = setInterval(() => {
    try {
      const status = readFileSync(`/proc/${mover.pid}/status`, 'utf8');
      peakKiB = Math.max(peakKiB, Number(/VmHWM:\s+(\d+)/.exec(status)?.[1] ?? 0));
    } catch {
      // exited
    }
  }, 50);
  await new Promise((resolve) => mover.once('exit', resolve));
  clearInterval(timer);
  await verify(target.url, queue.targetQueue, sent, true, 'peak RSS run');
  return peakKiB / 1024;
}

/**
 * End-to-end latency, from the publish to the source to the delivery on the target, at a steady
 * 1,000 msg/s for 10 s, through `dedup-bridge run`, the amqplib loop or Shovel.
 */
async function latency(
  source: RabbitNode,
  target: RabbitNode,
  redisServer: RedisServer,
  system: System = 'dedup-bridge',
) {
  const queue = await queues(source.url, target.url);
  const total = QUICK ? 3000 : 10_000;
  // As many as a new bridge process takes to settle (bench/NOTES.md, A process starts cold).
  const warmup = QUICK ? 1000 : 20_000;
  let mover: ChildProcess | string;
  if (system === 'dedup-bridge') {
    mover = spawn(process.execPath, bridgeArgs('run', source, target, redisServer, queue), {
      stdio: 'ignore',
    });
  } else {
    mover = startMover(system, source.url, target.url, redisServer.url, queue, warmup + total, source);
  }
  await sleep(1500);
  const consumerConnection = await amqp.connect(target.url, { noDelay: true });
  const consumer = await consumerConnection.createChannel();
  const samples: number[] = [];
  let warmed = 0;
  // Counted by ID, as the rounds are: a copy that arrives twice is a failure, and must not stand in
  // for one that never arrived (nor be a second sample).
  const seen = new Set<string>();
  let repeated = 0;
  await consumer.consume(
    queue.targetQueue,
    (message) => {
      if (!message) return;
      const id = String(message.properties.headers?._HQ_DUPL_ID);
      if (seen.has(id)) {
        repeated++;
        return;
      }
      seen.add(id);
      if (id.startsWith('warm-')) {
        warmed++;
        return;
      }
      const sentAt = Number(message.properties.headers?.['x-bench-sent-at']);
      samples.push(performance.timeOrigin + performance.now() - sentAt);
    },
    { noAck: true },
  );
  const producerConnection = await amqp.connect(source.url, { noDelay: true });
  const producer = await producerConnection.createChannel();
  const body = Buffer.alloc(1024, 'x');
  // First warmup messages at the same rate, not counted: a bridge process just started runs its
  // per-message code before V8 has compiled it, where Shovel runs in a broker long up (the
  // throughput rounds warm up each system too).
  const send = async (count: number, prefix: string) => {
    const started = performance.now();
    for (let i = 0; i < count; i++) {
      const due = started + i; // one per millisecond
      const wait = due - performance.now();
      if (wait > 1) await sleep(wait);
      producer.sendToQueue(queue.sourceQueue, body, {
        persistent: true,
        headers: {
          _HQ_DUPL_ID: `${prefix}-${i}`,
          'x-bench-sent-at': performance.timeOrigin + performance.now(),
        },
      });
    }
  };
  await send(warmup, 'warm');
  for (let i = 0; i < 100 && warmed < warmup; i++) await sleep(100);
  await send(total, 'lat');
  for (let i = 0; i < 100 && samples.length < total; i++) await sleep(100);
  if (typeof mover === 'string' || mover.exitCode === null) await stopMover(mover, source);
  await producerConnection.close();
  await consumerConnection.close();
  if (samples.length < total || warmed < warmup || repeated > 0) {
    failures++;
    say(
      `  latency run (${system}): ${total - samples.length + warmup - warmed} messages did not arrive, ${repeated} arrived again`,
    );
  }
  const sorted = samples.sort((a, b) => a - b);
  return {
    p50: sorted[Math.floor(sorted.length * 0.5)] ?? 0,
    p99: sorted[Math.floor(sorted.length * 0.99)] ?? 0,
    samples: sorted.length,
  };
}

/**
 * `migrate --parallel 8` over 8 queues against one queue alone, the same number of messages in
 * all, in alternating rounds: aggregate msg/s of each and the bridge's CPU per 1,000 messages.
 */
async function parallelMigration(source: RabbitNode, target: RabbitNode, redisServer: RedisServer) {
  const profile = PROFILES[0] as Profile;
  const parallel: number[] = [];
  const single: number[] = [];
  const cpu: { parallel: number[]; single: number[] } = { parallel: [], single: [] };
  for (let round = 0; round < ROUNDS; round++) {
    for (const width of round % 2 === 0 ? [8, 1] : [1, 8]) {
      const routes = await Promise.all(Array.from({ length: width }, () => queues(source.url, target.url)));
      const sent = await Promise.all(
        routes.map((route) => preload(source.url, route.sourceQueue, profile, Math.floor(MESSAGES / width))),
      );
      const expected = sent.reduce((sum, ids) => sum + ids.size, 0);
      const mover = spawn(
        process.execPath,
        [
          CLI,
          'migrate',
          '--source',
          source.url,
          ...routes.flatMap((route) => ['--source-queue', route.sourceQueue]),
          '--target',
          target.url,
          '--redis',
          redisServer.url,
          '--prefetch',
          String(PREFETCH),
          '--parallel',
          String(width),
          '--idle-timeout',
          '200ms',
          '--log-level',
          'warn',
          '--quiet',
          '--job-name',
          `bench-parallel-${process.pid}-${round}-${width}`,
        ],
        { stdio: 'ignore' },
      );
      const { ms, cpuMs: used } = await timeAllArrivals(target.url, routes, expected, mover.pid);
      if (!(await moverDone(mover, 60_000))) {
        failures++;
        say(`  parallel ${width}: the mover did not finish within 60 s of the last arrival`);
      }
      const spent = processCpuMs(mover.pid) - used;
      for (const [index, route] of routes.entries()) {
        await verify(
          target.url,
          route.targetQueue,
          sent[index] as Map<string, number>,
          true,
          `parallel ${width}`,
        );
      }
      const rate = expected / (Math.max(ms, 1) / 1000);
      (width === 8 ? parallel : single).push(rate);
      (width === 8 ? cpu.parallel : cpu.single).push((spent / expected) * 1000);
      say(`  parallel migration · round ${round + 1} · ${width} queue(s): ${Math.round(rate)} msg/s`);
    }
  }
  return {
    parallel: median(parallel),
    single: median(single),
    cpuParallel: median(cpu.parallel),
    cpuSingle: median(cpu.single),
  };
}

/** Like timeArrivals, over several target queues together; returns the mover's CPU at the first. */
async function timeAllArrivals(
  url: string,
  routes: { targetQueue: string }[],
  expected: number,
  pid: number | undefined,
): Promise<{ ms: number; cpuMs: number }> {
  const connection = await amqp.connect(url);
  const channel = await connection.createChannel();
  const deadline = Date.now() + 300_000;
  let first: number | undefined;
  let start = processCpuMs(pid);
  try {
    for (;;) {
      let arrived = 0;
      for (const route of routes) arrived += (await channel.checkQueue(route.targetQueue)).messageCount;
      const now = processCpuMs(pid);
      if (arrived > 0 && first === undefined) {
        first = Date.now();
        start = now;
      }
      if (arrived >= expected) return { ms: Date.now() - (first ?? Date.now()), cpuMs: start };
      if (Date.now() > deadline) throw new Error(`timed out with ${arrived}/${expected} on the target`);
      await sleep(20);
    }
  } finally {
    await connection.close();
  }
}

/** Throughput of the headline profile with CACHE_IDS committed IDs already in the scope. */
async function fullCacheThroughput(
  source: RabbitNode,
  target: RabbitNode,
  redisServer: RedisServer,
  redis: Redis,
) {
  const empty: number[] = [];
  const full: number[] = [];
  // A million committed IDs of other messages in the scope the full rounds forward into, so that
  // every lookup walks a scope that large (the bridge's default window, so the same layout).
  const scope = `bench-full-${process.pid}`;
  const cache = await DedupCache.open(redis, {
    token: 'bench',
    leaseMs: 30_000,
    windowMs: 7 * 86_400_000,
    prefix: 'dedup',
    scope,
  });
  for (let i = 0; i < CACHE_IDS; i += 1000) {
    const keys = Array.from({ length: Math.min(1000, CACHE_IDS - i) }, (_, j) => cache.keyOf(`old-${i + j}`));
    await cache.commit(keys);
  }
  // Empty and full rounds alternate, so that the machine's drift does not count as the cache's cost.
  for (let round = 0; round < ROUNDS; round++) {
    empty.push(await measure('dedup-bridge', PROFILES[0] as Profile, MESSAGES, source, target, redisServer));
    full.push(
      await measure('dedup-bridge', PROFILES[0] as Profile, MESSAGES, source, target, redisServer, scope),
    );
  }
  return { empty: median(empty), full: median(full) };
}

main().catch((error: unknown) => {
  process.stderr.write(`bench: ${error instanceof Error ? error.message : String(error)}\n`);
  process.exit(1);
});
