import { mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { RedisClusterSet } from '../harness/redis-topologies.js';
import {
  delivered,
  depthOf,
  migrateArgs,
  migrateWithReport,
  numbered,
  publishAll,
  queuePair,
  type RunningCli,
  startCli,
  takeAll,
  waitFor,
} from '../helpers.js';
import { clusterInSync, logCount, ProxiedSentinelSet, replicaOf } from './replica-link.js';
import { onRedis } from './topo-helpers.js';

const BEHIND = 'Redis replicas behind; holding acks';
const CAUGHT_UP = 'Redis replicas caught up; acking again';
const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

/** Whether `read` gives the same number twice, `ms` apart. */
async function steady(read: () => Promise<number>, ms: number): Promise<boolean> {
  const before = await read();
  await sleep(ms);
  return (await read()) === before;
}

function reportPath(): string {
  return join(mkdtempSync(join(tmpdir(), 'dedup-wait-')), 'report.json');
}

/** What reached the target, by ID: lost, duplicated (and how many of those unflagged), unexpected. */
async function landed(label: string, targetUrl: string, target: string, ids: string[]) {
  const { messages: received, count } = await delivered(label, targetUrl, target, ids);
  const flagged = received.filter((m) => m.properties.headers?.['x-dedup-in-doubt'] !== undefined).length;
  return { ...count, flagged, unflagged: count.duplicated - flagged };
}

describe('--redis-wait-replicas under Sentinel, the replica cut off before its master dies', () => {
  let set: ProxiedSentinelSet | undefined;
  let bridge: RunningCli | undefined;
  afterEach(async () => {
    bridge?.signal('SIGKILL');
    await set?.stop();
    set = undefined;
  });

  const TOTAL = 3000;

  it('without it: the IDs committed while the replica was cut off are forgotten, and a resend forwards them again (unflagged where their claims were forgotten too)', async () => {
    set = await ProxiedSentinelSet.start();
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const { ids, messages } = numbered(source, TOTAL);
    await publishAll(sourceUrl, source, messages);
    const args = (...extra: string[]) =>
      onRedis(migrateArgs(source, ['--target-queue', target], ...extra), (set as ProxiedSentinelSet).url);
    bridge = startCli(args('--max-rate', '400'));
    expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= 600, 30_000)).toBe(true);
    set.link.setMode('blackhole');
    const depthAtCut = await depthOf(targetUrl, target);
    // Forwarded, committed on the master alone, and acked: more than a prefetch window (500), so
    // that some were also claimed after the cut.
    expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= depthAtCut + 1200, 30_000)).toBe(
      true,
    );
    const depthAtKill = await depthOf(targetUrl, target);
    await set.master.stop(true);
    const replica = set.replica.port;
    expect(await waitFor(async () => (await set?.masterPort()) === replica, 30_000)).toBe(true);
    const ended = await bridge.done;
    expect(ended.code, ended.stderr).toBe(0);
    expect(logCount(ended.stdout, BEHIND)).toBe(0);
    const first = await landed('sentinel cut, no wait', targetUrl, target, ids);
    expect(first).toMatchObject({ lost: 0, unexpected: 0 });

    await publishAll(sourceUrl, source, messages);
    const resend = await migrateWithReport(args());
    expect(resend.code, resend.stderr).toBe(0);
    const forgotten = Number(resend.report?.forwarded);
    // What the master committed after the cut and before its death (all but the last prefetch
    // window of it acked): gone.
    expect(forgotten).toBeGreaterThanOrEqual(depthAtKill - depthAtCut - 500);
    expect(resend.report).toMatchObject({ duplicates: TOTAL - forgotten });
    const again = await takeAll(targetUrl, target);
    // The IDs claimed before the cut kept their claims on the replica (their deletion at commit
    // was lost): they come back in doubt, flagged. Those claimed after the cut left no trace and
    // are forwarded again with nothing to say they are copies.
    const flagged = again.filter((m) => m.properties.headers?.['x-dedup-in-doubt'] !== undefined).length;
    expect(flagged).toBeLessThanOrEqual(500);
    expect(forgotten - flagged).toBeGreaterThanOrEqual(100);
    process.stdout.write(
      `wait-replicas 0: replica cut off after ${depthAtCut} forwarded, master killed after ${depthAtKill} · lost ${first.lost} · IDs forgotten by the failover ${forgotten}, forwarded again when resent: ${forgotten - flagged} unflagged, ${flagged} flagged in-doubt\n`,
    );
  });

  it('with 1: acks wait while the replica is cut off, nothing acked is forgotten, and a resend forwards none', async () => {
    set = await ProxiedSentinelSet.start();
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const { ids, messages } = numbered(source, TOTAL);
    await publishAll(sourceUrl, source, messages);
    const args = (...extra: string[]) =>
      onRedis(
        migrateArgs(source, ['--target-queue', target], '--redis-wait-replicas', '1', ...extra),
        (set as ProxiedSentinelSet).url,
      );
    const report = reportPath();
    bridge = startCli(args('--max-rate', '400', '--report', report));
    const running = bridge;
    expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= 600, 30_000)).toBe(true);
    expect(logCount(running.output(), BEHIND)).toBe(0);
    set.link.setMode('blackhole');
    const depthAtCut = await depthOf(targetUrl, target);
    expect(await waitFor(() => logCount(running.output(), BEHIND) === 1, 10_000)).toBe(true);
    // The bridge forwards on until it holds a prefetch window (500) unacked, then takes no more.
    expect(await waitFor(() => steady(() => depthOf(sourceUrl, source), 1500), 15_000)).toBe(true);
    const depthAtKill = await depthOf(targetUrl, target);
    const sourceAtKill = await depthOf(sourceUrl, source);
    expect(depthAtKill).toBeGreaterThan(depthAtCut + 100);
    expect(depthAtKill).toBeLessThanOrEqual(depthAtCut + 500 + 200);

    await set.master.stop(true);
    const promoted = set.replica;
    expect(await waitFor(async () => (await set?.masterPort()) === promoted.port, 30_000)).toBe(true);
    // The promoted replica has no replica of its own: the bridge keeps holding.
    await sleep(2000);
    expect(logCount(running.output(), CAUGHT_UP)).toBe(0);
    expect(await depthOf(sourceUrl, source)).toBe(sourceAtKill);

    const restartedAt = Date.now();
    await set.restartOldMasterUnder(promoted);
    expect(await waitFor(() => logCount(running.output(), CAUGHT_UP) === 1, 20_000)).toBe(true);
    const resumedAfter = Date.now() - restartedAt;
    const ended = await running.done;
    expect(ended.code, ended.stderr).toBe(0);
    // Once each way, not once per batch. Should it say so twice, what it said and when tells why.
    const said = `the bridge's replica lines (old master back at ${new Date(restartedAt).toISOString()}):\n${ended.stdout
      .split('\n')
      .filter((line) => line.includes(BEHIND) || line.includes(CAUGHT_UP))
      .join('\n')}`;
    expect(logCount(ended.stdout, BEHIND), said).toBe(1);
    expect(logCount(ended.stdout, CAUGHT_UP), said).toBe(1);
    expect(JSON.parse(readFileSync(report, 'utf8'))).toMatchObject({ accounted: true, forwarded: TOTAL });
    const first = await landed('sentinel cut, wait 1', targetUrl, target, ids);
    expect(first).toMatchObject({ lost: 0, unexpected: 0, unflagged: 0 });

    await publishAll(sourceUrl, source, messages);
    const resend = await migrateWithReport(args());
    expect(resend.code, resend.stderr).toBe(0);
    expect(resend.report).toMatchObject({ forwarded: 0, duplicates: TOTAL });
    expect(await depthOf(targetUrl, target)).toBe(0);
    process.stdout.write(
      `wait-replicas 1: replica cut off after ${depthAtCut} forwarded; ${depthAtKill - depthAtCut} more forwarded and held unacked; master killed · acks resumed ${(resumedAfter / 1000).toFixed(1)}s after the old master came back as a replica · lost ${first.lost} · duplicated ${first.duplicated} (${first.flagged} flagged) · forwarded again when resent 0 of ${TOTAL}\n`,
    );
  });
});

