import { Cluster, type Redis } from 'ioredis';
import type { RedisClient } from './redis.js';

/** The part of a key that Redis Cluster hashes: the first non-empty `{...}`, else the whole key. */
export function hashTagOf(key: string): string {
  const open = key.indexOf('{');
  if (open >= 0) {
    const close = key.indexOf('}', open + 1);
    if (close > open + 1) return key.slice(open + 1, close);
  }
  return key;
}

/**
 * Splits keys into groups that share a hash tag, so each group sits in one Cluster slot and a
 * multi-key command (MGET, DEL) on it cannot fail with CROSSSLOT. Order is kept within a group.
 */
export function groupByHashTag(keys: readonly string[]): string[][] {
  const groups = new Map<string, string[]>();
  for (const key of keys) {
    const tag = hashTagOf(key);
    const group = groups.get(tag);
    if (group) group.push(key);
    else groups.set(tag, [key]);
  }
  return [...groups.values()];
}

/** The servers that hold keys: every master of a Cluster, or the one server otherwise. */
export function masterNodes(redis: RedisClient): Redis[] {
  return redis instanceof Cluster ? redis.nodes('master') : [redis];
}

/** MGET over keys from any slots: one MGET per hash tag, answers in the order of `keys`. */
export async function getMany(redis: RedisClient, keys: readonly string[]): Promise<(string | null)[]> {
  const values = new Map<string, string | null>();
  await Promise.all(
    groupByHashTag(keys).map(async (group) => {
      const reply = await redis.mget(...group);
      for (const [index, key] of group.entries()) values.set(key, reply[index] ?? null);
    }),
  );
  return keys.map((key) => values.get(key) ?? null);
}
