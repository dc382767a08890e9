import { describe, expect, it } from 'vitest';
import { routeToken } from '../../src/bridge/route-mark.js';
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
  withOption,
} from '../helpers.js';

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

  it("marks of other routes are carried on with this one last; this route's token is a loop; any other value is no mark", async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const park = uniqueName('mark-park');
    await declareQueue(sourceUrl, park);
    const own = routeToken(await routeNameOf(sourceUrl, source));
    const other = routeToken('rabbit@elsewhere/%2F/orders');
    const marked = (id: string, route: unknown) => ({
      body: id,
      options: { headers: { _HQ_DUPL_ID: id, 'x-dedup-route': route } },
    });
    const sent = [
      marked('other', other),
      // Not this version's form (route names, a JSON array, an AMQP array): no mark, replaced.
      marked('names', 'rabbit@elsewhere/%2F/orders'),
      marked('json', JSON.stringify([own])),
      marked('array', [own]),
      marked('own', `${other} ${own}`),
      marked('own-first', `${own} ${other}`),
    ];
    await publishAll(sourceUrl, source, sent);

    const run = await migrateWithReport(
      migrateArgs(source, ['--target-queue', target], '--park-queue', park),
    );
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 4, looped: 2, parked: 2, duplicates: 0 });
    const arrived = await takeAll(targetUrl, target);
    const routes = Object.fromEntries(
      arrived.map((m) => [
        String(m.properties.headers?._HQ_DUPL_ID),
        m.properties.headers?.['x-dedup-route'],
      ]),
    );
    expect(routes).toEqual({ other: `${other} ${own}`, names: own, json: own, array: own });
    const parked = await takeAll(sourceUrl, park);
    const count = countDelivery('marked by this route, parked', ['own', 'own-first'], idsOf(parked));
    expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
    expect(await depthOf(sourceUrl, source)).toBe(0);
  });
});
