import { Redis } from 'ioredis';
import { describe, expect, it } from 'vitest';
import { connectAmqp } from '../../src/amqp/connect.js';
import { publishRaw, routingBytesOf } from '../../src/amqp/internals.js';
import { createIdempotentConsumer } from '../../src/client/consumer.js';
import { withDedupId } from '../../src/client/producer.js';
import { createLogger } from '../../src/observe/log.js';
import {
  countDelivery,
  declareQueue,
  depthOf,
  migrateArgs,
  migrateWithReport,
  openBroker,
  routeMarkOf,
  runArgs,
  servers,
  startCli,
  takeRaw,
  uniqueName,
  waitFor,
  withOption,
} from '../helpers.js';
import {
  array,
  type BasicProperties,
  basicProperties,
  bool,
  bytes,
  decimal,
  deepValue,
  field,
  float32,
  float64,
  int8,
  int16,
  int32,
  int64,
  longString,
  nested,
  table,
  timestamp,
  uint8,
  uint16,
  uint32,
  voidValue,
} from '../wire.js';
import { adminServers, asUser } from './privilege-admin.js';

// Messages as a Java, .NET or Python producer sends them, built byte by byte (amqplib cannot even
// encode most of these types). What the target stores must be, byte for byte, what a direct
// publish to the target stores, plus only the documented additions: `_HQ_DUPL_ID` where the ID came
// from elsewhere, and the route's `x-dedup-route` mark.

const log = createLogger('silent');

type Built = Buffer & { spec: BasicProperties };

/** A content header built byte by byte, remembering what it was built from. */
function props(spec: BasicProperties = {}): Built {
  return Object.assign(basicProperties(spec), { spec });
}

/** The same header with `field` appended at the end of its table (made when there is none). */
function withField(built: Buffer, field: Buffer): Buffer {
  const { spec } = built as Built;
  return basicProperties({ ...spec, headers: Buffer.concat([spec.headers ?? Buffer.alloc(0), field]) });
}

interface Sent {
  /** Names the message in the delivery count. */
  label: string;
  properties: Buffer;
  body: Buffer;
  /** The content header expected on the target (built by hand too), or undefined: not forwarded. */
  expected: Buffer | undefined;
}

const MAX_I64 = 2n ** 63n - 1n;
const MIN_I64 = -(2n ** 63n);

/** Every header type, nested, with the extremes that amqplib's decoding loses. */
function everyType(id: Buffer): Buffer[] {
  return [
    field('_HQ_DUPL_ID', id),
    field('bool', bool(true)),
    field('i8', int8(-5)),
    field('u8', uint8(200)),
    field('i16', int16(1000)),
    field('u16', uint16(60000)),
    field('i32', int32(5)),
    field('u32', uint32(4_000_000_000)),
    field('i64-small', int64(5n)),
    field('i64-max', int64(MAX_I64)),
    field('i64-min', int64(MIN_I64)),
    field('i64-snowflake', int64(2n ** 62n + 1n)),
    field('f32', float32(1.5)),
    field('f64', float64(2.0)),
    field('f64-neg-zero', float64(-0)),
    field('dec', decimal(2, 12345)),
    field('ts', timestamp(2n ** 64n - 1n)),
    field('S-not-utf8', longString(Buffer.from([0x80, 0x00, 0x00, 0x01]))),
    field('x-bytes', bytes(Buffer.from([0, 1, 2, 254, 255]))),
    field('void', voidValue()),
    field('!', longString('a field named like amqplib type marker')),
    field('meta', nested(table(field('!', longString('nope'))))),
    field(
      'x-death',
      array(
        nested(
          table(
            field('count', int64(1n)),
            field('reason', longString('expired')),
            field('routing-keys', array(longString('a'), longString('b'))),
            field('time', timestamp(1_700_000_000n)),
          ),
        ),
      ),
    ),
    field('mixed', array(int8(1), float32(0.1), voidValue(), array(bool(false)), bytes('raw'))),
    field('repeated', int32(1)),
    field('repeated', longString('second')),
  ];
}

