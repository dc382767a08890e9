import { writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { FaultProxy } from '../harness/proxy.js';
import { type CliResult, type RunningCli, uniqueName, waitFor } from '../helpers.js';
import {
  createStream,
  readStored,
  type StreamCount,
  type StreamWatch,
  streamMessage,
  writeStream,
} from '../stream-helpers.js';
import { LEASE, STREAM_LINK_BYTES_PER_S, StreamWorld, warningsSince } from './stream-world.js';
import {
  declare,
  FULL,
  LANDING_RANGE,
  type LogLine,
  logLines,
  percentOf,
  publishWorkload,
  randomBetween,
  sleep,
  stoppedCounters,
} from './world.js';

// The stream target under faults (issue 30): every source message on the stream exactly once, with
// no copy of any kind (no duplicate, nothing flagged x-dedup-in-doubt), across SIGKILLs of the
// bridge, a restart of the target broker, cut stream connections, three replicas with the owner
// of the stream producer killed, and an owner paused past its lease. Each fault is shown to have
// struck mid-transfer (the stream's count when it struck, read by a subscription of the test's own)
// and to have been dealt with: the bridge's reconnect warning, and the split it logs of what was
// unanswered into stored (committed, no copy) and not (sent again) by the broker's last stored ID,
// some of them stored and not committed — the copies a 0-9-1 target would have flagged. The stream
// is counted at the end over the stream protocol, by _HQ_DUPL_ID. `npm run chaos` (CHAOS_FULL=1)
// runs the full table; npm test a short form of it.

const MESSAGES = 3_000;
const KILLS = FULL ? 24 : 6;
const CUTS = FULL ? 10 : 3;
const REPLICA_KILLS = FULL ? 8 : 3;
const STALLS = FULL ? 3 : 1;
/** An owner stalls this long: three leases, so that the other replica takes its producer over. */
const STALL_MS = 6_000;
/**
 * The stall scenario's workload and pace: the other replica forwards while the owner is paused and
 * until the paused one has exited, so each stall takes a share of the transfer; a slower line and
 * more messages in the full run leave room for all of them.
 */
const STALL_MESSAGES = FULL ? 6_000 : MESSAGES;
const STALL_LINK_BYTES_PER_S = FULL ? STREAM_LINK_BYTES_PER_S / 4 : STREAM_LINK_BYTES_PER_S;
const PREFETCH = 200;
const TRANSFER_TIMEOUT_MS = FULL ? 300_000 : 150_000;
const TEST_TIMEOUT_MS = FULL ? 900_000 : 300_000;
/** Faults are spread over this share of the transfer (percent of the messages on the stream). */
const SPAN = { min: 8, max: 85 } as const;

interface Row {
  scenario: string;
  sent: number;
  stored: number;
  lost: number;
  duplicated: number;
  unexpected: number;
  flagged: number;
  faults: number;
  landed: number[];
  /** What the bridges settled by the broker's last stored ID (landed / sent again). */
  settled: string;
  seconds: number;
}

const rows: Row[] = [];

/** Writes a bridge's whole output to a file, for a failure message: where to read it. */
function dump(name: string, output: string): string {
  const path = join(tmpdir(), `${name}-${Date.now()}.log`);
  writeFileSync(path, output);
  return path;
}

function formatRows(): string {
  const head = [
    'scenario',
    'sent',
    'stored',
    'lost',
    'dup',
    'unexpected',
    'flagged',
    'faults',
    'landed at',
    'settled: landed/again',
    's',
  ];
  const body = rows.map((r) => [
    r.scenario,
    String(r.sent),
    String(r.stored),
    String(r.lost),
    String(r.duplicated),
    String(r.unexpected),
    String(r.flagged),
    String(r.faults),
    r.landed.length === 0
      ? '-'
      : `${Math.round(Math.min(...r.landed))}–${Math.round(Math.max(...r.landed))}%`,
    r.settled,
    String(r.seconds),
  ]);
  const widths = head.map((h, i) => Math.max(h.length, ...body.map((row) => (row[i] as string).length)));
  const line = (cells: string[]) => `| ${cells.map((c, i) => c.padEnd(widths[i] as number)).join(' | ')} |`;
  return [line(head), `|${widths.map((w) => '-'.repeat(w + 2)).join('|')}|`, ...body.map(line)].join('\n');
}

/** The stream target's warning that its connection went: `target stream "<name>" at <url>: reconnecting`. */
const reconnecting = (line: LogLine) => /^target stream ".*" at \S+: reconnecting$/.test(line.msg);
/** Either side's stream connection going: a stream source's or a stream target's. */
const streamReconnecting = (line: LogLine) =>
  /^(source|target) stream ".*" at \S+: reconnecting$/.test(line.msg);

/**
 * What bridges settled by the broker's last stored ID, from their logs: each new owner of the
 * producer splits the ledger an earlier one left into landed (stored: committed, no copy) and not
 * landed (sent again, unflagged); each reconnect splits its unanswered publishes into stored and
 * sent again at their IDs.
 */
function settled(outputs: string[]) {
  const figures = { takeovers: 0, landed: 0, notLanded: 0, reconnects: 0, stored: 0, again: 0 };
  for (const line of outputs.flatMap((output) => logLines(output))) {
    if (line.msg.startsWith('stream producer taken')) {
      figures.takeovers++;
      figures.landed += Number(line.landed ?? 0);
      figures.notLanded += Number(line.notLanded ?? 0);
    } else if (line.msg.startsWith('stream connection back')) {
      figures.reconnects++;
      figures.stored += Number(line.stored ?? 0);
      figures.again += Number(line.again ?? 0);
    }
  }
  return figures;
}

function settledText(figures: ReturnType<typeof settled>): string {
  return `${figures.takeovers} takeovers settled ${figures.landed} landed + ${figures.notLanded} not; ${figures.reconnects} reconnects settled ${figures.stored} stored + ${figures.again} again`;
}

/**
 * Confirms come back this much later than the broker sent them, on every stream link: at any
 * moment the messages stored in the last 150 ms are not yet confirmed to the bridge, so that a
 * fault finds some stored and not committed — the copies a 0-9-1 target would have to flag.
 */
const CONFIRM_DELAY_MS = 150;

/** `count` points of the transfer (messages on the stream), one at random in each slice of `span`. */
function faultPoints(count: number, total = MESSAGES, span: { min: number; max: number } = SPAN): number[] {
  const slice = (span.max - span.min) / count;
  return Array.from({ length: count }, (_, k) => {
    const low = span.min + k * slice;
    return Math.round((total * randomBetween(low * 10, (low + slice) * 10)) / 1000);
  });
}

describe(`chaos, stream target (${FULL ? 'full' : 'short'}): exactly once, no copies of any kind`, {
  timeout: TEST_TIMEOUT_MS,
}, () => {
  let world: StreamWorld;
  beforeAll(async () => {
    world = await StreamWorld.create();
  }, 180_000);
  afterAll(async () => {
    if (rows.length > 0) {
      process.stdout.write(
        `\nstream chaos results (${FULL ? 'full' : 'short'} run, ${MESSAGES} messages per scenario (the stall: ${STALL_MESSAGES} at ${STALL_LINK_BYTES_PER_S / 1000} kB/s), prefetch ${PREFETCH}, lease ${LEASE}, stream link ${STREAM_LINK_BYTES_PER_S / 1000} kB/s):\n${formatRows()}\n`,
      );
    }
    await world?.stop();
  }, 120_000);

  /** A source queue with the workload in it, and the name of a stream (declared by the first bridge's target). */
  async function setUp(name: string, count = MESSAGES) {
    const sourceQueue = uniqueName(`schaos-${name}`);
    const stream = uniqueName(`schaos-${name}-s`);
    await declare(world.source.url, sourceQueue);
    // The stream, declared as an application would (run does not create it).
    const { default: amqp } = await import('amqplib');
    const connection = await amqp.connect(world.target.url);
    const channel = await connection.createChannel();
    await channel.assertQueue(stream, { durable: true, arguments: { 'x-queue-type': 'stream' } });
    await connection.close();
    const ids = await publishWorkload(world.source.url, sourceQueue, name, count);
    return { sourceQueue, stream, ids };
  }

  /** The stream's count now, as where a fault struck; printed. */
  function land(watch: StreamWatch, what: string, total = MESSAGES): number {
    const percent = percentOf(watch.count, total);
    process.stdout.write(
      `landing: ${what} struck with ${watch.count} of ${total} on the stream (${percent}%)\n`,
    );
    return percent;
  }

  /** Every fault struck inside the transfer: some but not all of the messages on the stream. */
  function expectLanded(name: string, landed: number[], expected: number): void {
    expect(landed.length, `${name}: faults that struck`).toBe(expected);
    for (const percent of landed) {
      expect(percent, `${name}: a fault struck at ${percent}% of the transfer`).toBeGreaterThanOrEqual(
        LANDING_RANGE.min,
      );
      expect(percent, `${name}: a fault struck at ${percent}% of the transfer`).toBeLessThanOrEqual(
        LANDING_RANGE.max,
      );
    }
  }

  /** 0 lost and 0 copies of any kind on the stream, counted by ID; the figures go in the table. */
  async function finish(
    name: string,
    stream: string,
    ids: readonly string[],
    started: number,
    landed: number[],
    outputs: string[],
  ): Promise<StreamCount> {
    const figures = settled(outputs);
    process.stdout.write(`seen: ${name}: ${settledText(figures)}\n`);
    const { count, evidence } = await world.count(name, stream, ids);
    rows.push({
      scenario: name,
      sent: ids.length,
      stored: count.stored,
      lost: count.lost,
      duplicated: count.duplicated,
      unexpected: count.unexpected,
      flagged: count.flagged,
      faults: landed.length,
      landed,
      settled: `${figures.landed + figures.stored}/${figures.notLanded + figures.again}`,
      seconds: Math.round((Date.now() - started) / 100) / 10,
    });
    expect(count, `${name}: ${evidence}`).toEqual({
      expected: ids.length,
      stored: ids.length,
      lost: 0,
      duplicated: 0,
      unexpected: 0,
      flagged: 0,
    });
    return count;
  }

  /** The first warning a bridge logged from `since` (and before `until`), or fails naming what it did log. */
  function expectNoticed(
    name: string,
    bridge: string,
    since: number,
    matches: (line: LogLine) => boolean,
    until = Number.POSITIVE_INFINITY,
  ): LogLine {
    const warnings = warningsSince(bridge, since).filter((line) => line.time < until);
    const found = warnings.find(matches);
    expect(
      found,
      `${name}: the bridge never logged the fault; its warnings: ${JSON.stringify(warnings.map((w) => w.msg))}`,
    ).toBeDefined();
    return found as LogLine;
  }

  it(`SIGKILL of the bridge ${KILLS} times over one transfer`, async () => {
    const name = 'stream-kill';
    const { sourceQueue, stream, ids } = await setUp(name);
    const started = Date.now();
    const watch = world.watch(stream);
    world.proxy.setDelay(CONFIRM_DELAY_MS);
    const landed: number[] = [];
    const outputs: string[] = [];
    let final: RunningCli | undefined;
    try {
      for (const [k, point] of faultPoints(KILLS).entries()) {
        const bridge = world.startBridge(sourceQueue, stream, { prefetch: PREFETCH });
        // Killed only once it owns the producer and the transfer reached its point.
        const owns = await waitFor(() => bridge.output().includes('stream producer taken'), 60_000);
        const reached = owns && (await watch.until(point, 60_000));
        landed.push(land(watch, `kill ${k + 1}`));
        bridge.signal('SIGKILL');
        const exit = await bridge.done;
        outputs.push(exit.stdout);
        expect(
          reached,
          `kill ${k + 1}: the bridge never took the producer, or the transfer never reached ${point}; ${exit.stdout.slice(-2000)}`,
        ).toBe(true);
      }
      final = world.startBridge(sourceQueue, stream, { prefetch: PREFETCH });
      const done = await world.untilTransferred(sourceQueue, watch, MESSAGES, TRANSFER_TIMEOUT_MS);
      expect(done, `the transfer did not finish: ${watch.count} on the stream`).toBe(true);
    } finally {
      world.proxy.setDelay(0);
      final?.signal('SIGTERM');
      await watch.stop();
    }
    const exit = await (final as RunningCli).done;
    outputs.push(exit.stdout);
    await finish(name, stream, ids, started, landed, outputs);
    expect(exit.code, exit.stderr).toBe(0);
    expectLanded(name, landed, KILLS);
    // Each kill left the next bridge publishes to settle by the broker's last stored ID, and some
    // of them were stored and not committed: the copies a 0-9-1 target would have sent again flagged.
    const figures = settled(outputs);
    expect(figures.takeovers, 'bridges that took the producer over').toBe(KILLS + 1);
    expect(figures.landed + figures.notLanded, 'publishes the kills left to settle').toBeGreaterThan(0);
    expect(figures.landed, 'stored and not committed when their bridge was killed').toBeGreaterThan(0);
    expect(stoppedCounters(exit.stdout)?.inDoubt ?? 0, 'copies forwarded flagged in-doubt').toBe(0);
  });

  // The target node stopped gracefully (SIGTERM, as a restart or an upgrade stops it), in both runs;
  // and in the full run also killed (SIGKILL). A single 3.10.8 node whose stream was killed has
  // been seen to leave the stream STREAM_NOT_AVAILABLE for over a minute after its restart, which
  // no client can help: so the short run, in npm test, restarts it gracefully only.
  for (const how of FULL ? (['stopped', 'killed'] as const) : (['stopped'] as const)) {
    it(`the target broker ${how} and restarted mid-transfer`, async () => {
      const name = `stream-target-${how}`;
      const { sourceQueue, stream, ids } = await setUp(name);
      const started = Date.now();
      const watch = world.watch(stream);
      world.proxy.setDelay(CONFIRM_DELAY_MS);
      const bridge = world.startBridge(sourceQueue, stream, { prefetch: PREFETCH });
      const landed: number[] = [];
      let since = 0;
      try {
        // Early in the transfer, so that most of it still has to cross the restart.
        const [point] = faultPoints(1, MESSAGES, { min: 10, max: 30 });
        expect(await watch.until(point as number, 60_000), bridge.output().slice(-2000)).toBe(true);
        since = Date.now();
        landed.push(land(watch, `target node ${how}`));
        await world.target.stop(how === 'killed');
        await sleep(1000);
        await world.target.start();
        const done = await world.untilTransferred(sourceQueue, watch, MESSAGES, TRANSFER_TIMEOUT_MS);
        expect(
          done,
          `the transfer did not finish: ${watch.count} on the stream; the bridge's output: ${dump(name, bridge.output())}`,
        ).toBe(true);
      } finally {
        world.proxy.setDelay(0);
        bridge.signal('SIGTERM');
        await watch.stop();
      }
      const exit = await bridge.done;
      await finish(name, stream, ids, started, landed, [exit.stdout]);
      expect(exit.code, exit.stderr).toBe(0);
      expectLanded(name, landed, 1);
      const seen = expectNoticed(name, exit.stdout, since, reconnecting);
      process.stdout.write(
        `seen: ${name}: the bridge logged "${seen.msg}" ${seen.time - since} ms after the stop began\n`,
      );
      expect(
        settled([exit.stdout]).reconnects,
        'reconnects that settled unanswered publishes',
      ).toBeGreaterThan(0);
    });
  }

  // A stream as source (issue 31): stream to stream, either broker stopped and restarted while
  // the transfer runs. The replica must equal the source entry for entry, in order, no copy. The
  // short run restarts the source only: a target restart is the scenario above, stream target alike.
  for (const broker of FULL ? (['source', 'target'] as const) : (['source'] as const)) {
    it(`stream to stream: the ${broker} broker stopped and restarted mid-transfer`, async () => {
      const name = `stream-source-${broker}-restart`;
      const sourceStream = uniqueName(`schaos-${name}-src`);
      const stream = uniqueName(`schaos-${name}-s`);
      await createStream(world.source.streamUrl, sourceStream);
      await createStream(world.target.streamUrl, stream);
      await writeStream(
        world.source.streamUrl,
        sourceStream,
        Array.from({ length: MESSAGES }, (_, n) => streamMessage(n, { messageId: `m-${n}`, symbol: true })),
      );
      const started = Date.now();
      const watch = world.watch(stream);
      world.proxy.setDelay(CONFIRM_DELAY_MS);
      const bridge = world.startStreamBridge(sourceStream, stream);
      const landed: number[] = [];
      let since = 0;
      try {
        const [point] = faultPoints(1, MESSAGES, { min: 10, max: 30 });
        expect(await watch.until(point as number, 60_000), bridge.output().slice(-2000)).toBe(true);
        since = Date.now();
        landed.push(land(watch, `${broker} node stopped`));
        const node = broker === 'source' ? world.source : world.target;
        await node.stop(false);
        await sleep(1000);
        await node.start();
        expect(
          await watch.until(MESSAGES, TRANSFER_TIMEOUT_MS),
          `the transfer did not finish: ${watch.count} on the stream; the bridge's output: ${dump(name, bridge.output())}`,
        ).toBe(true);
        // Nothing more comes: a copy would land after the last entry.
        await sleep(2000);
      } finally {
        world.proxy.setDelay(0);
        bridge.signal('SIGTERM');
        await watch.stop();
      }
      const exit = await bridge.done;
      expect(exit.code, exit.stderr).toBe(0);
      expectLanded(name, landed, 1);
      const seen = expectNoticed(name, exit.stdout, since, streamReconnecting);
      process.stdout.write(
        `seen: ${name}: the bridge logged "${seen.msg}" ${seen.time - since} ms after the stop began\n`,
      );
      const source = await readStored(world.source.streamUrl, sourceStream, { count: MESSAGES });
      const copy = await readStored(world.target.streamUrl, stream, { idleMs: 2000 });
      const offsets = copy.map((message) => (message.id ?? '').replace(/^.*@/, ''));
      const seenOffsets = new Set(offsets);
      const figures = {
        source: source.length,
        stored: copy.length,
        lost: source.filter((message) => !seenOffsets.has(String(message.offset))).length,
        duplicated: copy.length - seenOffsets.size,
        outOfOrder: offsets.filter((offset, index) => offset !== String(source[index]?.offset)).length,
        bodiesDiffer: copy.filter(
          (message, index) => !message.body.equals(source[index]?.body ?? Buffer.alloc(0)),
        ).length,
      };
      process.stdout.write(`replica ${name}: ${JSON.stringify(figures)}\n`);
      rows.push({
        scenario: name,
        sent: MESSAGES,
        stored: copy.length,
        lost: figures.lost,
        duplicated: figures.duplicated,
        unexpected: 0,
        flagged: copy.filter((message) => message.mentionsInDoubt).length,
        faults: landed.length,
        landed,
        settled: '-',
        seconds: Math.round((Date.now() - started) / 100) / 10,
      });
      expect(figures).toEqual({
        source: MESSAGES,
        stored: MESSAGES,
        lost: 0,
        duplicated: 0,
        outOfOrder: 0,
        bodiesDiffer: 0,
      });
    });
  }

  it(`the stream connection cut mid-frame ${CUTS} times mid-transfer`, async () => {
    const name = 'stream-cut';
    const { sourceQueue, stream, ids } = await setUp(name);
    const started = Date.now();
    const watch = world.watch(stream);
    world.proxy.setDelay(CONFIRM_DELAY_MS);
    const bridge = world.startBridge(sourceQueue, stream, { prefetch: PREFETCH });
    const landed: number[] = [];
    const cutTimes: number[] = [];
    let done = false;
    try {
      for (const [k, point] of faultPoints(CUTS).entries()) {
        expect(
          await watch.until(point, 60_000),
          `cut ${k + 1}: never reached ${point}; ${bridge.output().slice(-2000)}`,
        ).toBe(true);
        // Cut after a random number of bytes more from the bridge: mostly inside a publish frame.
        const before = world.proxy.clientBytes;
        const bytes = randomBetween(1, 20_000);
        cutTimes.push(Date.now());
        world.proxy.resetAfter(bytes);
        for (let i = 0; i < 200 && world.proxy.clientBytes < before + bytes; i++) await sleep(50);
        expect(
          world.proxy.clientBytes,
          `cut ${k + 1}: the bridge sent no more bytes to cut`,
        ).toBeGreaterThanOrEqual(before + bytes);
        landed.push(land(watch, `cut ${k + 1} (after ${bytes} more bytes)`));
      }
      done = await world.untilTransferred(sourceQueue, watch, MESSAGES, TRANSFER_TIMEOUT_MS);
    } finally {
      world.proxy.setDelay(0);
      bridge.signal('SIGTERM');
      await watch.stop();
    }
    const exit = await bridge.done;
    // A transfer that stopped is counted too (what is missing, and whether anything was copied).
    const output = done ? '' : dump(name, `${exit.stdout}\n${exit.stderr}`);
    await finish(name, stream, ids, started, landed, [exit.stdout]);
    expect(done, `the transfer did not finish; the bridge's output: ${output}`).toBe(true);
    expect(exit.code, exit.stderr).toBe(0);
    expectLanded(name, landed, CUTS);
    // The bridge noticed each cut: its reconnect warning after it, before the next one.
    for (const [k, at] of cutTimes.entries()) {
      const seen = expectNoticed(`${name} ${k + 1}`, exit.stdout, at, reconnecting, cutTimes[k + 1]);
      process.stdout.write(
        `seen: ${name} ${k + 1}: "${seen.msg}" ${seen.time - at} ms after the cut was armed\n`,
      );
    }
    const figures = settled([exit.stdout]);
    expect(figures.reconnects, 'reconnects').toBeGreaterThanOrEqual(1);
    expect(
      figures.stored + figures.again,
      'publishes unanswered when the connection was cut',
    ).toBeGreaterThan(0);
  });

  it(`three run replicas, the producer's owner killed ${REPLICA_KILLS} times`, async () => {
    const name = 'stream-replicas';
    const { sourceQueue, stream, ids } = await setUp(name);
    const started = Date.now();
    const watch = world.watch(stream);
    // Each replica writes through a proxy of its own, so that the one writing (the owner) shows.
    const replicas: { bridge: RunningCli; proxy: FaultProxy }[] = [];
    const spawn = async () => {
      const proxy = await world.streamProxy();
      proxy.setDelay(CONFIRM_DELAY_MS);
      replicas.push({ bridge: world.startBridge(sourceQueue, stream, { proxy, prefetch: PREFETCH }), proxy });
    };
    for (let i = 0; i < 3; i++) await spawn();
    const landed: number[] = [];
    const owners: number[] = [];
    const outputs: string[] = [];
    let mostWriting = 0;
    let exits: CliResult[] = [];
    try {
      for (const [k, point] of faultPoints(REPLICA_KILLS).entries()) {
        expect(await watch.until(point, 90_000), `replica kill ${k + 1}: never reached ${point}`).toBe(true);
        const { owner, most } = await writingReplica(replicas.map((r) => r.proxy));
        expect(
          owner,
          `replica kill ${k + 1}: no one replica was writing to the stream`,
        ).toBeGreaterThanOrEqual(0);
        // Only one replica writes at a time: the others stand by.
        mostWriting = Math.max(mostWriting, most);
        owners.push(owner);
        landed.push(land(watch, `replica kill ${k + 1} (the owner, replica ${owner})`));
        const victim = replicas[owner] as { bridge: RunningCli; proxy: FaultProxy };
        victim.bridge.signal('SIGKILL');
        outputs.push((await victim.bridge.done).stdout);
        await victim.proxy.stop();
        replicas.splice(owner, 1);
        await spawn();
      }
      const done = await world.untilTransferred(sourceQueue, watch, MESSAGES, TRANSFER_TIMEOUT_MS);
      expect(done, `the transfer did not finish: ${watch.count} on the stream`).toBe(true);
    } finally {
      for (const replica of replicas) replica.bridge.signal('SIGTERM');
      exits = await Promise.all(replicas.map((replica) => replica.bridge.done));
      await Promise.all(replicas.map((replica) => replica.proxy.stop()));
      await watch.stop();
    }
    outputs.push(...exits.map((exit) => exit.stdout));
    await finish(name, stream, ids, started, landed, outputs);
    expect(
      exits.map((exit) => exit.code),
      exits.map((exit) => exit.stderr).join('\n'),
    ).toEqual([0, 0, 0]);
    expectLanded(name, landed, REPLICA_KILLS);
    process.stdout.write(
      `seen: ${name}: owners killed: replicas ${owners.join(', ')}; at most ${mostWriting} replica(s) writing at once\n`,
    );
    // Every kill of the owner was followed by a takeover that settled what it left.
    const figures = settled(outputs);
    expect(figures.takeovers, 'takeovers of the producer (the first owner, then one per kill)').toBe(
      REPLICA_KILLS + 1,
    );
    expect(figures.landed + figures.notLanded, 'publishes the kills left to settle').toBeGreaterThan(0);
    expect(mostWriting, 'replicas writing to the stream at once').toBe(1);
    const flagged = exits.reduce((sum, exit) => sum + (stoppedCounters(exit.stdout)?.inDoubt ?? 0), 0);
    expect(flagged, 'copies forwarded flagged in-doubt').toBe(0);
  });

  it(`two run replicas, the producer's owner paused (SIGSTOP) past its lease ${STALLS} time(s)`, async () => {
    const name = 'stream-stall';
    const { sourceQueue, stream, ids } = await setUp(name, STALL_MESSAGES);
    const started = Date.now();
    const watch = world.watch(stream);
    type Replica = { bridge: RunningCli; proxy: FaultProxy };
    const replicas: Replica[] = [];
    const spawn = async () => {
      const proxy = await world.streamProxy();
      proxy.setDelay(CONFIRM_DELAY_MS);
      proxy.setRate(STALL_LINK_BYTES_PER_S);
      replicas.push({ bridge: world.startBridge(sourceQueue, stream, { proxy, prefetch: PREFETCH }), proxy });
    };
    for (let i = 0; i < 2; i++) await spawn();
    const landed: number[] = [];
    /** The owners paused and let go on, each with the moment it was let go on. */
    const fenced: { replica: Replica; resumed: number; wrote: number; exited: Promise<number> }[] = [];
    let exits: CliResult[] = [];
    let fencedExits: CliResult[] = [];
    try {
      for (const [k, point] of faultPoints(STALLS, STALL_MESSAGES).entries()) {
        expect(await watch.until(point, 90_000), `stall ${k + 1}: never reached ${point}`).toBe(true);
        const { owner } = await writingReplica(replicas.map((r) => r.proxy));
        expect(owner, `stall ${k + 1}: no one replica was writing to the stream`).toBeGreaterThanOrEqual(0);
        const paused = replicas[owner] as Replica;
        landed.push(land(watch, `stall ${k + 1} (replica ${owner} paused)`, STALL_MESSAGES));
        const countBefore = watch.count;
        paused.bridge.signal('SIGSTOP');
        await sleep(STALL_MS);
        const grew = watch.count - countBefore;
        process.stdout.write(
          `seen: ${name}: stall ${k + 1}: the stream grew by ${grew} while its owner was paused\n`,
        );
        expect(grew, `stall ${k + 1}: the stream grew while its owner was paused`).toBeGreaterThan(0);
        const wroteBefore = paused.proxy.clientBytes;
        paused.bridge.signal('SIGCONT');
        fenced.push({
          replica: paused,
          resumed: Date.now(),
          wrote: wroteBefore,
          exited: paused.bridge.done.then(() => Date.now()),
        });
        // A fresh replica in its place; the paused one, let go on, is to stop on its own.
        replicas.splice(owner, 1);
        await spawn();
      }
      const done = await world.untilTransferred(sourceQueue, watch, STALL_MESSAGES, TRANSFER_TIMEOUT_MS);
      expect(done, `the transfer did not finish: ${watch.count} on the stream`).toBe(true);
    } finally {
      for (const replica of replicas) replica.bridge.signal('SIGTERM');
      exits = await Promise.all(replicas.map((replica) => replica.bridge.done));
      for (const { replica } of fenced) replica.bridge.signal('SIGCONT');
      fencedExits = await Promise.all(fenced.map(({ replica }) => replica.bridge.done));
      await Promise.all(
        [...replicas, ...fenced.map((f) => f.replica)].map((replica) => replica.proxy.stop()),
      );
      await watch.stop();
    }
    // Each paused owner, let go on, found the producer taken over and stopped (exit 1) so that
    // what it held went back to the source, writing nothing more to the stream.
    for (const [k, { replica, resumed, wrote, exited }] of fenced.entries()) {
      const exit = fencedExits[k] as CliResult;
      const after = logLines(exit.stdout).filter((line) => line.time >= resumed);
      process.stdout.write(
        `seen: ${name}: stall ${k + 1}: the paused owner, let go on, wrote ${replica.proxy.clientBytes - wrote} bytes more and exited ${exit.code} ${(await exited) - resumed} ms after: ${after.map((line) => `+${line.time - resumed}ms ${line.msg}`).join(' | ')} | ${exit.stderr.trim()}\n`,
      );
      expect(exit.code, `stall ${k + 1}: the paused owner: ${exit.stderr}`).toBe(1);
      expect(exit.stderr).toMatch(/another bridge took over the stream producer/);
    }
    const outputs = [...fencedExits, ...exits].map((exit) => exit.stdout);
    await finish(name, stream, ids, started, landed, outputs);
    expect(
      exits.map((exit) => exit.code),
      exits.map((exit) => exit.stderr).join('\n'),
    ).toEqual([0, 0]);
    expectLanded(name, landed, STALLS);
    expect(settled(outputs).takeovers, 'takeovers of the producer').toBe(STALLS + 1);
  });
});

/**
 * Which of the replicas writes to the stream: the one whose proxy carries bytes from it in two
 * polls in a row (100 ms apart); -1 when none does within 20 s. `most` is the largest number of
 * replicas seen writing in one poll: more than one would be two owners of one producer at once.
 */
async function writingReplica(proxies: FaultProxy[]): Promise<{ owner: number; most: number }> {
  const deadline = Date.now() + 20_000;
  let before = proxies.map((proxy) => proxy.clientBytes);
  let streak = new Array<number>(proxies.length).fill(0);
  let most = 0;
  while (Date.now() < deadline) {
    await sleep(100);
    const now = proxies.map((proxy) => proxy.clientBytes);
    const writing = now.map((bytes, i) => bytes - (before[i] as number) > 200);
    most = Math.max(most, writing.filter(Boolean).length);
    streak = streak.map((count, i) => (writing[i] ? count + 1 : 0));
    before = now;
    const busy = streak.map((count, i) => (count >= 2 ? i : -1)).filter((i) => i >= 0);
    if (busy.length === 1) return { owner: busy[0] as number, most };
  }
  return { owner: -1, most };
}
