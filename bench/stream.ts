// npm run bench:stream: dedup-bridge with a stream target (issue 30) beside Shovel into the same
// kind of stream, and the amqplib loop, on the same throwaway brokers in one run, rounds rotating;
// figures as ratios, never as pass/fail. See docs/performance.md, "Stream target".
//
// The target node runs the stream plugin. Each round moves the same preloaded source queue (1 KiB,
// persistent, each message with its own _HQ_DUPL_ID) into a new stream declared over AMQP 0-9-1
// (x-queue-type: stream), the same for every system:
// - dedup-bridge: `migrate --target rabbitmq-stream://… --target-stream S`, over the stream protocol;
// - Shovel: a dynamic shovel in the source node, dest-queue = the stream, over 0-9-1 (on-confirm);
// - amqplib loop: bench/loop.ts, publishing into the stream over 0-9-1 with confirms (no dedup).
// A round is timed from the first message to the last committed on the stream, as seen by one
// live stream-protocol subscriber counting each chunk's records (the same for every system; a
// 0-9-1 queue's message count of a stream is refreshed every few seconds, so it cannot time a
// round). After the mover has finished, the stream is read back over 0-9-1 and counted by ID,
// outside the timing.
// Exits non-zero only when a round did not deliver every message exactly once.
import { type ChildProcess, spawn } from 'node:child_process';
import { rmSync, writeFileSync } from 'node:fs';
import { loadavg } from 'node:os';
import { fileURLToPath } from 'node:url';
import amqp from 'amqplib';
import { Redis } from 'ioredis';
import { type Chunk, StreamClient } from '../src/stream/client.js';
import {
  cleanLeftovers,
  freePort,
  newRunDir,
  processCpuMs,
  RabbitNode,
  RedisServer,
} from '../test/harness/servers.js';

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const CLI = `${ROOT}bin/dedup-bridge.js`;

const args = process.argv.slice(2);
const option = (name: string, fallback: string) => {
  const index = args.indexOf(name);
  return index >= 0 ? (args[index + 1] ?? fallback) : fallback;
};
const ROUNDS = Number(option('--rounds', '3'));
const MESSAGES = Number(option('--messages', '20000'));
const JSON_PATH = option('--json', '');
const PREFETCH = 1000;
const SIZE = 1024;
// As in bench/run.ts: each round is also measured from the arrival of this share of it to the
// last, past most of a new mover process's cold start.
const STEADY_FROM = 0.5;
// --no-loop: the bridge and Shovel only.
const SYSTEMS: System[] = args.includes('--no-loop')
  ? ['dedup-bridge', 'Shovel']
  : ['dedup-bridge', 'Shovel', 'amqplib loop'];

type System = 'dedup-bridge' | 'Shovel' | 'amqplib loop';
type CpuUse = Record<'mover' | 'source broker' | 'target broker' | 'Redis', number>;
type Pids = Record<keyof CpuUse, number | undefined>;

interface Round {
  system: System;
  round: number;
  rate: number;
  steady: number;
  cpu: CpuUse;
  /** Redis script calls the mover sent per message (the bridge's claims, reservations, commits). */
  redisCalls: number;
  /** Records on the stream, distinct IDs among them, IDs sent. */
  onStream: number;
  distinct: number;
  sent: number;
  exact: boolean;
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
const median = (values: number[]) => {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.floor(sorted.length / 2)] ?? 0;
};
const say = (text: string) => process.stdout.write(`${text}\n`);

let failures = 0;
let seq = 0;