function allProperties(headers: Buffer, user: string, messageId: string) {
  return {
    contentType: 'application/x-java-serialized-object',
    contentEncoding: 'gzip',
    headers,
    deliveryMode: 2,
    priority: 7,
    correlationId: 'corr-\u00e9',
    replyTo: 'replies.billing',
    expiration: '86400000',
    messageId,
    timestamp: 1_700_000_000n,
    type: 'order.created',
    userId: user,
    appId: 'billing-java',
    clusterId: 'legacy-cluster-7',
  };
}

/** The corpus, each message with the content header the target must hold after the bridge. */
function corpus(user: string, tag: string): Sent[] {
  const sent: Sent[] = [];
  const same = (label: string, properties: Buffer, body: Buffer) =>
    sent.push({ label, properties, body, expected: properties });

  const full = table(...everyType(longString(`${tag}-all-types`)));
  same('all types', props(allProperties(full, user, `${tag}-m1`)), Buffer.from([0xde, 0xad, 0, 0xbe, 0xef]));
  // 64-bit IDs that amqplib rounded to one number: two messages.
  same('l 2^62+1', props({ headers: table(field('_HQ_DUPL_ID', int64(2n ** 62n + 1n))) }), Buffer.alloc(0));
  same('l 2^62+2', props({ headers: table(field('_HQ_DUPL_ID', int64(2n ** 62n + 2n))) }), Buffer.from('b'));
  // Byte IDs that amqplib decoded to the same replacement characters: two messages.
  same(
    'S 80000001',
    props({ headers: table(field('_HQ_DUPL_ID', longString(Buffer.from([0x80, 0, 0, 1])))) }),
    Buffer.from(`${tag}-s80`),
  );
  same(
    'S 81000001',
    props({ headers: table(field('_HQ_DUPL_ID', longString(Buffer.from([0x81, 0, 0, 1])))) }),
    Buffer.from(`${tag}-s81`),
  );
  // One ID as S, as x and as S again: forwarded once, the first copy.
  const once = `${tag}-same-bytes`;
  same('same as S', props({ headers: table(field('_HQ_DUPL_ID', longString(once))) }), Buffer.from('first'));
  sent.push({
    label: 'same as x',
    properties: props({ headers: table(field('_HQ_DUPL_ID', bytes(once))) }),
    body: Buffer.from('second'),
    expected: undefined,
  });
  sent.push({
    label: 'same as S again',
    properties: props({ headers: table(field('_HQ_DUPL_ID', longString(once))) }),
    body: Buffer.from('third'),
    expected: undefined,
  });
  // The ID from the message_id: no header table at all on the source; the target gains one field.
  const big = Buffer.alloc(1024 * 1024);
  for (let i = 0; i < big.length; i++) big[i] = (i * 31) & 0xff;
  sent.push({
    label: '1 MiB body, ID from message_id',
    properties: props({ messageId: `${tag}-big`, clusterId: 'c1' }),
    body: big,
    expected: props({
      headers: table(field('_HQ_DUPL_ID', longString(`${tag}-big`))),
      messageId: `${tag}-big`,
      clusterId: 'c1',
    }),
  });
  // The ID from HornetQ's Artemis header, as a byte array that is not UTF-8: `_HQ_DUPL_ID` gains
  // the very same field value, appended at the end of the table.
  const artemis = bytes(Buffer.concat([Buffer.from(tag), Buffer.from([0xff, 0xfe])]));
  sent.push({
    label: 'ID from _AMQ_DUPL_ID bytes',
    properties: props({
      contentType: 'text/plain',
      headers: table(field('_AMQ_DUPL_ID', artemis), field('n', int32(7))),
    }),
    body: Buffer.from('artemis'),
    expected: props({
      contentType: 'text/plain',
      headers: table(field('_AMQ_DUPL_ID', artemis), field('n', int32(7)), field('_HQ_DUPL_ID', artemis)),
    }),
  });
  // A stale in-doubt flag from an earlier hop is not the bridge's to keep: removed, nothing else.
  sent.push({
    label: 'stale in-doubt flag',
    properties: props({
      headers: table(
        field('a', int16(-2)),
        field('x-dedup-in-doubt', bool(true)),
        field('_HQ_DUPL_ID', longString(`${tag}-stale`)),
      ),
    }),
    body: Buffer.from('stale'),
    expected: props({
      headers: table(field('a', int16(-2)), field('_HQ_DUPL_ID', longString(`${tag}-stale`))),
    }),
  });
  return sent;
}

