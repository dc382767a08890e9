import { cacheKey } from './cache.js';
import { keyOfValue } from './id.js';
import type { RedisClient } from './redis.js';
import { groupByHashTag, masterNodes } from './slots.js';

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

/** What the cache holds for each ID (typed on the command line, so keyed as a text ID). */
export async function inspectIds(
  redis: RedisClient,
  prefix: string,
  scope: string,
  ids: string[],
): Promise<IdState[]> {
  const [seconds, micros] = (await redis.time()) as [string | number, string | number];
  const now = Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
  const out: IdState[] = [];
  for (const id of ids) {
    const key = cacheKey(prefix, scope, keyOfValue(id) ?? id);
    const [value, ttl] = await Promise.all([redis.get(key), redis.pttl(key)]);
    if (value === null) {
      out.push({ id, key, state: 'unknown', owner: undefined, ttlMs: undefined, leaseMs: undefined });
      continue;
    }
    if (value === 'd') {
      out.push({ id, key, state: 'committed', owner: undefined, ttlMs: ttl, leaseMs: undefined });
      continue;
    }
    const match = /^c:([^:]*):(\d+):([01])$/.exec(value);
    const expiry = Number(match?.[2] ?? 0);
    const live = expiry > now;
    out.push({
      id,
      key,
      state: match?.[3] === '1' || !live ? 'in-doubt' : 'claimed',
      owner: match?.[1],
      ttlMs: ttl,
      leaseMs: live ? expiry - now : 0,
    });
  }
  return out;
}

export interface ScopeStats {
  committed: number;
  claimed: number;
  /** Bytes Redis reports for a sample of the keys, scaled to all of them. */
  approxBytes: number;
}

/**
 * Counts a scope's records with SCAN (no KEYS), and estimates their memory from a sample. On a
 * Cluster each master holds some of the scope's slots, so every master is scanned.
 */
export async function scopeStats(redis: RedisClient, prefix: string, scope: string): Promise<ScopeStats> {
  const pattern = `${cacheKey(prefix, scope, '').replace(/[*?[\]\\]/g, '\\$&')}*`;
  let committed = 0;
  let claimed = 0;
  let sampled = 0;
  let sampleBytes = 0;
  for (const node of masterNodes(redis)) {
    let cursor = '0';
    do {
      const [next, keys] = await node.scan(cursor, 'MATCH', pattern, 'COUNT', 1000);
      cursor = next;
      if (keys.length === 0) continue;
      // Straight to the node that owns these keys, one MGET per slot.
      for (const group of groupByHashTag(keys)) {
        for (const value of await node.mget(...group)) {
          if (value === 'd') committed++;
          else if (value !== null) claimed++;
        }
      }
      for (const key of keys.slice(0, 5)) {
        const bytes = Number(await node.memory('USAGE', key).catch(() => 0));
        if (bytes > 0) {
          sampled++;
          sampleBytes += bytes;
        }
      }
    } while (cursor !== '0');
  }
  const total = committed + claimed;
  return { committed, claimed, approxBytes: sampled > 0 ? Math.round((sampleBytes / sampled) * total) : 0 };
}

/** Deletes the records of the given IDs; returns how many existed. One DEL per slot. */
export async function forgetIds(
  redis: RedisClient,
  prefix: string,
  scope: string,
  ids: string[],
): Promise<number> {
  const keys = ids.map((id) => cacheKey(prefix, scope, keyOfValue(id) ?? id));
  let removed = 0;
  for (const group of groupByHashTag(keys)) removed += await redis.del(...group);
  return removed;
}
