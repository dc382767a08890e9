import zlib from 'node:zlib';
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

/** A sub-batch as the Java, .NET and Python clients write one: `compress` the records' bytes. */
function subBatch(
  records: string[],
  { compression = 0, compress = (b: Buffer) => b, count = records.length } = {},
): Buffer {
  const plain = Buffer.concat(records.map(simple));
  const body = compress(plain);
  const head = Buffer.alloc(11);
  head[0] = 0x80 | (compression << 4);
  head.writeUInt16BE(count, 1);
  head.writeUInt32BE(plain.length, 3);
  head.writeUInt32BE(body.length, 7);
  return Buffer.concat([head, body]);
}

const zstd = (zlib as unknown as { zstdCompressSync: (b: Buffer) => Buffer }).zstdCompressSync;
const shown = (parsed: ReturnType<typeof read>) =>
  parsed.messages.map((m) => [m.offset, m.unreadable ?? m.data.toString()]);

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

  it('gzip and zstd sub-batches are read; snappy and lz4 ones, or one that does not inflate, are one unreadable message per offset', () => {
    const gzip = subBatch(['g1', 'g2'], { compression: 1, compress: (b) => zlib.gzipSync(b) });
    const zst = subBatch(['z1', 'z2', 'z3'], { compression: 4, compress: zstd });
    expect(shown(read(chunk([gzip, simple('s'), zst], 6)))).toEqual([
      [100n, 'g1'],
      [101n, 'g2'],
      [102n, 's'],
      [103n, 'z1'],
      [104n, 'z2'],
      [105n, 'z3'],
    ]);
    const snappy = /compressed with snappy, which this bridge cannot read \(it reads gzip, and zstd/;
    const parsed = read(chunk([subBatch(['a', 'b'], { compression: 2 }), simple('after')], 3));
    expect(parsed.messages.map((m) => m.offset)).toEqual([100n, 101n, 102n]);
    expect(parsed.messages[0]?.unreadable).toMatch(snappy);
    expect(parsed.messages[1]?.unreadable).toMatch(snappy);
    expect(parsed.messages[2]).toEqual({ offset: 102n, data: Buffer.from('after') });
    const broken = read(chunk([subBatch(['a'], { compression: 1 }), simple('after')], 2));
    expect(broken.messages[0]?.unreadable).toMatch(/compressed with gzip that does not decompress/);
    expect(broken.messages[1]?.data.toString()).toBe('after');
  });

  it('a sub-batch that says more records than it holds, and entries past the chunk, are unreadable offsets, not a frame error', () => {
    const short = read(chunk([subBatch(['a', 'b'], { count: 4 }), simple('c')], 5));
    expect(shown(short)).toEqual([
      [100n, 'a'],
      [101n, 'b'],
      [102n, 'a sub-batch of 4 messages whose bytes end after 2'],
      [103n, 'a sub-batch of 4 messages whose bytes end after 2'],
      [104n, 'c'],
    ]);
    // A sub-batch of 3 in a chunk of 2 records: the third would take the next chunk's offset.
    expect(shown(read(chunk([subBatch(['a', 'b', 'c'])], 2)))).toEqual([
      [100n, 'a'],
      [101n, 'b'],
    ]);
    // Two entries announced, one there: the second's offset cannot be read.
    const cut = chunk([simple('a')], 2);
    cut.writeUInt16BE(2, 2);
    expect(shown(read(cut))).toEqual([
      [100n, 'a'],
      [101n, 'the chunk at offset 100 ends before its 2 messages do'],
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
