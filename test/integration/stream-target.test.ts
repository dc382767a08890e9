import { describe, expect, it } from 'vitest';
import { connectAmqp } from '../../src/amqp/connect.js';
import { publishRaw } from '../../src/amqp/internals.js';
import { createLogger } from '../../src/observe/log.js';
import { ContentHeader } from '../../src/wire/properties.js';
import {
  declareQueue,
  migrateWithReport,
  numbered,
  publishAll,
  type RunningCli,
  routeMarkOf,
  servers,
  startCli,
  takeRaw,
  uniqueName,
  waitFor,
} from '../helpers.js';
import {
  countStored,
  DEDUP_ID,
  type Delivered091,
  offenders,
  publisherSequence,
  read091,
  readStored,
  type Stored,
  StreamWatch,
} from '../stream-helpers.js';
import {
  array,
  type BasicProperties,
  basicProperties,
  bytes,
  decimal,
  everyScalarField,
  field,
  int8,
  int32,
  int64,
  longString,
  nested,
  table,
  timestamp,
  voidValue,
} from '../wire.js';

// The stream target (issue 30): a RabbitMQ stream written over the stream protocol by a named
// producer, so that every source message lands exactly once with no copy of any kind: no
// duplicate, and no `x-dedup-in-doubt` on anything. And what a 0-9-1 consumer of the stream
// receives is what it would have received had the same message been published straight into that
// stream over 0-9-1, content header byte for byte. On the harness's own target node, which serves
// the stream protocol (or TARGET_STREAM_URL's broker).

const log = createLogger('silent');

/** `dedup-bridge <command>` from a source queue into a stream of the harness's target broker. */
function streamArgs(command: 'run' | 'migrate', sourceQueue: string, stream: string, ...extra: string[]) {
  const { sourceUrl, targetStreamUrl, redisUrl } = servers();
  return [
    command,
    '--source',
    sourceUrl,
    '--source-queue',
    sourceQueue,
    '--target',
    targetStreamUrl,
    '--target-stream',
    stream,
    '--redis',
    redisUrl,
    ...(command === 'migrate' ? ['--idle-timeout', '300ms'] : []),
    ...extra,
  ];
}

/** A stream on the target broker, declared over 0-9-1 (as an application would). */
async function declareStream(name: string): Promise<void> {
  await declareQueue(servers().targetUrl, name, { arguments: { 'x-queue-type': 'stream' } });
}

/** Publishes content headers built byte by byte, with their bodies, through the default exchange. */
async function publishFrames(url: string, queue: string, messages: { header: Buffer; body: Buffer }[]) {
  const connection = await connectAmqp(url, { side: 'source', retryForMs: 5000, log });
  try {
    const channel = await connection.createConfirmChannel();
    for (const message of messages) publishRaw(channel, '', queue, message.header, message.body, () => {});
    await channel.waitForConfirms();
  } finally {
    await connection.close();
  }
}

/** Expects the stream to hold each expected ID once, nothing else and nothing flagged; returns it. */
async function expectExactlyOnce(label: string, stream: string, ids: readonly string[]): Promise<Stored[]> {
  const stored = await readStored(servers().targetStreamUrl, stream, { idleMs: 1500 });
  const count = countStored(label, ids, stored);
  expect(count, offenders(ids, stored)).toEqual({
    expected: ids.length,
    stored: ids.length,
    lost: 0,
    duplicated: 0,
    unexpected: 0,
    flagged: 0,
  });
  return stored;
}

// ---- the lossless corpus, byte by byte ---------------------------------------------------------

interface Sent {
  label: string;
  /** The content header sent to the source. */
  header: Buffer;
  body: Buffer;
  /** The content header a producer would publish straight into the stream for the same message. */
  direct: Buffer | undefined;
  id: string;
}

function everyScalar(id: Buffer): Buffer {
  return table(field(DEDUP_ID, id), ...everyScalarField());
}

/**
 * Messages as a Java, .NET or Python producer sends them, every property and scalar header type,
 * and what RabbitMQ 3.10 itself drops from a stream (tables, arrays, cluster-id) or changes (a
 * boolean octet of 2, a timestamp past 2^63 ms), each with the header a direct publish would carry.
 */
