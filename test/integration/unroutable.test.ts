import { describe, expect, it } from 'vitest';
import {
  declareQueue,
  delivered,
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

const ALL = Array.from({ length: 10 }, (_, i) => `u-${i}`);
/** The IDs the target exchange routes (key "good") and those it cannot (key "bad"). */
const ROUTABLE = ALL.filter((_, i) => i % 2 === 0);
const UNROUTABLE = ALL.filter((_, i) => i % 2 === 1);

/**
 * Ten messages in a source queue: even ones carry routing key "good", odd ones "bad" (published
 * through an exchange of the test's own on the source, bound to the queue by both keys, so each
 * message keeps its key). On the target, an exchange with only "good" bound to the target queue.
 */
async function setup(sourceOptions: Record<string, unknown> = {}) {
  const { sourceUrl, targetUrl } = servers();
  const source = uniqueName('src');
  const target = uniqueName('dst');
  const exchange = uniqueName('ex');
  const sourceExchange = uniqueName('src-ex');
  await declareQueue(sourceUrl, source, sourceOptions);
  await declareQueue(targetUrl, target);
  const broker = await openBroker(targetUrl);
  await broker.channel.assertExchange(exchange, 'direct', { durable: true });
  await broker.channel.bindQueue(target, exchange, 'good');
  await broker.close();
  const publisher = await openBroker(sourceUrl);
  await publisher.channel.assertExchange(sourceExchange, 'direct', { durable: true });
  await publisher.channel.bindQueue(source, sourceExchange, 'good');
  await publisher.channel.bindQueue(source, sourceExchange, 'bad');
  await publisher.close();
  await publishAll(
    sourceUrl,
    source,
    ALL.map((id, i) => ({
      body: `m${i}`,
      exchange: sourceExchange,
      routingKey: i % 2 === 0 ? 'good' : 'bad',
      options: { headers: { _HQ_DUPL_ID: id } },
    })),
  );
  return { sourceUrl, targetUrl, source, target, exchange };
}

const exactly = (n: number) => ({ expected: n, received: n, lost: 0, duplicated: 0, unexpected: 0 });

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
    // All ten are back in the source queue, each once; none reached the target.
    expect((await delivered('back in the source', sourceUrl, source, ALL)).count).toEqual(exactly(10));
    expect(await depthOf(targetUrl, target)).toBe(0);
  });

  // --on-unroutable requeue are the old names of --on-unforwardable retry: the same run either way.
  it.each([
    ['--on-unforwardable', 'retry'],
    ['--on-unroutable', 'requeue'],
  ])(
    '%s %s: the bridge holds and retries them; migrate gives up (exit 1), all ten in the source',
    async (flag, policy) => {
      const { sourceUrl, targetUrl, source, target } = await setup();
      const missing = uniqueName('no-such-queue');
      const run = await migrateWithReport(
        migrateArgs(
          source,
          ['--target-exchange', '', '--target-routing-key', missing],
          flag,
          policy,
          '--retry-for',
          '2s',
        ),
      );
      expect(run.code, run.stderr).toBe(1);
      expect(run.stderr.trim().split('\n').at(-1)).toMatch(
        /10 message\(s\) could not be forwarded .*or use --park-queue or --on-unforwardable dead-letter/,
      );
      expect(run.report).toMatchObject({ outcome: 'stalled', forwarded: 0, parked: 0, deadLettered: 0 });
      expect(run.report).toMatchObject({ remaining: 10, returned: 10 });
      // Retried by the bridge after a backoff, not returned to the source while the route ran.
      expect(Number(run.report?.retried)).toBeGreaterThan(0);
      expect(run.stdout).toContain('the bridge holds it unacked and retries it after a backoff');
      expect((await delivered('back in the source', sourceUrl, source, ALL)).count).toEqual(exactly(10));
      expect(await depthOf(targetUrl, target)).toBe(0);
    },
  );

  it('with --park-queue the unroutable ones move to the park queue and the routable ones arrive', async () => {
    const { sourceUrl, targetUrl, source, target, exchange } = await setup();
    const park = uniqueName('park');
    await declareQueue(sourceUrl, park);
    const run = await migrateWithReport(
      migrateArgs(source, ['--target-exchange', exchange], '--park-queue', park),
    );
    expect(run.code, run.stderr).toBe(0);
    // Each message goes by its own routing key: "good" ones are routed, "bad" ones are not.
    expect(run.report).toMatchObject({ forwarded: 5, parked: 5, unroutable: 5 });
    const arrived = await delivered('routable, on the target', targetUrl, target, ROUTABLE);
    expect(arrived.count).toEqual(exactly(5));
    // Forwarded once, not in doubt.
    expect(arrived.messages.map((m) => m.properties.headers?.['x-dedup-in-doubt'])).toEqual(
      Array(5).fill(undefined),
    );
    const parked = await delivered('unroutable, in the park queue', sourceUrl, park, UNROUTABLE);
    expect(parked.count).toEqual(exactly(5));
    expect(parked.messages.map((m) => m.properties.headers?.['x-dedup-park-reason'])).toEqual(
      Array(5).fill('unroutable'),
    );
    expect(await depthOf(sourceUrl, source)).toBe(0);
  });

  it('--target-routing-key replaces each message’s own key: with "good" for all, all ten arrive', async () => {
    const { sourceUrl, targetUrl, source, target, exchange } = await setup();
    const park = uniqueName('park');
    await declareQueue(sourceUrl, park);
    const run = await migrateWithReport(
      migrateArgs(
        source,
        ['--target-exchange', exchange, '--target-routing-key', 'good'],
        '--park-queue',
        park,
      ),
    );
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 10, parked: 0, unroutable: 0 });
    expect((await delivered('all, on the target', targetUrl, target, ALL)).count).toEqual(exactly(10));
    expect(await depthOf(sourceUrl, park)).toBe(0);
    expect(await depthOf(sourceUrl, source)).toBe(0);
  });

  it('with --on-unforwardable dead-letter they go to the source queue’s dead-letter exchange', async () => {
    const { sourceUrl } = servers();
    const dlq = uniqueName('dlq');
    await declareQueue(sourceUrl, dlq);
    const { source, target, targetUrl } = await setup({
      arguments: { 'x-dead-letter-exchange': '', 'x-dead-letter-routing-key': dlq },
    });
    const missing = uniqueName('no-such-queue');
    const run = await migrateWithReport(
      migrateArgs(
        source,
        ['--target-exchange', '', '--target-routing-key', missing],
        '--on-unforwardable',
        'dead-letter',
      ),
    );
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 0, deadLettered: 10 });
    // All ten, each once, dead-lettered by the source queue (rejected, not requeued).
    const dead = await delivered('dead-lettered', sourceUrl, dlq, ALL);
    expect(dead.count).toEqual(exactly(10));
    for (const message of dead.messages) {
      const deaths = message.properties.headers?.['x-death'] as { queue: string; reason: string }[];
      expect(deaths?.[0]).toMatchObject({ queue: source, reason: 'rejected' });
    }
    expect(await depthOf(sourceUrl, source)).toBe(0);
    expect(await depthOf(targetUrl, target)).toBe(0);
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
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 0, parked: 3, unroutable: 3 });
    expect((await takeAll(sourceUrl, park)).map((m) => m.properties.messageId).sort()).toEqual(
      [...ids].sort(),
    );
    expect(await depthOf(sourceUrl, source)).toBe(0);
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
