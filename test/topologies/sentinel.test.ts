import { mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { RedisSentinelSet } from '../harness/redis-topologies.js';
import {
  delivered,
  depthOf,
  migrateArgs,
  migrateWithReport,
  numbered,
  publishAll,
  queuePair,
  runCli,
  startCli,
  takeAll,
  waitFor,
} from '../helpers.js';
import { extraCopies, onRedis } from './topo-helpers.js';

const TOTAL = 3000;

describe('Redis Sentinel (master, replica, three sentinels)', () => {
  let set: RedisSentinelSet;
  beforeAll(async () => {
    set = await RedisSentinelSet.start();
  });
  afterAll(async () => {
    await set?.stop();
  });

  it('a master killed mid-transfer loses nothing; the IDs it had not replicated are forwarded again if resent', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const { ids, messages } = numbered(source, TOTAL);
    await publishAll(sourceUrl, source, messages);
    const oldMaster = set.master.port;
    expect(await set.masterPort()).toBe(oldMaster);

    // Throttled, so the failover lands in the middle of the transfer.
    const reportPath = join(mkdtempSync(join(tmpdir(), 'dedup-sentinel-')), 'report.json');
    const bridge = startCli(
      onRedis(
        migrateArgs(source, ['--target-queue', target], '--max-rate', '400', '--report', reportPath),
        set.url,
      ),
    );
    expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= TOTAL / 3, 30_000)).toBe(true);
    const killedAt = Date.now();
    const depthAtKill = await depthOf(targetUrl, target);
    await set.master.stop(true);
    expect(await waitFor(async () => (await set.masterPort()) === set.replica.port, 30_000)).toBe(true);
    const promotedAfter = Date.now() - killedAt;
    expect(await waitFor(async () => (await depthOf(targetUrl, target)) > depthAtKill + 50, 30_000)).toBe(
      true,
    );
    const resumedAfter = Date.now() - killedAt;
    const ended = await bridge.done;
    expect(ended.code, ended.stderr).toBe(0);
    // At start the master had its replica (and an append-only file): nothing to warn about.
    expect(ended.stdout).not.toMatch(/no replica connected|append-only/);
    expect(await depthOf(sourceUrl, source)).toBe(0);
    const report = JSON.parse(readFileSync(reportPath, 'utf8')) as Record<string, unknown>;
    expect(report).toMatchObject({ accounted: true });

    const { messages: received, count } = await delivered('sentinel failover', targetUrl, target, ids);
    expect(count.lost).toBe(0);
    expect(count.unexpected).toBe(0);
    // Counted on the target: a copy beyond the first is flagged, and at most one window of them.
    const extra = extraCopies(received);
    expect(extra.unflagged, 'every extra copy during the failover is flagged in-doubt').toBe(0);
    expect(extra.duplicated).toBeLessThanOrEqual(500);
    const flagged = extra.flagged;

    // What the new master remembers: the IDs committed on the old one but not yet replicated are gone.
    const scope = `queue:${target}`;
    const stats = await runCli(['cache', 'stats', '--redis', set.url, '--scope', scope]);
    expect(stats.code).toBe(0);
    const remembered = Number(/: (\d+) committed IDs/.exec(stats.stdout)?.[1]);
    const forgotten = TOTAL - remembered;

    // A producer that resends everything: exactly the forgotten IDs go through a second time.
    await publishAll(sourceUrl, source, messages);
    const resend = await migrateWithReport(onRedis(migrateArgs(source, ['--target-queue', target]), set.url));
    expect(resend.code).toBe(0);
    // The promoted replica stands alone now (its old master is dead), and the check says so.
    expect(resend.stdout).toContain('the Redis master Sentinel names has no replica connected');
    expect(resend.report).toMatchObject({ forwarded: forgotten, duplicates: TOTAL - forgotten });
    // And on the target: exactly the forgotten ones arrived again.
    expect(await takeAll(targetUrl, target)).toHaveLength(forgotten);
    process.stdout.write(
      `failover figures: ${TOTAL} messages · master killed after ${depthAtKill} forwarded · replica promoted after ${(promotedAfter / 1000).toFixed(1)}s · forwarding resumed after ${(resumedAfter / 1000).toFixed(1)}s · lost ${count.lost} · duplicated during the transfer ${count.duplicated} (${flagged} flagged in-doubt) · IDs forgotten by the failover ${forgotten} (forwarded again when resent: ${Number(resend.report?.forwarded)})\n`,
    );
  });
});