async function main(): Promise<void> {
  cleanLeftovers();
  const runDir = newRunDir();
  const streamPort = await freePort();
  const source = new RabbitNode(runDir, 'bench-source', { plugins: ['rabbitmq_shovel'] });
  const target = new RabbitNode(runDir, 'bench-stream', {
    plugins: ['rabbitmq_stream'],
    config: [`stream.listeners.tcp.1 = ${streamPort}`],
  });
  const redis = new RedisServer(runDir, 'bench-redis');
  say('bench:stream: starting two RabbitMQ nodes (the target with the stream plugin) and Redis…');
  await Promise.all([source.start(), target.start(), redis.start()]);
  const streamUrl = `rabbitmq-stream://guest:guest@127.0.0.1:${streamPort}/`;
  const counter = await StreamClient.connect({ url: streamUrl, connectionName: 'bench-stream counter' });
  const stats = new Redis(redis.url);
  const bench: Bench = { source, target, redis, streamUrl, counter, stats };
  say(
    `bench:stream: load average at the start ${loadavg()
      .map((load) => load.toFixed(2))
      .join(' ')}`,
  );
  const rounds: Round[] = [];
  try {
    // One untimed round each first (a mover's first transfer, and the brokers' first streams).
    for (const system of SYSTEMS) await measure(bench, system, Math.min(MESSAGES, 2000), 0);
    for (let round = 1; round <= ROUNDS; round++) {
      // Each round starts with the next system, so that none always runs first or last.
      const order = SYSTEMS.map((_, index) => SYSTEMS[(index + round - 1) % SYSTEMS.length] as System);
      for (const system of order) {
        const result = await measure(bench, system, MESSAGES, round);
        rounds.push(result);
        say(
          `  round ${round} · ${system}: ${Math.round(result.rate)} msg/s, steady ${Math.round(result.steady)} msg/s; ` +
            `on the stream ${result.onStream}, distinct IDs ${result.distinct} of ${result.sent}${result.exact ? '' : ' — NOT exactly once'}; ` +
            `load ${loadavg()[0]?.toFixed(1)}`,
        );
      }
    }
  } finally {
    await counter.close();
    await stats.quit();
    await Promise.allSettled([source.stop(), target.stop(), redis.stop()]);
    rmSync(runDir, { recursive: true, force: true });
  }
  say(
    `bench:stream: load average at the end ${loadavg()
      .map((load) => load.toFixed(2))
      .join(' ')}`,
  );
  report(rounds);
  if (failures > 0) {
    say(`bench:stream: ${failures} round(s) did not deliver every message exactly once`);
    process.exit(1);
  }
}

function report(rounds: Round[]): void {
  const of = (system: System) => rounds.filter((round) => round.system === system);
  const rate = (system: System) => median(of(system).map((round) => round.rate));
  const steady = (system: System) => median(of(system).map((round) => round.steady));
  say(
    `\nbench:stream: medians of ${ROUNDS} rotating rounds, ${MESSAGES} messages of ${SIZE} B, persistent, prefetch ${PREFETCH}, into a stream`,
  );
  say(`\nmsg/s (whole rounds from the first arrival; steady from the arrival of ${STEADY_FROM * 100}% on)`);
  const loop = SYSTEMS.includes('amqplib loop');
  say(
    `| measure | dedup-bridge (stream protocol) | Shovel (0-9-1) |${loop ? ' amqplib loop (0-9-1) |' : ''} bridge/Shovel |${loop ? ' bridge/loop |' : ''}`,
  );
  say(`|---|---|---|${loop ? '---|' : ''}---|${loop ? '---|' : ''}`);
  const rows = [
    { name: 'whole rounds', value: rate },
    { name: 'steady', value: steady },
  ].map(({ name, value }) => {
    const bridge = value('dedup-bridge');
    const shovel = value('Shovel');
    const amqplibLoop = loop ? value('amqplib loop') : 0;
    say(
      `| ${name} | ${Math.round(bridge)} | ${Math.round(shovel)} |${loop ? ` ${Math.round(amqplibLoop)} |` : ''} ${(bridge / shovel).toFixed(2)}× |${loop ? ` ${(bridge / amqplibLoop).toFixed(2)}× |` : ''}`,
    );
    return { name, bridge, shovel, loop: amqplibLoop, bridgeOverShovel: bridge / shovel };
  });
  // Each round's bridge against the Shovel of the same rotation (minutes apart at most): steadier
  // than the ratio of the medians on a host whose speed drifts.
  const pairs = of('dedup-bridge').map((bridge) => ({
    bridge,
    shovel: of('Shovel').find((round) => round.round === bridge.round) as Round,
  }));
  const perRound = {
    whole: median(pairs.map(({ bridge, shovel }) => bridge.rate / shovel.rate)),
    steady: median(pairs.map(({ bridge, shovel }) => bridge.steady / shovel.steady)),
  };
  say(
    `bridge/Shovel round by round: whole ${pairs.map(({ bridge, shovel }) => (bridge.rate / shovel.rate).toFixed(2)).join(' · ')} (median ${perRound.whole.toFixed(2)}×); ` +
      `steady ${pairs.map(({ bridge, shovel }) => (bridge.steady / shovel.steady).toFixed(2)).join(' · ')} (median ${perRound.steady.toFixed(2)}×)`,
  );
  const redisCalls = median(of('dedup-bridge').map((round) => round.redisCalls));
  say(
    `Redis script calls sent by the bridge per message: ${redisCalls.toFixed(3)} (median; claims, reservations, commits)`,
  );
  say(
    '\nCPU ms per 1,000 messages, from the first arrival until the mover finished (medians; Shovel runs inside the source broker)',
  );
  say('| system | mover | source broker | target broker | Redis | all |');
  say('|---|---|---|---|---|---|');
  const cpu = SYSTEMS.map((system) => {
    const row = Object.fromEntries(
      (['mover', 'source broker', 'target broker', 'Redis'] as const).map((name) => [
        name,
        median(of(system).map((round) => round.cpu[name])),
      ]),
    ) as CpuUse;
    const all = row.mover + row['source broker'] + row['target broker'] + row.Redis;
    say(
      `| ${system} | ${row.mover.toFixed(0)} | ${row['source broker'].toFixed(0)} | ${row['target broker'].toFixed(0)} | ${row.Redis.toFixed(0)} | ${all.toFixed(0)} |`,
    );
    return { system, ...row, all };
  });
  say('\nexactly once, per round: records on the stream / distinct IDs / IDs sent');
  for (const system of SYSTEMS) {
    say(
      `  ${system}: ${of(system)
        .map((round) => `${round.onStream} / ${round.distinct} / ${round.sent}`)
        .join(' · ')}`,
    );
  }
  if (JSON_PATH) {
    writeFileSync(
      JSON_PATH,
      `${JSON.stringify({ date: new Date().toISOString(), messages: MESSAGES, rounds: ROUNDS, table: rows, perRound, redisCalls, cpu, raw: rounds }, null, 2)}\n`,
    );
  }
}

