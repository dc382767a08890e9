import { mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createIdempotentConsumer } from '../../src/client/consumer.js';
import { closeRedis, connectRedis } from '../../src/dedup/redis.js';
import { createLogger } from '../../src/observe/log.js';
import { cli, RedisClusterSet } from '../harness/redis-topologies.js';
import {
  clearOfSliceEnd,
  countDelivery,
  declareQueue,
  delivered,
  depthOf,
  migrateArgs,
  migrateWithReport,
  numbered,
  openBroker,
  publishAll,
  queuePair,
  runCli,
  servers,
  startCli,
  takeAll,
  uniqueName,
  waitFor,
} from '../helpers.js';
import { extraCopies, onRedis } from './topo-helpers.js';

describe('Redis Cluster (three masters, one replica each)', () => {
  let cluster: RedisClusterSet;
  beforeAll(async () => {
    cluster = await RedisClusterSet.start();
  });
  afterAll(async () => {
    await cluster?.stop();
  });

  it('migrate forwards every message once, remembers the IDs in the Cluster, and the cache tools read them', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const { ids, messages } = numbered(source, 1000);
    await publishAll(sourceUrl, source, messages);
    const args = onRedis(migrateArgs(source, ['--target-queue', target]), cluster.url);
    // The expiry inspect shows below counts on the IDs' slice not ending before it reads them.
    await clearOfSliceEnd(cluster.url);

    // One master that may evict: the start-up check looks at every master, not just one.
    const [evicting] = (await cluster.masterPorts()).slice(-1);
    await cli(evicting ?? 0, 'config', 'set', 'maxmemory', '1gb', 'maxmemory-policy', 'allkeys-lru');
    const first = await migrateWithReport(args).finally(() =>
      cli(evicting ?? 0, 'config', 'set', 'maxmemory', '0', 'maxmemory-policy', 'noeviction'),
    );
    expect(first.stdout).toContain(
      `Redis master 127.0.0.1:${evicting} may evict keys (maxmemory-policy allkeys-lru)`,
    );
    expect(first.stdout).not.toContain('append-only');
    expect(first.stderr).not.toMatch(/CROSSSLOT|error/i);
    expect(first.code).toBe(0);
    expect(first.report).toMatchObject({ forwarded: 1000, duplicates: 0 });
    const { count } = await delivered('cluster first run', targetUrl, target, ids);
    expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });

    // The same messages again: every ID is found in the Cluster, nothing is forwarded.
    await publishAll(sourceUrl, source, messages);
    const again = await migrateWithReport(args);
    expect(again.code).toBe(0);
    expect(again.report).toMatchObject({ forwarded: 0, duplicates: 1000 });
    expect(await depthOf(targetUrl, target)).toBe(0);
    expect(await depthOf(sourceUrl, source)).toBe(0);

    const scope = `queue:${target}`;
    const tool = (...rest: string[]) => runCli([...rest, '--redis', cluster.url, '--scope', scope]);
    const stats = await tool('cache', 'stats');
    expect(stats.stderr).toBe('');
    expect(stats.stdout).toMatch(
      new RegExp(`^scope ${scope}: 1000 committed IDs, 0 claims, about \\d+ KiB$`, 'm'),
    );
    const inspect = await tool('inspect', ids[0] as string, 'nope');
    expect(inspect.code).toBe(0);
    expect(inspect.stdout).toMatch(
      new RegExp(`^${ids[0]}\\tkey ${ids[0]}\\tcommitted · expires in [78]d \\d+h$`, 'm'),
    );
    expect(inspect.stdout).toMatch(/^nope\tkey nope\tunknown$/m);
    const forget = await tool('cache', 'forget', ...ids.slice(0, 10), '--yes');
    expect(forget.stdout).toContain('forgot 10 of 10 ID(s)');
    expect((await tool('cache', 'stats')).stdout).toContain(': 990 committed IDs');

    // A dry run reads the Cluster too: the ten forgotten IDs would go, the rest are duplicates.
    await publishAll(sourceUrl, source, messages);
    const dry = await migrateWithReport([...args, '--dry-run']);
    expect(dry.code).toBe(0);
    expect(dry.report).toMatchObject({ forwarded: 10, duplicates: 990 });
  });

  it('the idempotent consumer runs its handler once per ID with a Cluster client', async () => {
    const { targetUrl } = servers();
    const queue = uniqueName('cluster-consumer');
    await declareQueue(targetUrl, queue);
    const { ids, messages } = numbered(queue, 200);
    // The first 50 twice: their second copies are duplicates the handler must not see.
    await publishAll(targetUrl, queue, [...messages, ...messages.slice(0, 50)]);
    const redis = await connectRedis(cluster.url, 10_000, createLogger('silent'));
    const broker = await openBroker(targetUrl);
    const handled: string[] = [];
    const consumer = await createIdempotentConsumer({
      channel: broker.channel,
      queue,
      redis,
      scope: uniqueName('app'),
      handler: (message) => {
        handled.push(String(message.properties.headers?._HQ_DUPL_ID));
      },
    });
    try {
      expect(await waitFor(() => consumer.counts.processed + consumer.counts.duplicates === 250)).toBe(true);
    } finally {
      await consumer.stop();
      await broker.close();
      closeRedis(redis);
    }
    expect(consumer.counts).toMatchObject({ processed: 200, duplicates: 50, failures: 0 });
    expect(countDelivery('cluster consumer', ids, handled)).toMatchObject({
      lost: 0,
      duplicated: 0,
      unexpected: 0,
    });
  });

  it('a master killed mid-transfer: its replica takes over, nothing is lost', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const total = 2000;
    const { ids, messages } = numbered(source, total);
    await publishAll(sourceUrl, source, messages);
    const reportPath = join(mkdtempSync(join(tmpdir(), 'dedup-cluster-')), 'report.json');
    const bridge = startCli(
      onRedis(
        migrateArgs(source, ['--target-queue', target], '--max-rate', '400', '--report', reportPath),
        cluster.url,
      ),
    );
    expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= total / 3, 30_000)).toBe(true);
    // The master holding most of this scope's keys, whatever the key layout.
    const victim = await cluster.busiestMaster(`*queue:${target}*`);
    const killedAt = Date.now();
    const depthAtKill = await depthOf(targetUrl, target);
    await cluster.node(victim).stop(true);
    expect(
      await waitFor(async () => !(await cluster.masterPorts()).includes(victim), 30_000),
      'a replica takes over',
    ).toBe(true);
    expect(await waitFor(async () => (await depthOf(targetUrl, target)) > depthAtKill + 50, 30_000)).toBe(
      true,
    );
    const resumedAfter = Date.now() - killedAt;
    const ended = await bridge.done;
    expect(ended.code, ended.stderr).toBe(0);
    expect(await depthOf(sourceUrl, source)).toBe(0);
    expect(JSON.parse(readFileSync(reportPath, 'utf8'))).toMatchObject({ accounted: true });

    const { messages: received, count } = await delivered('cluster failover', targetUrl, target, ids);
    expect(count).toMatchObject({ lost: 0, unexpected: 0 });
    // Counted on the target: a copy beyond the first is flagged, and at most one window of them.
    const extra = extraCopies(received);
    expect(extra.unflagged, 'every extra copy during the failover is flagged in-doubt').toBe(0);
    expect(extra.duplicated).toBeLessThanOrEqual(500);
    const flagged = extra.flagged;

    // What the promoted replica remembers, read from the Cluster itself (not from a report).
    const stats = await runCli(['cache', 'stats', '--redis', cluster.url, '--scope', `queue:${target}`]);
    expect(stats.code, stats.stderr).toBe(0);
    const forgotten = total - Number(/: (\d+) committed IDs/.exec(stats.stdout)?.[1]);

    // A producer resends everything: exactly the forgotten IDs reach the target again, unflagged
    // (without --redis-wait-replicas nothing told the bridge they were in doubt).
    await publishAll(sourceUrl, source, messages);
    const resend = await migrateWithReport(
      onRedis(migrateArgs(source, ['--target-queue', target]), cluster.url),
    );
    expect(resend.code).toBe(0);
    const again = await takeAll(targetUrl, target);
    expect(again).toHaveLength(forgotten);
    expect(resend.report).toMatchObject({ forwarded: forgotten, duplicates: total - forgotten });
    process.stdout.write(
      `cluster failover figures: ${total} messages · master ${victim} killed after ${depthAtKill} forwarded · forwarding resumed after ${(resumedAfter / 1000).toFixed(1)}s · lost ${count.lost} · duplicated ${count.duplicated} (${flagged} flagged in-doubt) · IDs forgotten (forwarded again when resent) ${forgotten}\n`,
    );
  });
});
