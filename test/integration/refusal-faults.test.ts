import { rmSync } from 'node:fs';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { FaultProxy } from '../harness/proxy.js';
import { newRunDir, RabbitNode } from '../harness/servers.js';
import {
  declareQueue,
  depthOf,
  idText,
  metricsUrl,
  publishAll,
  queuePair,
  runArgs,
  servers,
  startCli,
  takeAll,
  uniqueName,
  waitFor,
  withOption,
} from '../helpers.js';

// Faults around refusals and leases, found by a review of the fencing and the size trials (issues
// 28 and 34): a size limit raised or lowered while the bridge runs, renewals racing commits, and
// refusals held while the source link dies. Each asserts what the guarantee and the docs promise.

/** Sum of every series of one metric in a Prometheus scrape (any labels). */
function total(text: string, name: string): number {
  let sum = 0;
  for (const line of text.split('\n')) {
    const match = /^([a-z_]+)(\{[^}]*\})? (\S+)$/.exec(line);
    if (match && match[1] === name) sum += Number(match[3]);
  }
  return sum;
}

/**
 * The target of the two size-limit tests: one throwaway node of this file's own, since each sets
 * max_message_size, which would refuse other tests' bodies on the shared one. Started once (a node
 * start costs seconds) with the first test's limit; the second sets its own (new channels take it,
 * as both tests rely on). Killed at the end: it is thrown away.
 */
const FIRST_LIMIT = 4096;
let sizeTarget: RabbitNode;
let sizeRunDir: string;

beforeAll(async () => {
  sizeRunDir = newRunDir();
  sizeTarget = new RabbitNode(sizeRunDir, 'size-limits', { config: [`max_message_size = ${FIRST_LIMIT}`] });
  await sizeTarget.start();
}, 120_000);

afterAll(async () => {
  await sizeTarget?.stop(true);
  rmSync(sizeRunDir, { recursive: true, force: true });
});

describe('a size limit the target told is not kept for ever', () => {
  const LIMIT = FIRST_LIMIT;
  let target: RabbitNode;

  beforeAll(() => {
    target = sizeTarget;
  });

  it('forwards a held message once the operator raised max_message_size, as the refusal tells them to', async () => {
    const { sourceUrl } = servers();
    const source = uniqueName('rf-src');
    const destination = uniqueName('rf-dst');
    await declareQueue(sourceUrl, source);
    await declareQueue(target.url, destination);
    await publishAll(sourceUrl, source, [
      ...['a-1', 'a-2', 'a-3'].map((id) => ({
        body: `small ${id}`,
        options: { headers: { _HQ_DUPL_ID: id } },
      })),
      { body: Buffer.alloc(2 * LIMIT, 'x'), options: { headers: { _HQ_DUPL_ID: 'big' } } },
      ...['b-1', 'b-2', 'b-3'].map((id) => ({
        body: `small ${id}`,
        options: { headers: { _HQ_DUPL_ID: id } },
      })),
    ]);
    const args = withOption(runArgs(source, ['--target-queue', destination]), '--target', target.url);
    const bridge = startCli(args);
    try {
      const refused = await waitFor(() => /max_message_size/.test(bridge.output()), 30_000);
      expect(refused, bridge.output()).toBe(true);
      // The operator follows the refusal's advice: raise the limit (new channels take it), and the
      // bridge's connection goes and comes back, as after any hiccup.
      await target.ctl('eval', `application:set_env(rabbit, max_message_size, ${16 * LIMIT}).`);
      await target.ctl('close_all_connections', 'test: the limit was raised');
      // Control: the target now takes a body that size on a new channel.
      const scratch = uniqueName('rf-scratch');
      await declareQueue(target.url, scratch);
      await publishAll(target.url, scratch, [{ body: Buffer.alloc(2 * LIMIT, 'y') }]);
      expect((await takeAll(target.url, scratch)).length).toBe(1);
      const got: string[] = [];
      const arrived = await waitFor(async () => {
        for (const message of await takeAll(target.url, destination)) {
          got.push(idText(message.properties.headers?._HQ_DUPL_ID));
        }
        return got.includes('big');
      }, 50_000);
      const tooLarge = bridge
        .output()
        .split('\n')
        .filter((line) => line.includes('its limit is')).length;
      const reconnected = /reconnect/.test(bridge.output());
      console.log(
        `[size] ids on target: ${got.join(',')}; refusal lines: ${tooLarge}; bridge reconnected: ${reconnected}`,
      );
      expect(arrived, `big never forwarded after the limit was raised; got ${got.join(',')}`).toBe(true);
    } finally {
      bridge.signal('SIGTERM');
      await bridge.done;
    }
  }, 180_000);
});

