import { rmSync } from 'node:fs';
import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it, onTestFinished } from 'vitest';
import { FaultProxy } from '../harness/proxy.js';
import { newRunDir, RedisServer } from '../harness/servers.js';
import {
  type CliResult,
  countDelivery,
  depthOf,
  idsOf,
  migrateArgs,
  migrateWithReport,
  numbered,
  publishAll,
  queuePair,
  runArgs,
  runCli,
  servers,
  startCli,
  takeAll,
  waitFor,
  withIds,
  withOption,
} from '../helpers.js';

// Issue 34.4 and 34.5: a Redis that answers but refuses (full: OOM under noeviction) and a Redis
// that forgets (FLUSHDB) under a running migration. Each test has a Redis of its own, started here,
// since they fill it or empty it.

let runDir: string;
let redis: RedisServer;
let admin: Redis;

beforeAll(async () => {
  runDir = newRunDir();
  redis = new RedisServer(runDir, 'trouble-redis');
  await redis.start();
  admin = new Redis(redis.url, { lazyConnect: true, maxRetriesPerRequest: 1 });
  // While a test has stopped this Redis, the admin client reconnects quietly.
  admin.on('error', () => {});
  await admin.connect();
});

afterAll(async () => {
  admin?.disconnect();
  await redis?.stop();
  if (runDir) rmSync(runDir, { recursive: true, force: true });
});

/** Full: at (here far past) maxmemory with noeviction, so Redis refuses every write with OOM. */
async function fill(): Promise<void> {
  await admin.config('SET', 'maxmemory-policy', 'noeviction');
  await admin.config('SET', 'maxmemory', '1');
}

async function unfill(): Promise<void> {
  await admin.config('SET', 'maxmemory', '0');
}

/** `dedup-bridge migrate` between the harness's brokers, with this file's own Redis. */
function migrateArgsTo(source: string, target: string, ...extra: string[]): string[] {
  return withOption(migrateArgs(source, ['--target-queue', target], ...extra), '--redis', redis.url);
}

/** The lines the CLI wrote on stderr for itself (not the report's table). */
const ownLines = (stderr: string) => stderr.split('\n').filter((line) => line.startsWith('dedup-bridge:'));