describe('--redis-wait-replicas on a Redis Cluster', () => {
  let cluster: RedisClusterSet | undefined;
  let bridge: RunningCli | undefined;
  afterEach(async () => {
    bridge?.signal('SIGKILL');
    await cluster?.stop();
  });

  it("WAITs on the master holding each shard: its replica's death holds acks; its own death after commits forgets none", async () => {
    cluster = await RedisClusterSet.start();
    const set = cluster;
    await clusterInSync(set);
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const total = 4000;
    const { ids, messages } = numbered(source, total);
    await publishAll(sourceUrl, source, messages);
    const args = (...extra: string[]) =>
      onRedis(
        migrateArgs(source, ['--target-queue', target], '--redis-wait-replicas', '1', ...extra),
        set.url,
      );
    bridge = startCli(args('--max-rate', '400'));
    const running = bridge;
    expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= 400, 30_000)).toBe(true);

    // One master's replica dies: the commits of the shards on that master cannot be acknowledged,
    // the messages holding them stay unacked until they fill the prefetch window, and the transfer
    // stops. (A WAIT sent to another master would count that master's replica and ack them.)
    const victim = await set.busiestMaster(`*queue:${target}*`);
    const replica = set.node(await replicaOf(set, victim));
    expect(logCount(running.output(), BEHIND)).toBe(0);
    await replica.stop(true);
    expect(await waitFor(() => logCount(running.output(), BEHIND) === 1, 15_000)).toBe(true);
    expect(await waitFor(() => steady(() => depthOf(sourceUrl, source), 2000), 30_000)).toBe(true);
    expect(await depthOf(sourceUrl, source)).toBeGreaterThan(0);
    const left = await depthOf(sourceUrl, source);
    const stalledAt = total - left;
    await replica.start();
    expect(await waitFor(() => logCount(running.output(), CAUGHT_UP) === 1, 30_000)).toBe(true);

    // The master itself dies right after commits: its replica takes over with no replica of its
    // own (acks wait again) until the old master is back, as the new one's replica.
    expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= stalledAt + 300, 30_000)).toBe(
      true,
    );
    const depthAtKill = await depthOf(targetUrl, target);
    await set.node(victim).stop(true);
    expect(await waitFor(async () => !(await set.masterPorts()).includes(victim), 30_000)).toBe(true);
    expect(await waitFor(() => logCount(running.output(), BEHIND) === 2, 15_000)).toBe(true);
    await set.node(victim).start();
    expect(await waitFor(() => logCount(running.output(), CAUGHT_UP) === 2, 30_000)).toBe(true);
    const ended = await running.done;
    expect(ended.code, ended.stderr).toBe(0);
    const first = await landed('cluster, wait 1', targetUrl, target, ids);
    expect(first).toMatchObject({ lost: 0, unexpected: 0, unflagged: 0 });

    await publishAll(sourceUrl, source, messages);
    const resend = await migrateWithReport(args());
    expect(resend.code, resend.stderr).toBe(0);
    expect(resend.report).toMatchObject({ forwarded: 0, duplicates: total });
    process.stdout.write(
      `wait-replicas 1 on a Cluster: replica of master ${victim} killed → the source stood still with ${left} messages left (the bridge holding its prefetch window unacked) until the replica was back; master ${victim} killed after ${depthAtKill} forwarded · lost ${first.lost} · duplicated ${first.duplicated} (${first.flagged} flagged) · forwarded again when resent 0 of ${total}\n`,
    );
  });
});
