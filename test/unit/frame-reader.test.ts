import type { Channel } from 'amqplib';
import { describe, expect, it } from 'vitest';
import { installLosslessReaderFor, routingBytesOf } from '../../src/amqp/internals.js';
import { contentHeaderOf } from '../../src/wire/properties.js';
import {
  basicProperties,
  bytes,
  contentHeaderFrame,
  field,
  frame,
  int64,
  longString,
  shortstr,
  table,
} from '../wire.js';

// The bridge reads frames at an offset into what the socket gave (src/amqp/internals.ts) and
// decodes basic.deliver itself, reusing the last delivery's tag, exchange and routing key when
// their bytes match. Frames built here byte by byte, fed in reads of every size, must come out as
// they went in: each delivery with its own routing bytes, each header and body exact.

const CHANNEL = 3;

function deliver(
  tag: string,
  deliveryTag: bigint,
  redelivered: boolean,
  exchange: Buffer,
  key: Buffer,
): Buffer {
  const head = Buffer.alloc(4);
  head.writeUInt16BE(60, 0);
  head.writeUInt16BE(60, 2);
  const number = Buffer.alloc(9);
  number.writeBigUInt64BE(deliveryTag, 0);
  number.writeUInt8(redelivered ? 1 : 0, 8);
  return frame(1, CHANNEL, Buffer.concat([head, shortstr(tag), number, shortstr(exchange), shortstr(key)]));
}

/** basic.ack (60, 80): a method frame the reader leaves to amqplib's own decoder. */
function ack(deliveryTag: bigint): Buffer {
  const payload = Buffer.alloc(13);
  payload.writeUInt16BE(60, 0);
  payload.writeUInt16BE(80, 2);
  payload.writeBigUInt64BE(deliveryTag, 4);
  return frame(1, CHANNEL, payload);
}

interface Sent {
  tag: bigint;
  exchange: Buffer;
  key: Buffer;
  header: Buffer;
  body: Buffer;
}

const latin = Buffer.from([0x61, 0x2e, 0x80]); // "a.\x80": not UTF-8
const latinToo = Buffer.from([0x61, 0x2e, 0x81]); // amqplib decodes both to "a.\ufffd"
const messages: Sent[] = [
  {
    tag: 1n,
    exchange: Buffer.from('ex'),
    key: latin,
    header: headerWith('one'),
    body: Buffer.from('body one'),
  },
  { tag: 2n, exchange: Buffer.from('ex'), key: latinToo, header: headerWith('two'), body: Buffer.from('b2') },
  {
    tag: 2n ** 40n + 3n,
    exchange: Buffer.from('ex'),
    key: latin,
    header: headerWith('3'),
    body: Buffer.alloc(0),
  },
  {
    tag: 4n,
    exchange: Buffer.alloc(0),
    key: latin,
    header: headerWith('four'),
    body: Buffer.from('split body'),
  },
];

function headerWith(id: string): Buffer {
  return basicProperties({
    headers: table(
      field('_HQ_DUPL_ID', longString(id)),
      field('n', int64(-(2n ** 63n))),
      field('b', bytes('\x00\xff')),
    ),
    deliveryMode: 2,
  });
}

function wire(): Buffer {
  const parts: Buffer[] = [];
  for (const [index, message] of messages.entries()) {
    parts.push(deliver('ctag-1', message.tag, index === 1, message.exchange, message.key));
    parts.push(contentHeaderFrame(CHANNEL, message.body.length, message.header));
    // The last body comes in two frames.
    if (index === 3)
      parts.push(frame(3, CHANNEL, message.body.subarray(0, 4)), frame(3, CHANNEL, message.body.subarray(4)));
    else if (message.body.length > 0) parts.push(frame(3, CHANNEL, message.body));
    parts.push(ack(message.tag));
  }
  return Buffer.concat(parts);
}

interface Connection {
  rest: Buffer;
  maxFrameSize: number;
  recvSinceLastCheck: boolean;
  stream: { read(): Buffer | null };
  recvFrame(): unknown;
}

/** A connection as amqplib keeps it, its socket replaced by the given reads, with the reader installed. */
function readerOver(reads: Buffer[], maxFrameSize = 131072): Connection {
  const connection: Connection = {
    rest: Buffer.alloc(0),
    maxFrameSize,
    recvSinceLastCheck: false,
    stream: { read: () => reads.shift() ?? null },
    recvFrame: () => false,
  };
  installLosslessReaderFor({ connection } as unknown as Channel);
  return connection;
}

type Decoded = {
  id?: number;
  channel: number;
  fields?: Record<string, unknown> & object;
  content?: Buffer;
  size?: number;
};

function readAll(connection: Connection): Decoded[] {
  const out: Decoded[] = [];
  for (;;) {
    const decoded = connection.recvFrame() as Decoded | false;
    if (decoded === false) return out;
    out.push(decoded);
  }
}

