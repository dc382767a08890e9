import { describe, expect, it } from 'vitest';
import { InFlightBytes } from '../../src/amqp/in-flight-bytes.js';

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

  it('sizes the window for the bodies it returned, which come back first and cannot be returned again', () => {
    const bytes = new InFlightBytes(1 * MiB);
    bytes.admit(900 * 1024);
    // Two big bodies arrive while it is held: returned.
    expect(bytes.admit(900 * 1024)).toBe(false);
    expect(bytes.admit(700 * 1024)).toBe(false);
    bytes.release(900 * 1024);
    // Small bodies since then would size the window for a thousand of them.
    bytes.admit(1024);
    bytes.release(1024);
    bytes.admit(1024);
    bytes.release(1024);
    // The window takes the first returned body only: both together would pass the bound, and a
    // redelivered body is taken whatever its size.
    expect(bytes.windowFor(500)).toEqual({ window: 1, sized: true });
    bytes.consumerStarted();
    expect(bytes.admit(900 * 1024, false)).toBe(true);
    bytes.release(900 * 1024);
    expect(bytes.windowFor(500)).toEqual({ window: 1, sized: true });
    bytes.consumerStarted();
    expect(bytes.admit(700 * 1024, false)).toBe(true);
    bytes.release(700 * 1024);
    // Both back: the window goes by the bodies seen again, small ones from now on.
    for (let i = 0; i < 2; i++) {
      bytes.admit(1024);
      bytes.release(1024);
    }
    expect(bytes.windowFor(500)).toEqual({ window: 500, sized: true });
    expect(bytes.peak).toBe(1800 * 1024);
  });

  it("forgets the bodies it returned when a new consumer's first delivery is not one of them (another consumer took them)", () => {
    const bytes = new InFlightBytes(1 * MiB);
    bytes.admit(900 * 1024);
    expect(bytes.admit(900 * 1024)).toBe(false);
    bytes.release(900 * 1024);
    expect(bytes.windowFor(500)).toEqual({ window: 1, sized: true });
    bytes.consumerStarted();
    expect(bytes.admit(1024)).toBe(true);
    bytes.release(1024);
    expect(bytes.windowFor(500).window).toBeGreaterThan(1);
  });
});
