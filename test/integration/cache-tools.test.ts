import { Redis } from 'ioredis';
import { describe, expect, it } from 'vitest';
import { connectAmqp } from '../../src/amqp/connect.js';
import { publishRaw } from '../../src/amqp/internals.js';
import { createLogger } from '../../src/observe/log.js';
import {
  clearOfSliceEnd,
  DEFAULT_SLICE_MS,
  declareQueue,
  depthOf,
  lines,
  migrateArgs,
  migrateWithReport,
  publishAll,
  runCli,
  servers,
  takeAll,
  uniqueName,
  withIds,
} from '../helpers.js';
import { basicProperties, bytes, field, int32, int64, longString, table } from '../wire.js';

/** Publishes messages whose `_HQ_DUPL_ID` is the given field value, byte for byte (any AMQP type). */
async function publishTyped(url: string, queue: string, messages: { body: string; id: Buffer }[]) {
  const connection = await connectAmqp(url, {
    side: 'source',
    retryForMs: 5000,
    log: createLogger('silent'),
  });
  try {
    const channel = await connection.createConfirmChannel();
    for (const message of messages) {
      const properties = basicProperties({
        headers: table(field('_HQ_DUPL_ID', message.id)),
        deliveryMode: 2,
      });
      publishRaw(channel, '', queue, properties, Buffer.from(message.body), () => {});
    }
    await channel.waitForConfirms();
  } finally {
    await connection.close();
  }
}

