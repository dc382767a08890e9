import { describe, expect, it } from 'vitest';
import { connectAmqp } from '../../src/amqp/connect.js';
import { publishRaw } from '../../src/amqp/internals.js';
import { createLogger } from '../../src/observe/log.js';
import {
  countDelivery,
  declareQueue,
  depthOf,
  migrateArgs,
  migrateWithReport,
  openBroker,
  publishAll,
  queuePair,
  takeAll,
  takeRaw,
  uniqueName,
} from '../helpers.js';
import {
  basicProperties,
  decimal,
  field,
  int32,
  int64,
  longString,
  nested,
  table,
  timestamp,
  uint8,
} from '../wire.js';

describe('ID strategies end to end', () => {
  it('message-id: resent messages with the same message_id arrive once, with _HQ_DUPL_ID set to it', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const messages = [];
    for (let i = 0; i < 300; i++) messages.push({ body: `m${i}`, options: { messageId: `msg-${i}` } });
    for (let i = 0; i < 300; i += 3) messages.push({ body: `m${i}`, options: { messageId: `msg-${i}` } });
    await publishAll(sourceUrl, source, messages);

    const run = await migrateWithReport(
      migrateArgs(source, ['--target-queue', target], '--id-from', 'message-id'),
    );
    expect(run.code).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 300, duplicates: 100, noId: 0 });
    const arrived = await takeAll(targetUrl, target);
    const ids = Array.from({ length: 300 }, (_, i) => `msg-${i}`);
    const count = countDelivery(
      'message-id',
      ids,
      arrived.map((m) => String(m.properties.messageId)),
    );
    expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
    for (const message of arrived) {
      expect(message.properties.headers?._HQ_DUPL_ID).toBe(message.properties.messageId);
    }
  });

  it('content: identical payloads collapse into one; different routing keys or headers do not', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const broker = await openBroker(sourceUrl);
    await broker.channel.bindQueue(source, 'amq.direct', 'k1');
    await broker.channel.bindQueue(source, 'amq.direct', 'k2');
    await broker.close();
    const messages = [
      { body: 'routed', exchange: 'amq.direct', routingKey: 'k1' },
      { body: 'routed', exchange: 'amq.direct', routingKey: 'k1' },
      { body: 'routed', exchange: 'amq.direct', routingKey: 'k2' },
      { body: 'same' },
      { body: 'same' },
      { body: 'same' },
      { body: 'same', options: { headers: { 'x-death': [{ count: 1 }] } } }, // redelivery noise only
      { body: 'same', options: { headers: { tenant: 'a' } } },
      { body: 'other' },
      { body: 'other' },
    ];
    await publishAll(sourceUrl, source, messages);
    const run = await migrateWithReport(
      migrateArgs(source, ['--target-queue', target], '--id-from', 'content'),
    );
    expect(run.code).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 5, duplicates: 5 });
    const arrived = await takeAll(targetUrl, target);
    const bodies = arrived.map((m) => `${m.content.toString()}|${m.properties.headers?.tenant ?? ''}`).sort();
    expect(bodies).toEqual(['other|', 'routed|', 'routed|', 'same|', 'same|a']);
    for (const message of arrived) {
      expect(String(message.properties.headers?._HQ_DUPL_ID)).toMatch(
        /^[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/,
      );
    }
  });

  // Built byte by byte: a Java producer's decimal and timestamp headers, which amqplib decodes to the
  // same objects as tables that spell them out. They are four different messages, not duplicates.
  it('content: a decimal or timestamp header and the table amqplib decodes it to are different messages', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const spelled = (kind: string, value: Buffer) =>
      nested(table(field('!', longString(kind)), field('value', value)));
    const headers: [string, Buffer][] = [
      ['decimal', field('h', decimal(2, 500))],
      [
        'decimal as a table',
        field('h', spelled('decimal', nested(table(field('digits', int32(500)), field('places', uint8(2)))))),
      ],
      ['timestamp', field('h', timestamp(1700000000n))],
      ['timestamp as a table', field('h', spelled('timestamp', int64(1700000000n)))],
      ['decimal again', field('h', decimal(2, 500))],
    ];
    const connection = await connectAmqp(sourceUrl, {
      side: 'source',
      retryForMs: 5000,
      log: createLogger('silent'),
    });
    try {
      const channel = await connection.createConfirmChannel();
      for (const [, header] of headers) {
        publishRaw(
          channel,
          '',
          source,
          basicProperties({ headers: table(header) }),
          Buffer.from('same body'),
          () => {},
        );
      }
      await channel.waitForConfirms();
    } finally {
      await connection.close();
    }

    const run = await migrateWithReport(
      migrateArgs(source, ['--target-queue', target], '--id-from', 'content'),
    );
    expect(run.code, run.stderr).toBe(0);
    const arrived = await takeRaw(targetUrl, target);
    const labelOf = (header: Buffer) =>
      headers.slice(0, 4).find(([, field]) => header.includes(field))?.[0] ??
      `unexpected ${header.toString('hex')}`;
    const count = countDelivery(
      'content by header type',
      headers.slice(0, 4).map(([label]) => label),
      arrived.map((m) => labelOf(m.header)),
    );
    expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
    expect(run.report).toMatchObject({ forwarded: 4, duplicates: 1, remaining: 0 });
  });

  it('an ID header of an unsupported type: the next strategy decides, it is counted, nothing is lost', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const messages = [
      { body: 'table', options: { messageId: 'fallback-1', headers: { _HQ_DUPL_ID: { nested: 'x' } } } },
      { body: 'array', options: { messageId: 'fallback-2', headers: { _HQ_DUPL_ID: ['a', 'b'] } } },
      { body: 'number', options: { headers: { _HQ_DUPL_ID: 42 } } },
      { body: 'number again', options: { headers: { _HQ_DUPL_ID: 42 } } },
      { body: 'text 42', options: { headers: { _HQ_DUPL_ID: '42' } } },
      { body: 'bool', options: { headers: { _HQ_DUPL_ID: true } } },
    ];
    await publishAll(sourceUrl, source, messages);
    const run = await migrateWithReport(migrateArgs(source, ['--target-queue', target]));
    expect(run.code).toBe(0);
    // The number 42 and the text "42" are different IDs; the second number 42 is a duplicate.
    expect(run.report).toMatchObject({ forwarded: 5, duplicates: 1, noId: 0 });
    expect(run.stdout).toContain('cannot be an ID');
    const arrived = await takeAll(targetUrl, target);
    expect(arrived.map((m) => m.content.toString()).sort()).toEqual([
      'array',
      'bool',
      'number',
      'table',
      'text 42',
    ]);
    const table = arrived.find((m) => m.content.toString() === 'table');
    expect(table?.properties.headers?._HQ_DUPL_ID).toBe('fallback-1');
    expect(await depthOf(sourceUrl, source)).toBe(0);
  });

  it('a string ID and a Buffer of the same bytes are the same ID', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    await publishAll(sourceUrl, source, [
      { body: 'as text', options: { headers: { _HQ_DUPL_ID: 'order-7' } } },
      { body: 'as bytes', options: { headers: { _HQ_DUPL_ID: Buffer.from('order-7') } } },
    ]);
    const run = await migrateWithReport(migrateArgs(source, ['--target-queue', target]));
    expect(run.report).toMatchObject({ forwarded: 1, duplicates: 1 });
    expect((await takeAll(targetUrl, target)).map((m) => m.content.toString())).toEqual(['as text']);
  });

  it('IDs are scoped per target: the same ID to two targets is two messages', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const otherTarget = uniqueName('dst2');
    await declareQueue(targetUrl, otherTarget);
    const batch = [{ body: 'one', options: { headers: { _HQ_DUPL_ID: 'shared-id' } } }];
    await publishAll(sourceUrl, source, batch);
    expect((await migrateWithReport(migrateArgs(source, ['--target-queue', target]))).report).toMatchObject({
      forwarded: 1,
    });
    await publishAll(sourceUrl, source, batch);
    expect(
      (await migrateWithReport(migrateArgs(source, ['--target-queue', otherTarget]))).report,
    ).toMatchObject({
      forwarded: 1,
    });
    expect(await depthOf(targetUrl, target)).toBe(1);
    expect(await depthOf(targetUrl, otherTarget)).toBe(1);
  });
});
