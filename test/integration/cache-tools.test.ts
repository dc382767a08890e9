import { Redis } from 'ioredis';
import { describe, expect, it } from 'vitest';
import {
  clearOfSliceEnd,
  declareQueue,
  depthOf,
  migrateArgs,
  migrateWithReport,
  publishAll,
  runCli,
  servers,
  takeAll,
  uniqueName,
} from '../helpers.js';

describe('cache tools and start-up safety checks', () => {
  it('inspect shows committed IDs, cache stats counts them, cache forget lets one through again', async () => {
    const { sourceUrl, targetUrl, redisUrl } = servers();
    const source = uniqueName('tools-src');
    const target = uniqueName('tools-dst');
    await declareQueue(sourceUrl, source);
    await declareQueue(targetUrl, target);
    const batch = ['alpha', 'beta', 'gamma'].map((id) => ({
      body: id,
      options: { headers: { _HQ_DUPL_ID: id } },
    }));
    await publishAll(sourceUrl, source, batch);
    // The expiry asserted below counts on the IDs' slice not ending before inspect reads them.
    await clearOfSliceEnd(redisUrl);
    expect((await migrateWithReport(migrateArgs(source, ['--target-queue', target]))).code).toBe(0);
    const scope = `queue:${target}`;

    const inspect = await runCli(['inspect', '--redis', redisUrl, '--scope', scope, 'alpha', 'nope']);
    expect(inspect.code).toBe(0);
    // Kept for the 7-day window plus what is left of the 42-hour slice it was committed in.
    expect(inspect.stdout).toMatch(/^alpha\tcommitted · expires in [78]d \d+h\n/m);
    expect(inspect.stdout).toMatch(/^nope\tunknown · expires in -$/m);

    const stats = await runCli(['cache', 'stats', '--redis', redisUrl, '--scope', scope]);
    expect(stats.code).toBe(0);
    expect(stats.stdout).toMatch(new RegExp(`scope ${scope}: 3 committed IDs, 0 claims, about \\d+ KiB`));

    const refused = await runCli(['cache', 'forget', '--redis', redisUrl, '--scope', scope, 'beta']);
    expect(refused.code).toBe(2);
    expect(refused.stderr).toContain('add --yes');
    const forget = await runCli(['cache', 'forget', '--redis', redisUrl, '--scope', scope, 'beta', '--yes']);
    expect(forget.code).toBe(0);
    expect(forget.stdout).toContain('forgot 1 of 1 ID(s)');

    await takeAll(targetUrl, target);
    await publishAll(sourceUrl, source, batch);
    const again = await migrateWithReport(migrateArgs(source, ['--target-queue', target]));
    expect(again.report).toMatchObject({ forwarded: 1, duplicates: 2 });
    expect((await takeAll(targetUrl, target)).map((m) => m.content.toString())).toEqual(['beta']);
  });

  it('warns when Redis keeps nothing on disk or may evict, and --strict refuses to start', async () => {
    const { sourceUrl, targetUrl, redisUrl } = servers();
    const source = uniqueName('strict-src');
    const target = uniqueName('strict-dst');
    await declareQueue(sourceUrl, source);
    await declareQueue(targetUrl, target);
    await publishAll(sourceUrl, source, [
      { body: 'x', options: { headers: { _HQ_DUPL_ID: `${source}-x` } } },
    ]);
    const redis = new Redis(redisUrl);
    const persistence = await redis.info('persistence');
    const aof = /aof_enabled:1/.test(persistence);
    await redis.config('SET', 'maxmemory', '1gb');
    await redis.config('SET', 'maxmemory-policy', 'allkeys-lru');
    try {
      const warned = await migrateWithReport(migrateArgs(source, ['--target-queue', target]));
      expect(warned.code).toBe(0);
      expect(warned.stdout).toContain('Redis may evict keys (maxmemory-policy allkeys-lru)');
      if (!aof) expect(warned.stdout).toContain('Redis runs without an append-only file');

      await publishAll(sourceUrl, source, [
        { body: 'y', options: { headers: { _HQ_DUPL_ID: `${source}-y` } } },
      ]);
      const strict = await runCli([...migrateArgs(source, ['--target-queue', target]), '--strict']);
      expect(strict.code).toBe(2);
      expect(strict.stderr.trim().split('\n')).toHaveLength(1);
      expect(strict.stderr).toMatch(/^dedup-bridge: --strict: Redis/);
      expect(await depthOf(sourceUrl, source)).toBe(1);
    } finally {
      await redis.config('SET', 'maxmemory-policy', 'noeviction');
      await redis.config('SET', 'maxmemory', '0');
      await redis.quit();
    }
  });
});