interface Bench {
  source: RabbitNode;
  target: RabbitNode;
  redis: RedisServer;
  streamUrl: string;
  /** One stream-protocol connection for the whole run: each round's live subscriber. */
  counter: StreamClient;
  /** For INFO commandstats, read before and after a round, outside its timing. */
  stats: Redis;
}

/** One round: a new source queue and stream, preload, move, time the arrivals, verify. */
async function measure(bench: Bench, system: System, count: number, round: number): Promise<Round> {
  const { source, target, redis } = bench;
  seq++;
  const name = `bench-stream-${process.pid}-${seq}`;
  await declare(source.url, name, {});
  await declare(target.url, name, { 'x-queue-type': 'stream' });
  const sent = await preload(source.url, name, count);
  // The subscriber is live before the mover starts, so it sees the first arrival as it lands.
  const arrivals = await watch(bench.counter, name);
  const callsBefore = await scriptCalls(bench.stats);
  const mover = startMover(system, bench, name, count);
  const pids: Pids = {
    mover: typeof mover === 'string' ? undefined : mover.pid,
    'source broker': source.pid(),
    'target broker': target.pid(),
    Redis: redis.pid(),
  };
  const label = `round ${round} · ${system}`;
  const timing = await arrivals.until(count, Math.ceil(count * STEADY_FROM), pids, 300_000);
  if (typeof mover === 'string') {
    // Shovel acks each message once the target confirmed it: give its last acks time to land.
    await sleep(300);
  } else if (!(await moverDone(mover, 60_000))) {
    failures++;
    say(`  ${label}: the mover did not finish within 60 s of the last arrival`);
  } else if (mover.exitCode !== 0) {
    failures++;
    say(`  ${label}: the mover exited with ${mover.exitCode ?? mover.signalCode}`);
  }
  const end = cpuSample(pids);
  await stopMover(mover, source);
  await arrivals.stop();
  const redisCalls = ((await scriptCalls(bench.stats)) - callsBefore) / count;
  const left = await depth(source.url, name);
  if (left !== 0) {
    failures++;
    say(`  ${label}: ${left} messages left in the source queue`);
  }
  const seen = await readBack(target.url, name, count);
  let wrong = 0;
  for (const id of sent) if (seen.get(id) !== 1) wrong++;
  for (const id of seen.keys()) if (!sent.has(id)) wrong++;
  const onStream = [...seen.values()].reduce((a, b) => a + b, 0);
  if (wrong > 0) {
    failures++;
    say(`  ${label}: ${wrong} IDs not on the stream exactly once`);
  }
  const ms = Math.max(timing.last - timing.first, 1);
  const steadyMs = timing.last - timing.steady.at;
  const steadyMessages = count - timing.steady.arrived;
  return {
    system,
    round,
    rate: count / (ms / 1000),
    steady: steadyMs > 0 && steadyMessages > 0 ? steadyMessages / (steadyMs / 1000) : count / (ms / 1000),
    cpu: per1000(timing.firstCpu, end, count),
    redisCalls,
    onStream,
    distinct: seen.size,
    sent: sent.size,
    exact: wrong === 0,
  };
}

