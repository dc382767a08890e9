import { createHash } from 'node:crypto';
import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { DedupCache, sliceLengthFor } from '../../src/dedup/cache.js';
import { ConfigError } from '../../src/errors.js';
import { servers, uniqueName } from '../helpers.js';

describe('the Redis cache scripts (real Redis)', () => {
  let redis: Redis;
  beforeAll(() => {
    redis = new Redis(servers().redisUrl);
  });
  afterAll(async () => {
    await redis.quit();
  });

  const WINDOW = 60_000;
  const cacheOf = (scope: string, token: string, leaseMs = 10_000, shards?: number | 'auto') =>
    DedupCache.open(redis, { token, leaseMs, windowMs: WINDOW, prefix: 'dedup', scope, shards });
  // Whatever is sliced or expired by time goes by a fixed clock, never by where in a minute the
  // wall clock happens to be: this window's slices are 1 min, and AT is halfway through one.
  const AT = Date.UTC(2030, 0, 1, 12, 0, 30);
  const pinnedCacheOf = (scope: string, token: string, windowMs = WINDOW) =>
    DedupCache.open(redis, {
      token,
      leaseMs: 10_000,
      windowMs,
      prefix: 'dedup',
      scope,
      clock: () => AT,
    });
  const stateOf = async (cache: DedupCache, key: string) => (await cache.lookup([key]))[0]?.state;
  const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
  const nowMs = async () => {
    const [seconds, micros] = (await redis.time()) as [number, number];
    return Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
  };

  it('claims new IDs, reports committed ones as dup and live claims of others as busy', async () => {
    const scope = uniqueName('scope');
    const mine = await pinnedCacheOf(scope, 'ownerA');
    const theirs = await pinnedCacheOf(scope, 'ownerB');
    const [a, b] = [mine.keyOf('a'), mine.keyOf('b')];
    expect(await mine.claim([a, b])).toEqual(['new', 'new']);
    expect(await theirs.claim([a, b])).toEqual(['busy', 'busy']);
    expect(await mine.commit([a])).toEqual(['committed']);
    expect(await theirs.claim([a, b])).toEqual(['dup', 'busy']);
    // Committed: the claim is gone, the ID sits in a bucket that lives one window past its slice.
    expect(await redis.exists(a)).toBe(0);
    const [record] = await mine.lookup([a]);
    expect(record?.state).toBe('committed');
    expect(record?.ttlMs).toBeGreaterThan(WINDOW);
    expect(record?.ttlMs).toBeLessThanOrEqual(WINDOW + sliceLengthFor(WINDOW));
  });

  it('recognises its own claim sent twice (a re-sent command) and keeps an in-doubt flag', async () => {
    const scope = uniqueName('scope');
    const crashed = await cacheOf(scope, 'crashed', 1000);
    const a = crashed.keyOf('a');
    expect(await crashed.claim([a])).toEqual(['new']);
    const mine = await cacheOf(scope, 'mine');
    expect(await mine.claim([a])).toEqual(['busy']);
    await new Promise((resolve) => setTimeout(resolve, 1100));
    // The crashed owner's lease ran out: the ID is ours now, in doubt.
    expect(await mine.claim([a])).toEqual(['in-doubt']);
    expect(await mine.claim([a])).toEqual(['in-doubt']);
    // The crashed owner was only slow: the target confirmed its copy, so it commits the ID even
    // though we took the claim over; our copy (flagged in-doubt) is the duplicate.
    expect(await crashed.commit([a])).toEqual(['taken']);
    expect(await stateOf(mine, a)).toBe('committed');
    expect(await mine.commit([a])).toEqual(['already']);
    expect(await mine.claim([a])).toEqual(['dup']);
  });

  it('tells its own claim from one whose owner token starts with its own', async () => {
    const scope = uniqueName('scope');
    const short = await cacheOf(scope, 'own', 1000);
    const long = await cacheOf(scope, 'owner');
    const a = short.keyOf('a');
    expect(await short.claim([a])).toEqual(['new']);
    await sleep(1100);
    expect(await long.claim([a])).toEqual(['in-doubt']);
    expect(await redis.get(a)).toMatch(/^c:owner:/);
    // The claim is 'owner''s now: to 'own' that is a claim taken over, not its own.
    expect(await short.commit([a])).toEqual(['taken']);
    expect(await long.commit([a])).toEqual(['already']);
  });

  it('releases only its own claims, and commits an ID whose record vanished', async () => {
    const scope = uniqueName('scope');
    const mine = await cacheOf(scope, 'mine');
    const theirs = await cacheOf(scope, 'theirs');
    const [a, b, c] = [mine.keyOf('a'), mine.keyOf('b'), mine.keyOf('c')];
    await mine.claim([a]);
    await theirs.claim([b]);
    expect(await mine.release([a, b])).toBe(1);
    expect(await redis.exists(a)).toBe(0);
    expect(await redis.get(b)).toMatch(/^c:theirs:/);
    expect(await mine.commit([c])).toEqual(['restored']);
    expect(await stateOf(mine, c)).toBe('committed');
  });

  it('commits a batch of thousands in one call, and an ID named twice in it once', async () => {
    const scope = uniqueName('scope');
    const mine = await pinnedCacheOf(scope, 'mine');
    const theirs = await pinnedCacheOf(scope, 'theirs');
    const keys = Array.from({ length: 5000 }, (_, i) => mine.keyOf(`many-${i}`));
    expect(new Set(await mine.claim(keys))).toEqual(new Set(['new']));
    const results = await mine.commit(keys);
    expect(results.filter((r) => r === 'committed')).toHaveLength(5000);
    expect(await redis.exists(...keys)).toBe(0);
    expect(new Set(await theirs.claim(keys))).toEqual(new Set(['dup']));
    // The second time an ID comes in the same commit, its claim is already gone: it is reported
    // as already committed, and recorded once.
    const [a, b] = [mine.keyOf('twice-a'), mine.keyOf('twice-b')];
    await mine.claim([a, b]);
    expect(await mine.commit([a, b, a])).toEqual(['committed', 'committed', 'already']);
    expect(await theirs.claim([a, b])).toEqual(['dup', 'dup']);
  });

  it('a release that keeps the doubt makes the next claim, by anyone, in-doubt', async () => {
    const scope = uniqueName('scope');
    const mine = await cacheOf(scope, 'mine');
    const [a, b] = [mine.keyOf('a'), mine.keyOf('b')];
    await mine.claim([a, b]);
    expect(await mine.release([a], { keepInDoubt: true })).toBe(1);
    expect(await mine.claim([a])).toEqual(['in-doubt']);
    await mine.release([a, b], { keepInDoubt: true });
    expect(await (await cacheOf(scope, 'other')).claim([a, b])).toEqual(['in-doubt', 'in-doubt']);
  });

  it('renews the leases of its own claims only', async () => {
    const scope = uniqueName('scope');
    const mine = await cacheOf(scope, 'mine', 1000);
    const theirs = await cacheOf(scope, 'theirs', 1000);
    const [a, b] = [mine.keyOf('a'), mine.keyOf('b')];
    await mine.claim([a]);
    await theirs.claim([b]);
    await new Promise((resolve) => setTimeout(resolve, 700));
    expect(await mine.renew([a, b])).toBe(1);
    await new Promise((resolve) => setTimeout(resolve, 500));
    const third = await cacheOf(scope, 'third');
    // a was renewed and is still live; b's lease ran out and is taken over in doubt.
    expect(await third.claim([a, b])).toEqual(['busy', 'in-doubt']);
  });

  it('a claim lives as long as its owner renews it, and is in doubt for a window past its last lease', async () => {
    // A window shorter than the time in flight (an outage, a memory alarm): the claim must not die
    // with the window while its owner still renews it. Leases run out on a clock the test moves;
    // how long Redis keeps the record is real time.
    const scope = uniqueName('scope');
    let now = AT;
    const [windowMs, leaseMs] = [400, 300];
    const open = (token: string) =>
      DedupCache.open(redis, { token, leaseMs, windowMs, prefix: 'dedup', scope, clock: () => now });
    const owner = await open('owner');
    const other = await open('other');
    const a = owner.keyOf('a');
    expect(await owner.claim([a])).toEqual(['new']);
    for (let elapsed = 0; elapsed < 3 * windowMs; elapsed += 100) {
      await sleep(100);
      now += 100;
      expect(await owner.renew([a])).toBe(1);
    }
    expect(await other.claim([a])).toEqual(['busy']);
    expect(await redis.pttl(a)).toBeGreaterThan(windowMs);
    // The owner dies: its lease runs out, and the next claim within the window after that takes
    // the ID over in doubt (its copy may be on the target), not as new.
    await sleep(leaseMs + 200);
    now += leaseMs + 200;
    expect(await other.claim([a])).toEqual(['in-doubt']);
  });

  it('a renewal that runs after a release in doubt does not make the claim live again', async () => {
    const scope = uniqueName('scope');
    const mine = await pinnedCacheOf(scope, 'mine');
    const theirs = await pinnedCacheOf(scope, 'theirs');
    const [a, b, c] = [mine.keyOf('a'), mine.keyOf('b'), mine.keyOf('c')];
    await mine.claim([a, b, c]);
    expect(await mine.release([a, c], { keepInDoubt: true })).toBe(2);
    // A renewal sent before the release and run after it, as one in flight does: b only.
    expect(await mine.renew([a, b])).toBe(1);
    expect(await theirs.claim([a, b])).toEqual(['in-doubt', 'busy']);
    // Kept in doubt for a window from the release.
    expect(await redis.pttl(c)).toBeGreaterThan(WINDOW - 10_000);
    // Claimed again by its owner, it is live again (in doubt) and renewals hold it.
    expect(await mine.claim([c])).toEqual(['in-doubt']);
    expect(await mine.renew([c])).toBe(1);
    expect(await theirs.claim([c])).toEqual(['busy']);
  });

  it('a process that read the layout before an empty scope was re-sliced goes by the new slices', async () => {
    const scope = uniqueName('scope');
    const WEEK = 7 * 86_400_000;
    const open = (token: string, windowMs: number) =>
      DedupCache.open(redis, { token, leaseMs: 10_000, windowMs, prefix: 'dedup', scope, clock: () => AT });
    // A opens the empty scope first and slices it by the minute; B's week re-slices it (nothing
    // committed yet) while A runs on.
    const a = await open('a', WINDOW);
    const b = await open('b', WEEK);
    expect(a.layout.sliceMs).toBe(60_000);
    expect(b.layout.sliceMs).toBe(WEEK / 4);
    const [y, z, w] = [b.keyOf('y'), b.keyOf('z'), b.keyOf('w')];
    expect(await b.claim([y])).toEqual(['new']);
    expect(await b.commit([y])).toEqual(['committed']);
    expect(await a.claim([y])).toEqual(['dup']);
    expect(await stateOf(a, y)).toBe('committed');
    // What A commits lands in B's slices, as a commit in a handler's transaction does.
    expect(await a.claim([z, w])).toEqual(['new', 'new']);
    expect(await a.commit([z])).toEqual(['committed']);
    const transaction = redis.multi();
    a.commitIn(transaction, [w]);
    expect(await transaction.exec()).toEqual([[null, [1]]]);
    expect(await b.claim([z, w])).toEqual(['dup', 'dup']);
    expect(await redis.hkeys(`dedup:{${scope}}:m`)).toEqual([String(Math.floor(AT / (WEEK / 4)))]);
  });

  it('re-slices every shard of an empty scope, and each shard keeps the layout it holds IDs by', async () => {
    const scope = uniqueName('scope');
    const WEEK = 7 * 86_400_000;
    const open = (token: string, windowMs: number) =>
      DedupCache.open(redis, {
        token,
        leaseMs: 10_000,
        windowMs,
        prefix: 'dedup',
        scope,
        shards: 4,
        clock: () => AT,
      });
    const a = await open('a', WINDOW);
    const b = await open('b', WEEK);
    const keys = Array.from({ length: 40 }, (_, i) => b.keyOf(`id-${i}`));
    expect(await b.claim(keys)).toEqual(keys.map(() => 'new'));
    expect(await b.commit(keys)).toEqual(keys.map(() => 'committed'));
    expect(await a.claim(keys)).toEqual(keys.map(() => 'dup'));
    for (const base of b.bases())
      expect(await redis.get(`${base}:layout`)).toBe(`v1 shards=4 slice=${WEEK / 4}`);
    expect(await redis.get(`dedup:{${scope}}:layout`)).toBe(`v1 shards=4 slice=${WEEK / 4}`);
    // A layout written again with another shard count is refused, not read as if it were ours.
    await redis.set(`${b.bases()[0]}:layout`, `v1 shards=2 slice=${WEEK / 4}`);
    const first = keys.find((key) => key.startsWith(`${b.bases()[0]}:`)) as string;
    await expect(a.claim([first])).rejects.toThrow(ConfigError);
    await expect(a.claim([first])).rejects.toThrow(
      /written again while this process ran, with another shard count: restart it/,
    );
  });

  it('keeps committed IDs in small listpack hashes that grow by generations, all still found', async () => {
    const scope = uniqueName('scope');
    const cache = await pinnedCacheOf(scope, 'bulk');
    const ids = Array.from(
      { length: 3000 },
      (_, i) => `${String(i).padStart(8, '0')}-0000-4000-8000-000000000000`,
    );
    const keys = ids.map((id) => cache.keyOf(id));
    for (let i = 0; i < keys.length; i += 200) {
      const batch = keys.slice(i, i + 200);
      expect(await cache.claim(batch)).toEqual(batch.map(() => 'new'));
      expect(await cache.commit(batch)).toEqual(batch.map(() => 'committed'));
    }
    expect(await cache.claim(keys)).toEqual(keys.map(() => 'dup'));
    expect(await cache.claim([cache.keyOf('never-sent')])).toEqual(['new']);
    // No claim keys left behind for committed IDs, and every bucket is compact.
    expect(await redis.exists(...keys)).toBe(0);
    const meta = await redis.hgetall(`dedup:{${scope}}:m`);
    const [slice, value] = Object.entries(meta)[0] as [string, string];
    expect(Object.keys(meta)).toHaveLength(1);
    expect(slice).toBe(String(Math.floor(AT / cache.layout.sliceMs)));
    // 80 per bucket: a first slice starts with 16 buckets (1,280 IDs), then 64 for the other 1,720.
    const [, total, expireAt, list] = value.split(':');
    expect(Number(total)).toBe(3000);
    // The slice (and so its buckets) lives one window past its end.
    expect(Number(expireAt)).toBe((Number(slice) + 1) * cache.layout.sliceMs + WINDOW);
    expect(list).toBe('16,64');
    const encodings = new Set<string>();
    const sizes: number[] = [];
    for (const [gen, buckets] of (list as string).split(',').map(Number).entries()) {
      for (let bucket = 0; bucket < buckets; bucket++) {
        const key = `dedup:{${scope}}:d:${slice}:${gen}:${bucket}`;
        encodings.add(String(await redis.object('ENCODING', key)));
        sizes.push(await redis.hlen(key));
      }
    }
    expect([...encodings]).toEqual(['listpack']);
    expect(sizes.reduce((sum, size) => sum + size, 0)).toBe(3000);
    expect(Math.max(...sizes)).toBeLessThanOrEqual(128);
  });

  it("goes by the Redis server's clock unless given one", async () => {
    const scope = uniqueName('scope');
    const cache = await cacheOf(scope, 'server-time');
    const sliceMs = cache.layout.sliceMs;
    const before = await nowMs();
    await cache.commit([cache.keyOf('x')]);
    const after = await nowMs();
    // The slice of the commit's moment, somewhere between the two readings of Redis TIME.
    const [slice] = Object.keys(await redis.hgetall(`dedup:{${scope}}:m`)).map(Number);
    expect(slice).toBeGreaterThanOrEqual(Math.floor(before / sliceMs));
    expect(slice).toBeLessThanOrEqual(Math.floor(after / sliceMs));
    // A given clock picks the slice, and the buckets live what is left of it plus the window on
    // that clock, however far it is from the server's.
    const other = uniqueName('scope');
    const pinned = await pinnedCacheOf(other, 'pinned');
    const y = pinned.keyOf('y');
    await pinned.commit([y]);
    expect(Object.keys(await redis.hgetall(`dedup:{${other}}:m`))).toEqual([
      String(Math.floor(AT / sliceMs)),
    ]);
    const [record] = await pinned.lookup([y]);
    expect(record?.state).toBe('committed');
    expect(record?.ttlMs).toBeGreaterThan(WINDOW);
    expect(record?.ttlMs).toBeLessThanOrEqual(WINDOW + sliceMs / 2);
  });

  it('sizes a new slice from the previous one', async () => {
    const scope = uniqueName('scope');
    const cache = await pinnedCacheOf(scope, 'sized');
    const sliceMs = cache.layout.sliceMs;
    const current = Math.floor(AT / sliceMs);
    // The previous slice took 8,000 IDs: the new one starts with room for a quarter more, 125
    // buckets of 80.
    const later = AT + 60_000;
    await redis.hset(`dedup:{${scope}}:m`, String(current - 1), `0:8000:${later}:1,4,16`);
    // What the writer expects counts only for a scope's first slice.
    cache.expectedIds = 100_000;
    await cache.commit([cache.keyOf('first-of-the-slice')]);
    const expireAt = (current + 1) * sliceMs + WINDOW;
    expect(await redis.hget(`dedup:{${scope}}:m`, String(current))).toBe(`1:1:${expireAt}:125`);
  });

  it("sizes a new scope's first slice for the IDs its writer expects, at least 16 buckets", async () => {
    const firstSliceOf = async (expectedIds: number) => {
      const scope = uniqueName('scope');
      const cache = await cacheOf(scope, 'expecting');
      cache.expectedIds = expectedIds;
      await cache.commit([cache.keyOf('first')]);
      const [value] = Object.values(await redis.hgetall(`dedup:{${scope}}:m`));
      return value?.split(':')[3];
    };
    // 10,000 IDs and a quarter more, 80 per bucket.
    expect(await firstSliceOf(10_000)).toBe('157');
    expect(await firstSliceOf(100)).toBe('16');
    expect(await firstSliceOf(0)).toBe('16');
    // Over 4 slot shards each shard's slice is sized for its quarter: 2,500 and a quarter more.
    const scope = uniqueName('scope');
    const sharded = await cacheOf(scope, 'expecting', 10_000, 4);
    sharded.expectedIds = 10_000;
    await sharded.commit([sharded.keyOf('first')]);
    const metas = await Promise.all(sharded.bases().map((base) => redis.hgetall(`${base}:m`)));
    const sizes = metas.flatMap((meta) => Object.values(meta).map((value) => value.split(':')[3]));
    expect(sizes).toEqual(['40']);
  });

  it('a writer with a shorter window leaves the slices a longer window still needs', async () => {
    const scope = uniqueName('scope');
    // The first writer's window (4 min) slices the scope by the minute.
    const long = await pinnedCacheOf(scope, 'long', 240_000);
    expect(long.layout.sliceMs).toBe(60_000);
    const now = AT;
    const current = Math.floor(now / 60_000);
    const meta = `dedup:{${scope}}:m`;
    // Three minutes old: past a 1-minute window, inside the 4-minute one that wrote it.
    await redis.hset(meta, String(current - 3), `0:5:${now + 60_000}:1`);
    // Long past every window: its buckets are gone.
    await redis.hset(meta, String(current - 9), `0:5:${now - 1000}:1`);
    const short = await pinnedCacheOf(scope, 'short');
    await short.commit([short.keyOf('x')]);
    expect((await redis.hkeys(meta)).sort()).toEqual([String(current - 3), String(current)].sort());
  });

  it('a writer with a longer window makes every bucket of the slice live as long, not only those it writes to', async () => {
    const scope = uniqueName('scope');
    const short = await pinnedCacheOf(scope, 'short');
    const keys = Array.from({ length: 200 }, (_, i) => short.keyOf(`short-${i}`));
    await short.claim(keys);
    await short.commit(keys);
    const long = await pinnedCacheOf(scope, 'long', 240_000);
    const one = long.keyOf('long-1');
    await long.claim([one]);
    await long.commit([one]);
    const slice = Math.floor(AT / 60_000);
    const [, , , list] = ((await redis.hget(`dedup:{${scope}}:m`, String(slice))) ?? '').split(':');
    const buckets = Number(list);
    expect(buckets).toBeGreaterThanOrEqual(16);
    // The slice lives a 4-minute window past its end now; an ID the short writer committed must be
    // found for as long, wherever its bucket is.
    const left = (slice + 1) * 60_000 + 240_000 - AT;
    for (let b = 0; b < buckets; b++) {
      const ttl = await redis.pttl(`dedup:{${scope}}:d:${slice}:0:${b}`);
      expect(ttl, `bucket ${b}`).toBeGreaterThan(left - 10_000);
    }
    expect(await long.claim(keys)).toEqual(keys.map(() => 'dup'));
  });

  it('refuses a window many slices long on a scope sliced for a shorter one, unless it is empty', async () => {
    const used = uniqueName('scope');
    const first = await cacheOf(used, 'first');
    await first.commit([first.keyOf('x')]);
    const week = { token: 'week', leaseMs: 10_000, windowMs: 7 * 86_400_000, prefix: 'dedup' };
    await expect(DedupCache.open(redis, { ...week, scope: used })).rejects.toThrow(
      /^--dedup-window: scope "[^"]+" keeps its IDs in slices of 1m .* use a shorter window, or another --scope, or, .* `dedup-bridge cache reset-scope --scope [^ ]+ --yes` \(see --force there\)$/,
    );
    // Nothing committed yet: the scope takes slices that suit the longer window.
    const empty = uniqueName('scope');
    await cacheOf(empty, 'first');
    const taken = await DedupCache.open(redis, { ...week, scope: empty });
    expect(taken.layout.sliceMs).toBe((7 * 86_400_000) / 4);
  });

  it('forgets committed and claimed IDs on request', async () => {
    const scope = uniqueName('scope');
    const cache = await cacheOf(scope, 'mine');
    const [a, b, c] = [cache.keyOf('a'), cache.keyOf('b'), cache.keyOf('c')];
    await cache.claim([a, b]);
    await cache.commit([a]);
    expect(await cache.forget([a, b, c])).toBe(2);
    // The slice's total no longer counts the forgotten ID (cache stats reads it).
    const [meta] = Object.values(await redis.hgetall(`dedup:{${scope}}:m`));
    expect(meta?.split(':')[1]).toBe('0');
    expect((await cache.lookup([a, b, c])).map((record) => record.state)).toEqual([
      'unknown',
      'unknown',
      'unknown',
    ]);
    expect(await cache.claim([a])).toEqual(['new']);
  });

  it('spreads a scope over slot shards, and keeps the shard count the scope was written with', async () => {
    const scope = uniqueName('scope');
    const cache = await cacheOf(scope, 'sharded', 10_000, 4);
    const keys = Array.from({ length: 200 }, (_, i) => cache.keyOf(`id-${i}`));
    const tags = new Set(keys.map((key) => key.slice(key.indexOf('{'), key.indexOf('}') + 1)));
    expect([...tags].sort()).toEqual([0, 1, 2, 3].map((shard) => `{${scope} ${shard}}`));
    expect(await cache.claim(keys)).toEqual(keys.map(() => 'new'));
    expect(await cache.commit(keys)).toEqual(keys.map(() => 'committed'));
    // Another process with the default ('auto') reads the stored layout and finds every ID.
    const later = await cacheOf(scope, 'later');
    expect(later.layout.shards).toBe(4);
    expect(await later.claim(keys)).toEqual(keys.map(() => 'dup'));
    await expect(cacheOf(scope, 'wrong', 10_000, 2)).rejects.toThrow(ConfigError);
    await expect(cacheOf(scope, 'wrong', 10_000, 2)).rejects.toThrow(/stored over 4 shard/);
  });

  it('stores each ID by its SHA-1 digest, in the shard and bucket the layout names (what every version reads)', async () => {
    // Worked out here from the digest alone, not through the cache's own code: a change of how the
    // digest is made or split would leave a scope's stored IDs unseen after an upgrade. Shard and
    // bucket counts that are not powers of two, so that every bit of the two 32-bit numbers counts
    // (with 4 shards and 16 buckets only 2 and 4 low bits did, and a lost top bit went unseen).
    const scope = uniqueName('scope');
    const cache = await DedupCache.open(redis, {
      token: 'layout',
      leaseMs: 10_000,
      windowMs: WINDOW,
      prefix: 'dedup',
      scope,
      shards: 5,
      clock: () => AT,
    });
    cache.expectedIds = 100_000;
    const ids = Array.from({ length: 64 }, (_, i) => `id-${i}-é-\u{1F600}-${'x'.repeat(i)}`);
    const keys = ids.map((id) => cache.keyOf(id));
    expect(await cache.claim(keys)).toEqual(keys.map(() => 'new'));
    expect(await cache.commit(keys)).toEqual(keys.map(() => 'committed'));
    const slice = Math.floor(AT / sliceLengthFor(WINDOW));
    for (const [i, id] of ids.entries()) {
      const sha = createHash('sha1').update(id, 'utf8').digest();
      const base = `dedup:{${scope} ${sha.readUInt32BE(16) % 5}}`;
      expect(keys[i]).toBe(`${base}:c:${id}`);
      const meta = await redis.hget(`${base}:m`, String(slice));
      const buckets = Number(/:(\d+)$/.exec(meta ?? '')?.[1]);
      // 20,000 IDs a shard with room to spare: 313 buckets, an odd number.
      expect(buckets).toBe(313);
      const bucket = `${base}:d:${slice}:0:${sha.readUInt32BE(12) % buckets}`;
      expect(await redis.hexists(bucket, sha.subarray(0, 12)), id).toBe(1);
    }
  });
});