describe('cache tools and start-up safety checks', () => {
  it('inspect shows committed IDs, cache stats counts them, cache forget lets one through again', async () => {
    const { sourceUrl, targetUrl, redisUrl } = servers();
    const source = uniqueName('tools-src');
    const target = uniqueName('tools-dst');
    await declareQueue(sourceUrl, source);
    await declareQueue(targetUrl, target);
    const batch = withIds(['alpha', 'beta', 'gamma']);
    await publishAll(sourceUrl, source, batch);
    // The expiry asserted below counts on the IDs' slice not ending before inspect reads them.
    await clearOfSliceEnd(redisUrl);
    expect((await migrateWithReport(migrateArgs(source, ['--target-queue', target]))).code).toBe(0);
    const scope = `queue:${target}`;

    const inspect = await runCli(['inspect', '--redis', redisUrl, '--scope', scope, 'alpha', 'nope']);
    expect(inspect.code).toBe(0);
    // Kept for the 7-day window plus what is left of the 42-hour slice it was committed in.
    expect(inspect.stdout).toMatch(/^alpha\tkey alpha\tcommitted · expires in [78]d \d+h\n/m);
    expect(inspect.stdout).toMatch(/^nope\tkey nope\tunknown$/m);

    const stats = await runCli(['cache', 'stats', '--redis', redisUrl, '--scope', scope]);
    expect(stats.code).toBe(0);
    expect(stats.stdout).toMatch(new RegExp(`scope ${scope}: 3 committed IDs, 0 claims, about \\d+ KiB`));

    const refused = await runCli(['cache', 'forget', '--redis', redisUrl, '--scope', scope, 'beta']);
    expect(refused.code).toBe(2);
    expect(refused.stderr).toContain('add --yes');
    const forget = await runCli(['cache', 'forget', '--redis', redisUrl, '--scope', scope, 'beta', '--yes']);
    expect(forget.code).toBe(0);
    expect(forget.stdout).toContain('beta\tkey beta\tforgotten\n');
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

  it('inspect and forget take byte and integer IDs (--hex, --int), print the key each maps to, and name the scopes that exist', async () => {
    const { sourceUrl, targetUrl, redisUrl } = servers();
    const source = uniqueName('typed-src');
    const target = uniqueName('typed-dst');
    // A prefix of its own, so that the scopes listed are this test's only.
    const prefix = uniqueName('pfx');
    await declareQueue(sourceUrl, source);
    await declareQueue(targetUrl, target);
    const big = 2n ** 62n + 1n; // no double holds it: a neighbour of 2^62
    const sent = [
      { body: 'text', id: longString('order-7') },
      { body: 'bytes', id: bytes(Buffer.from([0xff, 0x00, 0xfe])) }, // a HornetQ byte[], not UTF-8
      { body: 'int', id: int32(42) },
      { body: 'int64', id: int64(big) },
    ];
    await publishTyped(sourceUrl, source, sent);
    const migrate = migrateArgs(source, ['--target-queue', target], '--redis-prefix', prefix);
    const first = await migrateWithReport(migrate);
    expect(first.code, first.stderr).toBe(0);
    expect(first.report).toMatchObject({ forwarded: 4, duplicates: 0 });
    const scope = `queue:${target}`;
    const tool = ['--redis', redisUrl, '--redis-prefix', prefix, '--scope', scope];

    const inspect = await runCli([
      'inspect',
      ...tool,
      'order-7',
      '42',
      '--hex',
      'ff00fe',
      '--hex',
      '6f726465722d37',
      '--int',
      '42',
      '--int',
      String(big),
      '--int',
      String(big - 1n),
    ]);
    expect(inspect.code, inspect.stderr).toBe(0);
    expect(lines(inspect.stdout).map((line) => line.replace(/ · expires in .*/, ''))).toEqual([
      'order-7\tkey order-7\tcommitted',
      // A text "42" is not the integer 42.
      '42\tkey 42\tunknown',
      '--hex ff00fe\tkey bytes:ff00fe\tcommitted',
      // Bytes that are valid UTF-8 are the same ID as that text.
      '--hex 6f726465722d37\tkey order-7\tcommitted',
      '--int 42\tkey num:42\tcommitted',
      `--int ${big}\tkey num:${big}\tcommitted`,
      `--int ${big - 1n}\tkey num:${big - 1n}\tunknown`,
    ]);

    const forget = await runCli([
      'cache',
      'forget',
      ...tool,
      '--hex',
      'ff:00:fe',
      '--int',
      String(big),
      '--yes',
    ]);
    expect(forget.code, forget.stderr).toBe(0);
    expect(lines(forget.stdout)).toEqual([
      '--hex ff00fe\tkey bytes:ff00fe\tforgotten',
      `--int ${big}\tkey num:${big}\tforgotten`,
      `forgot 2 of 2 ID(s) in scope ${scope}`,
    ]);
    // The same four again: the two forgotten ones are forwarded again, the others are duplicates.
    await publishTyped(sourceUrl, source, sent);
    const again = await migrateWithReport(migrate);
    expect(again.code, again.stderr).toBe(0);
    expect(again.report).toMatchObject({ forwarded: 2, duplicates: 2 });
    expect(await depthOf(sourceUrl, source)).toBe(0);
    expect((await takeAll(targetUrl, target)).map((m) => m.content.toString())).toEqual([
      'text',
      'bytes',
      'int',
      'int64',
      'bytes',
      'int64',
    ]);

    // Typed IDs that cannot be: one line each, exit 2.
    for (const [flag, value, said] of [
      ['--hex', 'abc', '--hex: "abc" is not bytes in hex'],
      ['--int', '1.5', '--int: "1.5" is not a whole number'],
      ['--int', String(2n ** 64n + 1n), 'wider than 64 bits and no double holds it exactly'],
    ] as const) {
      const bad = await runCli(['inspect', ...tool, flag, value]);
      expect(bad.code).toBe(2);
      expect(lines(bad.stderr)).toHaveLength(1);
      expect(bad.stderr).toContain(said);
    }

    // A scope that is not there is said so, with the ones that are; not "unknown", not "0".
    for (const command of [
      ['inspect', 'order-7'],
      ['cache', 'stats'],
      ['cache', 'forget', 'order-7', '--yes'],
    ]) {
      const typo = await runCli([
        ...command,
        '--redis',
        redisUrl,
        '--redis-prefix',
        prefix,
        '--scope',
        `${scope}x`,
      ]);
      expect(typo.code).toBe(2);
      expect(typo.stdout).toBe('');
      expect(lines(typo.stderr)).toEqual([
        `dedup-bridge: --scope: no such scope "${scope}x" under --redis-prefix "${prefix}"; the scopes there are ${scope}`,
      ]);
    }
    const nothing = await runCli([
      'cache',
      'stats',
      '--redis',
      redisUrl,
      '--redis-prefix',
      `${prefix}x`,
      '--scope',
      scope,
    ]);
    expect(nothing.code).toBe(2);
    expect(nothing.stderr).toContain(`no scope is stored under --redis-prefix "${prefix}x" on this Redis`);
  });

  it('a scope first written with a short trial window: a long window is refused naming cache reset-scope, which clears it', async () => {
    const { sourceUrl, targetUrl, redisUrl } = servers();
    const source = uniqueName('trial-src');
    const target = uniqueName('trial-dst');
    const prefix = uniqueName('pfx');
    await declareQueue(sourceUrl, source);
    await declareQueue(targetUrl, target);
    await publishAll(sourceUrl, source, withIds(['a', 'b', 'c']));
    const migrate = migrateArgs(source, ['--target-queue', target], '--redis-prefix', prefix);
    // The trial: a one-minute window lays the scope out in slices of one minute.
    const trial = await migrateWithReport([...migrate, '--dedup-window', '1m']);
    expect(trial.code, trial.stderr).toBe(0);
    expect(trial.report).toMatchObject({ forwarded: 3 });
    const scope = `queue:${target}`;

    // Production with the default 7d window: refused while the trial's IDs live, naming the remedy.
    await publishAll(sourceUrl, source, withIds(['c', 'd', 'e']));
    const refused = await runCli([...migrate, '--quiet']);
    expect(refused.code).toBe(2);
    expect(lines(refused.stderr)).toHaveLength(1);
    expect(refused.stderr).toMatch(
      new RegExp(
        `--dedup-window: scope "${scope}" keeps its IDs in slices of 1m .*cache reset-scope --scope ${scope} --yes`,
      ),
    );
    expect(await depthOf(sourceUrl, source)).toBe(3);
    expect(await depthOf(targetUrl, target)).toBe(3);

    const tool = ['cache', 'reset-scope', '--redis', redisUrl, '--redis-prefix', prefix, '--scope', scope];
    const unconfirmed = await runCli(tool);
    expect(unconfirmed.code).toBe(2);
    expect(unconfirmed.stderr).toContain('add --yes');

    // A live claim: some bridge is forwarding on the scope right now. Never reset under it.
    const redis = new Redis(redisUrl);
    try {
      const [seconds] = (await redis.time()) as [string | number, string | number];
      const claim = `${prefix}:{${scope}}:c:in-flight`;
      await redis.set(claim, `c:other-bridge:${Number(seconds) * 1000 + 60_000}:0`, 'PX', 60_000);
      const inUse = await runCli([...tool, '--yes', '--force']);
      expect(inUse.code).toBe(3);
      expect(lines(inUse.stderr)).toEqual([
        `dedup-bridge: cache reset-scope: scope "${scope}" is in use: 1 ID(s) are being forwarded now (claims held by other-bridge); stop every bridge and migrate job that writes to it, then reset`,
      ]);
      await redis.del(claim);

      // When the last ID expires is the newest slice's expiry, read from Redis around the call: how
      // long that is depends on where in a slice the wall clock was, so the test computes it.
      const redisNow = async () => {
        const [s, micros] = (await redis.time()) as [string | number, string | number];
        return Number(s) * 1000 + Math.floor(Number(micros) / 1000);
      };
      const slices = Object.values(await redis.hgetall(`${prefix}:{${scope}}:m`));
      const lastExpiry = Math.max(...slices.map((value) => Number(value.split(':')[2])));
      const askedAt = await redisNow();
      const unforced = await runCli([...tool, '--yes']);
      const answeredAt = await redisNow();
      expect(unforced.code).toBe(2);
      expect(lines(unforced.stderr)).toHaveLength(1);
      const said = new RegExp(
        `scope "${scope}" holds 3 committed ID\\(s\\); .* If they are from a trial, add --force; or wait until they expire \\(the last in ((?:\\d+[dhms] ?)+)\\)`,
      ).exec(unforced.stderr);
      expect(said, unforced.stderr).not.toBeNull();
      const unitMs: Record<string, number> = { d: 86_400_000, h: 3_600_000, m: 60_000, s: 1000 };
      const saidMs = [...(said?.[1] ?? '').matchAll(/(\d+)([dhms])/g)].reduce(
        (sum, [, n, unit]) => sum + Number(n) * (unitMs[unit as string] ?? 0),
        0,
      );
      // Printed in whole seconds, rounded down, at a moment between the two readings.
      expect(saidMs).toBeLessThanOrEqual(lastExpiry - askedAt);
      expect(saidMs).toBeGreaterThan(lastExpiry - answeredAt - 1000);
      expect(await redis.exists(`${prefix}:{${scope}}:m`)).toBe(1);

      const reset = await runCli([...tool, '--yes', '--force']);
      expect(reset.code, reset.stderr).toBe(0);
      expect(reset.stdout).toMatch(
        new RegExp(
          `^reset scope ${scope}: deleted \\d+ key\\(s\\) \\(it kept IDs in slices of 1m 0s\\); forgot 3 committed ID\\(s\\) and 0 claim\\(s\\) left in doubt;`,
        ),
      );
      expect(await redis.keys(`${prefix}:*`)).toEqual([]);

      // Now the 7d window lays the scope out for itself; "c", forgotten with the trial, comes again.
      const after = await migrateWithReport(migrate);
      expect(after.code, after.stderr).toBe(0);
      expect(after.report).toMatchObject({ forwarded: 3, duplicates: 0, remaining: 0 });
      expect(await redis.get(`${prefix}:{${scope}}:layout`)).toBe(`v1 shards=1 slice=${DEFAULT_SLICE_MS}`);
      expect(await depthOf(sourceUrl, source)).toBe(0);
      expect((await takeAll(targetUrl, target)).map((m) => m.content.toString())).toEqual([
        'a',
        'b',
        'c',
        'c',
        'd',
        'e',
      ]);
    } finally {
      await redis.quit();
    }
  });
});
