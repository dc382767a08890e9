import { Redis } from 'ioredis';
import { describe, expect, it } from 'vitest';
import { connectAmqp } from '../../src/amqp/connect.js';
import { publishRaw } from '../../src/amqp/internals.js';
import { routeToken } from '../../src/bridge/route-mark.js';
import { createIdempotentConsumer } from '../../src/client/consumer.js';
import { createLogger } from '../../src/observe/log.js';
import { ContentHeader } from '../../src/wire/properties.js';
import { FaultProxy } from '../harness/proxy.js';
import {
  countDelivery,
  depthOf,
  metricsUrl,
  migrateArgs,
  migrateWithReport,
  openBroker,
  publishAll,
  queuePair,
  routeMarkOf,
  routeNameOf,
  runArgs,
  sample,
  servers,
  startCli,
  takeRaw,
  uniqueName,
  waitFor,
  withOption,
} from '../helpers.js';
import { basicProperties, bool, field, int32, longString, table } from '../wire.js';
import { adminServers } from './privilege-admin.js';

// The bridge's hot path: bodies copied out of the socket read, content headers spliced into one
// buffer, one promise per batch of publishes, at most two claim calls out, commits coalesced. Each
// test asserts what a user checks on the brokers: every message there once, byte for byte, or
// flagged in-doubt where it may be doubled; nothing forwarded left unacked.

const log = createLogger('silent');
const ID = '_HQ_DUPL_ID';
const IN_DOUBT = 'x-dedup-in-doubt';

/** Publishes content headers built by hand, with their bodies, through the default exchange. */
async function publishBuilt(url: string, queue: string, messages: { header: Buffer; body: Buffer }[]) {
  const connection = await connectAmqp(url, { side: 'source', retryForMs: 5000, log });
  try {
    const channel = await connection.createConfirmChannel();
    for (const message of messages) publishRaw(channel, '', queue, message.header, message.body, () => {});
    await channel.waitForConfirms();
  } finally {
    await connection.close();
  }
}

/** The ID and in-doubt flag of a forwarded message, read from its raw header. */
function idOf(header: Buffer): { id: string; inDoubt: boolean } {
  const parsed = new ContentHeader(header);
  const span = parsed.field(ID);
  const flag = parsed.field(IN_DOUBT);
  const value = flag ? parsed.valueOf(flag) : undefined;
  return {
    id: span ? parsed.valueBytes(span).subarray(5).toString('utf8') : '(none)',
    inDoubt: value?.type === 't' && value.value,
  };
}

/**
 * Checks a target against what was sent: nothing lost or unexpected, and an ID that arrived more
 * than once arrived unflagged at most once (every other copy says it may be a duplicate).
 */
function expectOnceOrFlagged(label: string, ids: string[], arrived: { header: Buffer; body: Buffer }[]) {
  const read = arrived.map((m) => ({ ...idOf(m.header), body: m.body.toString() }));
  const count = countDelivery(
    label,
    ids,
    read.map((m) => m.id),
  );
  expect(count).toMatchObject({ lost: 0, unexpected: 0 });
  const unflagged = new Map<string, number>();
  for (const m of read) {
    expect(m.body, m.id).toBe(`body of ${m.id}`);
    if (!m.inDoubt) unflagged.set(m.id, (unflagged.get(m.id) ?? 0) + 1);
  }
  expect([...unflagged].filter(([, times]) => times > 1)).toEqual([]);
  return read;
}

function plainMessages(prefix: string, count: number) {
  return Array.from({ length: count }, (_, i) => ({
    body: `body of ${prefix}-${i}`,
    options: { headers: { [ID]: `${prefix}-${i}`, n: i } },
  }));
}