describe('lease renewals racing commits', () => {
  it('reports no lost lease and resets nothing in a fault-free transfer', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const N = 10_000;
    await publishAll(
      sourceUrl,
      source,
      Array.from({ length: N }, (_, i) => ({
        body: `m${i}`,
        options: { headers: { _HQ_DUPL_ID: `id-${i}` } },
      })),
    );
    const bridge = startCli([
      ...runArgs(source, ['--target-queue', target]),
      '--lease',
      '1s',
      '--metrics-port',
      '0',
    ]);
    try {
      const url = await metricsUrl(bridge);
      let scrape = '';
      const done = await waitFor(async () => {
        scrape = await (await fetch(`${url}/metrics`)).text();
        return total(scrape, 'dedup_bridge_forwarded_total') >= N;
      }, 120_000);
      expect(done, bridge.output().slice(-2000)).toBe(true);
      const lost = total(scrape, 'dedup_bridge_lease_lost_total');
      const resets = total(scrape, 'dedup_bridge_fence_resets_total');
      const fenced = total(scrape, 'dedup_bridge_fenced_total');
      const warnings = bridge
        .output()
        .split('\n')
        .filter((line) => line.includes('leases no longer ours')).length;
      const onTarget = await takeAll(targetUrl, target);
      console.log(
        `[renew] forwarded ${N}; on target ${onTarget.length}; lease_lost ${lost}; warnings ${warnings}; fence_resets ${resets}; fenced ${fenced}`,
      );
      expect(onTarget.length).toBe(N);
      expect({ lost, warnings, resets }).toEqual({ lost: 0, warnings: 0, resets: 0 });
    } finally {
      bridge.signal('SIGTERM');
      await bridge.done;
    }
  }, 240_000);
});

describe('a size limit lowered while the bridge runs (the ordinary channel closes over a size)', () => {
  let target: RabbitNode;

  beforeAll(async () => {
    target = sizeTarget;
    await target.ctl('eval', 'application:set_env(rabbit, max_message_size, 65536).');
  }, 120_000);

  it('loses nothing, flags every later copy and only those sent before the refused one, and takes a body exactly at the limit', async () => {
    const LIMIT = 4096;
    const { sourceUrl } = servers();
    const source = uniqueName('rf-lsrc');
    const destination = uniqueName('rf-ldst');
    await declareQueue(sourceUrl, source);
    await declareQueue(target.url, destination);
    const bridge = startCli([
      ...withOption(runArgs(source, ['--target-queue', destination]), '--target', target.url),
      '--prefetch',
      '1000',
    ]);
    const got: { id: string; flagged: boolean }[] = [];
    const drain = async () => {
      for (const message of await takeAll(target.url, destination)) {
        got.push({
          id: idText(message.properties.headers?._HQ_DUPL_ID),
          flagged: message.properties.headers?.['x-dedup-in-doubt'] === true,
        });
      }
    };
    try {
      // Phase 1: 8 KiB bodies prove that size; later ones up to 10 KiB go on the ordinary channel.
      await publishAll(
        sourceUrl,
        source,
        Array.from({ length: 100 }, (_, i) => ({
          body: Buffer.alloc(8192, 'p'),
          options: { headers: { _HQ_DUPL_ID: `p-${i}` } },
        })),
      );
      const proven = await waitFor(async () => {
        await drain();
        return got.length >= 100;
      }, 60_000);
      expect(proven, bridge.output()).toBe(true);
      // The limit is lowered (new channels take it) and the bridge reconnects: phase 2 is
      // published once its target link is back (or after 30 s, whatever the bridge logged).
      const reconnects = () =>
        bridge
          .output()
          .split('\n')
          .filter((line) => line.includes('"side":"target"') && line.includes('connected again')).length;
      const connectedBefore = reconnects();
      await target.ctl('eval', `application:set_env(rabbit, max_message_size, ${LIMIT}).`);
      await target.ctl('close_all_connections', 'test: the limit was lowered');
      await waitFor(() => reconnects() > connectedBefore, 30_000);
      // Phase 2: 3,000 bodies of 3 KiB and exactly 4 KiB (at the limit: taken), one in 200 of 8 KiB.
      const sent: string[] = [];
      const poison = new Set<string>();
      const messages = Array.from({ length: 3000 }, (_, i) => {
        const id = `q-${i}`;
        const big = i % 200 === 10;
        if (big) poison.add(id);
        else sent.push(id);
        const size = big ? 8192 : i % 2 === 0 ? LIMIT : 3072;
        return { body: Buffer.alloc(size, 'q'), options: { headers: { _HQ_DUPL_ID: id } } };
      });
      await publishAll(sourceUrl, source, messages);
      const wanted = new Set(sent);
      await waitFor(async () => {
        await drain();
        return [...wanted].every((id) => got.some((m) => m.id === id));
      }, 90_000);
      await new Promise((resolve) => setTimeout(resolve, 3000));
      await drain();
      const seen = new Map<string, number>();
      let unflaggedLate = 0;
      let flaggedCopies = 0;
      const firstOrder: string[] = [];
      for (const message of got) {
        const n = (seen.get(message.id) ?? 0) + 1;
        seen.set(message.id, n);
        if (n === 1) firstOrder.push(message.id);
        else if (message.flagged) flaggedCopies++;
        else unflaggedLate++;
      }
      const lost = sent.filter((id) => !seen.has(id));
      const poisonLanded = [...poison].filter((id) => seen.has(id));
      const phase2 = firstOrder.filter((id) => id.startsWith('q-')).map((id) => Number(id.slice(2)));
      let inversions = 0;
      const pairs: string[] = [];
      for (let i = 1; i < phase2.length; i++) {
        if ((phase2[i] as number) < (phase2[i - 1] as number)) {
          inversions++;
          pairs.push(`${phase2[i - 1]}>${phase2[i]}`);
        }
      }
      const flaggedIds = got
        .filter((m, i) => m.flagged && got.findIndex((o) => o.id === m.id) !== i)
        .map((m) => m.id);
      console.log(
        `[lower] inversions (earlier first copy > later): ${pairs.join(' ')}; flagged dups: ${flaggedIds.join(',')}; poison: ${[...poison].slice(0, 3).join(',')}`,
      );
      const closes = bridge
        .output()
        .split('\n')
        .filter((line) => line.includes('target channel error')).length;
      console.log(
        `[lower] sent ${sent.length} (+${poison.size} over the limit); lost ${lost.length}; flagged copies ${flaggedCopies}; unflagged late ${unflaggedLate}; poison landed ${poisonLanded.length}; order inversions ${inversions}; channel closes ${closes}`,
      );
      // The order of first copies is not kept across a close (docs/guarantee.md, Limits): the
      // publishes the close left go again after a backoff, behind later ones (printed above).
      expect({ lost: lost.length, unflaggedLate, poisonLanded: poisonLanded.length, closes }).toEqual({
        lost: 0,
        unflaggedLate: 0,
        poisonLanded: 0,
        closes: 1,
      });
      // Only what was sent before the refused one on the closed channel is in doubt.
      const refused = Math.min(...[...poison].map((id) => Number(id.slice(2))));
      expect(
        flaggedIds.every((id) => Number(id.slice(2)) < refused),
        flaggedIds.join(','),
      ).toBe(true);
    } finally {
      bridge.signal('SIGTERM');
      await bridge.done;
    }
  }, 240_000);
});

