import amqp, { type ChannelModel, type ConfirmChannel, type ConsumeMessage } from 'amqplib';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { installLosslessReader, publishRaw, routingBytesOf } from '../../src/amqp/internals.js';
import { encodeMessage, mappingFor, UnencodableError } from '../../src/stream/amqp10.js';
import { type PublishedMessage, StreamClient } from '../../src/stream/client.js';
import { BASIC_PROPERTIES, ContentHeader, contentHeaderOf } from '../../src/wire/properties.js';
import { servers, uniqueName } from '../helpers.js';
import {
  array,
  type BasicProperties,
  basicProperties,
  decimal,
  everyScalarField,
  field,
  float32Bits,
  float64,
  int8,
  int32,
  int64,
  longString,
  nested,
  table,
  timestamp,
  voidValue,
} from '../wire.js';

// The codec against RabbitMQ itself: each message, built byte by byte as a Java, .NET or Python
// client sends it, is (a) published straight into a stream over AMQP 0-9-1, and (b) encoded by
// amqp10.ts and published over the stream protocol into another stream. Then both streams are
// read back twice: over the stream protocol (the stored AMQP 1.0 bytes must be the same bytes) and
// over 0-9-1 with x-stream-offset (the delivered content headers, routing and bodies must be the
// same bytes).

let amqpUrl = '';
let stream: StreamClient;
let model: ChannelModel;
let channel: ConfirmChannel;

interface Case {
  label: string;
  properties: BasicProperties;
  body: Buffer;
}

/** Every scalar header type RabbitMQ reads, with zeros, empties, false and the extremes. */

const CASES: Case[] = [
  {
    label: 'every property but cluster-id, every scalar header type',
    properties: {
      contentType: 'application/x-java-serialized-object',
      contentEncoding: 'gzip',
      headers: table(...everyScalarField()),
      deliveryMode: 2,
      priority: 7,
      correlationId: 'corr-é',
      replyTo: 'replies.billing',
      expiration: '86400000',
      messageId: 'm-1',
      timestamp: 1_700_000_000n,
      type: 'order.created',
      userId: 'guest',
      appId: 'billing-java',
    },
    body: Buffer.from('{"order":1}'),
  },
  {
    label: 'zero and empty properties',
    properties: {
      contentType: '',
      contentEncoding: '',
      headers: table(),
      deliveryMode: 1,
      priority: 0,
      correlationId: '',
      replyTo: '',
      expiration: '0',
      messageId: '',
      timestamp: 0n,
      type: '',
      appId: '',
    },
    body: Buffer.alloc(0),
  },
  { label: 'no properties at all', properties: {}, body: Buffer.from('bare') },
  {
    label: 'properties at 255 bytes, a large body',
    properties: {
      messageId: 'i'.repeat(255),
      correlationId: 'c'.repeat(255),
      replyTo: 'r'.repeat(255),
      type: 't'.repeat(255),
      appId: 'a'.repeat(255),
      contentType: 'ct'.repeat(127),
    },
    body: Buffer.alloc(70_000, 0xab),
  },
  {
    label: 'bytes that are not UTF-8 in short-string properties',
    properties: {
      messageId: Buffer.from([0xc3, 0x28, 0x00]),
      correlationId: Buffer.from([0xff]),
      type: Buffer.from([0xfe, 0x80]),
    },
    body: Buffer.from([0, 1, 2]),
  },
  {
    label: 'tables and arrays, which RabbitMQ 3.10 drops from a stream',
    properties: {
      headers: table(
        field('before', int32(1)),
        field('meta', nested(table(field('a', longString('b'))))),
        field('list', array(int8(1), longString('two'), voidValue())),
        field('x-death', array(nested(table(field('count', int64(1n)))))),
        field('after', int32(2)),
      ),
    },
    body: Buffer.from('nested'),
  },
  {
    label: 'a header named like a property annotation',
    properties: {
      type: 'real-type',
      headers: table(field('x-basic-type', longString('header')), field('x-basic-app-id', longString('h2'))),
    },
    body: Buffer.from('names'),
  },
  {
    label: 'a timestamp past 2^63 ms',
    properties: {
      timestamp: 2n ** 64n - 1n,
      headers: table(field('ts-max', timestamp(2n ** 64n - 1n)), field('ts-2^63', timestamp(2n ** 63n))),
    },
    body: Buffer.from('late'),
  },
  {
    label: 'with cluster-id',
    properties: { clusterId: 'cluster-a', messageId: 'with-cluster' },
    body: Buffer.from('cluster'),
  },
];