describe('a full Redis (OOM under noeviction)', () => {
  it('at start, migrate waits --retry-for, then one line and exit 1, not an internal error; nothing moves', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const { messages } = numbered(source, 20);
    await publishAll(sourceUrl, source, messages);
    await fill();
    try {
      const started = Date.now();
      const result = await migrateWithReport(migrateArgsTo(source, target, '--retry-for', '2s'));
      const seconds = (Date.now() - started) / 1000;
      process.stdout.write(`oom at start (migrate): exit ${result.code} after ${seconds.toFixed(1)}s\n`);
      expect(result.code).toBe(1);
      expect(result.stderr).not.toMatch(/internal error|ReplyError|\n\s+at /);
      const lines = ownLines(result.stderr);
      expect(lines).toHaveLength(1);
      expect(lines[0]).toMatch(
        /^dedup-bridge: Redis at redis:\/\/127\.0\.0\.1:\d+ refused writes for [23]s \(OOM command not allowed when used memory > 'maxmemory'\) when taking the job lock, past --retry-for: it is full .*raise its maxmemory or free memory.*; nothing was moved: run again when it is back$/,
      );
      expect(seconds).toBeLessThan(20);
      expect(result.report?.exitCode).toBe(1);
    } finally {
      await unfill();
    }
    expect(await depthOf(targetUrl, target)).toBe(0);
    expect(await depthOf(sourceUrl, source)).toBe(messages.length);
  });

  it('at start, run --retry-for 2s: one line naming the dedup scope, exit 1', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    await publishAll(sourceUrl, source, numbered(source, 5).messages);
    await fill();
    try {
      const result = await runCli(
        withOption(runArgs(source, ['--target-queue', target], '--retry-for', '2s'), '--redis', redis.url),
      );
      process.stdout.write(`oom at start (run): exit ${result.code}\n`);
      expect(result.code).toBe(1);
      expect(result.stderr).not.toMatch(/internal error|ReplyError|\n\s+at /);
      expect(result.stderr.trim().split('\n')).toHaveLength(1);
      expect(result.stderr).toMatch(
        /^dedup-bridge: Redis at redis:\/\/127\.0\.0\.1:\d+ refused writes for [23]s \(OOM command not allowed when used memory > 'maxmemory'\) when opening the dedup scope, past --retry-for: /,
      );
    } finally {
      await unfill();
    }
    expect(await depthOf(targetUrl, target)).toBe(0);
    expect(await depthOf(sourceUrl, source)).toBe(5);
  });

  it('mid-run, migrate ends after --retry-for with exit 1 and the OOM line; nothing is lost, and a run after it completes', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const { ids, messages } = numbered(source, 3000);
    await publishAll(sourceUrl, source, messages);
    const run = migrateWithReport(
      migrateArgsTo(source, target, '--retry-for', '2s', '--prefetch', '100', '--max-rate', '600'),
    );
    expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= 300)).toBe(true);
    await fill();
    const atFault = await depthOf(targetUrl, target);
    let result: Awaited<typeof run>;
    try {
      result = await run;
    } finally {
      await unfill();
    }
    const onTarget = idsOf(await takeAll(targetUrl, target));
    const inSource = idsOf(await takeAll(sourceUrl, source));
    process.stdout.write(
      `oom mid-run: ${atFault} of ${messages.length} on the target when Redis filled; exit ${result.code}; ${onTarget.length} on the target, ${inSource.length} left in the source\n`,
    );
    // It struck mid-transfer.
    expect(atFault).toBeGreaterThan(0);
    expect(atFault).toBeLessThan(messages.length / 2);
    expect(result.code).toBe(1);
    expect(result.stderr).not.toMatch(/internal error|\n\s+at /);
    const lines = ownLines(result.stderr);
    expect(lines).toHaveLength(1);
    expect(lines[0]).toMatch(
      /^dedup-bridge: Redis at redis:\/\/127\.0\.0\.1:\d+ refused writes for \ds \(OOM command not allowed when used memory > 'maxmemory'\), past --retry-for: it is full .*raise its maxmemory or free memory.*; nothing unforwarded was acked: run again when it is back$/,
    );
    const report = result.report as Record<string, unknown>;
    expect(report.outcome).toBe('failed');
    expect(report.exitCode).toBe(1);
    expect(String(report.problem)).toMatch(/refused writes for \ds \(OOM /);
    // Nothing lost: each ID is on the target or still in the source.
    const first = countDelivery('oom mid-run (target + source)', ids, [...onTarget, ...inSource]);
    expect(first.lost).toBe(0);
    expect(first.unexpected).toBe(0);
    expect(inSource.length).toBeGreaterThan(0);
    expect(report.forwarded).toBe(onTarget.length);

    // Redis has room again: the next run forwards the rest, and no ID twice.
    await publishAll(sourceUrl, source, withIds(inSource));
    const again = await migrateWithReport(migrateArgsTo(source, target));
    expect(again.code).toBe(0);
    const rest = idsOf(await takeAll(targetUrl, target));
    const total = countDelivery('oom mid-run, then run again', ids, [...onTarget, ...rest]);
    expect(total.lost).toBe(0);
    expect(total.duplicated).toBe(0);
    expect(total.unexpected).toBe(0);
  });
});

describe('a Redis that dies mid-run and stays down', () => {
  it('migrate ends after --retry-for with exit 1, says its job lock was not released, and loses nothing', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const { ids, messages } = numbered(source, 2000);
    await publishAll(sourceUrl, source, messages);
    const run = migrateWithReport(
      migrateArgsTo(source, target, '--retry-for', '2s', '--prefetch', '100', '--max-rate', '600'),
    );
    expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= 300)).toBe(true);
    await redis.stop(true);
    const atFault = await depthOf(targetUrl, target);
    let result: Awaited<typeof run>;
    try {
      // Before the fix the run never ended: dropping the job lock waited for Redis.
      result = await run;
    } finally {
      await redis.start();
    }
    const onTarget = idsOf(await takeAll(targetUrl, target));
    const inSource = idsOf(await takeAll(sourceUrl, source));
    process.stdout.write(
      `redis gone mid-run: ${atFault} of ${messages.length} on the target when it died; exit ${result.code}; ${onTarget.length} on the target, ${inSource.length} left in the source\n`,
    );
    // It struck mid-transfer, and the bridge saw it.
    expect(atFault).toBeLessThan(messages.length / 2);
    expect(result.stdout + result.stderr).toMatch(/lost; reconnecting/);
    expect(result.code).toBe(1);
    expect(result.stderr).not.toMatch(/internal error|\n\s+at /);
    const own = ownLines(result.stderr);
    expect(own).toHaveLength(1);
    expect(own[0]).toMatch(
      /^dedup-bridge: Redis at redis:\/\/127\.0\.0\.1:\d+ unreachable for \ds \(--retry-for\)/,
    );
    expect(result.stdout + result.stderr).toMatch(
      /job lock not released \((Redis did not answer within 5s|the release failed: Connection is closed\.)\); unless the release still reaches it, the next run of this job is refused until the lock expires, within --job-lock-lease \(30s\)/,
    );
    expect(result.report).toMatchObject({ outcome: 'failed', exitCode: 1 });
    // Nothing lost: each ID is on the target or back in the source.
    const count = countDelivery('redis gone mid-run (target + source)', ids, [...onTarget, ...inSource]);
    expect(count.lost).toBe(0);
    expect(count.unexpected).toBe(0);
    expect(inSource.length).toBeGreaterThan(0);
  });
});

