import type { ChannelModel } from 'amqplib';
import { describe, expect, it } from 'vitest';
import { installLosslessReader, routingBytesOf } from '../../src/amqp/internals.js';
import { contentHeaderOf } from '../../src/wire/properties.js';
import { basicProperties, contentHeaderFrame, field, frame, longString, shortstr, table } from '../wire.js';

// The bridge's own connections read frames through src/amqp/internals.ts: a small body is copied
// out of the socket read it came in (kept as a view it would keep the whole read alive), the routing
// bytes are copied, and the properties decode when read. Fed hand-built frames, several messages to a
// read, as a broker sends them.

/** A connection shaped as amqplib's, whose socket hands out `reads` one after another. */
function fakeConnection(reads: Buffer[]) {
  const connection = {
    rest: Buffer.alloc(0),
    stream: { read: () => reads.shift() ?? null },
    channels: [],
    recvFrame: () => false as unknown,
    onSocketError: () => {},
    muxer: { _readIncoming: () => {} },
    frameMax: 131_072,
    maxFrameSize: 131_072,
    recvSinceLastCheck: false,
  };
  installLosslessReader({ connection } as unknown as ChannelModel);
  /** Every frame the reader gives, until the reads run out. */
  const all = (): Record<string, unknown>[] => {
    const out: Record<string, unknown>[] = [];
    for (;;) {
      const next = connection.recvFrame() as Record<string, unknown> | false;
      if (!next) return out;
      out.push(next);
    }
  };
  return { all };
}

/** basic.deliver on channel 1: consumer tag, delivery tag, redelivered, exchange, routing key. */
function deliver(exchange: string, routingKey: string): Buffer {
  const tag = Buffer.alloc(9);
  tag.writeBigUInt64BE(7n, 0);
  const head = Buffer.alloc(4);
  head.writeUInt16BE(60, 0);
  head.writeUInt16BE(60, 2);
  return frame(1, 1, Buffer.concat([head, shortstr('ctag'), tag, shortstr(exchange), shortstr(routingKey)]));
}

describe('the lossless frame reader', () => {
  it('hands out each body byte for byte, a small one as a copy of its own, across reads and frames', () => {
    const header = basicProperties({
      messageId: 'm-1',
      headers: table(field('_HQ_DUPL_ID', longString('id-1'))),
    });
    const small = Buffer.from('small body');
    const big = Buffer.alloc(100_000, 7);
    const stream = Buffer.concat([
      deliver('', 'queue-a'),
      contentHeaderFrame(1, small.length, header),
      frame(3, 1, small),
      deliver('ex', ''),
      contentHeaderFrame(1, big.length, header),
      frame(3, 1, big.subarray(0, 60_000)),
      frame(3, 1, big.subarray(60_000)),
      deliver('ex', 'k'),
      contentHeaderFrame(1, 0, header),
    ]);
    // Split mid-frame, as a socket does.
    const frames = fakeConnection([
      stream.subarray(0, 30),
      stream.subarray(30, 70_000),
      stream.subarray(70_000),
    ]).all();
    const bodies = frames.filter((f) => 'content' in f).map((f) => f.content as Buffer);
    expect(bodies.map((b) => b.length)).toEqual([small.length, 60_000, 40_000]);
    expect(bodies[0]).toEqual(small);
    expect(Buffer.concat(bodies.slice(1))).toEqual(big);
    // The small body is a copy (in Node's pool of small buffers), not a view of the read it came in
    // with the start of the big one: that read can go while the small message is in flight.
    expect((bodies[0] as Buffer).buffer).not.toBe((bodies[1] as Buffer).buffer);
    expect((bodies[0] as Buffer).buffer.byteLength).toBeLessThanOrEqual(Buffer.poolSize);

    const delivers = frames.filter((f) => f.id === (60 << 16) + 60);
    const routing = delivers.map((f) => routingBytesOf(f.fields as object));
    expect(routing.map((r) => [r?.exchange.toString(), r?.routingKey.toString()])).toEqual([
      ['', 'queue-a'],
      ['ex', ''],
      ['ex', 'k'],
    ]);
    const headers = frames.filter((f) => f.id === 60);
    expect(headers.map((f) => f.size)).toEqual([small.length, big.length, 0]);
    for (const f of headers) {
      const properties = f.fields as { messageId?: string };
      expect(properties.messageId).toBe('m-1');
      expect(contentHeaderOf(f.fields as never).bytes).toEqual(header);
    }
  });
});