async function publishCorpus(url: string, queue: string, sent: Sent[]): Promise<void> {
  const connection = await connectAmqp(url, { side: 'source', retryForMs: 5000, log });
  try {
    const channel = await connection.createConfirmChannel();
    for (const message of sent) {
      publishRaw(channel, '', queue, message.properties, message.body, () => {});
    }
    await channel.waitForConfirms();
  } finally {
    await connection.close();
  }
}

/**
 * Compares what the target holds after the bridge with what a direct publish of the same bytes to
 * the target stores, and with the hand-built expectation; counts lost, duplicated and unexpected.
 */
async function expectForwardedExactly(
  label: string,
  sent: Sent[],
  source: string,
  target: string,
): Promise<void> {
  const { sourceUrl, targetUrl } = servers();
  // Every forwarded copy ends with the route's mark, after any other field the bridge added.
  const mark = await routeMarkOf(sourceUrl, source);
  const expectedOf = (message: Sent) => withField(message.expected as Buffer, mark);
  const reference = uniqueName('reference');
  await declareQueue(targetUrl, reference);
  const forwarded = sent.filter((message) => message.expected !== undefined);
  await publishCorpus(targetUrl, reference, forwarded);
  const direct = await takeRaw(targetUrl, reference);
  const bridged = await takeRaw(targetUrl, target);

  const key = (header: Buffer, body: Buffer) => `${header.toString('hex')}/${body.toString('hex')}`;
  const wanted = new Map(forwarded.map((m) => [key(expectedOf(m), m.body), m.label]));
  const count = countDelivery(
    label,
    wanted.values(),
    bridged.map(
      (m) => wanted.get(key(m.header, m.body)) ?? `unexpected ${m.header.toString('hex').slice(0, 80)}`,
    ),
  );
  expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0, received: forwarded.length });
  // The broker stores what it is given: the direct publish is the original, byte for byte.
  expect(direct.map((m) => key(m.header, m.body))).toEqual(forwarded.map((m) => key(m.properties, m.body)));
  // Bridged in source order, and each one as expected, field by field of the header bytes.
  for (const [index, message] of forwarded.entries()) {
    expect(bridged[index]?.header.toString('hex'), message.label).toBe(expectedOf(message).toString('hex'));
    expect(bridged[index]?.body.equals(message.body), message.label).toBe(true);
  }
}

