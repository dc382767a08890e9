import { createServer } from 'node:net';
import { describe, expect, it } from 'vitest';
import { FaultProxy } from '../harness/proxy.js';
import {
  countDelivery,
  depthOf,
  idText,
  metricsUrl,
  migrateArgs,
  migrateWithReport,
  type OutgoingMessage,
  publishAll,
  queuePair,
  runArgs,
  runCli,
  sample,
  servers,
  startCli,
  takeAll,
  waitFor,
  withOption,
} from '../helpers.js';

async function get(url: string): Promise<{ status: number; body: string }> {
  const response = await fetch(url);
  return { status: response.status, body: await response.text() };
}

describe('metrics and health (--metrics-port)', () => {
  it('counts what the target received, times each stage, and reports readiness until the target is cut', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const proxy = FaultProxy.forUrl(targetUrl);
    await proxy.start();
    const bridge = startCli([
      ...withOption(runArgs(source, ['--target-queue', target]), '--target', proxy.urlFor(targetUrl)),
      '--metrics-port',
      '0',
      '--prefetch',
      '50',
      '--shutdown-timeout',
      '1s',
    ]);
    try {
      const url = await metricsUrl(bridge);
      expect((await get(`${url}/healthz`)).status).toBe(200);
      expect(await waitFor(async () => (await get(`${url}/readyz`)).status === 200)).toBe(true);

      // 300 IDs, 30 of them sent twice: the second copies are acked as duplicates.
      const messages: OutgoingMessage[] = [];
      for (let i = 0; i < 300; i++) messages.push({ body: `m${i}`, options: { messageId: `id-${i}` } });
      for (let i = 0; i < 300; i += 10) messages.push({ body: `m${i}`, options: { messageId: `id-${i}` } });
      await publishAll(sourceUrl, source, messages);

      const route = { route: source };
      let scrape = '';
      const settled = await waitFor(async () => {
        scrape = (await get(`${url}/metrics`)).body;
        return (
          sample(scrape, 'dedup_bridge_consumed_total', route) === 330 &&
          sample(scrape, 'dedup_bridge_in_flight', route) === 0 &&
          sample(scrape, 'dedup_bridge_source_queue_depth', route) === 0
        );
      }, 30_000);
      expect(settled, scrape).toBe(true);

      const received = await takeAll(targetUrl, target);
      const ids = Array.from({ length: 300 }, (_, i) => `id-${i}`);
      const count = countDelivery(
        'metrics',
        ids,
        received.map((message) => idText(message.properties.messageId)),
      );
      expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });

      expect(sample(scrape, 'dedup_bridge_forwarded_total', route)).toBe(received.length);
      expect(sample(scrape, 'dedup_bridge_duplicates_total', route)).toBe(30);
      expect(sample(scrape, 'dedup_bridge_in_doubt_total', route)).toBe(0);
      expect(sample(scrape, 'dedup_bridge_unroutable_total', route)).toBe(0);
      // Every message was claimed once; the 300 forwarded were each confirmed and committed once.
      expect(sample(scrape, 'dedup_bridge_claim_seconds_count', route)).toBe(330);
      expect(sample(scrape, 'dedup_bridge_confirm_seconds_count', route)).toBe(300);
      expect(sample(scrape, 'dedup_bridge_commit_seconds_count', route)).toBe(300);
      expect(sample(scrape, 'dedup_bridge_confirm_seconds_bucket', { ...route, le: '+Inf' })).toBe(300);
      expect(sample(scrape, 'dedup_bridge_claim_seconds_sum', route)).toBeGreaterThan(0);
      for (const side of ['source', 'target', 'redis']) {
        expect(sample(scrape, 'dedup_bridge_connection_up', { ...route, side })).toBe(1);
      }
      expect(sample(scrape, 'dedup_bridge_consuming', route)).toBe(1);
      expect(scrape).toContain('# TYPE dedup_bridge_forwarded_total counter');
      expect(scrape).toContain('# TYPE dedup_bridge_confirm_seconds histogram');

      // The target goes away (connections reset, new ones refused): not ready, and it says why.
      await proxy.stop();
      let ready = { status: 0, body: '' };
      expect(
        await waitFor(async () => {
          ready = await get(`${url}/readyz`);
          return ready.status === 503;
        }),
      ).toBe(true);
      expect(JSON.parse(ready.body)).toEqual({
        status: 'not ready',
        down: [`${source}: target connection down`],
      });
      expect((await get(`${url}/healthz`)).status).toBe(200);
      const cut = (await get(`${url}/metrics`)).body;
      expect(sample(cut, 'dedup_bridge_connection_up', { ...route, side: 'target' })).toBe(0);
      expect(sample(cut, 'dedup_bridge_connection_up', { ...route, side: 'source' })).toBe(1);

      // Meanwhile the bridge takes a prefetch window (50) and holds it; the rest waits in the queue.
      const more = Array.from({ length: 80 }, (_, i) => ({
        body: 'later',
        options: { messageId: `later-${i}` },
      }));
      await publishAll(sourceUrl, source, more);
      let held = '';
      const holding = await waitFor(async () => {
        held = (await get(`${url}/metrics`)).body;
        return (
          sample(held, 'dedup_bridge_source_queue_depth', route) === 30 &&
          sample(held, 'dedup_bridge_in_flight', route) === 50
        );
      }, 15_000);
      expect(holding, held).toBe(true);
      expect(sample(held, 'dedup_bridge_forwarded_total', route)).toBe(300);

      bridge.signal('SIGTERM');
      const result = await bridge.done;
      expect(result.code, result.stderr).toBe(0);
      // Nothing unforwarded was acked: all 80 are back in the source.
      expect(await waitFor(async () => (await depthOf(sourceUrl, source)) === 80)).toBe(true);
      // The port is closed with the process.
      await expect(fetch(`${url}/healthz`)).rejects.toThrow();
    } finally {
      bridge.signal('SIGKILL');
      await proxy.stop();
    }
  });

  it('migrate serves the metrics of its queues while it runs and closes the port when it is done', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const sent = Array.from({ length: 50 }, (_, i) => ({ body: 'x', options: { messageId: `mig-${i}` } }));
    await publishAll(sourceUrl, source, sent);
    const job = startCli([
      ...migrateArgs(source, ['--target-queue', target], '--metrics-port', '0', '--quiet').map((arg) =>
        arg === '300ms' ? '2s' : arg,
      ),
    ]);
    try {
      const url = await metricsUrl(job);
      let scrape = '';
      // While it waits out the idle timeout, the queue's counters are there to see.
      const seen = await waitFor(async () => {
        scrape = (await get(`${url}/metrics`)).body;
        return sample(scrape, 'dedup_bridge_forwarded_total', { route: source }) === 50;
      });
      expect(seen, scrape).toBe(true);
      const result = await job.done;
      expect(result.code, result.stderr).toBe(0);
      expect(await depthOf(targetUrl, target)).toBe(50);
      await expect(fetch(`${url}/healthz`)).rejects.toThrow();
    } finally {
      job.signal('SIGKILL');
    }
  });

  it('a port in use or a bad port value is one line and exit 2, before any server is contacted', async () => {
    const taken = createServer();
    await new Promise<void>((resolve) => taken.listen(0, '127.0.0.1', resolve));
    const port = (taken.address() as { port: number }).port;
    try {
      // Unreachable brokers: the port check must come first, or this would retry for a while.
      const args = [
        'run',
        '--source',
        'amqp://guest:guest@127.0.0.1:1',
        '--source-queue',
        'q',
        '--target',
        'amqp://guest:guest@127.0.0.1:1',
        '--target-queue',
        'q2',
        '--redis',
        servers().redisUrl,
        '--metrics-host',
        '127.0.0.1',
      ];
      const busy = await runCli([...args, '--metrics-port', String(port)], { timeoutMs: 20_000 });
      expect(busy.stderr).toBe(
        `dedup-bridge: --metrics-port: port ${port} is already in use on 127.0.0.1; pick a free port or stop what listens there\n`,
      );
      expect(busy.code).toBe(2);

      const bad = await runCli([...args.slice(0, -2), '--metrics-port', 'http'], { timeoutMs: 20_000 });
      expect(bad.stderr).toMatch(
        /^dedup-bridge: --metrics-port \(or DEDUP_BRIDGE_METRICS_PORT\): "http" is not a port/,
      );
      expect(bad.code).toBe(2);
    } finally {
      taken.close();
    }
  });
});

