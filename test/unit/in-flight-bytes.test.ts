import { describe, expect, it } from 'vitest';
import { InFlightBytes } from '../../src/bridge/limits.js';

const MiB = 1024 * 1024;

describe('InFlightBytes (--max-in-flight-bytes)', () => {
  it('takes bodies up to the bound, returns the one that would pass it, and lets a bigger one pass alone', () => {
    const bytes = new InFlightBytes(16 * MiB);
    for (let i = 0; i < 4; i++) expect(bytes.admit(4 * MiB)).toBe(true);
    expect(bytes.full).toBe(true);
    expect(bytes.admit(1)).toBe(false);
    expect(bytes).toMatchObject({ held: 16 * MiB, count: 4, returned: 1, peak: 16 * MiB + 1 });
    for (let i = 0; i < 4; i++) bytes.release(4 * MiB);
    expect(bytes.admit(40 * MiB)).toBe(true);
    expect(bytes.admit(1)).toBe(false);
    expect(bytes.peak).toBe(40 * MiB + 1);
  });

  it('opens a window of one until a body is seen, then as many of that size as fit, never past the prefetch', () => {
    const bytes = new InFlightBytes(16 * MiB);
    expect(bytes.windowFor(500)).toEqual({ window: 1, sized: false });
    bytes.admit(4 * MiB);
    expect(bytes.windowFor(500)).toEqual({ window: 3, sized: true });
    bytes.release(4 * MiB);
    expect(bytes.windowFor(500)).toEqual({ window: 4, sized: true });
    expect(bytes.windowFor(2)).toEqual({ window: 2, sized: true });
    bytes.admit(1024);
    bytes.release(1024);
    expect(bytes.windowFor(500)).toEqual({ window: 500, sized: true });
  });

  it('empty bodies open the window to the whole prefetch', () => {
    const bytes = new InFlightBytes(16 * MiB);
    bytes.admit(0);
    expect(bytes.windowFor(500)).toEqual({ window: 499, sized: true });
    bytes.release(0);
    expect(bytes.windowFor(500)).toEqual({ window: 500, sized: true });
  });

  it('a paused consumer comes back when half the bound is free and a body of the size seen fits, or nothing is held', () => {
    const bytes = new InFlightBytes(16 * MiB);
    for (let i = 0; i < 3; i++) bytes.admit(5 * MiB);
    expect(bytes.mayResume).toBe(false);
    bytes.release(5 * MiB);
    expect(bytes.mayResume).toBe(false);
    bytes.release(5 * MiB);
    expect(bytes.mayResume).toBe(true);
  });
});
