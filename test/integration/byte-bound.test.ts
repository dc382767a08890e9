import { randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { FaultProxy } from '../harness/proxy.js';
import {
  countDelivery,
  depthOf,
  idText,
  metricsUrl,
  publishAll,
  queuePair,
  runArgs,
  sample,
  startCli,
  takeAll,
  waitFor,
  withOption,
} from '../helpers.js';

// --max-in-flight-bytes (issue 18, item 3): the bodies a route holds stay within the bound (plus
// the one delivery that arrived past it and was returned unread), whatever the broker already sent.

const MiB = 1024 * 1024;

/** Resident memory of a process as the kernel counts it: now (VmRSS) or its peak (VmHWM), in bytes. */
function rssOf(pid: number, field: 'VmRSS' | 'VmHWM'): number {
  const line = readFileSync(`/proc/${pid}/status`, 'utf8')
    .split('\n')
    .find((text) => text.startsWith(`${field}:`));
  return Number(/(\d+)/.exec(line ?? '')?.[1] ?? 0) * 1024;
}

interface Outcome {
  peakBytes: number | undefined;
  returnedUnread: number | undefined;
  /** How much the process's peak resident memory rose above what it used before the bodies came. */
  rssRise: number;
}

/**
 * Forwards `sizes` (one message each, distinct IDs, random bodies) with a bound, over a line to
 * the target slower than the source (so that bodies pile up in the bridge), checks every ID
 * reached the target exactly once with its body, and returns what was measured.
 */
async function forward(label: string, sizes: number[], bound: string): Promise<Outcome> {
  const { sourceUrl, targetUrl, source, target } = await queuePair();
  const bodies = new Map(sizes.map((size, i) => [`${label}-${i}`, randomBytes(size)]));
  const proxy = FaultProxy.forUrl(targetUrl);
  await proxy.start();
  proxy.setRate(8 * MiB);
  const bridge = startCli([
    ...withOption(runArgs(source, ['--target-queue', target]), '--target', proxy.urlFor(targetUrl)),
    '--max-in-flight-bytes',
    bound,
    '--metrics-port',
    '0',
    '--shutdown-timeout',
    '1s',
  ]);
  try {
    const url = await metricsUrl(bridge);
    expect(await waitFor(async () => (await fetch(`${url}/readyz`)).status === 200)).toBe(true);
    const before = rssOf(bridge.pid, 'VmRSS');
    await publishAll(
      sourceUrl,
      source,
      [...bodies].map(([id, body]) => ({ body, options: { messageId: id } })),
    );
    expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= bodies.size, 120_000)).toBe(true);
    let scrape = '';
    expect(
      await waitFor(async () => {
        scrape = await (await fetch(`${url}/metrics`)).text();
        return sample(scrape, 'dedup_bridge_in_flight', { route: source }) === 0;
      }),
    ).toBe(true);
    const rssRise = rssOf(bridge.pid, 'VmHWM') - before;
    const received = await takeAll(targetUrl, target);
    const ids = received.map((message) => idText(message.properties.messageId));
    expect(countDelivery(label, bodies.keys(), ids)).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
    for (const message of received) {
      expect(message.content.equals(bodies.get(String(message.properties.messageId)) as Buffer)).toBe(true);
    }
    const outcome = {
      peakBytes: sample(scrape, 'dedup_bridge_in_flight_bytes_peak', { route: source }),
      returnedUnread: sample(scrape, 'dedup_bridge_returned_unread_total', { route: source }),
      rssRise,
    };
    process.stdout.write(
      `${label}: peak in flight ${((outcome.peakBytes ?? 0) / MiB).toFixed(1)} MiB, returned unread ${outcome.returnedUnread}, peak RSS ${(rssRise / MiB).toFixed(0)} MiB above the ${(before / MiB).toFixed(0)} MiB before\n`,
    );
    return outcome;
  } finally {
    bridge.signal('SIGTERM');
    await bridge.done;
    await proxy.stop();
  }
}

describe('--max-in-flight-bytes', () => {
  it('20 bodies of 4 MiB with a 16 MiB bound: each forwarded once, the bodies held at once never past the bound plus one', async () => {
    const bounded = await forward(
      'bound-16MiB',
      Array.from({ length: 20 }, () => 4 * MiB),
      '16MiB',
    );
    expect(bounded.peakBytes).toBeGreaterThan(0);
    expect(bounded.peakBytes).toBeLessThanOrEqual(16 * MiB + 4 * MiB);
    // With the whole prefetch window the bridge would take all 80 MiB at once.
    const unbounded = await forward(
      'bound-1GiB',
      Array.from({ length: 20 }, () => 4 * MiB),
      '1GiB',
    );
    expect(unbounded.peakBytes).toBeGreaterThan(20 * MiB);
    // Measured from outside: the bound holds the process's memory down too (GC lag and the
    // copies on their way to the target come on top of the bodies, in both runs).
    expect(bounded.rssRise).toBeLessThan(unbounded.rssRise);
  }, 240_000);

  it('a body bigger than the bound passes alone, with the smaller ones around it', async () => {
    const sizes = [1 * MiB, 1 * MiB, 24 * MiB, 1 * MiB, 1 * MiB];
    const outcome = await forward('bigger-than-bound', sizes, '8MiB');
    // It was taken (no bound stops it for good), and never more than the bound besides it.
    expect(outcome.peakBytes).toBeGreaterThanOrEqual(24 * MiB);
    expect(outcome.peakBytes).toBeLessThanOrEqual(8 * MiB + 24 * MiB);
  }, 240_000);
});