function corpus(tag: string): Sent[] {
  const sent: Sent[] = [];
  const add = (label: string, spec: BasicProperties, body: Buffer, id: string, direct?: BasicProperties) => {
    const header = basicProperties(spec);
    sent.push({ label, header, body, id, direct: direct ? basicProperties(direct) : header });
  };
  const idOf = (n: string) => `${tag}-${n}`;

  add(
    'every property but cluster-id, every scalar header type',
    {
      contentType: 'application/x-java-serialized-object',
      contentEncoding: 'gzip',
      headers: everyScalar(longString(idOf('all'))),
      deliveryMode: 2,
      priority: 7,
      correlationId: 'corr-é',
      replyTo: 'replies.billing',
      expiration: '86400000',
      messageId: `${tag}-m1`,
      timestamp: 1_700_000_000n,
      type: 'order.created',
      userId: 'guest',
      appId: 'billing-java',
    },
    Buffer.from([0xde, 0xad, 0, 0xbe, 0xef]),
    idOf('all'),
  );
  add(
    'zero and empty properties (expiration aside)',
    {
      contentType: '',
      contentEncoding: '',
      headers: table(field(DEDUP_ID, longString(idOf('empty')))),
      deliveryMode: 1,
      priority: 0,
      correlationId: '',
      replyTo: '',
      // Not '0': the source queue would drop it (it expires unless a consumer takes it at once).
      expiration: '1000000',
      messageId: '',
      timestamp: 0n,
      type: '',
      appId: '',
    },
    Buffer.alloc(0),
    idOf('empty'),
  );
  add(
    'the ID header alone',
    { headers: table(field(DEDUP_ID, longString(idOf('bare')))) },
    Buffer.from('bare'),
    idOf('bare'),
  );
  add(
    'properties at 255 bytes, a 70 kB body',
    {
      headers: table(field(DEDUP_ID, longString(idOf('long')))),
      messageId: 'i'.repeat(255),
      correlationId: 'c'.repeat(255),
      replyTo: 'r'.repeat(255),
      type: 't'.repeat(255),
      appId: 'a'.repeat(255),
      contentType: 'ct'.repeat(127),
    },
    Buffer.alloc(70_000, 0xab),
    idOf('long'),
  );
  add(
    'bytes that are not UTF-8 in short-string properties',
    {
      headers: table(field(DEDUP_ID, longString(idOf('bytes')))),
      messageId: Buffer.from([0xc3, 0x28, 0x00]),
      correlationId: Buffer.from([0xff]),
      type: Buffer.from([0xfe, 0x80]),
    },
    Buffer.from([0, 1, 2]),
    idOf('bytes'),
  );
  add(
    'tables and arrays among the headers (RabbitMQ drops them from a stream)',
    {
      headers: table(
        field('before', int32(1)),
        field(DEDUP_ID, longString(idOf('nested'))),
        field('meta', nested(table(field('a', longString('b'))))),
        field('list', array(int8(1), longString('two'), voidValue())),
        field('x-death', array(nested(table(field('count', int64(1n)))))),
        field('after', int32(2)),
      ),
    },
    Buffer.from('nested'),
    idOf('nested'),
  );
  add(
    'a header named like a property annotation',
    {
      type: 'real-type',
      headers: table(
        field(DEDUP_ID, longString(idOf('names'))),
        field('x-basic-type', longString('header')),
        field('x-basic-app-id', longString('h2')),
      ),
    },
    Buffer.from('names'),
    idOf('names'),
  );
  add(
    'a timestamp past 2^63 ms',
    {
      timestamp: 2n ** 64n - 1n,
      headers: table(
        field(DEDUP_ID, longString(idOf('late'))),
        field('ts-max', timestamp(2n ** 64n - 1n)),
        field('ts-2^63', timestamp(2n ** 63n)),
      ),
    },
    Buffer.from('late'),
    idOf('late'),
  );
  add(
    'with cluster-id',
    {
      clusterId: 'cluster-a',
      messageId: 'with-cluster',
      headers: table(field(DEDUP_ID, longString(idOf('cluster')))),
    },
    Buffer.from('cluster'),
    idOf('cluster'),
  );
  add(
    'the ID as a byte array',
    { headers: table(field(DEDUP_ID, bytes(idOf('as-bytes'))), field('n', int32(3))) },
    Buffer.from('as bytes'),
    idOf('as-bytes'),
  );
  // No ID header: the ID comes from message_id, and the bridge sets `_HQ_DUPL_ID` to it, as a
  // producer publishing straight into the stream would have to.
  const messageId = `${tag}-from-message-id`;
  add(
    'the ID from message_id',
    { messageId, contentType: 'text/plain' },
    Buffer.from('from message_id'),
    messageId,
    { messageId, contentType: 'text/plain', headers: table(field(DEDUP_ID, longString(messageId))) },
  );
  // A producer's resend of the first: a duplicate, never forwarded.
  const first = sent[0] as Sent;
  sent.push({ ...first, label: 'a resend of the first', direct: undefined });
  return sent;
}