describe('bad ID headers are counted where the README says (issue 17, item 8)', () => {
  // A table and an array cannot be IDs: the next --id-from strategy (message-id) decides.
  const badHeaders = (prefix: string) => [
    { body: 'table', options: { messageId: `${prefix}-1`, headers: { _HQ_DUPL_ID: { nested: 'x' } } } },
    { body: 'array', options: { messageId: `${prefix}-2`, headers: { _HQ_DUPL_ID: ['a', 'b'] } } },
    { body: 'fine', options: { headers: { _HQ_DUPL_ID: `${prefix}-3` } } },
  ];

  it('run: dedup_bridge_bad_id_header_total counts them, and every message is forwarded', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const bridge = startCli([...runArgs(source, ['--target-queue', target]), '--metrics-port', '0']);
    try {
      const url = await metricsUrl(bridge);
      await publishAll(sourceUrl, source, badHeaders('bad-metric'));
      const route = { route: source };
      let scrape = '';
      const settled = await waitFor(async () => {
        scrape = (await get(`${url}/metrics`)).body;
        return sample(scrape, 'dedup_bridge_forwarded_total', route) === 3;
      }, 30_000);
      expect(settled, scrape).toBe(true);
      expect(sample(scrape, 'dedup_bridge_bad_id_header_total', route)).toBe(2);
      expect(sample(scrape, 'dedup_bridge_no_id_total', route)).toBe(0);
      expect(scrape).toContain('# TYPE dedup_bridge_bad_id_header_total counter');
      bridge.signal('SIGTERM');
      expect((await bridge.done).code).toBe(0);
      expect((await takeAll(targetUrl, target)).map((m) => m.content.toString()).sort()).toEqual([
        'array',
        'fine',
        'table',
      ]);
    } finally {
      bridge.signal('SIGKILL');
    }
  });

  it('migrate: the report counts them per queue and in total', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    await publishAll(sourceUrl, source, badHeaders('bad-report'));
    const run = await migrateWithReport(migrateArgs(source, ['--target-queue', target]));
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 3, badIdHeader: 2, noId: 0, accounted: true });
    const queues = (run.report?.queues ?? []) as Record<string, unknown>[];
    expect(queues[0]).toMatchObject({ badIdHeader: 2 });
    expect(await depthOf(sourceUrl, source)).toBe(0);
    expect(await takeAll(targetUrl, target)).toHaveLength(3);
  });
});
