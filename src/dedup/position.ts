import { readFileSync } from 'node:fs';
import type { RedisClient } from './redis.js';

/**
 * What a stream source route has settled (forwarded and committed, or found a duplicate of what
 * was): every offset before `next` but those in `holes`, inclusive ranges in ascending order. A
 * message the route cannot forward (unroutable, say) is a hole, and the route reads on past it:
 * a restart reads the holes again and skips what was settled around them, however long ago.
 * A plain "first offset not settled" would send every later message again once the dedup window
 * has forgotten them.
 */
export interface ReadPosition {
  next: bigint;
  holes: readonly (readonly [first: bigint, last: bigint])[];
}

/** Holes kept at most: past them, the ones closest together are merged into wider holes. */
const MAX_HOLES = 256;

/** The first offset a route at `position` reads. */
export function firstToRead(position: ReadPosition): bigint {
  return position.holes[0]?.[0] ?? position.next;
}

/** Whether `offset` was settled by the route at `position`. */
export function isSettled(position: ReadPosition, offset: bigint): boolean {
  return offset < position.next && !position.holes.some(([first, last]) => offset >= first && offset <= last);
}

/**
 * The position of a route that settled everything before `next` but `unsettled` (ascending
 * offsets). Past MAX_HOLES ranges, the ranges with the narrowest gaps between them are merged: a
 * wider hole only reads settled offsets again (as duplicates), and `next` stays where it is.
 */
export function positionOf(next: bigint, unsettled: Iterable<bigint>): ReadPosition {
  const holes: [bigint, bigint][] = [];
  for (const offset of unsettled) {
    if (offset >= next) break;
    const last = holes[holes.length - 1];
    if (last && offset === last[1] + 1n) last[1] = offset;
    else holes.push([offset, offset]);
  }
  if (holes.length <= MAX_HOLES) return { next, holes };
  // Close the narrowest gaps (gap i lies between holes i and i + 1).
  const gaps = holes
    .slice(1)
    .map(([first], index) => ({ index, size: first - (holes[index] as [bigint, bigint])[1] }));
  gaps.sort((a, b) => (a.size < b.size ? -1 : a.size > b.size ? 1 : a.index - b.index));
  const closed = new Set(gaps.slice(0, holes.length - MAX_HOLES).map((gap) => gap.index));
  const merged: [bigint, bigint][] = [];
  holes.forEach((hole, index) => {
    const previous = merged[merged.length - 1];
    if (previous && closed.has(index - 1)) previous[1] = hole[1];
    else merged.push([hole[0], hole[1]]);
  });
  return { next, holes: merged };
}

/** As stored: `next`, then each hole as `first` or `first-last`, space separated, in decimal. */
export function encodePosition(position: ReadPosition): string {
  const holes = position.holes.map(([first, last]) => (first === last ? `${first}` : `${first}-${last}`));
  return [String(position.next), ...holes].join(' ');
}

export function parsePosition(text: string): ReadPosition {
  const [next = '', ...holes] = text.split(' ');
  const number = (part: string) => {
    if (!/^\d+$/.test(part))
      throw new Error(`a stored stream position "${text}" is not one this version wrote`);
    return BigInt(part);
  };
  return {
    next: number(next),
    holes: holes.map((hole) => {
      const [first = '', last = first] = hole.split('-');
      return [number(first), number(last)] as const;
    }),
  };
}

/**
 * A route's position in Redis, next to the dedup records of the same scope,
 * `<prefix>:{<scope>}:position:<source>`. Kept in Redis rather than by the stream's own offset
 * tracking because a Redis write is answered (a position the bridge reports is one Redis holds),
 * it needs no write permission on the source, and the source broker of a migration is left as
 * it was.
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
  async load(): Promise<ReadPosition | undefined> {
    const text = await this.redis.get(this.key);
    return text === null ? undefined : parsePosition(text);
  }

  /**
   * Stores `first` as a new route's position unless one is stored already (another replica of the
   * route started first and may be reading from it); returns the position kept.
   */
  async init(first: bigint): Promise<ReadPosition> {
    await this.redis.set(this.key, first.toString(), 'NX');
    return (await this.load()) ?? { next: first, holes: [] };
  }

  /** Stores `position` unless the one stored has a later `next`; returns the position kept. */
  async save(position: ReadPosition): Promise<ReadPosition> {
    const call = (this.redis as unknown as Record<string, (key: string, value: string) => Promise<string>>)
      .dedupBridge_position_save as (key: string, value: string) => Promise<string>;
    return parsePosition(await call.call(this.redis, this.key, encodePosition(position)));
  }
}
