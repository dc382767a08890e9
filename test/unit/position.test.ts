import { describe, expect, it } from 'vitest';
import {
  encodePosition,
  firstToRead,
  isSettled,
  parsePosition,
  positionOf,
} from '../../src/dedup/position.js';

// A stream source route's position: what it settled, as stored in Redis (a pure value).

describe('stream read position', () => {
  it('names the unsettled offsets below next as ranges, and reads from the first of them', () => {
    const position = positionOf(100n, [3n, 4n, 5n, 50n, 98n, 99n, 100n, 130n]);
    expect(encodePosition(position)).toBe('100 3-5 50 98-99');
    expect(firstToRead(position)).toBe(3n);
    expect([2n, 3n, 5n, 6n, 50n, 51n, 99n, 100n].map((offset) => isSettled(position, offset))).toEqual([
      true,
      false,
      false,
      true,
      false,
      true,
      false,
      false,
    ]);
    expect(firstToRead(positionOf(7n, []))).toBe(7n);
  });

  it('reads back what it stores, exactly to 2^64, and the plain offset of a position with no holes', () => {
    const big = (1n << 64n) - 1n;
    const position = positionOf(big, [0n, big - 2n]);
    expect(parsePosition(encodePosition(position))).toEqual(position);
    expect(parsePosition('42')).toEqual({ next: 42n, holes: [] });
    expect(() => parsePosition('42 x')).toThrow(/not one this version wrote/);
  });

  it('past 256 holes, the closest ones merge into wider holes: nothing unsettled is skipped, next stays', () => {
    // 300 single holes, every other offset below 600, and one far out at 900.
    const unsettled = [...Array.from({ length: 299 }, (_, n) => BigInt(n * 2)), 900n];
    const position = positionOf(1000n, unsettled);
    expect(position.holes.length).toBe(256);
    expect(position.next).toBe(1000n);
    for (const offset of unsettled) expect(isSettled(position, offset)).toBe(false);
    // The far hole stays narrow: the gaps closed were the narrowest.
    expect(position.holes[255]).toEqual([900n, 900n]);
    expect(isSettled(position, 899n)).toBe(true);
  });
});
