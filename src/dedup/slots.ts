import { Cluster, type Redis } from 'ioredis';
import type { RedisClient } from './redis.js';

/** The servers that hold keys: every master of a Cluster, or the one server otherwise. */
export function masterNodes(redis: RedisClient): Redis[] {
  return redis instanceof Cluster ? redis.nodes('master') : [redis];
}
