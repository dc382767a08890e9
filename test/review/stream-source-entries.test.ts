import { gzipSync } from 'node:zlib';
import amqp from 'amqplib';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createStream, readStored, streamMessage } from '../stream-helpers.js';
import {
  countBy,
  drainQueue,
  linesOf,
  migrate,
  outputOf,
  plainEntry,
  publish091,
  publishEntries,
  records,
  StreamNodes,
  scopeName,
  srcArgs,
  subBatchEntry,
  u32,
} from './stream-source-kit.js';

// Attacks on what a stream source reads: long property strings, sub-batches (gzip, other codecs,
// malformed), 0-9-1 header types, a timestamp start. Everything against throwaway nodes.

const nodes = new StreamNodes();
beforeAll(() => nodes.start(), 180_000);
afterAll(() => nodes.stop());

const PREFIX = scopeName('entries');

function str32(code: number, bytes: Buffer): Buffer {
  return Buffer.concat([Buffer.from([code]), u32(bytes.length), bytes]);
}

/** A message whose message-id, reply-to and correlation-id are utf8 strings of `len` bytes. */
function longIdMessage(n: number, len: number): Buffer {
  const id = Buffer.from(`mid-${n}-`.padEnd(len, 'x'));
  const reply = Buffer.from(`reply-${n}-`.padEnd(len, 'r'));
  const corr = Buffer.from(`corr-${n}-`.padEnd(len, 'c'));
  const items = Buffer.concat([
    str32(0xb1, id),
    Buffer.from([0x40, 0x40, 0x40]),
    str32(0xb1, reply),
    str32(0xb1, corr),
  ]);
  const list = Buffer.concat([Buffer.from([0xd0]), u32(items.length + 4), u32(6), items]);
  const body = Buffer.from(`body ${n}`);
  return Buffer.concat([
    Buffer.from([0x00, 0x53, 0x73]),
    list,
    Buffer.from([0x00, 0x53, 0x75, 0xb0]),
    u32(body.length),
    body,
  ]);
}

const toStream = (s: string) => ['--target', nodes.dst, '--target-stream', s];
const toQueue = (q: string) => ['--target', nodes.target.url, '--target-queue', q];

async function targetQueue(name: string): Promise<void> {
  const conn = await amqp.connect(nodes.target.url);
  const ch = await conn.createChannel();
  await ch.assertQueue(name, { durable: true });
  await conn.close();
}

/** The properties section (0x00 0x53 0x73 ...) of stored bytes, as written above (list32). */
function propertiesSection(raw: Buffer): Buffer | undefined {
  const at = raw.indexOf(Buffer.from([0x00, 0x53, 0x73]));
  if (at < 0) return undefined;
  if (raw[at + 3] === 0xd0) return raw.subarray(at, at + 4 + 4 + raw.readUInt32BE(at + 4));
  if (raw[at + 3] === 0xc0) return raw.subarray(at, at + 5 + (raw[at + 4] as number));
  return raw.subarray(at, at + 4);
}

