import { describe, expect, it } from 'vitest';
import { connectAmqp } from '../../src/amqp/connect.js';
import { publishRaw } from '../../src/amqp/internals.js';
import { createLogger } from '../../src/observe/log.js';
import { ContentHeader, contentHeaderOf } from '../../src/wire/properties.js';
import {
  countDelivery,
  declareQueue,
  depthOf,
  idsOf,
  migrateArgs,
  migrateWithReport,
  numbered,
  openBroker,
  publishAll,
  queuePair,
  routeNameOf,
  runArgs,
  runCli,
  servers,
  takeAll,
  uniqueName,
  withIds,
  withOption,
} from '../helpers.js';
import { array, field, longString } from '../wire.js';

/**
 * One pass of a bridge from before 2026-12-01 from a queue to another, as far as its mark goes: it
 * reads `x-dedup-route` only as an AMQP array of strings, refuses a message that holds its own route,
 * and forwards the others with the field replaced by that array plus its route (the last 16).
 * Returns the `_HQ_DUPL_ID`s it refused (taken off the queue, as its park would).
 */
async function olderBridgePass(
  from: { url: string; queue: string },
  to: { url: string; queue: string },
  route: string,
): Promise<string[]> {
  const log = createLogger('silent');
  const source = await connectAmqp(from.url, { side: 'source', retryForMs: 5000, log });
  const target = await connectAmqp(to.url, { side: 'target', retryForMs: 5000, log });
  const refused: string[] = [];
  try {
    const taking = await source.createChannel();
    const sending = await target.createConfirmChannel();
    for (;;) {
      const message = await taking.get(from.queue, { noAck: true });
      if (message === false) break;
      const header = new ContentHeader(Buffer.from(contentHeaderOf(message.properties).bytes));
      const span = header.field('x-dedup-route');
      const value = span ? header.valueOf(span) : undefined;
      const marks =
        value?.type === 'A'
          ? value.value.flatMap((item) => (item.type === 'S' ? [item.value.toString('utf8')] : []))
          : [];
      if (marks.includes(route)) {
        refused.push(String(message.properties.headers?._HQ_DUPL_ID));
        continue;
      }
      const kept = [...marks, route].slice(-16);
      const mark = field('x-dedup-route', array(...kept.map((name) => longString(name))));
      const bytes = header.splice({ remove: ['x-dedup-route'], append: [mark], dropUserId: false });
      publishRaw(sending, '', to.queue, bytes, message.content, () => {});
    }
    await sending.waitForConfirms();
  } finally {
    await source.close();
    await target.close();
  }
  return refused;
}