/** Each header entry as `name=tag:hex` (the name as hex if it is not printable). */
function entries(header: ContentHeader, skip: string[] = []): string[] {
  return (header.fields ?? [])
    .filter((span) => !skip.includes(span.name))
    .map((span) => {
      const value = header.valueBytes(span);
      const name = span.name.length > 20 ? `${span.name.slice(0, 8)}…(${span.name.length})` : span.name;
      const hex = value.subarray(1).toString('hex');
      return `${name}=${String.fromCharCode(value[0] as number)}:${hex.length > 24 ? `${hex.slice(0, 24)}…` : hex}`;
    });
}

/**
 * How a delivered content header differs from the one published, property by property and header
 * by header; RabbitMQ's own `x-stream-offset` header on every stream delivery is left out.
 */
function differences(sent: Buffer, delivered: Buffer): string[] {
  const a = new ContentHeader(sent);
  const b = new ContentHeader(delivered);
  const out: string[] = [];
  BASIC_PROPERTIES.forEach(([name, kind], index) => {
    if (kind === 'table') return;
    const before = kind === 'shortstr' ? a.shortstrBytes(name)?.toString('hex') : a.propertyAt(index);
    const after = kind === 'shortstr' ? b.shortstrBytes(name)?.toString('hex') : b.propertyAt(index);
    if (before !== after) out.push(`${name} ${String(before)} -> ${String(after)}`);
  });
  const left = entries(b, ['x-stream-offset']);
  const gone: string[] = [];
  for (const entry of entries(a)) {
    const at = left.indexOf(entry);
    if (at >= 0) left.splice(at, 1);
    else gone.push(entry);
  }
  if (gone.length > 0) out.push(`header lost or changed: ${gone.join(', ')}`);
  if (left.length > 0) out.push(`header new: ${left.join(', ')}`);
  if (out.length === 0 && gone.length === 0) {
    const order = entries(a).join() === entries(b, ['x-stream-offset']).join();
    if (!order) out.push('header order changed');
  }
  return out;
}

/** What RabbitMQ 3.10 itself changes between a 0-9-1 publish into a stream and its delivery. */
const EXPECTED_CHANGES: string[] = [
  'every property but cluster-id, every scalar header type: header lost or changed: bool-octet-2=t:02; header new: bool-octet-2=t:01',
  'zero and empty properties: kept exactly',
  'no properties at all: kept exactly',
  'properties at 255 bytes, a large body: kept exactly',
  'bytes that are not UTF-8 in short-string properties: kept exactly',
  'tables and arrays, which RabbitMQ 3.10 drops from a stream: header lost or changed: meta=F:000000080161530000000162, list=A:0000000b6201530000000374…, x-death=A:00000014460000000f05636f…',
  'a header named like a property annotation: appId undefined -> 6832; header lost or changed: x-basic-app-id=S:000000026832',
  'a timestamp past 2^63 ms: header lost or changed: ts-2^63=T:8000000000000000; header new: ts-2^63=T:0000000000000000',
  'with cluster-id: clusterId 636c75737465722d61 -> undefined',
];

async function declareStream(name: string): Promise<void> {
  await channel.assertQueue(name, { durable: true, arguments: { 'x-queue-type': 'stream' } });
}

