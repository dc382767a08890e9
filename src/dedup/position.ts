import { readFileSync } from 'node:fs';
import type { RedisClient } from './redis.js';

/**
 * Where a stream source route has read up to: the offset of the first message it has not settled
 * (forwarded and committed, or a duplicate of one that was), kept in Redis next to the dedup
 * records of the same scope, `<prefix>:{<scope>}:position:<source>`. Kept in Redis rather than by
 * the stream's own offset tracking because a Redis write is answered (a position the bridge
 * reports is one Redis holds), it needs no write permission on the source, and the source broker
 * of a migration is left as it was.
 */
export class PositionStore {
  private readonly key: string;

  constructor(
    private readonly redis: RedisClient,
    prefix: string,
    scope: string,
    /** The source stream, as `<cluster>/<vhost>/<stream>`. */
    source: string,
  ) {
    this.key = `${prefix}:{${scope}}:position:${source}`;
    if (!('dedupBridge_position_save' in redis)) {
      redis.defineCommand('dedupBridge_position_save', {
        numberOfKeys: 1,
        lua: readFileSync(new URL('./lua/position-save.lua', import.meta.url), 'utf8'),
      });
    }
  }

  /** The stored position, or undefined for a route that has stored none. */
  async load(): Promise<bigint | undefined> {
    const text = await this.redis.get(this.key);
    return text === null ? undefined : BigInt(text);
  }

  /**
   * Stores `first` as a new route's position unless one is stored already (another replica of the
   * route started first and may be reading from it); returns the position kept.
   */
  async init(first: bigint): Promise<bigint> {
    await this.redis.set(this.key, first.toString(), 'NX');
    return (await this.load()) ?? first;
  }

  /** Raises the stored position to `next` (never lowers it); returns the position kept. */
  async save(next: bigint): Promise<bigint> {
    const call = (this.redis as unknown as Record<string, (key: string, value: string) => Promise<string>>)
      .dedupBridge_position_save as (key: string, value: string) => Promise<string>;
    return BigInt(await call.call(this.redis, this.key, next.toString()));
  }
}