describe('a Redis back while a run ends', () => {
  it('migrate drops its job lock once Redis answers within the wait, and the next run of the job is not refused', async () => {
    // A Redis of its own, with its append-only file as the docs ask: killed, it comes back with
    // what it held (the file's Redis comes back empty, and forgets every ID, as documented).
    const durable = new RedisServer(runDir, 'durable-redis', true);
    onTestFinished(() => durable.stop());
    await durable.start();
    const check = new Redis(durable.url, { lazyConnect: true, maxRetriesPerRequest: 1 });
    check.on('error', () => {});
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const { ids, messages } = numbered(source, 2000);
    await publishAll(sourceUrl, source, messages);
    const job = `back-at-end-${source}`;
    const args = withOption(
      migrateArgsTo(source, target, '--job-name', job, '--retry-for', '8s', '--prefetch', '100'),
      '--redis',
      durable.url,
    );
    const run = startCli([...args, '--max-rate', '600', '--log-level', 'debug']);
    expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= 300)).toBe(true);
    await durable.stop(true);
    const atFault = await depthOf(targetUrl, target);
    // Redis comes back once the run, past --retry-for, has begun dropping its lock, right after its
    // client failed an attempt: after 8 s of outage the next is 4-6 s away, past most of the 5 s
    // the release waits (the parent commit left the lock there, and the next run was refused).
    let backAfterRelease = false;
    let afterAnAttempt = false;
    try {
      backAfterRelease = await waitFor(() => run.output().includes('dropping the job lock'), 30_000);
      const from = run.output().indexOf('dropping the job lock');
      afterAnAttempt = await waitFor(
        () => run.output().slice(from).includes('connection error; reconnecting'),
        3800,
      );
    } finally {
      await durable.start();
    }
    const first = await run.done;
    let lockLeft: number;
    try {
      await check.connect();
      lockLeft = await check.exists(`dedup:job:${job}`);
    } finally {
      check.disconnect();
    }
    // The next run of the job, at once: not refused (exit 3); it moves what the first left.
    const second = await runCli(args);
    const targetMessages = await takeAll(targetUrl, target);
    const onTarget = idsOf(targetMessages);
    const inSource = idsOf(await takeAll(sourceUrl, source));
    const flagged = targetMessages.filter((m) => m.properties.headers?.['x-dedup-in-doubt'] === true).length;
    process.stdout.write(
      `redis back while the run ended: ${atFault} of ${messages.length} on the target when it died; exits ${first.code} then ${second.code}; lock left ${lockLeft}; ${onTarget.length} on the target (${flagged} flagged in-doubt), ${inSource.length} left in the source\n`,
    );
    expect(backAfterRelease, first.stdout + first.stderr).toBe(true);
    process.stdout.write(`redis back right after a failed attempt of the run's client: ${afterAnAttempt}\n`);
    expect(atFault).toBeLessThan(messages.length / 2);
    expect(first.code).toBe(1);
    expect(first.stdout + first.stderr).not.toMatch(/job lock not released/);
    expect(lockLeft).toBe(0);
    expect(second.code, second.stdout + second.stderr).toBe(0);
    const count = countDelivery('redis back while the run ended', ids, [...onTarget, ...inSource]);
    expect([count.lost, count.unexpected]).toEqual([0, 0]);
    // A copy confirmed by the target whose commit Redis's death cut off goes again, flagged.
    expect(count.duplicated).toBeLessThanOrEqual(flagged);
    expect(inSource).toEqual([]);
  });
});