describe('the hot path', () => {
  it('bodies empty, one byte, at and around frame boundaries, over several frames: byte for byte, both ways', async () => {
    const { sourceUrl, targetUrl } = servers();
    // A frame_max of 4096 on one side (4,088 payload bytes a frame) and amqplib's 131,072 on the other.
    for (const small of ['source', 'target'] as const) {
      const { source, target } = await queuePair();
      const frame = 4088;
      const sizes = [
        0,
        1,
        frame - 1,
        frame,
        frame + 1,
        2 * frame,
        2 * frame + 1,
        131_063,
        131_064,
        131_065,
        300_000,
      ];
      const messages: { header: Buffer; body: Buffer; expected: Buffer }[] = [];
      const mark = await routeMarkOf(sourceUrl, source);
      sizes.forEach((size, index) => {
        // Small messages around each big one share the socket reads it came in.
        for (const [kind, length] of [
          ['big', size],
          ['small', 1 + (index % 7)],
        ] as const) {
          const id = `${small}-${kind}-${index}`;
          const fields = [field('a', int32(index)), field(ID, longString(id)), field('flag', bool(true))];
          const spec = { messageId: id, headers: table(...fields), priority: 1, clusterId: 'c' };
          const body = Buffer.alloc(length);
          for (let i = 0; i < length; i++) body[i] = (i * 7 + index) & 0xff;
          messages.push({
            header: basicProperties(spec),
            body,
            expected: basicProperties({ ...spec, headers: table(...fields, mark) }),
          });
        }
      });
      await publishBuilt(sourceUrl, source, messages);
      let args = migrateArgs(source, ['--target-queue', target], '--prefetch', '500');
      if (small === 'source') args = withOption(args, '--source', `${sourceUrl}?frameMax=4096`);
      else args = withOption(args, '--target', `${targetUrl}?frameMax=4096`);
      const run = await migrateWithReport(args);
      expect(run.code, run.stderr).toBe(0);
      expect(run.report).toMatchObject({ forwarded: messages.length, remaining: 0 });
      const arrived = await takeRaw(targetUrl, target);
      expect(arrived).toHaveLength(messages.length);
      for (const [index, message] of messages.entries()) {
        const got = arrived[index];
        expect(got?.header.toString('hex'), `${small} #${index}`).toBe(message.expected.toString('hex'));
        expect(got?.body.length, `${small} #${index}`).toBe(message.body.length);
        expect(got?.body.equals(message.body), `${small} #${index}`).toBe(true);
      }
    }
  });

  it('the target connection cut in the middle of a batch: the lost publishes go again flagged, none lost', async () => {
    const { targetUrl } = servers();
    const { sourceUrl, source, target } = await queuePair();
    const messages = plainMessages(source, 3000);
    await publishAll(sourceUrl, source, messages);
    const proxy = FaultProxy.forUrl(targetUrl);
    await proxy.start();
    try {
      // Cut mid-stream, twice: somewhere in the publishes of a batch whose earlier ones confirm.
      proxy.resetAfter(150_000);
      const args = withOption(
        migrateArgs(source, ['--target-queue', target], '--batch-size', '100', '--prefetch', '400'),
        '--target',
        proxy.urlFor(targetUrl),
      );
      const running = migrateWithReport(args);
      expect(
        await waitFor(async () => proxy.connections > 0 && (await depthOf(targetUrl, target)) > 1500),
      ).toBe(true);
      proxy.resetAfter(50_000);
      const run = await running;
      expect(run.code, run.stderr).toBe(0);
      expect(run.report).toMatchObject({ remaining: 0, forwarded: 3000 });
      expect(run.report?.inDoubt as number).toBeGreaterThan(0);
      expect(await depthOf(sourceUrl, source)).toBe(0);
      expectOnceOrFlagged(
        'cut mid-batch',
        messages.map((m) => m.options.headers[ID] as string),
        await takeRaw(targetUrl, target),
      );
    } finally {
      await proxy.stop();
    }
  });

  for (const timeout of ['30s', '1ms'] as const) {
    it(`SIGTERM while claims wait behind the two out and commits queue (--shutdown-timeout ${timeout}): acked or unfinished, none lost`, async () => {
      const { redisUrl } = servers();
      const { sourceUrl, targetUrl, source, target } = await queuePair();
      const messages = plainMessages(source, 1500);
      await publishAll(sourceUrl, source, messages);
      // A slow Redis: every claim and commit waits, so batches pile up behind the two claims out.
      const proxy = FaultProxy.forUrl(redisUrl);
      await proxy.start();
      proxy.setDelay(40);
      try {
        const args = withOption(
          runArgs(
            source,
            ['--target-queue', target],
            '--batch-size',
            '20',
            '--prefetch',
            '400',
            '--shutdown-timeout',
            timeout,
          ),
          '--redis',
          proxy.urlFor(redisUrl),
        );
        const bridge = startCli(args);
        expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= 100, 60_000)).toBe(true);
        bridge.signal('SIGTERM');
        const result = await bridge.done;
        expect(result.code, result.stderr).toBe(0);
        const stopped = result.stdout.split('\n').find((line) => line.includes('"msg":"stopped"'));
        expect(stopped, result.stdout).toBeDefined();
        const unfinished = (JSON.parse(stopped as string) as { unfinished: number }).unfinished;
        if (timeout === '30s') expect(unfinished).toBe(0);
        // What the bridge finished is on the target and gone from the source; what it says it did
        // not finish may be on both (it was published, not acked); nothing is on neither.
        const onTarget = (await takeRaw(targetUrl, target)).map((m) => idOf(m.header).id);
        const left = (await takeRaw(sourceUrl, source)).map((m) => idOf(m.header).id);
        const both = onTarget.filter((id) => left.includes(id));
        expect(both.length).toBeLessThanOrEqual(unfinished);
        expect(new Set(onTarget).size).toBe(onTarget.length);
        const count = countDelivery(
          `SIGTERM ${timeout}`,
          messages.map((m) => m.options.headers[ID] as string),
          [...new Set([...onTarget, ...left])],
        );
        expect(count).toMatchObject({ lost: 0, unexpected: 0, duplicated: 0 });
      } finally {
        await proxy.stop();
      }
    });
  }

  it('a Redis outage while commits are queued: messages held unacked, then forwarded once when it is back', async () => {
    const { redisUrl } = servers();
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const messages = plainMessages(source, 2000);
    await publishAll(sourceUrl, source, messages);
    const proxy = FaultProxy.forUrl(redisUrl);
    await proxy.start();
    proxy.setDelay(20);
    try {
      const args = withOption(
        runArgs(source, ['--target-queue', target], '--batch-size', '25', '--prefetch', '300'),
        '--redis',
        proxy.urlFor(redisUrl),
      );
      const bridge = startCli(args);
      expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= 200, 60_000)).toBe(true);
      // Gone mid-flow: the connections die and new ones hear nothing.
      proxy.setMode('blackhole');
      proxy.resetAll();
      // The client says so once; its calls (claims and commits) wait for the connection meanwhile.
      expect(
        await waitFor(() =>
          /"msg":"Redis at [^"]*: (lost; reconnecting|connection error)/.test(bridge.output()),
        ),
      ).toBe(true);
      await new Promise((resolve) => setTimeout(resolve, 1500));
      const during = await depthOf(targetUrl, target);
      proxy.setMode('pass');
      proxy.setDelay(0);
      expect(await waitFor(async () => (await depthOf(sourceUrl, source)) === 0, 90_000)).toBe(true);
      expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= messages.length, 30_000)).toBe(
        true,
      );
      bridge.signal('SIGTERM');
      const result = await bridge.done;
      expect(result.code, result.stderr).toBe(0);
      expect(during).toBeLessThan(messages.length);
      expectOnceOrFlagged(
        'Redis outage',
        messages.map((m) => m.options.headers[ID] as string),
        await takeRaw(targetUrl, target),
      );
    } finally {
      await proxy.stop();
    }
  });

  it('SIGTERM during a Redis outage with commits queued: unfinished said, and the next run flags what may be doubled', async () => {
    const { redisUrl } = servers();
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const messages = plainMessages(source, 1500);
    await publishAll(sourceUrl, source, messages);
    const proxy = FaultProxy.forUrl(redisUrl);
    await proxy.start();
    proxy.setDelay(20);
    try {
      const args = withOption(
        runArgs(
          source,
          ['--target-queue', target],
          '--batch-size',
          '25',
          '--prefetch',
          '300',
          '--lease',
          '2s',
          '--shutdown-timeout',
          '1s',
        ),
        '--redis',
        proxy.urlFor(redisUrl),
      );
      const bridge = startCli(args);
      expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= 200, 60_000)).toBe(true);
      // Redis goes silent: claims and commits out wait, confirmed batches queue behind the commit.
      proxy.setMode('blackhole');
      await new Promise((resolve) => setTimeout(resolve, 1000));
      bridge.signal('SIGTERM');
      const result = await bridge.done;
      expect(result.code, result.stderr).toBe(0);
      const stopped = result.stdout.split('\n').find((line) => line.includes('"msg":"stopped"'));
      expect(stopped, result.stdout).toBeDefined();
      const unfinished = (JSON.parse(stopped as string) as { unfinished: number }).unfinished;
      expect(unfinished).toBeGreaterThan(0);
      // Published and not committed: on the target and back in the source, as many as it said.
      const first = await takeRaw(targetUrl, target);
      const firstIds = new Set(first.map((m) => idOf(m.header).id));
      const left = (await takeRaw(sourceUrl, source)).map((m) => idOf(m.header).id);
      expect(left.filter((id) => firstIds.has(id)).length).toBeLessThanOrEqual(unfinished);
      await publishAll(
        sourceUrl,
        source,
        messages.filter((m) => left.includes(m.options.headers[ID] as string)),
      );
      // Redis back; the next run forwards the rest, flagging the copies it cannot rule out.
      proxy.setMode('pass');
      proxy.resetAll();
      proxy.setDelay(0);
      const again = await migrateWithReport(
        withOption(
          migrateArgs(source, ['--target-queue', target], '--lease', '2s'),
          '--redis',
          proxy.urlFor(redisUrl),
        ),
      );
      expect(again.code, again.stderr).toBe(0);
      expect(await depthOf(sourceUrl, source)).toBe(0);
      expectOnceOrFlagged(
        'SIGTERM in a Redis outage, then a second run',
        messages.map((m) => m.options.headers[ID] as string),
        [...first, ...(await takeRaw(targetUrl, target))],
      );
    } finally {
      await proxy.stop();
    }
  });

  it("a slow target line fills amqplib's write buffer mid-batch: the rest of the batch waits for drain, none lost or doubled", async () => {
    const { targetUrl } = servers();
    const { sourceUrl, source, target } = await queuePair();
    const ids = Array.from({ length: 240 }, (_, i) => `${source}-${i}`);
    const bodyOf = (i: number) => Buffer.alloc(60_000, i & 0xff);
    await publishAll(
      sourceUrl,
      source,
      ids.map((id, i) => ({ body: bodyOf(i), options: { headers: { [ID]: id } } })),
    );
    const proxy = FaultProxy.forUrl(targetUrl);
    await proxy.start();
    // 14 MB over a 4 MB/s line: the bridge's writes outrun it and wait for 'drain'.
    proxy.setRate(4_000_000);
    try {
      const run = await migrateWithReport(
        withOption(
          migrateArgs(source, ['--target-queue', target], '--batch-size', '50', '--prefetch', '240'),
          '--target',
          proxy.urlFor(targetUrl),
        ),
      );
      expect(run.code, run.stderr).toBe(0);
      expect(run.report).toMatchObject({ forwarded: 240, inDoubt: 0, remaining: 0 });
    } finally {
      await proxy.stop();
    }
    const arrived = await takeRaw(targetUrl, target);
    const read = arrived.map((m) => ({ id: idOf(m.header).id, body: m.body }));
    const count = countDelivery(
      'drain',
      ids,
      read.map((m) => m.id),
    );
    expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
    for (const m of read) expect(m.body.equals(bodyOf(ids.indexOf(m.id))), m.id).toBe(true);
  });

  it('the source connection cut while batches wait behind the two claims out: each message forwarded once', async () => {
    const { redisUrl } = servers();
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const messages = plainMessages(source, 1500);
    await publishAll(sourceUrl, source, messages);
    const redisProxy = FaultProxy.forUrl(redisUrl);
    const sourceProxy = FaultProxy.forUrl(sourceUrl);
    await redisProxy.start();
    await sourceProxy.start();
    // A slow Redis keeps batches waiting for a claim call; then their channel goes.
    redisProxy.setDelay(30);
    try {
      let args = runArgs(source, ['--target-queue', target], '--batch-size', '20', '--prefetch', '400');
      args = withOption(args, '--redis', redisProxy.urlFor(redisUrl));
      args = withOption(args, '--source', sourceProxy.urlFor(sourceUrl));
      const bridge = startCli(args);
      expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= 150, 60_000)).toBe(true);
      sourceProxy.resetAll();
      redisProxy.setDelay(0);
      expect(
        await waitFor(
          async () =>
            (await depthOf(sourceUrl, source)) === 0 && (await depthOf(targetUrl, target)) >= messages.length,
          90_000,
        ),
      ).toBe(true);
      bridge.signal('SIGTERM');
      const result = await bridge.done;
      expect(result.code, result.stderr).toBe(0);
      expect(result.stdout).toMatch(/source broker.*: lost; reconnecting/);
    } finally {
      await sourceProxy.stop();
      await redisProxy.stop();
    }
    const arrived = await takeRaw(targetUrl, target);
    const count = countDelivery(
      'source cut',
      messages.map((m) => m.options.headers[ID] as string),
      arrived.map((m) => idOf(m.header).id),
    );
    expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
    expect(await depthOf(sourceUrl, source)).toBe(0);
  });

  it('messages the target closes its channel over, amid batches that confirm: only they are refused, the rest arrive', async () => {
    const admin = await adminServers();
    await admin.targetCtl('eval', 'application:set_env(rabbit, max_message_size, 65536).');
    try {
      const { sourceUrl, targetUrl, redisUrl } = admin;
      const source = uniqueName('poison-src');
      const target = uniqueName('poison-dst');
      const held = uniqueName('poison-held');
      const setup = await openBroker(sourceUrl);
      await setup.channel.assertQueue(held, { durable: true });
      await setup.channel.assertQueue(source, {
        durable: true,
        arguments: { 'x-dead-letter-exchange': '', 'x-dead-letter-routing-key': held },
      });
      await setup.close();
      const targetSetup = await openBroker(targetUrl);
      await targetSetup.channel.assertQueue(target, { durable: true });
      await targetSetup.close();
      const poisonAt = new Set([100, 301, 302, 550]);
      const ids = Array.from({ length: 600 }, (_, i) => `${source}-${i}`);
      await publishAll(
        sourceUrl,
        source,
        ids.map((id, i) => ({
          body: poisonAt.has(i) ? Buffer.alloc(70_000, 1) : `body of ${id}`,
          options: { headers: { [ID]: id } },
        })),
      );
      const run = await migrateWithReport([
        'migrate',
        '--source',
        sourceUrl,
        '--source-queue',
        source,
        '--target',
        targetUrl,
        '--target-queue',
        target,
        '--redis',
        redisUrl,
        '--idle-timeout',
        '300ms',
        '--batch-size',
        '50',
        '--prefetch',
        '200',
        '--on-unforwardable',
        'dead-letter',
      ]);
      expect(run.code, run.stderr).toBe(0);
      expect(run.report).toMatchObject({ forwarded: 596, nacked: 4, deadLettered: 4, remaining: 0 });
      const innocent = ids.filter((_, i) => !poisonAt.has(i));
      expectOnceOrFlagged('poison', innocent, await takeRaw(targetUrl, target));
      const refused = (await takeRaw(sourceUrl, held)).map((m) => idOf(m.header).id).sort();
      expect(refused).toEqual(ids.filter((_, i) => poisonAt.has(i)).sort());
    } finally {
      await admin.targetCtl('eval', 'application:set_env(rabbit, max_message_size, 134217728).');
      await admin.stop();
    }
  });

  it('copies of one ID in one batch and in batches queued behind each other: forwarded once', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    // Each ID five times, the copies spread over the queue and next to each other.
    const ids = Array.from({ length: 200 }, (_, i) => `${source}-${i}`);
    const sent = [...ids, ...ids, ...ids.flatMap((id) => [id, id]), ...ids].map((id) => ({
      body: `body of ${id}`,
      options: { headers: { [ID]: id } },
    }));
    await publishAll(sourceUrl, source, sent);
    const run = await migrateWithReport(
      migrateArgs(source, ['--target-queue', target], '--batch-size', '7', '--prefetch', '300'),
    );
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 200, duplicates: 800, remaining: 0 });
    const arrived = await takeRaw(targetUrl, target);
    const count = countDelivery(
      'copies',
      ids,
      arrived.map((m) => idOf(m.header).id),
    );
    expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
  });

  it('a message refused for having no ID is named in the log by its message_id', async () => {
    const { sourceUrl, source, target } = await queuePair();
    await publishAll(sourceUrl, source, [
      { body: 'no id', options: { messageId: 'mid-\u00e9-1', headers: { other: 1 } } },
    ]);
    const run = await migrateWithReport(
      migrateArgs(
        source,
        ['--target-queue', target],
        '--id-from',
        'header:X-Order',
        '--on-unforwardable',
        'dead-letter',
      ),
    );
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ noId: 1, deadLettered: 1 });
    const line = run.stdout
      .split('\n')
      .find((text) => text.includes('"msg":"message has no ID under any --id-from strategy'));
    expect(line, run.stdout).toBeDefined();
    expect(JSON.parse(line as string)).toMatchObject({ id: 'mid-\u00e9-1', routingKey: source });
  });

  it('dedup_bridge_confirm_seconds counts the forwarded messages only, not those the target returned', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    // Two routing keys into the source queue; the target routes only one of them.
    const sourceExchange = `${source}-in`;
    const targetExchange = `${target}-in`;
    const sourceBroker = await openBroker(sourceUrl);
    await sourceBroker.channel.assertExchange(sourceExchange, 'direct', {
      durable: false,
      autoDelete: false,
    });
    for (const key of ['ok', 'nowhere']) await sourceBroker.channel.bindQueue(source, sourceExchange, key);
    await sourceBroker.close();
    const targetBroker = await openBroker(targetUrl);
    await targetBroker.channel.assertExchange(targetExchange, 'direct', {
      durable: false,
      autoDelete: false,
    });
    await targetBroker.channel.bindQueue(target, targetExchange, 'ok');
    await targetBroker.close();
    const messages = Array.from({ length: 120 }, (_, i) => ({
      body: `body of ${source}-${i}`,
      exchange: sourceExchange,
      routingKey: i % 6 === 0 ? 'nowhere' : 'ok',
      options: { headers: { [ID]: `${source}-${i}` } },
    }));
    await publishAll(sourceUrl, source, messages);
    const bridge = startCli([
      ...runArgs(source, ['--target-exchange', targetExchange], '--on-unforwardable', 'dead-letter'),
      '--metrics-port',
      '0',
    ]);
    try {
      const url = await metricsUrl(bridge);
      const route = { route: source };
      let scrape = '';
      const settled = await waitFor(async () => {
        scrape = await (await fetch(`${url}/metrics`)).text();
        return (
          sample(scrape, 'dedup_bridge_consumed_total', route) === 120 &&
          sample(scrape, 'dedup_bridge_in_flight', route) === 0
        );
      });
      expect(settled, scrape).toBe(true);
      expect(sample(scrape, 'dedup_bridge_forwarded_total', route)).toBe(100);
      expect(sample(scrape, 'dedup_bridge_unroutable_total', route)).toBe(20);
      // Per forwarded message (README's metrics table): the 20 returned ones were never confirmed.
      expect(sample(scrape, 'dedup_bridge_confirm_seconds_count', route)).toBe(100);
      expect(await depthOf(targetUrl, target)).toBe(100);
    } finally {
      bridge.signal('SIGTERM');
      await bridge.done;
    }
  });

  it("the library's consumer hands its handler plain properties, whole when spread, after the bridge forwarded them", async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    await publishAll(sourceUrl, source, [
      {
        body: 'order',
        options: { messageId: 'order-1', contentType: 'text/plain', headers: { [ID]: 'order-1', n: 7 } },
      },
    ]);
    const run = await migrateWithReport(migrateArgs(source, ['--target-queue', target]));
    expect(run.code, run.stderr).toBe(0);
    const broker = await openBroker(targetUrl);
    const redis = new Redis(servers().redisUrl);
    const seen: Record<string, unknown>[] = [];
    try {
      const consumer = await createIdempotentConsumer({
        channel: broker.channel,
        queue: target,
        redis,
        scope: uniqueName('app'),
        handler: (message) => {
          seen.push({ ...message.properties });
        },
      });
      expect(await waitFor(() => consumer.counts.processed === 1)).toBe(true);
      await consumer.stop();
    } finally {
      await broker.close();
      await redis.quit();
    }
    expect(seen).toHaveLength(1);
    expect(seen[0]).toMatchObject({
      messageId: 'order-1',
      contentType: 'text/plain',
      deliveryMode: 2,
      headers: { [ID]: 'order-1', n: 7, 'x-dedup-route': routeToken(await routeNameOf(sourceUrl, source)) },
    });
  });
});