describe('stream source: what it reads', () => {
  it('1. message-id, reply-to, correlation-id over 255 bytes are copied as stored, stream to stream', async () => {
    const src = 'long-ids';
    const dst = 'long-ids-copy';
    await createStream(nodes.src, src);
    await createStream(nodes.dst, dst);
    const written = Array.from({ length: 5 }, (_, n) => longIdMessage(n, 300 + n));
    const pub = await publishEntries(nodes.src, src, written.map(plainEntry));
    expect(pub.errors).toEqual([]);
    const res = await migrate(srcArgs('migrate', nodes, src, toStream(dst), PREFIX, '--retry-for', '10s'));
    const stored = await readStored(nodes.dst, dst, { idleMs: 2000 });
    const bodies = stored.map((s) => s.body.toString());
    const c = countBy('long ids', ['body 0', 'body 1', 'body 2', 'body 3', 'body 4'], bodies);
    let differ = 0;
    stored.forEach((s, i) => {
      const want = propertiesSection(written[i] as Buffer);
      const got = propertiesSection(s.raw);
      if (!want || !got || !want.equals(got)) differ++;
    });
    console.log(`properties sections that differ: ${differ}`);
    expect({ code: res.code, ...c, differ }).toEqual({
      code: 0,
      expected: 5,
      got: 5,
      lost: 0,
      duplicated: 0,
      unexpected: 0,
      outOfOrder: 0,
      differ: 0,
    });
  });

  it('2a. a gzip sub-batch of 5 records then 10 plain entries: all 15 copied, in order, once (stream to stream)', async () => {
    const src = 'gzip-src';
    const dst = 'gzip-dst';
    await createStream(nodes.src, src);
    await createStream(nodes.dst, dst);
    const batch = records(Array.from({ length: 5 }, (_, n) => streamMessage(n)));
    const gz = gzipSync(batch);
    const pub = await publishEntries(nodes.src, src, [
      subBatchEntry(1, 5, batch.length, gz),
      ...Array.from({ length: 10 }, (_, n) => plainEntry(streamMessage(5 + n))),
    ]);
    console.log('publish', JSON.stringify(pub));
    expect(pub.errors).toEqual([]);
    const started = Date.now();
    const res = await migrate(srcArgs('migrate', nodes, src, toStream(dst), PREFIX, '--retry-for', '15s'));
    const took = Date.now() - started;
    const out = outputOf(res);
    const reconnects = linesOf(out, /reconnect/i);
    console.log(
      `took ${took} ms; reconnect lines ${reconnects.length}: ${reconnects.slice(0, 2).join(' | ')}`,
    );
    const stored = await readStored(nodes.dst, dst, { idleMs: 2000 });
    const want = Array.from({ length: 15 }, (_, n) => `body ${n}`);
    const c = countBy(
      'gzip stream->stream',
      want,
      stored.map((s) => s.body.toString()),
    );
    expect({ code: res.code, ...c }).toEqual({
      code: 0,
      expected: 15,
      got: 15,
      lost: 0,
      duplicated: 0,
      unexpected: 0,
      outOfOrder: 0,
    });
  });

  it('2b. the same gzip sub-batch, stream to queue: all 15 once, in order', async () => {
    const src = 'gzip-src-q';
    const q = 'gzip-q';
    await createStream(nodes.src, src);
    await targetQueue(q);
    const batch = records(Array.from({ length: 5 }, (_, n) => streamMessage(n)));
    const pub = await publishEntries(nodes.src, src, [
      subBatchEntry(1, 5, batch.length, gzipSync(batch)),
      ...Array.from({ length: 10 }, (_, n) => plainEntry(streamMessage(5 + n))),
    ]);
    expect(pub.errors).toEqual([]);
    const res = await migrate(srcArgs('migrate', nodes, src, toQueue(q), PREFIX, '--retry-for', '15s'));
    const out = outputOf(res);
    console.log(`reconnect lines ${linesOf(out, /reconnect/i).length}`);
    const got = await drainQueue(nodes.target.url, q);
    const want = Array.from({ length: 15 }, (_, n) => `body ${n}`);
    const c = countBy(
      'gzip stream->queue',
      want,
      got.map((m) => m.content.toString()),
    );
    expect({ code: res.code, ...c }).toEqual({
      code: 0,
      expected: 15,
      got: 15,
      lost: 0,
      duplicated: 0,
      unexpected: 0,
      outOfOrder: 0,
    });
  });

  for (const [compression, name] of [
    [2, 'snappy'],
    [3, 'lz4'],
  ] as const) {
    it(`2c. a ${name} sub-batch (compression ${compression}, faked bytes) after 3 plain entries: one clear line, an exit, no spin; a re-run duplicates nothing`, async () => {
      const src = `${name}-src`;
      const dst = `${name}-dst`;
      await createStream(nodes.src, src);
      await createStream(nodes.dst, dst);
      const batch = records(Array.from({ length: 5 }, (_, n) => streamMessage(3 + n)));
      const pub = await publishEntries(nodes.src, src, [
        ...Array.from({ length: 3 }, (_, n) => plainEntry(streamMessage(n))),
        subBatchEntry(compression, 5, batch.length, Buffer.concat([Buffer.from('FAKE'), batch])),
        ...Array.from({ length: 3 }, (_, n) => plainEntry(streamMessage(8 + n))),
      ]);
      console.log('publish', JSON.stringify(pub));
      expect(pub.errors).toEqual([]);
      const started = Date.now();
      const res = await migrate(srcArgs('migrate', nodes, src, toStream(dst), PREFIX, '--retry-for', '15s'));
      const took = Date.now() - started;
      const out = outputOf(res);
      const reconnects = linesOf(out, /reconnect/i);
      const naming = linesOf(out, /compress/i);
      console.log(
        `took ${took} ms, exit ${res.code}; reconnect lines ${reconnects.length}; lines naming the compression ${naming.length}: ${naming.slice(0, 2).join(' | ')}`,
      );
      const again = await migrate(
        srcArgs('migrate', nodes, src, toStream(dst), PREFIX, '--retry-for', '15s'),
      );
      console.log(
        `re-run exit ${again.code}, reconnect lines ${linesOf(outputOf(again), /reconnect/i).length}`,
      );
      const stored = await readStored(nodes.dst, dst, { idleMs: 2000 });
      const bodies = stored.map((s) => s.body.toString());
      const c = countBy(`${name} first 3`, ['body 0', 'body 1', 'body 2'], bodies);
      expect({
        exitedByItself: res.code !== null,
        failed: res.code !== 0,
        clearLine: naming.length > 0,
        spin: reconnects.length >= 3,
        duplicated: c.duplicated,
        lost: c.lost,
      }).toEqual({
        exitedByItself: true,
        failed: true,
        clearLine: true,
        spin: false,
        duplicated: 0,
        lost: 0,
      });
    });
  }

  it('3. a sub-batch whose header claims more records than it holds: no silent spin, an exit with a clear line', async () => {
    const src = 'bad-batch';
    const dst = 'bad-batch-dst';
    await createStream(nodes.src, src);
    await createStream(nodes.dst, dst);
    const batch = records(Array.from({ length: 2 }, (_, n) => streamMessage(2 + n)));
    const pub = await publishEntries(nodes.src, src, [
      ...Array.from({ length: 2 }, (_, n) => plainEntry(streamMessage(n))),
      subBatchEntry(0, 7, batch.length, batch),
      ...Array.from({ length: 2 }, (_, n) => plainEntry(streamMessage(20 + n))),
    ]);
    console.log('publish', JSON.stringify(pub));
    const started = Date.now();
    const res = await migrate(srcArgs('migrate', nodes, src, toStream(dst), PREFIX, '--retry-for', '15s'));
    const took = Date.now() - started;
    const out = outputOf(res);
    const reconnects = linesOf(out, /reconnect/i);
    console.log(
      `took ${took} ms, exit ${res.code}; reconnect lines ${reconnects.length}: ${reconnects[0] ?? ''}`,
    );
    const stored = await readStored(nodes.dst, dst, { idleMs: 2000 }).catch((e: Error) => {
      console.log('reading the target failed:', e.message);
      return [];
    });
    console.log('on the target:', stored.map((s) => s.body.toString()).join(', '));
    const bodies = stored.map((s) => s.body.toString());
    const odd = bodies.filter((b) => !/^body \d+$/.test(b));
    expect({
      exitedByItself: res.code !== null,
      spin: reconnects.length >= 3,
      oddEntriesForwarded: odd.length,
    }).toEqual({ exitedByItself: true, spin: false, oddEntriesForwarded: 0 });
  });

  it('9a. entries a 0-9-1 client published with unusual header types arrive in the queue as they were published', async () => {
    const src = 'typed-headers';
    const q = 'typed-q';
    const srcConn = await amqp.connect(nodes.source.url);
    const ch = await srcConn.createChannel();
    await ch.assertQueue(src, { durable: true, arguments: { 'x-queue-type': 'stream' } });
    await srcConn.close();
    await targetQueue(q);
    const headers: Record<string, unknown>[] = [
      { a: { '!': 'timestamp', value: 1_700_000_000 } },
      { b: { '!': 'decimal', value: { places: 2, digits: 12345 } } },
      { c: { '!': 'byte', value: -5 } },
      { d: { '!': 'short', value: -300 } },
      { e: { '!': 'float', value: 1.5 } },
      { f: { '!': 'double', value: 2.25 } },
      { g: { '!': 'int64', value: 9_007_199_254_740_991 } },
      { h: true, i: null },
      { l: Buffer.from([0, 1, 2, 255]) },
      { m: { '!': 'unsignedbyte', value: 200 } },
      { o: { '!': 'unsignedint', value: 4_000_000_000 } },
      { p: '' },
    ];
    // One connection per message, with a deadline: RabbitMQ 3.10 itself may refuse a header type
    // (INTERNAL_ERROR); only what it stored is expected on the target.
    const accepted: number[] = [];
    for (let n = 0; n < headers.length; n++) {
      const ok = await Promise.race([
        publish091(nodes.source.url, [
          {
            routingKey: src,
            body: Buffer.from(`typed ${n}`),
            options: {
              headers: headers[n],
              messageId: `t-${n}`,
              timestamp: 1_700_000_000 + n,
              priority: 3,
              type: 'kind',
              expiration: '600000',
            },
          },
        ]).then(
          () => true,
          (e: Error) => {
            console.log(`publish of typed ${n} ${JSON.stringify(headers[n])} failed: ${e.message}`);
            return false;
          },
        ),
        new Promise<boolean>((r) => setTimeout(() => r(false), 5000)),
      ]);
      if (ok) accepted.push(n);
    }
    console.log(`the source stream took ${accepted.length} of ${headers.length}: ${accepted.join(',')}`);
    const res = await migrate(srcArgs('migrate', nodes, src, toQueue(q), PREFIX, '--retry-for', '10s'));
    const got = await drainQueue(nodes.target.url, q);
    const c = countBy(
      'typed headers',
      accepted.map((n) => `typed ${n}`),
      got.map((m) => m.content.toString()),
    );
    const strip = (h: Record<string, unknown> | undefined) => {
      const out: Record<string, unknown> = {};
      for (const [k, v] of Object.entries(h ?? {}))
        if (!['_HQ_DUPL_ID', 'x-dedup-route', 'x-stream-offset', 'x-stream-chunk-timestamp'].includes(k))
          out[k] = v;
      return out;
    };
    // The reference: what was published (a typed value as its value; a 0-9-1 consumer of the source
    // stream on 3.10 cannot be used: its channel closes with INTERNAL_ERROR on these entries).
    // amqplib 2.3 decodes a timestamp or a decimal as { '!': type, value }, the other types as values.
    const plain = (v: unknown): unknown => {
      if (v && typeof v === 'object' && !Buffer.isBuffer(v) && !Array.isArray(v) && '!' in (v as object)) {
        const typed = v as { '!': string; value: unknown };
        return typed['!'] === 'timestamp' || typed['!'] === 'decimal' ? typed : typed.value;
      }
      return v;
    };
    const canon = (h: Record<string, unknown>) =>
      JSON.stringify(Object.fromEntries(Object.entries(h).sort(([x], [y]) => (x < y ? -1 : 1))));
    const differences: string[] = [];
    got.forEach((m) => {
      const n = Number(m.content.toString().replace('typed ', ''));
      const sent = headers[n] as Record<string, unknown>;
      const want: Record<string, unknown> = {};
      for (const [k, v] of Object.entries(sent)) want[k] = plain(v);
      const have = strip(m.properties.headers);
      const a = canon(want);
      const b = canon(have);
      const p = m.properties;
      const props = `${p.messageId} ${p.timestamp} ${p.priority} ${p.type} ${p.expiration}`;
      if (a !== b || props !== `t-${n} ${1_700_000_000 + n} 3 kind 600000`)
        differences.push(
          `${m.content}: published ${a} / forwarded ${b} (${Object.entries(have)
            .map(
              ([k, v]) =>
                `${k}: ${Object.prototype.toString.call(v)} ${(v as object)?.constructor?.name} ${String(v)}`,
            )
            .join('; ')}) props ${props}`,
        );
    });
    console.log(`differences ${differences.length}`);
    for (const d of differences) console.log('  ', d.slice(0, 500));
    expect({ code: res.code, lost: c.lost, duplicated: c.duplicated, differences }).toEqual({
      code: 0,
      lost: 0,
      duplicated: 0,
      differences: [],
    });
  });

  it('9b. --source-start <time> copies exactly the entries written after that time', async () => {
    const src = 'ts-src';
    const dst = 'ts-dst';
    await createStream(nodes.src, src);
    await createStream(nodes.dst, dst);
    await publishEntries(
      nodes.src,
      src,
      Array.from({ length: 10 }, (_, n) => plainEntry(streamMessage(n))),
    );
    await new Promise((r) => setTimeout(r, 2000));
    const at = new Date();
    await new Promise((r) => setTimeout(r, 1000));
    await publishEntries(
      nodes.src,
      src,
      Array.from({ length: 10 }, (_, n) => plainEntry(streamMessage(10 + n))),
    );
    const res = await migrate(
      srcArgs(
        'migrate',
        nodes,
        src,
        toStream(dst),
        PREFIX,
        '--source-start',
        at.toISOString(),
        '--retry-for',
        '10s',
      ),
    );
    const stored = await readStored(nodes.dst, dst, { idleMs: 2000 });
    const c = countBy(
      'timestamp start',
      Array.from({ length: 10 }, (_, n) => `body ${10 + n}`),
      stored.map((s) => s.body.toString()),
    );
    expect({ code: res.code, ...c }).toEqual({
      code: 0,
      expected: 10,
      got: 10,
      lost: 0,
      duplicated: 0,
      unexpected: 0,
      outOfOrder: 0,
    });
  });

  it('9c. --source-start at an offset beyond the end, then the stream grows past it: the later entries are copied, nothing refused', async () => {
    const src = 'beyond-src';
    const dst = 'beyond-dst';
    await createStream(nodes.src, src);
    await createStream(nodes.dst, dst);
    await publishEntries(
      nodes.src,
      src,
      Array.from({ length: 10 }, (_, n) => plainEntry(streamMessage(n))),
    );
    const first = await migrate(
      srcArgs('migrate', nodes, src, toStream(dst), PREFIX, '--source-start', '15', '--retry-for', '10s'),
    );
    await publishEntries(
      nodes.src,
      src,
      Array.from({ length: 10 }, (_, n) => plainEntry(streamMessage(10 + n))),
    );
    const second = await migrate(srcArgs('migrate', nodes, src, toStream(dst), PREFIX, '--retry-for', '10s'));
    const stored = await readStored(nodes.dst, dst, { idleMs: 2000 });
    const c = countBy(
      'offset beyond the end',
      Array.from({ length: 5 }, (_, n) => `body ${15 + n}`),
      stored.map((s) => s.body.toString()),
    );
    expect({ first: first.code, second: second.code, ...c }).toEqual({
      first: 0,
      second: 0,
      expected: 5,
      got: 5,
      lost: 0,
      duplicated: 0,
      unexpected: 0,
      outOfOrder: 0,
    });
  });
});
