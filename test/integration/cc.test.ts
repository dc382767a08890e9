import { describe, expect, it } from 'vitest';
import { connectAmqp } from '../../src/amqp/connect.js';
import { publishRaw } from '../../src/amqp/internals.js';
import { createLogger } from '../../src/observe/log.js';
import {
  countDelivery,
  declareQueue,
  migrateArgs,
  migrateWithReport,
  openBroker,
  routeMarkOf,
  runCli,
  servers,
  takeRaw,
  uniqueName,
} from '../helpers.js';
import { array, basicProperties, field, int16, int32, longString, table } from '../wire.js';

// Issue 34.5: a `CC` header makes RabbitMQ route a copy to each routing key it lists (sender-selected
// distribution), on the target as on the source. Shovel forwards it, and so does the bridge by
// default; --strip-cc removes it (and `BCC`) from the table, nothing else.

const log = createLogger('silent');

/** A target exchange routing key `main` to one queue and key `other` to a second. */
async function targetWithTwoQueues() {
  const { targetUrl } = servers();
  const exchange = uniqueName('cc-x');
  const main = uniqueName('cc-main');
  const other = uniqueName('cc-other');
  const otherKey = uniqueName('other-key');
  await declareQueue(targetUrl, main);
  await declareQueue(targetUrl, other);
  const broker = await openBroker(targetUrl);
  try {
    await broker.channel.assertExchange(exchange, 'direct', { durable: true });
    await broker.channel.bindQueue(main, exchange, 'main');
    await broker.channel.bindQueue(other, exchange, otherKey);
  } finally {
    await broker.close();
  }
  return { exchange, main, other, otherKey };
}

/** Two messages with a CC naming the second queue's key, one without; the header bytes by hand. */
function messages(tag: string, otherKey: string) {
  const cc = field('CC', array(longString(otherKey)));
  const made = (n: number, withCc: boolean) => {
    const id = field('_HQ_DUPL_ID', longString(`${tag}-${n}`));
    const before = field('a', int16(-2));
    const after = field('n', int32(n));
    const headers = withCc ? table(before, cc, id, after) : table(before, id, after);
    return {
      id: `${tag}-${n}`,
      withCc,
      body: Buffer.from(`body ${n}`),
      headers,
      properties: basicProperties({ contentType: 'text/plain', headers }),
      // The same table without CC: what --strip-cc forwards (before the route's mark).
      stripped: table(before, id, after),
    };
  };
  return [made(1, true), made(2, false), made(3, true)];
}

async function publish(url: string, queue: string, sent: ReturnType<typeof messages>) {
  const connection = await connectAmqp(url, { side: 'source', retryForMs: 5000, log });
  try {
    const channel = await connection.createConfirmChannel();
    for (const message of sent) publishRaw(channel, '', queue, message.properties, message.body, () => {});
    await channel.waitForConfirms();
  } finally {
    await connection.close();
  }
}

describe('CC headers on forward', () => {
  for (const strip of [false, true]) {
    it(
      strip
        ? '--strip-cc: only the target queue gets a copy, the header otherwise byte for byte'
        : 'by default (as Shovel): the target routes a copy by the CC too',
      async () => {
        const { sourceUrl, targetUrl } = servers();
        const source = uniqueName('cc-src');
        await declareQueue(sourceUrl, source);
        const { exchange, main, other, otherKey } = await targetWithTwoQueues();
        const sent = messages(uniqueName('cc'), otherKey);
        await publish(sourceUrl, source, sent);
        const run = await migrateWithReport(
          migrateArgs(
            source,
            ['--target-exchange', exchange, '--target-routing-key', 'main'],
            ...(strip ? ['--strip-cc'] : []),
          ),
        );
        expect(run.code, run.stderr).toBe(0);
        expect(run.report).toMatchObject({ forwarded: sent.length, remaining: 0 });
        const onMain = await takeRaw(targetUrl, main);
        const onOther = await takeRaw(targetUrl, other);
        const label = strip ? 'with --strip-cc' : 'default';
        const ids = sent.map((message) => message.id);
        const withCc = sent.filter((message) => message.withCc).map((message) => message.id);
        const mainCount = countDelivery(
          `cc ${label}: ${main}`,
          ids,
          onMain.map((m) => m.id),
        );
        const otherCount = countDelivery(
          `cc ${label}: ${other}`,
          strip ? [] : withCc,
          onOther.map((m) => m.id),
        );
        expect(mainCount).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
        expect(otherCount).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
        expect(onOther).toHaveLength(strip ? 0 : withCc.length);
        // Byte for byte: as sent (or without CC), plus only the route's mark at the end of the table.
        const mark = await routeMarkOf(sourceUrl, source);
        for (const [index, message] of sent.entries()) {
          const headers = Buffer.concat([strip ? message.stripped : message.headers, mark]);
          const expected = basicProperties({ contentType: 'text/plain', headers });
          expect(onMain[index]?.header.toString('hex'), message.id).toBe(expected.toString('hex'));
          expect(onMain[index]?.body.equals(message.body)).toBe(true);
        }
      },
    );
  }
});

describe('DEDUP_BRIDGE_STRIP_CC', () => {
  it('takes true or false; anything else is one line naming the variable, exit 2', async () => {
    const source = uniqueName('cc-src');
    const args = migrateArgs(source, ['--target-queue', uniqueName('cc-dst')]);
    const result = await runCli(args, { env: { DEDUP_BRIDGE_STRIP_CC: 'maybe' } });
    expect(result.code).toBe(2);
    expect(result.stderr).toBe('dedup-bridge: DEDUP_BRIDGE_STRIP_CC (--strip-cc): must be true or false\n');
  });
});