describe('held retries whose source channel died', () => {
  it('a quorum source, a full target (reject-publish) and a source reset while refusals are held: nothing lost, later copies flagged', async () => {
    const { sourceUrl, targetUrl } = servers();
    const source = uniqueName('rf-qsrc');
    const destination = uniqueName('rf-qdst');
    await declareQueue(sourceUrl, source, { arguments: { 'x-queue-type': 'quorum' } });
    await declareQueue(targetUrl, destination, {
      arguments: { 'x-max-length': 5, 'x-overflow': 'reject-publish' },
    });
    const ids = Array.from({ length: 20 }, (_, i) => `r-${i}`);
    await publishAll(
      sourceUrl,
      source,
      ids.map((id) => ({ body: `body ${id}`, options: { headers: { _HQ_DUPL_ID: id } } })),
    );
    const proxy = FaultProxy.forUrl(sourceUrl);
    await proxy.start();
    const bridge = startCli(
      withOption(runArgs(source, ['--target-queue', destination]), '--source', proxy.urlFor(sourceUrl)),
    );
    const got: { id: string; flagged: boolean }[] = [];
    const drain = async () => {
      for (const message of await takeAll(targetUrl, destination)) {
        got.push({
          id: idText(message.properties.headers?._HQ_DUPL_ID),
          flagged: message.properties.headers?.['x-dedup-in-doubt'] === true,
        });
      }
    };
    try {
      expect(
        await waitFor(() => /holds it unacked and retries/.test(bridge.output()), 30_000),
        bridge.output(),
      ).toBe(true);
      // The source link dies while the refused ones are held: they go back to the quorum queue.
      proxy.resetAll();
      await new Promise((resolve) => setTimeout(resolve, 2000));
      const all = await waitFor(async () => {
        await drain();
        return ids.every((id) => got.some((m) => m.id === id));
      }, 120_000);
      await new Promise((resolve) => setTimeout(resolve, 3000));
      await drain();
      const seen = new Map<string, number>();
      let unflaggedLate = 0;
      let flagged = 0;
      for (const m of got) {
        const n = (seen.get(m.id) ?? 0) + 1;
        seen.set(m.id, n);
        if (n > 1) {
          if (m.flagged) flagged++;
          else unflaggedLate++;
        }
      }
      const lost = ids.filter((id) => !seen.has(id)).length;
      const left = await depthOf(sourceUrl, source);
      console.log(
        `[held] all arrived ${all}; lost ${lost}; flagged copies ${flagged}; unflagged late ${unflaggedLate}; left in source ${left}; retried lines ${
          bridge
            .output()
            .split('\n')
            .filter((l) => l.includes('retries it after')).length
        }`,
      );
      expect({ lost, unflaggedLate, left }).toEqual({ lost: 0, unflaggedLate: 0, left: 0 });
    } finally {
      bridge.signal('SIGTERM');
      const result = await bridge.done;
      console.log(`[held] exit ${result.code}`);
      await proxy.stop();
    }
  }, 240_000);
});