function publishDirect(queue: string, header: Buffer, body: Buffer): Promise<void> {
  return new Promise((resolve, reject) => {
    publishRaw(channel, '', queue, header, body, (error) => (error ? reject(error) : resolve()));
  });
}

async function publishEncoded(publisherId: number, messages: PublishedMessage[]): Promise<void> {
  const waiting = new Set(messages.map((m) => m.publishingId));
  await new Promise<void>((resolve, reject) => {
    const onConfirm = (id: number, ids: bigint[]) => {
      if (id !== publisherId) return;
      for (const one of ids) waiting.delete(one);
      if (waiting.size === 0) {
        stream.off('confirm', onConfirm);
        resolve();
      }
    };
    stream.on('confirm', onConfirm);
    stream.on('publish-error', (_id, errors) =>
      reject(new Error(JSON.stringify(errors, (_k, v) => String(v)))),
    );
    stream.publish(publisherId, messages);
  });
}

interface Delivered {
  exchange: string;
  routingKey: string;
  header: Buffer;
  body: Buffer;
}

/** Reads `count` messages of a stream over 0-9-1, from its first offset. */
async function read091(queue: string, count: number): Promise<Delivered[]> {
  const reading = await model.createChannel();
  await reading.prefetch(1000);
  const out: Delivered[] = [];
  await new Promise<void>((resolve, reject) => {
    const timer = setTimeout(
      () => reject(new Error(`only ${out.length} of ${count} read from ${queue}`)),
      10_000,
    );
    reading
      .consume(
        queue,
        (message: ConsumeMessage | null) => {
          if (!message) return;
          const routing = routingBytesOf(message.fields);
          out.push({
            exchange: routing?.exchange.toString('latin1') ?? message.fields.exchange,
            routingKey: routing?.routingKey.toString('latin1') ?? message.fields.routingKey,
            header: Buffer.from(contentHeaderOf(message.properties).bytes),
            body: message.content,
          });
          reading.ack(message);
          if (out.length === count) {
            clearTimeout(timer);
            resolve();
          }
        },
        { arguments: { 'x-stream-offset': 'first' } },
      )
      .catch(reject);
  });
  await reading.close();
  return out;
}

beforeAll(async () => {
  // The harness's target broker, which serves the stream protocol (or TARGET_STREAM_URL's).
  const { targetUrl, targetStreamUrl } = servers();
  amqpUrl = targetUrl;
  model = await amqp.connect(amqpUrl);
  model.on('error', () => {});
  installLosslessReader(model);
  channel = await model.createConfirmChannel();
  stream = await StreamClient.connect({ url: targetStreamUrl });
});

afterAll(async () => {
  await stream?.close();
  await model?.close().catch(() => {});
});