describe('a full Redis under run', () => {
  it('run --retry-for 2s gives up as for a lost connection: one line, exit 1; what it held stays in the source', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const first = numbered(`${source}-a`, 50);
    const second = numbered(`${source}-b`, 50);
    // A stop lets in-flight work finish for --shutdown-timeout (30 s): a claim Redis refuses cannot.
    const args = runArgs(source, ['--target-queue', target], '--retry-for', '2s', '--shutdown-timeout', '1s');
    const bridge = startCli(withOption(args, '--redis', redis.url));
    let ended = false;
    void bridge.done.then(() => {
      ended = true;
    });
    let result: CliResult | 'still running';
    try {
      await publishAll(sourceUrl, source, first.messages);
      expect(await waitFor(async () => (await depthOf(targetUrl, target)) === first.ids.length)).toBe(true);
      await fill();
      await publishAll(sourceUrl, source, second.messages);
      result = await Promise.race([
        bridge.done,
        new Promise<'still running'>((resolve) => setTimeout(() => resolve('still running'), 30_000)),
      ]);
    } finally {
      if (!ended) bridge.signal('SIGKILL');
      await unfill();
    }
    expect(result, bridge.output().slice(-3000)).not.toBe('still running');
    const done = result as CliResult;
    const onTarget = idsOf(await takeAll(targetUrl, target));
    const inSource = idsOf(await takeAll(sourceUrl, source));
    process.stdout.write(
      `oom under run: exit ${done.code}; ${onTarget.length} on the target, ${inSource.length} left in the source\n`,
    );
    expect(done.code).toBe(1);
    expect(done.stderr).toMatch(
      /^dedup-bridge: Redis at redis:\/\/127\.0\.0\.1:\d+ refused writes for \ds \(OOM command not allowed when used memory > 'maxmemory'\), past --retry-for: it is full .*; nothing unforwarded was acked\n$/,
    );
    const ids = [...first.ids, ...second.ids];
    const count = countDelivery('oom under run (target + source)', ids, [...onTarget, ...inSource]);
    expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
    expect(onTarget.sort()).toEqual([...first.ids].sort());
  });
});