/** The content header without RabbitMQ's own `x-stream-offset` (the offset differs between streams). */
function withoutOffset(header: Buffer): string {
  return new ContentHeader(header)
    .splice({ remove: ['x-stream-offset'], append: [], dropUserId: false })
    .toString('hex');
}

/**
 * The corpus as the bridge wrote it into `bridgedStream` (among `total` messages) against a direct
 * 0-9-1 publish of the same messages, with the one change the bridge documents for every forwarded
 * copy (its route's `x-dedup-route` mark, appended last), into a second stream on the same broker:
 * what a 0-9-1
 * consumer receives from each, content header byte for byte (but RabbitMQ's own x-stream-offset)
 * and body; and the stored AMQP 1.0 sections (but the message annotations, which name each
 * stream's routing key), which a stream-protocol consumer reads.
 */
async function expectAsDirect(
  label: string,
  sent: Sent[],
  source: string,
  bridgedStream: string,
  total: number,
): Promise<void> {
  const { sourceUrl, targetUrl, targetStreamUrl } = servers();
  const forwarded = sent.filter((message) => message.direct !== undefined);
  const reference = uniqueName('stream-direct');
  await declareStream(reference);
  const mark = await routeMarkOf(sourceUrl, source);
  await publishFrames(
    targetUrl,
    reference,
    forwarded.map((message) => ({
      header: new ContentHeader(message.direct as Buffer).splice({
        remove: [],
        append: [mark],
        dropUserId: false,
      }),
      body: message.body,
    })),
  );

  const [viaBridge, viaDirect] = await Promise.all([
    read091(targetUrl, bridgedStream, total),
    read091(targetUrl, reference, forwarded.length),
  ]);
  const byId = (list: Delivered091[]) => new Map(list.map((m) => [m.id, m]));
  const bridged = byId(viaBridge);
  const direct = byId(viaDirect);
  const differences: string[] = [];
  for (const message of forwarded) {
    const a = bridged.get(message.id);
    const b = direct.get(message.id);
    if (!a || !b) {
      differences.push(`${message.label}: not read from the ${a ? 'direct' : 'bridged'} stream`);
      continue;
    }
    if (withoutOffset(a.header) !== withoutOffset(b.header)) {
      differences.push(
        `${message.label}: content header\n  bridged ${withoutOffset(a.header)}\n  direct  ${withoutOffset(b.header)}`,
      );
    }
    if (!a.body.equals(b.body)) differences.push(`${message.label}: body`);
    if (a.inDoubt) differences.push(`${message.label}: flagged in-doubt`);
  }
  const first = bridged.get(forwarded[0]?.id);
  process.stdout.write(
    `${label}: ${forwarded.length} messages read over 0-9-1 compared with a direct 0-9-1 publish: ${differences.length} differ; ` +
      `routing: bridged exchange "${first?.exchange}" key "${first?.routingKey}", direct exchange "${viaDirect[0]?.exchange}" key "${viaDirect[0]?.routingKey}"\n`,
  );
  expect(differences).toEqual([]);

  // Over the stream protocol: the same sections, but for the routing annotations.
  const sections = async (stream: string) =>
    new Map(
      (await readStored(targetStreamUrl, stream, { idleMs: 1000 })).map((m) => [
        m.id,
        withoutAnnotations(m.raw),
      ]),
    );
  const storedBridged = await sections(bridgedStream);
  const storedDirect = await sections(reference);
  const storedDifferences = forwarded
    .filter((message) => storedBridged.get(message.id) !== storedDirect.get(message.id))
    .map(
      (message) =>
        `${message.label}:\n  bridged ${storedBridged.get(message.id)}\n  direct  ${storedDirect.get(message.id)}`,
    );
  expect(storedDifferences).toEqual([]);
}

/** A stored message's sections but the message annotations (which come first when present), as hex. */
function withoutAnnotations(bytes: Buffer): string {
  if (bytes[0] === 0x00 && bytes[1] === 0x53 && bytes[2] === 0x72) {
    const size = bytes[3] === 0xc1 ? 2 + (bytes[4] as number) : 5 + bytes.readUInt32BE(4);
    return bytes.subarray(3 + size).toString('hex');
  }
  return bytes.toString('hex');
}