describe('the AMQP 1.0 codec against RabbitMQ', () => {
  it('the broker is one the mapping is for', () => {
    expect(mappingFor(stream.serverVersion)).toBe('rabbit_msg_record');
    expect(() => mappingFor('3.13.7')).toThrow(UnencodableError);
    expect(() => mappingFor('4.1.0')).toThrow(UnencodableError);
  });

  it('stores the same bytes, and delivers the same content headers, as a direct 0-9-1 publish', async () => {
    const direct = uniqueName('codec-direct');
    const encoded = uniqueName('codec-encoded');
    await declareStream(direct);
    await declareStream(encoded);
    await stream.declarePublisher(1, 'codec', encoded);

    const headers = CASES.map((c) => basicProperties(c.properties));
    for (let i = 0; i < CASES.length; i++) {
      await publishDirect(direct, headers[i] as Buffer, (CASES[i] as Case).body);
    }
    const results = CASES.map((c, i) =>
      encodeMessage(new ContentHeader(headers[i] as Buffer), c.body, { exchange: '', routingKey: direct }),
    );
    await publishEncoded(
      1,
      results.map((r, i) => ({ publishingId: BigInt(i + 1), data: r.bytes })),
    );

    // (1) The stored AMQP 1.0 bytes.
    const storedDirect = await stream.readStream(direct, { count: CASES.length });
    const storedEncoded = await stream.readStream(encoded, { count: CASES.length });
    expect(storedDirect).toHaveLength(CASES.length);
    expect(storedEncoded).toHaveLength(CASES.length);
    const storedDiffs: string[] = [];
    CASES.forEach((c, i) => {
      const a = storedDirect[i]?.data.toString('hex');
      const b = storedEncoded[i]?.data.toString('hex');
      if (a !== b) storedDiffs.push(`${c.label}:\n  direct  ${a}\n  encoded ${b}`);
    });
    expect(storedDiffs).toEqual([]);

    // (2) What a 0-9-1 consumer of each stream receives.
    const viaDirect = await read091(direct, CASES.length);
    const viaEncoded = await read091(encoded, CASES.length);
    CASES.forEach((c, i) => {
      expect(viaEncoded[i], c.label).toEqual(viaDirect[i]);
    });

    // What RabbitMQ itself changes on the way (the same for both streams), for the record.
    const changes = CASES.map((c, i) => {
      const found = differences(headers[i] as Buffer, viaDirect[i]?.header as Buffer);
      return `${c.label}: ${found.length === 0 ? 'kept exactly' : found.join('; ')}`;
    });
    console.log(
      `direct and encoded agree on all ${CASES.length} messages; what 3.10 changes:\n${changes.join('\n')}`,
    );
    expect(changes).toEqual(EXPECTED_CHANGES);
    expect(results[5]?.lost).toEqual([
      'header "meta" (a table)',
      'header "list" (an array)',
      'header "x-death" (an array)',
    ]);
    expect(results[8]?.lost).toEqual(['property clusterId']);
    expect(results[7]?.lost).toEqual(['header "ts-2^63" (a timestamp that comes back as 0)']);
  });

  it('what RabbitMQ 3.10 cannot store from 0-9-1 is refused by the encoder', async () => {
    const refused = uniqueName('codec-refused');
    await declareStream(refused);
    const cases: [string, Buffer][] = [
      ['decimal', field('dec', decimal(2, 12345))],
      ['NaN float', field('nan', float32Bits(0x7fc00000))],
      ['infinite double', field('inf', float64(Number.POSITIVE_INFINITY))],
    ];
    const outcomes: string[] = [];
    for (const [label, header] of cases) {
      const bytes = basicProperties({ headers: table(header) });
      expect(() => encodeMessage(new ContentHeader(bytes), Buffer.from(label))).toThrow(UnencodableError);
      // And the direct publish: what does RabbitMQ do with it?
      const direct = await amqp.connect(amqpUrl);
      direct.on('error', () => {});
      const ch = await direct.createConfirmChannel();
      ch.on('error', () => {});
      const outcome = await new Promise<string>((resolve) => {
        const timer = setTimeout(() => resolve('no answer in 5 s'), 5000);
        ch.on('close', () => {
          clearTimeout(timer);
          resolve('channel closed');
        });
        direct.on('close', () => {
          clearTimeout(timer);
          resolve('connection closed');
        });
        try {
          publishRaw(ch, '', refused, bytes, Buffer.from(label), (error) => {
            clearTimeout(timer);
            resolve(error ? `nacked: ${String(error)}` : 'confirmed');
          });
        } catch (error) {
          resolve(`not sent: ${String(error)}`);
        }
      });
      outcomes.push(`${label}: direct 0-9-1 publish ${outcome}`);
      await direct.close().catch(() => {});
    }
    const stored = await stream.readStream(refused, { idleMs: 1000 });
    outcomes.push(`messages in the stream afterwards: ${stored.length}`);
    console.log(outcomes.join('\n'));
    expect(outcomes).toEqual([
      'decimal: direct 0-9-1 publish nacked: Error: channel closed',
      'NaN float: direct 0-9-1 publish nacked: Error: channel closed',
      'infinite double: direct 0-9-1 publish nacked: Error: channel closed',
      'messages in the stream afterwards: 0',
    ]);
  });
});
