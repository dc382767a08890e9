import { describe, expect, it } from 'vitest';
import { parseChunk, Reader, StreamFrameError } from '../../src/stream/client.js';

// Osiris chunks as a Deliver carries them, built by hand: the 48-byte header, maybe a filter's
// bloom (brokers with stream filtering), the entries, maybe the trailer (3.10 leaves it out).

function simple(data: string): Buffer {
  const body = Buffer.from(data);
  const head = Buffer.alloc(4);
  head.writeUInt32BE(body.length, 0);
  return Buffer.concat([head, body]);
}

function subBatch(records: string[]): Buffer {
  const body = Buffer.concat(records.map(simple));
  const head = Buffer.alloc(11);
  head[0] = 0x80;
  head.writeUInt16BE(records.length, 1);
  head.writeUInt32BE(body.length, 3);
  head.writeUInt32BE(body.length, 7);
  return Buffer.concat([head, body]);
}

function chunk(
  entries: Buffer[],
  records: number,
  { bloom = 0, trailer = Buffer.alloc(0), sendTrailer = true, type = 0 } = {},
): Buffer {
  const data = Buffer.concat(entries);
  const head = Buffer.alloc(48);
  head[0] = 0x51;
  head[1] = type;
  head.writeUInt16BE(entries.length, 2);
  head.writeUInt32BE(records, 4);
  head.writeBigInt64BE(1_700_000_000_000n, 8);
  head.writeBigUInt64BE(3n, 16);
  head.writeBigUInt64BE(100n, 24);
  head.writeUInt32BE(data.length, 36);
  head.writeUInt32BE(trailer.length, 40);
  head[44] = bloom;
  return Buffer.concat([head, Buffer.alloc(bloom, 0xee), data, sendTrailer ? trailer : Buffer.alloc(0)]);
}

const read = (bytes: Buffer) => parseChunk(new Reader(bytes));

describe('osiris chunks', () => {
  it('simple entries, offsets from the chunk id', () => {
    const parsed = read(chunk([simple('a'), simple('bc')], 2));
    expect(parsed.firstOffset).toBe(100n);
    expect(parsed.epoch).toBe(3n);
    expect(parsed.messages.map((m) => [m.offset, m.data.toString()])).toEqual([
      [100n, 'a'],
      [101n, 'bc'],
    ]);
  });

  it('uncompressed sub-batches', () => {
    const parsed = read(chunk([subBatch(['x', 'y', 'z']), simple('w')], 4));
    expect(parsed.messages.map((m) => [m.offset, m.data.toString()])).toEqual([
      [100n, 'x'],
      [101n, 'y'],
      [102n, 'z'],
      [103n, 'w'],
    ]);
  });

  it('with or without the trailer, with a bloom filter', () => {
    const trailer = Buffer.alloc(13, 1);
    for (const options of [
      { trailer, sendTrailer: false },
      { trailer, sendTrailer: true },
      { bloom: 16, trailer, sendTrailer: false },
      { bloom: 16, trailer, sendTrailer: true },
    ]) {
      expect(read(chunk([simple('m')], 1, options)).messages.map((m) => m.data.toString())).toEqual(['m']);
    }
  });

  it('tracking chunks carry no messages; a chunk longer than its frame is an error', () => {
    expect(read(chunk([simple('t')], 1, { type: 1 })).messages).toEqual([]);
    const whole = chunk([simple('abc')], 1);
    expect(() => read(whole.subarray(0, whole.length - 1))).toThrow(StreamFrameError);
  });
});