describe('a RabbitMQ stream as target', () => {
  it("the tests' own reader sees copies: a duplicate and a flagged copy published straight into a stream are counted", async () => {
    const { targetUrl, targetStreamUrl } = servers();
    const stream = uniqueName('st-reader');
    await declareStream(stream);
    const tag = uniqueName('copy');
    const { ids, messages } = numbered(tag, 3);
    const flagged = {
      body: 'flagged copy',
      options: { headers: { [DEDUP_ID]: ids[1], 'x-dedup-in-doubt': true } },
    };
    await publishAll(targetUrl, stream, [...messages, messages[1] as (typeof messages)[0], flagged]);
    const watch = new StreamWatch(targetStreamUrl, stream);
    try {
      expect(await watch.until(5, 20_000)).toBe(true);
    } finally {
      await watch.stop();
    }
    const stored = await readStored(targetStreamUrl, stream, { count: 5 });
    expect(stored.map((m) => m.id)).toEqual([...ids, ids[1], ids[1]]);
    expect(countStored('reader self-check', ids, stored)).toEqual({
      expected: 3,
      stored: 5,
      lost: 0,
      duplicated: 2,
      unexpected: 0,
      flagged: 1,
    });
    const over091 = await read091(targetUrl, stream, 5);
    expect(over091.map((m) => [m.id, m.inDoubt])).toEqual([
      [ids[0], false],
      [ids[1], false],
      [ids[2], false],
      [ids[1], false],
      [ids[1], true],
    ]);
  });

  it('migrate --declare-target: each of 1,000 IDs once on a new stream, nothing flagged; a re-run forwards none', async () => {
    const { sourceUrl } = servers();
    const source = uniqueName('st-src');
    const stream = uniqueName('st-stream');
    await declareQueue(sourceUrl, source);
    const tag = uniqueName('m');
    const { ids, messages } = numbered(tag, 1000);
    // 50 of them sent twice, as a producer that retries does.
    await publishAll(sourceUrl, source, [...messages, ...messages.slice(100, 150)]);

    const first = await migrateWithReport(streamArgs('migrate', source, stream, '--declare-target'));
    expect(first.code, first.stderr).toBe(0);
    expect(first.report).toMatchObject({ forwarded: 1000, duplicates: 50, inDoubt: 0, remaining: 0 });
    const stored = await expectExactlyOnce('migrate', stream, ids);
    const inOrder = stored.every((message, i) => message.id === ids[i]);
    process.stdout.write(`migrate: the stream holds the IDs in source order: ${inOrder}\n`);

    // The same messages again: every one is a duplicate, nothing more lands.
    await publishAll(sourceUrl, source, messages);
    const again = await migrateWithReport(streamArgs('migrate', source, stream));
    expect(again.code, again.stderr).toBe(0);
    expect(again.report).toMatchObject({ forwarded: 0, duplicates: 1000, inDoubt: 0, remaining: 0 });
    await expectExactlyOnce('migrate re-run', stream, ids);
  });

  it('migrate without --declare-target refuses a stream that does not exist, and forwards nothing', async () => {
    const { sourceUrl } = servers();
    const source = uniqueName('st-src');
    const stream = uniqueName('st-missing');
    await declareQueue(sourceUrl, source);
    await publishAll(sourceUrl, source, numbered(uniqueName('x'), 3).messages);
    const run = await migrateWithReport(streamArgs('migrate', source, stream));
    expect(run.code, run.stderr).toBe(2);
    expect(run.stderr).toContain(stream);
    const left = await takeRaw(sourceUrl, source);
    expect(left).toHaveLength(3);
  });

  it('migrate: the lossless corpus reads back over 0-9-1 as a direct 0-9-1 publish of it does', async () => {
    const { sourceUrl } = servers();
    const source = uniqueName('st-lossless-src');
    const stream = uniqueName('st-lossless');
    await declareQueue(sourceUrl, source);
    const sent = corpus(uniqueName('c'));
    await publishFrames(sourceUrl, source, sent);
    const run = await migrateWithReport(streamArgs('migrate', source, stream, '--declare-target'));
    expect(run.code, run.stderr).toBe(0);
    const ids = sent.filter((m) => m.direct !== undefined).map((m) => m.id);
    await expectExactlyOnce('lossless migrate', stream, ids);
    expect(run.report, JSON.stringify(run.report)).toMatchObject({
      forwarded: sent.length - 1,
      duplicates: 1,
      inDoubt: 0,
      remaining: 0,
    });
    await expectAsDirect('lossless migrate', sent, source, stream, ids.length);
  });

  it('a message the stream cannot store as RabbitMQ would (a decimal header) is parked; the others land', async () => {
    const { sourceUrl } = servers();
    const source = uniqueName('st-dec-src');
    const park = uniqueName('st-dec-park');
    const stream = uniqueName('st-dec');
    await declareQueue(sourceUrl, source);
    await declareQueue(sourceUrl, park);
    const tag = uniqueName('d');
    const plain = (n: number) => ({
      header: basicProperties({ headers: table(field(DEDUP_ID, longString(`${tag}-${n}`))) }),
      body: Buffer.from(`body ${n}`),
    });
    const decimalHeader = basicProperties({
      headers: table(field(DEDUP_ID, longString(`${tag}-decimal`)), field('price', decimal(2, 12345))),
    });
    await publishFrames(sourceUrl, source, [
      plain(1),
      { header: decimalHeader, body: Buffer.from('decimal') },
      plain(2),
    ]);
    const run = await migrateWithReport(
      streamArgs('migrate', source, stream, '--declare-target', '--park-queue', park),
    );
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 2, parked: 1, inDoubt: 0, remaining: 0 });
    await expectExactlyOnce('around a decimal', stream, [`${tag}-1`, `${tag}-2`]);
    const parked = await takeRaw(sourceUrl, park);
    expect(parked.map((m) => [m.id, m.body.toString()])).toEqual([[`${tag}-decimal`, 'decimal']]);
    const header = new ContentHeader(parked[0]?.header as Buffer);
    const reason = header.field('x-dedup-park-reason');
    const because = reason ? header.valueBytes(reason).subarray(5).toString() : '(no reason)';
    process.stdout.write(`decimal: parked because ${because}\n`);
    expect(because).toMatch(/decimal/);
  });

  it('run: forwards the corpus and a stream of messages as they come, under a named producer; SIGTERM exits 0', async () => {
    const { sourceUrl, targetStreamUrl } = servers();
    const source = uniqueName('st-run-src');
    const stream = uniqueName('st-run');
    const producer = uniqueName('producer');
    await declareQueue(sourceUrl, source);
    await declareStream(stream);
    const sent = corpus(uniqueName('r'));
    const tag = uniqueName('n');
    const { ids, messages } = numbered(tag, 500);
    const watch = new StreamWatch(targetStreamUrl, stream);
    let bridge: RunningCli | undefined;
    try {
      bridge = startCli(streamArgs('run', source, stream, '--target-producer', producer));
      const running = bridge;
      expect(await waitFor(() => running.output().includes('"msg":"forwarding"')), running.output()).toBe(
        true,
      );
      await publishFrames(sourceUrl, source, sent);
      await publishAll(sourceUrl, source, messages);
      const total = sent.length - 1 + ids.length;
      expect(
        await watch.until(total, 60_000),
        `${watch.count} of ${total} on the stream; ${running.output().slice(-3000)}`,
      ).toBe(true);
    } finally {
      bridge?.signal('SIGTERM');
      await watch.stop();
    }
    const exit = await (bridge as RunningCli).done;
    expect(exit.code, exit.stderr).toBe(0);
    expect(exit.stdout).toMatch(/"msg":"stopped"/);
    // Nothing left behind in the source queue, nothing more on the stream after the stop.
    expect(await takeRaw(sourceUrl, source)).toEqual([]);
    const corpusIds = sent.filter((m) => m.direct !== undefined).map((m) => m.id);
    const stored = await expectExactlyOnce('run', stream, [...corpusIds, ...ids]);
    // Written by the producer named: its last stored publishing ID covers every message (IDs are
    // strictly increasing, never 0), and the broker knows nothing of another name on this stream.
    const sequence = await publisherSequence(targetStreamUrl, producer, stream);
    process.stdout.write(
      `run: producer "${producer}": last stored publishing ID ${sequence} for ${stored.length} messages\n`,
    );
    expect(sequence).toBeGreaterThanOrEqual(BigInt(stored.length));
    expect(await publisherSequence(targetStreamUrl, `${producer}-other`, stream)).toBe(0n);
    // Byte for byte as a direct publish, through run as through migrate.
    await expectAsDirect('lossless run', sent, source, stream, stored.length);
  });
});