describe('a Redis that forgets (FLUSHDB) under a running migration', () => {
  it('counts and logs the commits that found no claim, and loses nothing', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const { ids, messages } = numbered(source, 3000);
    await publishAll(sourceUrl, source, messages);
    // A slow target (its confirms held back) keeps claimed batches waiting for their confirms: claims
    // are in Redis when it forgets. (--max-rate no longer holds claims: it waits before the claim.)
    const proxy = FaultProxy.forUrl(targetUrl);
    await proxy.start();
    proxy.setDelay(300);
    const args = withOption(
      migrateArgsTo(source, target, '--prefetch', '200', '--max-rate', '600'),
      '--target',
      proxy.urlFor(targetUrl),
    );
    let result: Awaited<ReturnType<typeof migrateWithReport>>;
    let before: number;
    try {
      const run = migrateWithReport(args);
      expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= 300)).toBe(true);
      before = await depthOf(targetUrl, target);
      await admin.flushdb();
      result = await run;
    } finally {
      await proxy.stop();
    }
    const onTarget = idsOf(await takeAll(targetUrl, target));
    const report = result.report as Record<string, unknown>;
    process.stdout.write(
      `flushdb mid-run: ${before} of ${messages.length} on the target before, ${onTarget.length - before} after; exit ${result.code}; claimsLost ${report.claimsLost}, alreadyCommitted ${report.alreadyCommitted}\n`,
    );
    // It struck mid-transfer: some were forwarded before it, and more after.
    expect(before).toBeGreaterThan(0);
    expect(before).toBeLessThan(messages.length / 2);
    expect(result.code).toBe(0);
    expect(report.outcome).toBe('drained');
    expect(report.claimsLost).toBeGreaterThan(0);
    expect(report.claimsLost).toBeLessThanOrEqual(200 + 200);
    const warnings = result.stdout
      .split('\n')
      .filter((line) => line.includes('Redis had lost the claims of'));
    expect(warnings.length).toBeGreaterThan(0);
    expect(warnings.length).toBeLessThanOrEqual(10);
    const warning = JSON.parse(warnings[0] as string) as Record<string, unknown>;
    expect(warning.level).toBe('warn');
    expect(String(warning.msg)).toMatch(
      /^Redis had lost the claims of \d+ confirmed message\(s\) \(FLUSHDB, a restart or a failover without persistence\): committed again, but duplicates are possible for what was in flight/,
    );
    // Every ID on the target, once (one process, nothing redelivered: nothing to duplicate).
    const delivery = countDelivery('flushdb mid-run', ids, onTarget);
    expect(delivery.lost).toBe(0);
    expect(delivery.duplicated).toBe(0);
    expect(delivery.unexpected).toBe(0);
    expect(await depthOf(sourceUrl, source)).toBe(0);
  });

  it('a commit that finds its ID committed by another process first is counted and logged: the target holds two copies', async () => {
    const { sourceUrl, targetUrl } = servers();
    const { source, target } = await queuePair();
    const { source: other } = await queuePair();
    const id = `${source}-shared`;
    const message = { body: 'shared', options: { headers: { _HQ_DUPL_ID: id } } };
    await publishAll(sourceUrl, other, [message]);
    // Process A reaches Redis through a proxy that can hold its bytes, and the target slowly, so
    // that its claim is in Redis well before its commit. Its publish is confirmed (300 ms each way)
    // well before its lease of 3 s runs low: a publish still unconfirmed then would be cut with
    // the target connection (docs/guarantee.md, a process that stalls), and only B's copy land.
    const redisProxy = FaultProxy.forUrl(redis.url);
    const targetProxy = FaultProxy.forUrl(targetUrl);
    await redisProxy.start();
    await targetProxy.start();
    const args = [
      'run',
      '--source',
      sourceUrl,
      '--source-queue',
      source,
      '--target',
      targetProxy.urlFor(targetUrl),
      '--target-queue',
      target,
      '--redis',
      redisProxy.urlFor(redis.url),
      '--lease',
      '3s',
    ];
    const a = startCli(args);
    try {
      expect(await waitFor(() => a.output().includes('"msg":"forwarding"'))).toBe(true);
      // A first message of the same size, so that the shared one is no new size (tried alone on a
      // trial channel, which costs its opening round trips) but goes on the ordinary channel.
      await publishAll(sourceUrl, source, [
        { body: 'warmup', options: { headers: { _HQ_DUPL_ID: `${id}-w` } } },
      ]);
      expect(await waitFor(async () => (await depthOf(targetUrl, target)) === 1, 30_000)).toBe(true);
      expect((await takeAll(targetUrl, target)).length).toBe(1);
      targetProxy.setDelay(300);
      const sentBefore = targetProxy.clientBytes;
      await publishAll(sourceUrl, source, [message]);
      // A publishes only once its claim is answered: once the publish leaves A, the claim is
      // A's (waiting for the key to show in Redis instead raced the claim's answer, which the
      // blackhole could then hold back). The proxy sees it, in this process, at once.
      expect(await waitFor(() => targetProxy.clientBytes >= sentBefore + 50, 30_000, 5)).toBe(true);
      expect((await admin.keys('*:c:*')).length).toBeGreaterThan(0);
      // A's renewals and its commit wait: its lease runs out, and B takes the claim over.
      redisProxy.setMode('blackhole');
      await new Promise((resolve) => setTimeout(resolve, 4500));
      const b = await migrateWithReport(migrateArgsTo(other, target));
      expect(b.code, b.stderr).toBe(0);
      expect(b.report).toMatchObject({ forwarded: 1, inDoubt: 1 });
      // A's commit goes now, after B's: it finds the ID committed.
      redisProxy.setMode('pass');
      expect(await waitFor(async () => (await depthOf(sourceUrl, source)) === 0, 30_000)).toBe(true);
      expect(
        await waitFor(() => a.output().includes('had their IDs committed already'), 10_000),
        a.output().slice(-4000),
      ).toBe(true);
    } finally {
      a.signal('SIGTERM');
    }
    const result = await a.done;
    await redisProxy.stop();
    await targetProxy.stop();
    expect(result.code, result.stderr).toBe(0);
    const lines = result.stdout
      .split('\n')
      .filter((line) => line.includes('had their IDs committed already'));
    expect(lines).toHaveLength(1);
    const warning = JSON.parse(lines[0] as string) as Record<string, unknown>;
    expect(warning).toMatchObject({ level: 'warn', alreadyCommitted: 1 });
    expect(String(warning.msg)).toBe(
      '1 confirmed message(s) had their IDs committed already: another process forwarded them first (the target may hold two copies), or a commit was sent again after a reconnect',
    );
    const stopped = result.stdout.split('\n').find((line) => line.includes('"msg":"stopped"'));
    expect(JSON.parse(stopped as string).counters).toMatchObject({ forwarded: 2, alreadyCommitted: 1 });
    // Two copies on the target, as the line says: A's, and B's flagged in-doubt.
    const copies = await takeAll(targetUrl, target);
    process.stdout.write(
      `already committed: ${copies.length} copies of ${id} on the target, in-doubt flags ${copies.map((m) => m.properties.headers?.['x-dedup-in-doubt'] ?? false).join(', ')}\n`,
    );
    expect(idsOf(copies)).toEqual([id, id]);
    expect(copies.filter((m) => m.properties.headers?.['x-dedup-in-doubt'] === true)).toHaveLength(1);
  });
});
