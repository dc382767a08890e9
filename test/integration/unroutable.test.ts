import { describe, expect, it } from 'vitest';
import {
  declareQueue,
  depthOf,
  migrateArgs,
  migrateWithReport,
  openBroker,
  publishAll,
  runArgs,
  servers,
  startCli,
  takeAll,
  uniqueName,
  waitFor,
} from '../helpers.js';

/** Ten messages: even ones routed by key "good", odd ones by key "bad", which nothing is bound to. */
async function setup(sourceOptions: Record<string, unknown> = {}) {
  const { sourceUrl, targetUrl } = servers();
  const source = uniqueName('src');
  const target = uniqueName('dst');
  const exchange = uniqueName('ex');
  await declareQueue(sourceUrl, source, sourceOptions);
  await declareQueue(targetUrl, target);
  const broker = await openBroker(targetUrl);
  await broker.channel.assertExchange(exchange, 'direct', { durable: true });
  await broker.channel.bindQueue(target, exchange, 'good');
  await broker.close();
  const messages = Array.from({ length: 10 }, (_, i) => ({
    body: `m${i}`,
    routingKey: i % 2 === 0 ? 'good' : 'bad',
    exchange: '',
    options: { headers: { _HQ_DUPL_ID: `u-${i}` } },
  }));
  // Published straight to the source queue; the bridge uses each message's own key on the target.
  const { sourceUrl: url } = servers();
  const pub = await openBroker(url);
  for (const message of messages) {
    pub.channel.sendToQueue(source, Buffer.from(message.body), {
      ...message.options,
      persistent: true,
    });
  }
  await pub.channel.waitForConfirms();
  await pub.close();
  return { sourceUrl, targetUrl, source, target, exchange };
}

