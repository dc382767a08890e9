import { DedupCache } from './cache.js';
import { keyOfValue } from './id.js';
import type { RedisClient } from './redis.js';
import { masterNodes } from './slots.js';

export interface IdState {
  id: string;
  key: string;
  state: 'committed' | 'claimed' | 'in-doubt' | 'unknown';
  /** The claim's owner token (claimed and in-doubt only). */
  owner: string | undefined;
  /** Time left before the record expires, in ms; undefined when there is no record. */
  ttlMs: number | undefined;
  /** For a live claim: time left on its lease, in ms. */
  leaseMs: number | undefined;
}

// The tools look at every slice still stored, whatever window wrote it.
const ANY_WINDOW = Number.MAX_SAFE_INTEGER;

function openScope(redis: RedisClient, prefix: string, scope: string): Promise<DedupCache | undefined> {
  return DedupCache.existing(redis, { prefix, scope, windowMs: ANY_WINDOW });
}

/** What the cache holds for each ID (typed on the command line, so keyed as a text ID). */
export async function inspectIds(
  redis: RedisClient,
  prefix: string,
  scope: string,
  ids: string[],
): Promise<IdState[]> {
  const cache = await openScope(redis, prefix, scope);
  if (!cache) {
    return ids.map((id) => ({
      id,
      key: '',
      state: 'unknown',
      owner: undefined,
      ttlMs: undefined,
      leaseMs: undefined,
    }));
  }
  const now = await redisNow(redis);
  const keys = ids.map((id) => cache.keyOf(keyOfValue(id) ?? id));
  const records = await cache.lookup(keys);
  return ids.map((id, index) => {
    const key = keys[index] as string;
    const record = records[index];
    if (!record || record.state === 'unknown') {
      return { id, key, state: 'unknown', owner: undefined, ttlMs: undefined, leaseMs: undefined };
    }
    if (record.state === 'committed') {
      return { id, key, state: 'committed', owner: undefined, ttlMs: record.ttlMs, leaseMs: undefined };
    }
    const match = /^c:([^:]*):(\d+):([01])$/.exec(record.claim);
    const expiry = Number(match?.[2] ?? 0);
    const live = expiry > now;
    return {
      id,
      key,
      state: match?.[3] === '1' || !live ? 'in-doubt' : 'claimed',
      owner: match?.[1],
      ttlMs: record.ttlMs,
      leaseMs: live ? expiry - now : 0,
    };
  });
}

export interface ScopeStats {
  committed: number;
  claimed: number;
  /** Bytes Redis reports for a sample of the keys, scaled to all of them. */
  approxBytes: number;
}

/**
 * Counts a scope's records: committed IDs from the slice totals in each shard's meta hash, claims
 * with SCAN (no KEYS); memory from a sample of the keys, scaled up.
 */
export async function scopeStats(redis: RedisClient, prefix: string, scope: string): Promise<ScopeStats> {
  const cache = await openScope(redis, prefix, scope);
  if (!cache) return { committed: 0, claimed: 0, approxBytes: 0 };
  const now = await redisNow(redis);
  const usage = async (key: string) => Number((await redis.memory('USAGE', key).catch(() => 0)) ?? 0);
  let committed = 0;
  let approxBytes = 0;
  for (const base of cache.bases()) {
    for (const [slice, value] of Object.entries(await redis.hgetall(`${base}:m`))) {
      const [, total, expireAt, list] = value.split(':');
      // A slice past its expiry is gone (its buckets expired); the next commit drops its entry.
      if (Number(expireAt) <= now) continue;
      committed += Number(total);
      // Each generation from a few of its buckets (a bucket not created yet counts as 0 bytes).
      for (const [generation, buckets] of (list ?? '').split(',').map(Number).entries()) {
        const picks = Math.min(3, buckets);
        let bytes = 0;
        for (let bucket = 0; bucket < picks; bucket++) {
          bytes += await usage(`${base}:d:${slice}:${generation}:${bucket}`);
        }
        approxBytes += picks > 0 ? (bytes / picks) * buckets : 0;
      }
    }
  }
  // Claims: one SCAN per server (on a Cluster, each master) that matches every shard of the scope.
  const glob = (text: string) => text.replace(/[*?[\]\\]/g, '\\$&');
  const tag = cache.layout.shards === 1 ? `{${glob(scope)}}` : `{${glob(scope)} *}`;
  const pattern = `${glob(prefix)}:${tag}:c:*`;
  let claimed = 0;
  let claimBytes = 0;
  let sampled = 0;
  for (const node of masterNodes(redis)) {
    let cursor = '0';
    do {
      const [next, keys] = await node.scan(cursor, 'MATCH', pattern, 'COUNT', 1000);
      cursor = next;
      claimed += keys.length;
      for (const key of keys.slice(0, 3)) {
        claimBytes += Number((await node.memory('USAGE', key).catch(() => 0)) ?? 0);
        sampled++;
      }
    } while (cursor !== '0');
  }
  if (sampled > 0) approxBytes += (claimBytes / sampled) * claimed;
  return { committed, claimed, approxBytes: Math.round(approxBytes) };
}

async function redisNow(redis: RedisClient): Promise<number> {
  const [seconds, micros] = (await redis.time()) as [string | number, string | number];
  return Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
}

/** Deletes the records of the given IDs; returns how many had one. */
export async function forgetIds(
  redis: RedisClient,
  prefix: string,
  scope: string,
  ids: string[],
): Promise<number> {
  const cache = await openScope(redis, prefix, scope);
  if (!cache || ids.length === 0) return 0;
  return cache.forget(ids.map((id) => cache.keyOf(keyOfValue(id) ?? id)));
}