// A route whose target routes back into its source queue would forward each message onto the queue
// it came from and then ack it as a duplicate: every message deleted, reported forwarded.
describe('loops are refused, never drained', () => {
  it('the same queue as source and target on the same broker: exit 2 before anything moves, however the URL names it', async () => {
    const { sourceUrl } = servers();
    const queue = uniqueName('self');
    await declareQueue(sourceUrl, queue);
    await publishAll(sourceUrl, queue, numbered(queue, 20).messages);
    // Another URL of the very same node: only the broker itself can say it is the same cluster.
    const byName = new URL(sourceUrl);
    byName.hostname = 'localhost';
    const attempts = [
      withOption(migrateArgs(queue, ['--target-queue', queue]), '--target', sourceUrl),
      withOption(migrateArgs(queue, ['--target-queue', queue]), '--target', byName.toString()),
      withOption(runArgs(queue, ['--target-queue', queue]), '--target', byName.toString()),
    ];
    for (const args of attempts) {
      const result = await runCli(args);
      expect(result.code, result.stdout + result.stderr).toBe(2);
      const errors = result.stderr.split('\n').filter((line) => line.startsWith('dedup-bridge:'));
      expect(errors).toHaveLength(1);
      expect(errors[0]).toMatch(/the target is the source queue itself \(queue "t-self-[0-9a-f]+"/);
      expect(result.stderr).not.toMatch(/guest:guest|\n\s+at /);
    }
    expect(await depthOf(sourceUrl, queue)).toBe(20);
  });

  it('a loop through an exchange: what comes back is parked as a loop, nothing is acked as a duplicate', async () => {
    const { sourceUrl } = servers();
    const queue = uniqueName('loop-src');
    const park = uniqueName('loop-park');
    const exchange = uniqueName('loop-ex');
    await declareQueue(sourceUrl, queue);
    await declareQueue(sourceUrl, park);
    const broker = await openBroker(sourceUrl);
    await broker.channel.assertExchange(exchange, 'fanout', { durable: true });
    await broker.channel.bindQueue(queue, exchange, '');
    await broker.close();
    const sent = numbered(queue, 50);
    await publishAll(sourceUrl, queue, sent.messages);

    const args = withOption(
      migrateArgs(queue, ['--target-exchange', exchange], '--park-queue', park),
      '--target',
      sourceUrl,
    );
    const run = await migrateWithReport(args);
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 50, duplicates: 0, looped: 50, parked: 50 });
    expect(run.stdout).toMatch(/a message this route forwarded came back to its source queue/);
    // Every message is still somewhere: each one once, in the park queue, with the reason.
    expect(await depthOf(sourceUrl, queue)).toBe(0);
    const parked = await takeAll(sourceUrl, park);
    const count = countDelivery('loop through an exchange, parked', sent.ids, idsOf(parked));
    expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
    expect(String(parked[0]?.properties.headers?.['x-dedup-park-reason'])).toMatch(/^loop: /);
  });

  it("marks of other routes are carried on with this one last; this route's mark, in either form, is a loop", async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const park = uniqueName('mark-park');
    await declareQueue(sourceUrl, park);
    const own = await routeNameOf(sourceUrl, source);
    const other = 'rabbit@elsewhere/%2F/orders';
    // Each as a producer or a bridge left it: one string holding a JSON array (read, not written),
    // the AMQP array of strings every version writes, and a value that is no mark of ours.
    const marked = (id: string, route: unknown) => ({
      body: id,
      options: { headers: { _HQ_DUPL_ID: id, 'x-dedup-route': route } },
    });
    const sent = [
      marked('other-json', JSON.stringify([other])),
      marked('other-array', [other]),
      marked('foreign', 'not a mark'),
      marked('own-json', JSON.stringify([other, own])),
      marked('own-array', [own, other]),
    ];
    await publishAll(sourceUrl, source, sent);

    const run = await migrateWithReport(
      migrateArgs(source, ['--target-queue', target], '--park-queue', park),
    );
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 3, looped: 2, parked: 2, duplicates: 0 });
    const arrived = await takeAll(targetUrl, target);
    const routes = Object.fromEntries(
      arrived.map((m) => [
        String(m.properties.headers?._HQ_DUPL_ID),
        m.properties.headers?.['x-dedup-route'],
      ]),
    );
    expect(routes).toEqual({
      'other-json': [other, own],
      'other-array': [other, own],
      foreign: [own],
    });
    const parked = await takeAll(sourceUrl, park);
    const count = countDelivery('marked by this route, parked', ['own-json', 'own-array'], idsOf(parked));
    expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
    expect(await depthOf(sourceUrl, source)).toBe(0);
  });

  it('a loop through a bridge from before 2026-12-01 is seen both ways: each side finds its own mark in the form it reads', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const park = uniqueName('mixed-park');
    await declareQueue(sourceUrl, park);
    // The older bridge runs the way back, target queue to source queue.
    const older = await routeNameOf(targetUrl, target);
    const way = { back: { url: targetUrl, queue: target }, there: { url: sourceUrl, queue: source } };
    await publishAll(sourceUrl, source, withIds(['here-first']));
    await publishAll(targetUrl, target, withIds(['there-first']));

    // 'there-first' goes back with the older bridge's mark; then this route forwards both.
    expect(await olderBridgePass(way.back, way.there, older)).toEqual([]);
    const forward = migrateArgs(source, ['--target-queue', target], '--park-queue', park);
    const first = await migrateWithReport(forward);
    expect(first.code, first.stderr).toBe(0);
    expect(first.report).toMatchObject({ forwarded: 2, looped: 0 });

    // The older bridge must see its own mark on what this route forwarded ('there-first' went
    // through it), and carry this route's mark back on the other.
    expect(await olderBridgePass(way.back, way.there, older)).toEqual(['there-first']);
    const again = await migrateWithReport(forward);
    expect(again.code, again.stderr).toBe(0);
    expect(again.report).toMatchObject({ forwarded: 0, looped: 1, parked: 1, duplicates: 0 });
    const parked = await takeAll(sourceUrl, park);
    expect(idsOf(parked)).toEqual(['here-first']);
    expect(await depthOf(sourceUrl, source)).toBe(0);
  });
});
