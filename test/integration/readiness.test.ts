import { describe, expect, it } from 'vitest';
import { FaultProxy } from '../harness/proxy.js';
import {
  countDelivery,
  declareQueue,
  idText,
  metricsUrl,
  openBroker,
  publishAll,
  queuePair,
  type RunningCli,
  runArgs,
  sample,
  startCli,
  takeAll,
  waitFor,
  withOption,
} from '../helpers.js';

// Readiness says what the source broker sees (issue 18, item 2): /readyz and
// dedup_bridge_consuming must not say "consuming" while the broker lists no consumer on the queue.

/** How many consumers the broker lists on the queue (a passive declare of our own). */
async function consumersOf(url: string, queue: string): Promise<number> {
  const broker = await openBroker(url);
  try {
    return (await broker.channel.checkQueue(queue)).consumerCount;
  } finally {
    await broker.close();
  }
}

interface Readiness {
  status: number;
  body: string;
  consuming: number | undefined;
}

async function readiness(url: string, route: string): Promise<Readiness> {
  const ready = await fetch(`${url}/readyz`);
  const body = await ready.text();
  const scrape = await (await fetch(`${url}/metrics`)).text();
  return { status: ready.status, body, consuming: sample(scrape, 'dedup_bridge_consuming', { route }) };
}

/** A bridge whose source connection goes through `proxy`, serving metrics. */
function bridgeThrough(
  proxy: FaultProxy,
  source: string,
  target: string,
  sourceUrl: string,
  extra: string[] = [],
): RunningCli {
  const args = withOption(runArgs(source, ['--target-queue', target]), '--source', proxy.urlFor(sourceUrl));
  return startCli([...args, '--metrics-port', '0', '--shutdown-timeout', '1s', ...extra]);
}

/** How many consumers the bridge started on the source so far (its debug log). */
function consumersStarted(output: string): number {
  return output.split('\n').filter((line) => line.includes('"msg":"source consumer started"')).length;
}

/** Polls until /readyz, the gauge and the broker agree; returns the last readiness seen. */
async function untilAgreed(
  url: string,
  sourceUrl: string,
  source: string,
  want: 'ready' | 'not ready',
): Promise<{ agreed: boolean; last: Readiness | undefined; consumers: number }> {
  let last: Readiness | undefined;
  let consumers = -1;
  const agreed = await waitFor(async () => {
    last = await readiness(url, source);
    consumers = await consumersOf(sourceUrl, source);
    return want === 'ready'
      ? last.status === 200 && last.consuming === 1 && consumers === 1
      : last.status === 503 && last.consuming === 0 && consumers === 0;
  }, 60_000);
  return { agreed, last, consumers };
}

/** Publishes `count` messages and checks each reached the target exactly once. */
async function forwardsAll(
  label: string,
  sourceUrl: string,
  source: string,
  targetUrl: string,
  target: string,
) {
  const ids = Array.from({ length: 20 }, (_, i) => `${label}-${i}`);
  await publishAll(
    sourceUrl,
    source,
    ids.map((id) => ({ body: id, options: { messageId: id } })),
  );
  const received: string[] = [];
  await waitFor(async () => {
    for (const message of await takeAll(targetUrl, target))
      received.push(idText(message.properties.messageId));
    return received.length >= ids.length;
  }, 60_000);
  expect(countDelivery(label, ids, received)).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
}