describe('unroutable messages are never lost', () => {
  it('by default they go back to the source queue; migrate gives up after --retry-for and exits 1', async () => {
    const { sourceUrl, targetUrl, source, target } = await setup();
    // Every message is unroutable: the default exchange has no queue of this name.
    const missing = uniqueName('no-such-queue');
    const run = await migrateWithReport(
      migrateArgs(source, ['--target-exchange', '', '--target-routing-key', missing], '--retry-for', '2s'),
    );
    expect(run.code).toBe(1);
    const lines = run.stderr.trim().split('\n');
    expect(lines.at(-1)).toMatch(/10 message\(s\) could not be forwarded .*--park-queue/);
    expect(run.report).toMatchObject({ outcome: 'stalled', forwarded: 0, remaining: 10 });
    expect(Number(run.report?.unroutable)).toBeGreaterThanOrEqual(10);
    expect(await depthOf(sourceUrl, source)).toBe(10);
    expect(await depthOf(targetUrl, target)).toBe(0);
  });

  it('with --park-queue the unroutable ones move to the park queue and the routable ones arrive', async () => {
    const { sourceUrl, targetUrl, source, target, exchange } = await setup();
    const park = uniqueName('park');
    await declareQueue(sourceUrl, park);
    const run = await migrateWithReport(
      migrateArgs(source, ['--target-exchange', exchange], '--park-queue', park),
    );
    expect(run.code).toBe(0);
    // The bridge used each message's own routing key: the queue name. Route them with key "good".
    expect(run.report).toMatchObject({ forwarded: 0, parked: 10, unroutable: 10 });
    const parked = await takeAll(sourceUrl, park);
    expect(parked.map((m) => m.content.toString()).sort()).toEqual(
      Array.from({ length: 10 }, (_, i) => `m${i}`).sort(),
    );
    expect(parked[0]?.properties.headers?.['x-dedup-park-reason']).toBe('unroutable');
    expect(await depthOf(sourceUrl, source)).toBe(0);
    expect(await depthOf(targetUrl, target)).toBe(0);
  });

  it('routes per message: with the message key "good" bound, only the "bad" ones are parked', async () => {
    const { sourceUrl, targetUrl, source, target, exchange } = await setup();
    const park = uniqueName('park');
    await declareQueue(sourceUrl, park);
    // Re-publish through an exchange on the source so each message keeps its own routing key.
    await takeAll(sourceUrl, source);
    const broker = await openBroker(sourceUrl);
    await broker.channel.bindQueue(source, 'amq.direct', 'good');
    await broker.channel.bindQueue(source, 'amq.direct', 'bad');
    await broker.close();
    await publishAll(
      sourceUrl,
      source,
      Array.from({ length: 10 }, (_, i) => ({
        body: `m${i}`,
        exchange: 'amq.direct',
        routingKey: i % 2 === 0 ? 'good' : 'bad',
        options: { headers: { _HQ_DUPL_ID: `r-${i}` } },
      })),
    );
    const run = await migrateWithReport(
      migrateArgs(source, ['--target-exchange', exchange], '--park-queue', park),
    );
    expect(run.code).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 5, parked: 5, unroutable: 5 });
    expect((await takeAll(targetUrl, target)).map((m) => m.content.toString()).sort()).toEqual([
      'm0',
      'm2',
      'm4',
      'm6',
      'm8',
    ]);
    expect((await takeAll(sourceUrl, park)).map((m) => m.content.toString()).sort()).toEqual([
      'm1',
      'm3',
      'm5',
      'm7',
      'm9',
    ]);
  });

  it('with --on-unroutable dead-letter they go to the source queue’s dead-letter exchange', async () => {
    const { sourceUrl } = servers();
    const dlq = uniqueName('dlq');
    await declareQueue(sourceUrl, dlq);
    const { source } = await setup({
      arguments: { 'x-dead-letter-exchange': '', 'x-dead-letter-routing-key': dlq },
    });
    const missing = uniqueName('no-such-queue');
    const run = await migrateWithReport(
      migrateArgs(
        source,
        ['--target-exchange', '', '--target-routing-key', missing],
        '--on-unroutable',
        'dead-letter',
      ),
    );
    expect(run.code).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 0, deadLettered: 10 });
    expect(await depthOf(sourceUrl, dlq)).toBe(10);
    expect(await depthOf(sourceUrl, source)).toBe(0);
  });

  it('an unroutable message whose ID is re-encoded as a key (long, or prefix-like) is still recognised as returned', async () => {
    const { sourceUrl } = servers();
    const source = uniqueName('src');
    const park = uniqueName('park');
    await declareQueue(sourceUrl, source);
    await declareQueue(sourceUrl, park);
    const ids = ['x'.repeat(250), 'num:42', 'bytes:ab'];
    await publishAll(
      sourceUrl,
      source,
      ids.map((id, i) => ({ body: `m${i}`, options: { messageId: id } })),
    );
    const missing = uniqueName('no-such-queue');
    const run = await migrateWithReport(
      migrateArgs(source, ['--target-exchange', '', '--target-routing-key', missing], '--park-queue', park),
    );
    expect(run.code).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 0, parked: 3, unroutable: 3 });
    expect((await takeAll(sourceUrl, park)).map((m) => m.properties.messageId).sort()).toEqual(
      [...ids].sort(),
    );
  });

  it('a publish nacked by one of several queues behind an exchange leaves its ID in doubt: the next copy is flagged', async () => {
    const { sourceUrl, targetUrl } = servers();
    const source = uniqueName('fan-src');
    const stores = uniqueName('fan-a');
    const full = uniqueName('fan-full');
    const exchange = uniqueName('fan-ex');
    await declareQueue(sourceUrl, source);
    await declareQueue(targetUrl, stores);
    await declareQueue(targetUrl, full, { arguments: { 'x-max-length': 1, 'x-overflow': 'reject-publish' } });
    const broker = await openBroker(targetUrl);
    await broker.channel.assertExchange(exchange, 'fanout', { durable: true });
    await broker.channel.bindQueue(stores, exchange, '');
    await broker.channel.bindQueue(full, exchange, '');
    broker.channel.sendToQueue(full, Buffer.from('filler'));
    await broker.channel.waitForConfirms();
    await broker.close();
    await publishAll(sourceUrl, source, [{ body: 'fan', options: { headers: { _HQ_DUPL_ID: 'fan-1' } } }]);

    const bridge = startCli(runArgs(source, ['--target-exchange', exchange]));
    try {
      // The first attempt: stored by one queue, refused by the full one, so nacked.
      expect(await waitFor(() => /"reason":"nacked"/.test(bridge.output()))).toBe(true);
      expect(await depthOf(targetUrl, stores)).toBe(1);
      await takeAll(targetUrl, full); // room again: the retry is taken by both queues
      expect(await waitFor(async () => (await depthOf(targetUrl, stores)) === 2)).toBe(true);
      expect(await waitFor(async () => (await depthOf(sourceUrl, source)) === 0)).toBe(true);
    } finally {
      bridge.signal('SIGTERM');
    }
    expect((await bridge.done).code).toBe(0);
    const copies = (await takeAll(targetUrl, stores)).map((m) => ({
      id: String(m.properties.headers?._HQ_DUPL_ID),
      inDoubt: m.properties.headers?.['x-dedup-in-doubt'] === true,
    }));
    expect(copies).toEqual([
      { id: 'fan-1', inDoubt: false },
      { id: 'fan-1', inDoubt: true },
    ]);
    const other = await takeAll(targetUrl, full);
    expect(other.map((m) => m.properties.headers?.['x-dedup-in-doubt'])).toEqual([true]);
  });
});