describe('the wire path is lossless', () => {
  it('migrate: every property and header type arrives as it left; only _HQ_DUPL_ID is added', async () => {
    const { sourceUrl, targetUrl } = servers();
    const source = uniqueName('lossless-src');
    const target = uniqueName('lossless-dst');
    await declareQueue(sourceUrl, source);
    await declareQueue(targetUrl, target);
    const sent = corpus(new URL(sourceUrl).username || 'guest', uniqueName('m'));
    await publishCorpus(sourceUrl, source, sent);

    const run = await migrateWithReport(migrateArgs(source, ['--target-queue', target]));
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ forwarded: sent.length - 2, duplicates: 2, remaining: 0 });
    await expectForwardedExactly('lossless migrate', sent, source, target);
  });

  it('run: the same corpus, forwarded by the long-lived bridge, arrives byte for byte', async () => {
    const { sourceUrl, targetUrl } = servers();
    const source = uniqueName('lossless-src');
    const target = uniqueName('lossless-dst');
    await declareQueue(sourceUrl, source);
    await declareQueue(targetUrl, target);
    const sent = corpus(new URL(sourceUrl).username || 'guest', uniqueName('r'));
    const bridge = startCli(runArgs(source, ['--target-queue', target]));
    try {
      await publishCorpus(sourceUrl, source, sent);
      const arrived = await waitFor(
        async () =>
          (await depthOf(targetUrl, target)) >= sent.length - 2 && (await depthOf(sourceUrl, source)) === 0,
      );
      expect(arrived, bridge.output()).toBe(true);
    } finally {
      bridge.signal('SIGTERM');
    }
    const result = await bridge.done;
    expect(result.code, result.stderr).toBe(0);
    await expectForwardedExactly('lossless run', sent, source, target);
  });

  it('a header table nested 12,000 deep is parked with its reason; the messages around it go on', async () => {
    const { sourceUrl, targetUrl } = servers();
    const source = uniqueName('deep-src');
    const target = uniqueName('deep-dst');
    const park = uniqueName('deep-park');
    await declareQueue(sourceUrl, source);
    await declareQueue(sourceUrl, park);
    await declareQueue(targetUrl, target);
    const tag = uniqueName('d');
    const ordinary = (n: number): Sent => {
      const properties = props({ headers: table(field('_HQ_DUPL_ID', longString(`${tag}-${n}`))) });
      return { label: `ordinary ${n}`, properties, body: Buffer.from(`body ${n}`), expected: properties };
    };
    const deep = props({
      headers: table(field('_HQ_DUPL_ID', longString(`${tag}-deep`)), field('deep', deepValue(12_000))),
    });
    const sent: Sent[] = [
      ordinary(1),
      { label: 'deep', properties: deep, body: Buffer.from('deep body'), expected: undefined },
      ordinary(2),
      ordinary(3),
    ];
    const bridge = startCli(runArgs(source, ['--target-queue', target], '--park-queue', park));
    try {
      await publishCorpus(sourceUrl, source, sent);
      const settled = await waitFor(
        async () => (await depthOf(targetUrl, target)) === 3 && (await depthOf(sourceUrl, park)) === 1,
      );
      expect(settled, bridge.output()).toBe(true);
    } finally {
      bridge.signal('SIGTERM');
    }
    const result = await bridge.done;
    expect(result.code, result.stderr).toBe(0);
    // The deep table did not drop the source connection: the bridge never reconnected.
    expect(result.stdout).not.toMatch(/: lost; reconnecting/);
    expect(result.stdout).toMatch(/message refused: header table: field table nested deeper than 64 levels/);
    await expectForwardedExactly('around a deep table', sent, source, target);
    // The parked copy is the message as it came, with the reason (and the park's sequence number)
    // appended to its table.
    const parked = await takeRaw(sourceUrl, park);
    expect(parked).toHaveLength(1);
    const reason = 'unreadable: header table: field table nested deeper than 64 levels';
    const expectedPark = props({
      headers: table(
        field('_HQ_DUPL_ID', longString(`${tag}-deep`)),
        field('deep', deepValue(12_000)),
        field('x-dedup-park-reason', longString(reason)),
        field('x-dedup-park-seq', int64(1n)),
      ),
    });
    expect(parked[0]?.header.equals(expectedPark)).toBe(true);
    expect(parked[0]?.body.toString()).toBe('deep body');
  });

  it('a message whose header cannot be published to the target is refused once, parked, and the bridge goes on', async () => {
    const { sourceUrl, targetUrl } = servers();
    const source = uniqueName('big-header-src');
    const target = uniqueName('big-header-dst');
    const park = uniqueName('big-header-park');
    await declareQueue(sourceUrl, source);
    await declareQueue(sourceUrl, park);
    await declareQueue(targetUrl, target);
    const tag = uniqueName('h');
    const ordinary = (n: number): Sent => {
      const properties = props({ headers: table(field('_HQ_DUPL_ID', longString(`${tag}-${n}`))) });
      return { label: `ordinary ${n}`, properties, body: Buffer.from(`body ${n}`), expected: properties };
    };
    // A 20 kB header: the source takes it, the target connection (frame_max 8 kB) cannot carry it.
    const large = props({
      headers: table(
        field('_HQ_DUPL_ID', longString(`${tag}-large`)),
        field('blob', longString('z'.repeat(20_000))),
      ),
    });
    const sent: Sent[] = [
      ordinary(1),
      { label: 'large header', properties: large, body: Buffer.from('large'), expected: undefined },
      ordinary(2),
    ];
    const smallFrames = new URL(targetUrl);
    smallFrames.searchParams.set('frameMax', '8192');
    const args = runArgs(source, ['--target-queue', target], '--park-queue', park);
    args[args.indexOf('--target') + 1] = smallFrames.toString();
    const bridge = startCli(args);
    try {
      await publishCorpus(sourceUrl, source, sent);
      const settled = await waitFor(
        async () => (await depthOf(targetUrl, target)) === 2 && (await depthOf(sourceUrl, park)) === 1,
      );
      expect(settled, bridge.output()).toBe(true);
    } finally {
      bridge.signal('SIGTERM');
    }
    const result = await bridge.done;
    expect(result.code, result.stderr).toBe(0);
    const refusals = result.stdout.split('\n').filter((line) => line.includes('message refused'));
    expect(refusals).toHaveLength(1);
    expect(refusals[0]).toMatch(/does not fit the target's frame_max \(8192 bytes\)/);
    await expectForwardedExactly('around a large header', sent, source, target);
    const parked = await takeRaw(sourceUrl, park);
    expect(parked.map((m) => m.body.toString())).toEqual(['large']);
  });

  it('the bridge, the idempotent consumer and the producer helpers key every ID type alike', async () => {
    const { sourceUrl, targetUrl, redisUrl } = servers();
    const source = uniqueName('agree-src');
    const target = uniqueName('agree-dst');
    const scope = uniqueName('agree-scope');
    await declareQueue(sourceUrl, source);
    await declareQueue(targetUrl, target);
    const tag = uniqueName('a');
    const ids: [string, Buffer][] = [
      ['S text', longString(`${tag}-text`)],
      ['S 80000001', longString(Buffer.from([0x80, 0, 0, 1]))],
      ['S 81000001', longString(Buffer.from([0x81, 0, 0, 1]))],
      ['x not utf-8', bytes(Buffer.from([0xff, 0, 0x7f]))],
      ['b', int8(-7)],
      ['B', uint8(250)],
      ['s', int16(-30_000)],
      ['u', uint16(65_000)],
      ['I', int32(-2_000_000_000)],
      ['i', uint32(4_000_000_001)],
      ['l 2^62+1', int64(2n ** 62n + 1n)],
      ['l 2^62+2', int64(2n ** 62n + 2n)],
      ['l min', int64(MIN_I64)],
      ['f 0.1', float32(0.1)],
      ['d 0.1', float64(0.1)],
      ['d -0.0', float64(-0)],
      ['t', bool(true)],
    ];
    const sent: Sent[] = ids.map(([label, id]) => {
      const properties = props({ headers: table(field('_HQ_DUPL_ID', id)) });
      return { label, properties, body: Buffer.from(label), expected: properties };
    });
    // IDs from the message_id, whose keys are not the text itself (a reserved prefix, bytes that
    // are not UTF-8, over 200 bytes): `_HQ_DUPL_ID` carries the message_id's bytes, which the
    // consumer keys back to the same ID.
    for (const [label, messageId] of [
      ['message_id num:5', Buffer.from(`num:5-${tag}`)],
      ['message_id not UTF-8', Buffer.concat([Buffer.from(tag), Buffer.from([0xff])])],
      ['message_id 250 bytes', Buffer.from(`${tag}-`.padEnd(250, 'a'))],
    ] as const) {
      sent.push({
        label,
        properties: props({ messageId }),
        body: Buffer.from(label),
        expected: props({ headers: table(field('_HQ_DUPL_ID', longString(messageId))), messageId }),
      });
    }
    await publishCorpus(sourceUrl, source, sent);
    // The same text through the library's producer helper: the same ID as the S above.
    const broker = await openBroker(sourceUrl);
    broker.channel.publish('', source, Buffer.from('helper copy'), withDedupId({}, `${tag}-text`));
    broker.channel.publish(
      '',
      source,
      Buffer.from('helper bytes'),
      withDedupId({}, Buffer.from([0xff, 0, 0x7f])),
    );
    await broker.channel.waitForConfirms();
    await broker.close();

    const run = await migrateWithReport(migrateArgs(source, ['--target-queue', target], '--scope', scope));
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ forwarded: sent.length, duplicates: 2 });
    await expectForwardedExactly('one per ID type', sent, source, target);

    // Each copy again on the target, read by the idempotent consumer in the bridge's own scope: it
    // finds every ID already committed under the key it computes, so the keys agree.
    // What the bridge put on the target, once more (the message_id ones now carry _HQ_DUPL_ID).
    await publishCorpus(
      targetUrl,
      target,
      sent.map((m) => ({ ...m, properties: m.expected as Buffer })),
    );
    const redis = new Redis(redisUrl);
    const reader = await openBroker(targetUrl);
    const handled: string[] = [];
    const consumer = await createIdempotentConsumer({
      channel: reader.channel,
      queue: target,
      redis,
      scope,
      handler: (_message, context) => {
        handled.push(context.dedupId);
      },
    });
    try {
      expect(
        await waitFor(() => consumer.counts.duplicates === sent.length, 10_000),
        JSON.stringify(consumer.counts),
      ).toBe(true);
      expect(consumer.counts).toMatchObject({ processed: 0, duplicates: sent.length, withoutId: 0 });
    } finally {
      await consumer.stop();
      await reader.close();
      redis.disconnect();
    }
    expect(handled).toEqual([]);
  });

  it('routing keys that are not UTF-8 travel as they are and, with content IDs, stay two messages', async () => {
    const { sourceUrl, targetUrl } = servers();
    const source = uniqueName('key-src');
    const target = uniqueName('key-dst');
    await declareQueue(sourceUrl, source);
    await declareQueue(targetUrl, target);
    const bind = async (url: string, queue: string) => {
      const broker = await openBroker(url);
      await broker.channel.bindQueue(queue, 'amq.topic', 'a.#');
      await broker.close();
    };
    await bind(sourceUrl, source);
    await bind(targetUrl, target);
    // The same body and properties under two keys that amqplib decodes to one text ("a.\ufffd").
    const keys = [Buffer.from([0x61, 0x2e, 0x80]), Buffer.from([0x61, 0x2e, 0x81])];
    const connection = await connectAmqp(sourceUrl, { side: 'source', retryForMs: 5000, log });
    const channel = await connection.createConfirmChannel();
    for (const key of keys) publishRaw(channel, 'amq.topic', key, props(), Buffer.from('same'), () => {});
    await channel.waitForConfirms();
    await connection.close();

    const run = await migrateWithReport(migrateArgs(source, ['--target-exchange', 'amq.topic']));
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 2, duplicates: 0 });
    const reader = await connectAmqp(targetUrl, { side: 'target', retryForMs: 5000, log });
    const got: string[] = [];
    try {
      const readChannel = await reader.createChannel();
      for (;;) {
        const message = await readChannel.get(target, { noAck: true });
        if (message === false) break;
        got.push(routingBytesOf(message.fields)?.routingKey.toString('hex') ?? 'none');
      }
    } finally {
      await reader.close();
    }
    expect(got).toEqual(['612e80', '612e81']);
  });

  it('a parked copy that comes back unroutable is never acked, even with a table too deep to read', async () => {
    const { sourceUrl, targetUrl } = servers();
    const source = uniqueName('lostpark-src');
    const target = uniqueName('lostpark-dst');
    const park = uniqueName('lostpark-park');
    await declareQueue(sourceUrl, source);
    await declareQueue(sourceUrl, park);
    await declareQueue(targetUrl, target);
    const bridge = startCli(runArgs(source, ['--target-queue', target], '--park-queue', park));
    try {
      expect(await waitFor(() => bridge.output().includes('"msg":"forwarding"'))).toBe(true);
      // The park queue goes away under the running bridge: a parked copy is returned unroutable.
      const admin = await openBroker(sourceUrl);
      await admin.channel.deleteQueue(park);
      await admin.close();
      const deep = props({
        headers: table(field('_HQ_DUPL_ID', longString(uniqueName('deep'))), field('deep', deepValue(70))),
      });
      await publishCorpus(sourceUrl, source, [
        { label: 'deep', properties: deep, body: Buffer.from('precious'), expected: undefined },
      ]);
      expect(await waitFor(() => bridge.output().includes('parking failed'))).toBe(true);
    } finally {
      bridge.signal('SIGTERM');
    }
    expect((await bridge.done).code).toBe(0);
    const left = await takeRaw(sourceUrl, source);
    expect(left.map((m) => m.body.toString())).toEqual(['precious']);
    expect(await depthOf(targetUrl, target)).toBe(0);
  });

  it('a user_id the target would refuse travels as x-dedup-source-user-id; one that came as a header is dropped (a producer can forge it)', async () => {
    const admin = await adminServers();
    const user = uniqueName('bridge-t');
    const password = `p-${uniqueName('pw')}`;
    try {
      await admin.addUsers('target', [
        { name: user, password, permissions: { configure: '.*', write: '.*', read: '.*' } },
      ]);
      const source = uniqueName('user-src');
      const target = uniqueName('user-dst');
      await declareQueue(admin.sourceUrl, source);
      await declareQueue(admin.targetUrl, target);
      const sourceUser = new URL(admin.sourceUrl).username || 'guest';
      const tag = uniqueName('u');
      const forged = field('x-dedup-source-user-id', longString('admin'));
      const id = (n: number) => field('_HQ_DUPL_ID', longString(`${tag}-${n}`));
      const sent: Sent[] = [
        {
          label: 'user_id of the source user, and a forged header',
          properties: props({ headers: table(forged, id(1)), userId: sourceUser, appId: 'a' }),
          body: Buffer.from('one'),
          // user_id out, the forged header out, the real user_id appended as the header.
          expected: props({
            headers: table(id(1), field('x-dedup-source-user-id', longString(sourceUser))),
            appId: 'a',
          }),
        },
        {
          label: 'no user_id, a forged header',
          properties: props({ headers: table(id(2), forged) }),
          body: Buffer.from('two'),
          expected: props({ headers: table(id(2)) }),
        },
      ];
      await publishCorpus(admin.sourceUrl, source, sent);
      const args = withOption(
        withOption(
          migrateArgs(source, ['--target-queue', target]),
          '--target',
          asUser(admin.targetUrl, user, password),
        ),
        '--source',
        admin.sourceUrl,
      );
      const run = await migrateWithReport(withOption(args, '--redis', admin.redisUrl));
      expect(run.code, run.stderr).toBe(0);
      const mark = await routeMarkOf(admin.sourceUrl, source);
      const arrived = await takeRaw(admin.targetUrl, target);
      expect(arrived.map((m) => m.header.toString('hex'))).toEqual(
        sent.map((m) => withField(m.expected as Buffer, mark).toString('hex')),
      );
    } finally {
      await admin.deleteUsers('target', [user]).catch(() => {});
      await admin.stop();
    }
  });
});
