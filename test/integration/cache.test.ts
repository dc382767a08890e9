import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { cacheKey, DedupCache } from '../../src/dedup/cache.js';
import { servers, uniqueName } from '../helpers.js';

describe('the Redis cache scripts (real Redis)', () => {
  let redis: Redis;
  beforeAll(() => {
    redis = new Redis(servers().redisUrl);
  });
  afterAll(async () => {
    await redis.quit();
  });

  const keysFor = (scope: string, ...ids: string[]) => ids.map((id) => cacheKey('dedup', scope, id));
  const cacheOf = (token: string, leaseMs = 10_000) =>
    new DedupCache(redis, { token, leaseMs, windowMs: 60_000 });

  it('claims new IDs, reports committed ones as dup and live claims of others as busy', async () => {
    const scope = uniqueName('scope');
    const [a, b] = keysFor(scope, 'a', 'b') as [string, string];
    const mine = cacheOf('ownerA');
    const theirs = cacheOf('ownerB');
    expect(await mine.claim([a, b])).toEqual(['new', 'new']);
    expect(await theirs.claim([a, b])).toEqual(['busy', 'busy']);
    expect(await mine.commit([a])).toEqual(['committed']);
    expect(await theirs.claim([a, b])).toEqual(['dup', 'busy']);
    expect(await redis.get(a)).toBe('d');
    const ttl = await redis.pttl(a);
    expect(ttl).toBeGreaterThan(50_000);
    expect(ttl).toBeLessThanOrEqual(60_000);
  });

  it('recognises its own claim sent twice (a re-sent command) and keeps an in-doubt flag', async () => {
    const scope = uniqueName('scope');
    const [a] = keysFor(scope, 'a') as [string];
    const crashed = cacheOf('crashed', 1000);
    expect(await crashed.claim([a])).toEqual(['new']);
    const mine = cacheOf('mine');
    expect(await mine.claim([a])).toEqual(['busy']);
    await new Promise((resolve) => setTimeout(resolve, 1100));
    // The crashed owner's lease ran out: the ID is ours now, in doubt.
    expect(await mine.claim([a])).toEqual(['in-doubt']);
    expect(await mine.claim([a])).toEqual(['in-doubt']);
    // The crashed owner was only slow: the target confirmed its copy, so it commits the ID even
    // though we took the claim over; our copy (flagged in-doubt) is the duplicate.
    expect(await crashed.commit([a])).toEqual(['taken']);
    expect(await redis.get(a)).toBe('d');
    expect(await mine.commit([a])).toEqual(['already']);
    expect(await mine.claim([a])).toEqual(['dup']);
  });

  it('releases only its own claims, and commits an ID whose record vanished', async () => {
    const scope = uniqueName('scope');
    const [a, b, c] = keysFor(scope, 'a', 'b', 'c') as [string, string, string];
    const mine = cacheOf('mine');
    const theirs = cacheOf('theirs');
    await mine.claim([a]);
    await theirs.claim([b]);
    expect(await mine.release([a, b])).toBe(1);
    expect(await redis.exists(a)).toBe(0);
    expect(await redis.get(b)).toMatch(/^c:theirs:/);
    expect(await mine.commit([c])).toEqual(['restored']);
    expect(await redis.get(c)).toBe('d');
  });

  it('a release that keeps the doubt makes the next claim, by anyone, in-doubt', async () => {
    const scope = uniqueName('scope');
    const [a, b] = keysFor(scope, 'a', 'b') as [string, string];
    const mine = cacheOf('mine');
    await mine.claim([a, b]);
    expect(await mine.release([a], { keepInDoubt: true })).toBe(1);
    expect(await mine.claim([a])).toEqual(['in-doubt']);
    await mine.release([a, b], { keepInDoubt: true });
    expect(await cacheOf('other').claim([a, b])).toEqual(['in-doubt', 'in-doubt']);
  });

  it('renews the leases of its own claims only', async () => {
    const scope = uniqueName('scope');
    const [a, b] = keysFor(scope, 'a', 'b') as [string, string];
    const mine = cacheOf('mine', 1000);
    const theirs = cacheOf('theirs', 1000);
    await mine.claim([a]);
    await theirs.claim([b]);
    await new Promise((resolve) => setTimeout(resolve, 700));
    expect(await mine.renew([a, b])).toBe(1);
    await new Promise((resolve) => setTimeout(resolve, 500));
    const third = cacheOf('third');
    // a was renewed and is still live; b's lease ran out and is taken over in doubt.
    expect(await third.claim([a, b])).toEqual(['busy', 'in-doubt']);
  });
});