/** What a user of the frames would check: routing bytes, tags, header bytes and bodies. */
function summary(frames: Decoded[]): unknown[] {
  return frames.map((decoded) => {
    if (decoded.content) return { channel: decoded.channel, body: decoded.content.toString('hex') };
    if (decoded.size !== undefined) {
      const header = contentHeaderOf(decoded.fields as never);
      return { channel: decoded.channel, size: decoded.size, header: header.bytes.toString('hex') };
    }
    const fields = decoded.fields as Record<string, unknown>;
    const routing = routingBytesOf(fields);
    return {
      channel: decoded.channel,
      id: decoded.id,
      ...fields,
      routing: routing && {
        exchange: routing.exchange.toString('hex'),
        key: routing.routingKey.toString('hex'),
      },
    };
  });
}

function expected(): unknown[] {
  const out: unknown[] = [];
  for (const [index, message] of messages.entries()) {
    out.push({
      channel: CHANNEL,
      id: (60 << 16) | 60,
      consumerTag: 'ctag-1',
      deliveryTag: Number(message.tag),
      redelivered: index === 1,
      exchange: message.exchange.toString('utf8'),
      routingKey: message.key.toString('utf8'),
      routing: { exchange: message.exchange.toString('hex'), key: message.key.toString('hex') },
    });
    out.push({ channel: CHANNEL, size: message.body.length, header: message.header.toString('hex') });
    if (index === 3) {
      out.push({ channel: CHANNEL, body: message.body.subarray(0, 4).toString('hex') });
      out.push({ channel: CHANNEL, body: message.body.subarray(4).toString('hex') });
    } else if (message.body.length > 0) out.push({ channel: CHANNEL, body: message.body.toString('hex') });
    out.push({
      channel: CHANNEL,
      id: (60 << 16) | 80,
      deliveryTag: Number(message.tag),
      multiple: false,
      routing: undefined,
    });
  }
  return out;
}

describe('the frame reader', () => {
  it('reads frames as they were sent, in one read or split at every byte', () => {
    const bytesOnWire = wire();
    expect(summary(readAll(readerOver([bytesOnWire])))).toEqual(expected());
    for (let size = 1; size < 64; size++) {
      const reads: Buffer[] = [];
      for (let at = 0; at < bytesOnWire.length; at += size) reads.push(bytesOnWire.subarray(at, at + size));
      expect(summary(readAll(readerOver(reads))), `reads of ${size} bytes`).toEqual(expected());
    }
  });

  it('gives two deliveries whose routing keys decode to one text their own bytes', () => {
    const frames = readAll(readerOver([wire()])).filter((decoded) => decoded.id === ((60 << 16) | 60));
    const keys = frames.map((decoded) =>
      routingBytesOf(decoded.fields as object)?.routingKey.toString('hex'),
    );
    expect(keys).toEqual(['612e80', '612e81', '612e80', '612e80']);
    expect(frames.map((decoded) => decoded.fields?.routingKey)).toEqual([
      'a.\ufffd',
      'a.\ufffd',
      'a.\ufffd',
      'a.\ufffd',
    ]);
  });

  it('copies headers and bodies out of the read, so that a message does not keep the read alive', () => {
    // A read far larger than one body: the body is copied, not a view of the read.
    const big = Buffer.concat([wire(), frame(3, CHANNEL, Buffer.alloc(200_000 - 8, 1))]);
    const frames = readAll(readerOver([big], 1_000_000));
    const first = frames.find((decoded) => decoded.content) as Decoded;
    expect((first.content as Buffer).buffer).not.toBe(big.buffer);
    const header = frames.find((decoded) => decoded.size !== undefined) as Decoded;
    expect(contentHeaderOf(header.fields as never).bytes.buffer).not.toBe(big.buffer);
  });

  it('refuses a frame larger than the negotiated size, and one without its end octet', () => {
    expect(() => readAll(readerOver([frame(3, CHANNEL, Buffer.alloc(100))], 64))).toThrow(
      'Frame size 100 exceeds maxFrameSize 64',
    );
    const broken = frame(3, CHANNEL, Buffer.from('xyz'));
    broken[broken.length - 1] = 0;
    expect(() => readAll(readerOver([broken]))).toThrow('Invalid frame');
  });

  it('keeps nothing of a deliver whose routing key runs past its frame: the next delivery has its own exchange', () => {
    const good = (exchange: string) => deliver('t', 1n, false, Buffer.from(exchange), Buffer.from('key'));
    // exB with a key whose length octet says 3 and 2 bytes follow: amqplib decodes it, cut short.
    const cut = deliver('t', 2n, false, Buffer.from('exB'), Buffer.from('key'));
    const payloadEnd = cut.length - 1;
    const short = frame(1, CHANNEL, cut.subarray(7, payloadEnd - 1));
    const frames = readAll(readerOver([good('exA'), short, good('exB')]));
    const routing = frames.map((decoded) => {
      const bytesOf = routingBytesOf(decoded.fields as object);
      return bytesOf && `${bytesOf.exchange.toString()}/${bytesOf.routingKey.toString()}`;
    });
    expect(routing).toEqual(['exA/key', undefined, 'exB/key']);
    expect(frames.map((decoded) => decoded.fields?.exchange)).toEqual(['exA', 'exB', 'exB']);
  });

  it('leaves a deliver too short for its fields to amqplib, which refuses it', () => {
    const head = Buffer.from([0, 60, 0, 60]);
    const short = frame(1, CHANNEL, Buffer.concat([head, shortstr('tag'), Buffer.alloc(3)]));
    expect(() => readAll(readerOver([short]))).toThrow(RangeError);
  });
});