/** Script calls Redis has run so far (what a client sends as one call; INFO commandstats). */
async function scriptCalls(redis: Redis): Promise<number> {
  let calls = 0;
  for (const match of (await redis.info('commandstats')).matchAll(
    /^cmdstat_(?:evalsha|eval):calls=(\d+)/gm,
  )) {
    calls += Number(match[1]);
  }
  return calls;
}

async function declare(url: string, queue: string, args: Record<string, string>): Promise<void> {
  const connection = await amqp.connect(url);
  const channel = await connection.createChannel();
  await channel.assertQueue(queue, { durable: true, arguments: args });
  await connection.close();
}

/** Preloads `count` persistent 1 KiB messages, each with its own _HQ_DUPL_ID; returns the IDs. */
async function preload(url: string, queue: string, count: number): Promise<Set<string>> {
  const connection = await amqp.connect(url);
  const channel = await connection.createConfirmChannel();
  const body = Buffer.alloc(SIZE, 'x');
  const sent = new Set<string>();
  for (let i = 0; i < count; i++) {
    const id = `${queue}-${i}`;
    sent.add(id);
    if (!channel.sendToQueue(queue, body, { persistent: true, headers: { _HQ_DUPL_ID: id } })) {
      await channel.waitForConfirms();
    }
    if (i % 2000 === 1999) await channel.waitForConfirms();
  }
  await channel.waitForConfirms();
  await connection.close();
  return sent;
}

const SUBSCRIPTION = 1;

interface Timing {
  first: number;
  firstCpu: CpuUse;
  steady: { at: number; arrived: number };
  last: number;
}

/**
 * A live subscriber from the stream's start that counts the records of each chunk as the broker
 * delivers it (a chunk is delivered once committed). The CPU of every process is read three
 * times only: at the first arrival, the steady mark and the last.
 */
async function watch(client: StreamClient, stream: string) {
  let arrived = 0;
  let onChunk: ((id: number, chunk: Chunk) => void) | undefined;
  await client.subscribe(SUBSCRIPTION, stream, 'first', 50);
  return {
    until(expected: number, steadyFrom: number, pids: Pids, timeoutMs: number): Promise<Timing> {
      return new Promise((resolve, reject) => {
        let first = 0;
        let firstCpu: CpuUse | undefined;
        let steady: Timing['steady'] | undefined;
        const timer = setTimeout(
          () => reject(new Error(`timed out with ${arrived}/${expected} on stream ${stream}`)),
          timeoutMs,
        );
        onChunk = (id, chunk) => {
          if (id !== SUBSCRIPTION || chunk.chunkType !== 0) return;
          const now = performance.now();
          if (arrived === 0) {
            first = now;
            firstCpu = cpuSample(pids);
          }
          arrived += chunk.numRecords;
          if (steady === undefined && arrived >= steadyFrom) steady = { at: now, arrived };
          if (arrived >= expected) {
            clearTimeout(timer);
            resolve({
              first,
              firstCpu: firstCpu as CpuUse,
              steady: steady ?? { at: now, arrived },
              last: now,
            });
          }
        };
        client.on('chunk', onChunk);
      });
    },
    async stop(): Promise<void> {
      if (onChunk) client.off('chunk', onChunk);
      await client.unsubscribe(SUBSCRIPTION);
    },
  };
}