describe('readiness is what the source broker sees', () => {
  it('a source connection that dies in the read that answered its basic.consume: not ready while the broker lists no consumer, ready again once it does', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const proxy = FaultProxy.forUrl(sourceUrl);
    await proxy.start();
    const bridge = bridgeThrough(proxy, source, target, sourceUrl);
    try {
      const url = await metricsUrl(bridge);
      const ready = await untilAgreed(url, sourceUrl, source, 'ready');
      expect(ready.agreed, JSON.stringify(ready)).toBe(true);

      // The bridge reconnects; its consume-ok arrives with a frame it cannot parse behind it, and
      // its connection dies in that same read (as a 12,000-deep header table once made it).
      proxy.poisonNextConsumeOk();
      proxy.resetAll();
      expect(await waitFor(() => proxy.poisoned)).toBe(true);
      const down = await untilAgreed(url, sourceUrl, source, 'not ready');
      expect(down.agreed, `${JSON.stringify(down)}\n${bridge.output()}`).toBe(true);
      expect(JSON.parse(down.last?.body ?? '{}').status).toBe('not ready');

      proxy.setMode('pass');
      const again = await untilAgreed(url, sourceUrl, source, 'ready');
      expect(again.agreed, `${JSON.stringify(again)}\n${bridge.output()}`).toBe(true);
      await forwardsAll('after-drop', sourceUrl, source, targetUrl, target);
    } finally {
      bridge.signal('SIGTERM');
      await bridge.done;
      await proxy.stop();
    }
  }, 180_000);

  it('a consumer the broker cancelled (its queue deleted and declared again) while word of it is held up: not ready once answers from the broker stop coming (documented: within 10 s), ready again once the broker lists it', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const proxy = FaultProxy.forUrl(sourceUrl);
    await proxy.start();
    const bridge = bridgeThrough(proxy, source, target, sourceUrl);
    try {
      const url = await metricsUrl(bridge);
      const ready = await untilAgreed(url, sourceUrl, source, 'ready');
      expect(ready.agreed, JSON.stringify(ready)).toBe(true);

      // Nothing reaches the bridge (nor the broker from it): the basic.cancel the broker sends
      // when the queue goes is held, as are the bridge's passive declares.
      proxy.setMode('blackhole');
      const admin = await openBroker(sourceUrl);
      try {
        await admin.channel.deleteQueue(source);
      } finally {
        await admin.close();
      }
      await declareQueue(sourceUrl, source);
      const down = await untilAgreed(url, sourceUrl, source, 'not ready');
      expect(down.agreed, `${JSON.stringify(down)}\n${bridge.output()}`).toBe(true);
      expect(JSON.parse(down.last?.body ?? '{}')).toEqual({
        status: 'not ready',
        down: [`${source}: not consuming`],
      });

      // The cancel arrives: the bridge consumes again from the queue of the same name.
      proxy.setMode('pass');
      const again = await untilAgreed(url, sourceUrl, source, 'ready');
      expect(again.agreed, `${JSON.stringify(again)}\n${bridge.output()}`).toBe(true);
      expect(bridge.output()).toContain('the broker cancelled the consumer');
      await forwardsAll('after-cancel', sourceUrl, source, targetUrl, target);
    } finally {
      bridge.signal('SIGTERM');
      await bridge.done;
      await proxy.stop();
    }
  }, 180_000);

  it('a consumer the broker dropped without a word reaching the bridge: not ready, then the bridge reconnects itself once the broker twice lists no consumer', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const proxy = FaultProxy.forUrl(sourceUrl);
    await proxy.start();
    const bridge = bridgeThrough(proxy, source, target, sourceUrl);
    try {
      const url = await metricsUrl(bridge);
      const ready = await untilAgreed(url, sourceUrl, source, 'ready');
      expect(ready.agreed, JSON.stringify(ready)).toBe(true);

      // The broker's basic.cancel (class 60, method 30) never reaches the bridge; everything else
      // does, once the queue is back (a passive declare meanwhile would find no queue).
      proxy.swallowServerMethod(60, 30);
      proxy.setMode('blackhole');
      const admin = await openBroker(sourceUrl);
      try {
        await admin.channel.deleteQueue(source);
      } finally {
        await admin.close();
      }
      await declareQueue(sourceUrl, source);
      proxy.setMode('pass');
      expect(await waitFor(() => proxy.swallowedCount === 1)).toBe(true);
      const down = await untilAgreed(url, sourceUrl, source, 'not ready');
      expect(down.agreed, `${JSON.stringify(down)}\n${bridge.output()}`).toBe(true);

      const again = await untilAgreed(url, sourceUrl, source, 'ready');
      expect(again.agreed, `${JSON.stringify(again)}\n${bridge.output()}`).toBe(true);
      expect(bridge.output()).toContain('the broker lists no consumer on the queue');
      await forwardsAll('after-silent-drop', sourceUrl, source, targetUrl, target);
    } finally {
      bridge.signal('SIGTERM');
      await bridge.done;
      await proxy.stop();
    }
  }, 180_000);

  // Issue 28: dedup_bridge_consuming read 0 on a loaded machine while the route worked. The bridge
  // replaces its own consumer to change its window (the first body tells the size; basic.qos acts
  // only on consumers started after it): between the cancel and the new consume-ok it had no
  // consumer tag, and a passive declare asked before the cancel but answered after it listed none.
  // Neither is a route that stopped consuming. A slow source link (300 ms each way) makes the
  // change take seconds, so that samples every 50 ms see whatever it shows.
  it('readiness and the consuming gauge hold steady while the bridge replaces its consumer with a wider window', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const proxy = FaultProxy.forUrl(sourceUrl);
    await proxy.start();
    const bridge = bridgeThrough(proxy, source, target, sourceUrl, ['--log-level', 'debug']);
    try {
      const url = await metricsUrl(bridge);
      const ready = await untilAgreed(url, sourceUrl, source, 'ready');
      expect(ready.agreed, JSON.stringify(ready)).toBe(true);
      proxy.setDelay(300);
      const consumersBefore = consumersStarted(bridge.output());
      const ids = Array.from({ length: 200 }, (_, i) => `steady-${i}`);
      await publishAll(
        sourceUrl,
        source,
        ids.map((id) => ({ body: id, options: { messageId: id } })),
      );
      const samples: { status: number; consuming: number | undefined; paused: number | undefined }[] = [];
      const received: string[] = [];
      const started = Date.now();
      let doneAt: number | undefined;
      while (Date.now() - started < 60_000 && (doneAt === undefined || Date.now() - doneAt < 1500)) {
        const ready = await fetch(`${url}/readyz`);
        await ready.text();
        const scrape = await (await fetch(`${url}/metrics`)).text();
        samples.push({
          status: ready.status,
          consuming: sample(scrape, 'dedup_bridge_consuming', { route: source }),
          paused: sample(scrape, 'dedup_bridge_consumer_paused', { route: source }),
        });
        for (const message of await takeAll(targetUrl, target))
          received.push(idText(message.properties.messageId));
        if (doneAt === undefined && received.length >= ids.length) doneAt = Date.now();
        await new Promise((resolve) => setTimeout(resolve, 50));
      }
      expect(countDelivery('steady readiness', ids, received)).toMatchObject({
        lost: 0,
        duplicated: 0,
        unexpected: 0,
      });
      // The bridge did replace its consumer while the samples were taken (the first body told the
      // size, and the window of one opened).
      const replaced = consumersStarted(bridge.output()) - consumersBefore;
      const notReady = samples.filter((one) => one.status !== 200).length;
      const notConsuming = samples.filter((one) => one.consuming !== 1 || one.paused !== 0).length;
      process.stdout.write(
        `steady readiness: ${samples.length} samples over ${Date.now() - started} ms, ${replaced} consumer(s) replaced; not ready in ${notReady}, not consuming (or paused) in ${notConsuming}\n`,
      );
      expect(replaced).toBeGreaterThan(0);
      expect(notReady).toBe(0);
      expect(notConsuming).toBe(0);
    } finally {
      bridge.signal('SIGTERM');
      await bridge.done;
      await proxy.stop();
    }
  }, 180_000);
});