/**
 * Reads the stream back over AMQP 0-9-1 from its first offset (as a consumer of the target would)
 * and counts each _HQ_DUPL_ID; stops 500 ms after the last message once `expected` have come.
 */
async function readBack(url: string, stream: string, expected: number): Promise<Map<string, number>> {
  const connection = await amqp.connect(url);
  const channel = await connection.createChannel();
  await channel.prefetch(2000);
  const seen = new Map<string, number>();
  let total = 0;
  await new Promise<void>((resolve) => {
    let timer = setTimeout(resolve, 60_000);
    void channel.consume(
      stream,
      (message) => {
        if (!message) return;
        const id = String(message.properties.headers?._HQ_DUPL_ID);
        seen.set(id, (seen.get(id) ?? 0) + 1);
        total++;
        // A stream consumer's acks are its credit.
        channel.ack(message);
        if (total >= expected) {
          clearTimeout(timer);
          timer = setTimeout(resolve, 500);
        }
      },
      { noAck: false, arguments: { 'x-stream-offset': 'first' } },
    );
  });
  await connection.close();
  return seen;
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

function startMover(system: System, bench: Bench, name: string, count: number): ChildProcess | string {
  const { source, target, redis } = bench;
  if (system === 'dedup-bridge') {
    return spawn(
      process.execPath,
      [
        CLI,
        'migrate',
        '--source',
        source.url,
        '--source-queue',
        name,
        '--target',
        bench.streamUrl,
        '--target-stream',
        name,
        '--redis',
        redis.url,
        '--prefetch',
        String(PREFETCH),
        '--idle-timeout',
        '200ms',
        '--log-level',
        'warn',
        '--quiet',
        '--job-name',
        `bench-${name}`,
      ],
      { stdio: ['ignore', 'ignore', 'inherit'] },
    );
  }
  if (system === 'amqplib loop') {
    return spawn(
      process.execPath,
      [
        '--import',
        'tsx',
        `${ROOT}bench/loop.ts`,
        source.url,
        name,
        target.url,
        name,
        String(PREFETCH),
        String(count),
      ],
      { stdio: ['ignore', 'ignore', 'inherit'], cwd: ROOT },
    );
  }
  const shovel = `bench-shovel-${name}`;
  void source.ctl(
    'set_parameter',
    'shovel',
    shovel,
    JSON.stringify({
      'src-protocol': 'amqp091',
      'src-uri': source.url,
      'src-queue': name,
      'dest-protocol': 'amqp091',
      'dest-uri': target.url,
      'dest-queue': name,
      'ack-mode': 'on-confirm',
      'src-prefetch-count': PREFETCH,
    }),
  );
  return shovel;
}

async function stopMover(mover: ChildProcess | string, source: RabbitNode): Promise<void> {
  if (typeof mover === 'string') {
    await source.ctl('clear_parameter', 'shovel', mover).catch(() => '');
    return;
  }
  if (mover.exitCode === null && mover.signalCode === null) {
    const exited = new Promise((resolve) => mover.once('exit', resolve));
    mover.kill('SIGTERM');
    await exited;
  }
}

function cpuSample(pids: Pids): CpuUse {
  const names = Object.keys(pids) as (keyof CpuUse)[];
  return Object.fromEntries(names.map((name) => [name, processCpuMs(pids[name])])) as CpuUse;
}

function per1000(from: CpuUse, to: CpuUse, messages: number): CpuUse {
  return Object.fromEntries(
    Object.entries(to).map(([name, used]) => [name, ((used - from[name as keyof CpuUse]) / messages) * 1000]),
  ) as CpuUse;
}

/** Waits for a mover process to exit on its own, reading its CPU until then (its tail counts). */
async function moverDone(mover: ChildProcess, timeoutMs: number): Promise<boolean> {
  const deadline = Date.now() + timeoutMs;
  while (mover.exitCode === null && mover.signalCode === null) {
    processCpuMs(mover.pid);
    if (Date.now() > deadline) return false;
    await sleep(20);
  }
  return true;
}

main().catch((error: unknown) => {
  process.stderr.write(`bench:stream: ${error instanceof Error ? error.message : String(error)}\n`);
  process.exit(1);
});
