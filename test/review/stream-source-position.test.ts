import amqp from 'amqplib';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startCli } from '../helpers.js';
import { createStream, readStored, streamMessage, writeStream } from '../stream-helpers.js';
import {
  countBy,
  drainQueue,
  linesOf,
  migrate,
  outputOf,
  publish091,
  redisDel,
  redisGet,
  redisKeys,
  StreamNodes,
  scopeName,
  srcArgs,
} from './stream-source-kit.js';

// Attacks on the route's read position: a held entry pinning it past the dedup window,
// --max-messages in the middle of a chunk, two bridges on one route.

const nodes = new StreamNodes();
beforeAll(() => nodes.start(), 180_000);
afterAll(() => nodes.stop());

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function queueDepth(url: string, queue: string): Promise<number> {
  const conn = await amqp.connect(url);
  const ch = await conn.createChannel();
  const q = await ch.checkQueue(queue);
  await conn.close();
  return q.messageCount;
}

describe('stream source: the position', () => {
  it('4. one entry held (unroutable) pins the position; once the dedup records of the 500 later entries expire, a re-run forwards them again', async () => {
    const prefix = scopeName('hold');
    const src = 'hold-src';
    const sconn = await amqp.connect(nodes.source.url);
    const sch = await sconn.createChannel();
    await sch.assertQueue(src, { durable: true, arguments: { 'x-queue-type': 'stream' } });
    await sch.assertExchange('src-x', 'direct', { durable: true });
    await sch.bindQueue(src, 'src-x', 'good');
    await sch.bindQueue(src, 'src-x', 'bad');
    await sconn.close();
    const tconn = await amqp.connect(nodes.target.url);
    const tch = await tconn.createChannel();
    await tch.assertExchange('tx', 'direct', { durable: true });
    await tch.assertQueue('hold-q', { durable: true });
    await tch.bindQueue('hold-q', 'tx', 'good');
    await tconn.close();
    await publish091(nodes.source.url, [
      { exchange: 'src-x', routingKey: 'bad', body: Buffer.from('h 0') },
      ...Array.from({ length: 500 }, (_, n) => ({
        exchange: 'src-x',
        routingKey: 'good',
        body: Buffer.from(`h ${n + 1}`),
      })),
    ]);
    const args = srcArgs(
      'run',
      nodes,
      src,
      ['--target', nodes.target.url, '--target-exchange', 'tx'],
      prefix,
    );
    const first = startCli(args);
    for (let i = 0; i < 120 && (await queueDepth(nodes.target.url, 'hold-q')) < 500; i++) await sleep(250);
    await sleep(3000);
    first.signal('SIGTERM');
    const r1 = await first.done;
    console.log(
      `first run exit ${r1.code}; unroutable lines ${linesOf(outputOf(r1), /unroutable|could not be forwarded/i).length}`,
    );
    const keys = await redisKeys(nodes.redis.url, `${prefix}:*`);
    const position = keys.find((k) => k.includes(':position:'));
    console.log(
      `keys ${keys.length}: ${keys.slice(0, 6).join(' ')}; position ${position} = ${position ? await redisGet(nodes.redis.url, position) : ''}`,
    );
    // The dedup window passes: every dedup record goes, the position stays (it has no expiry).
    const records = keys.filter((k) => !k.includes(':position:') && !k.endsWith(':layout'));
    await redisDel(nodes.redis.url, records);
    console.log(`deleted ${records.length} dedup keys`);
    const b = await amqp.connect(nodes.target.url);
    const bch = await b.createChannel();
    await bch.bindQueue('hold-q', 'tx', 'bad');
    await b.close();
    const second = startCli(args);
    let last = -1;
    for (let i = 0; i < 60; i++) {
      await sleep(500);
      const d = await queueDepth(nodes.target.url, 'hold-q');
      if (d === last && d >= 501) break;
      last = d;
    }
    await sleep(2000);
    second.signal('SIGTERM');
    await second.done;
    const got = await drainQueue(nodes.target.url, 'hold-q');
    const want = Array.from({ length: 501 }, (_, n) => `h ${n}`);
    const c = countBy(
      'held entry pins the position',
      want,
      got.map((m) => m.content.toString()),
    );
    const flagged = got.filter((m) => m.properties.headers?.['x-dedup-in-doubt'] !== undefined).length;
    console.log(`forwarded twice: ${c.duplicated} of 500; copies flagged in-doubt: ${flagged}`);
    expect({ lost: c.lost, duplicated: c.duplicated }).toEqual({ lost: 0, duplicated: 0 });
  });

  it('5. --max-messages N in the middle of a chunk: exactly N, then a re-run copies the rest, none twice', async () => {
    const prefix = scopeName('max');
    const src = 'max-src';
    const dst = 'max-dst';
    await createStream(nodes.src, src);
    await createStream(nodes.dst, dst);
    // 100 per Publish frame: the broker writes them in few chunks.
    await writeStream(
      nodes.src,
      src,
      Array.from({ length: 300 }, (_, n) => streamMessage(n)),
    );
    const to = ['--target', nodes.dst, '--target-stream', dst];
    const first = await migrate(srcArgs('migrate', nodes, src, to, prefix, '--max-messages', '37'));
    const afterFirst = await readStored(nodes.dst, dst, { idleMs: 1500 });
    console.log(`after --max-messages 37: ${afterFirst.length} on the target`);
    const second = await migrate(srcArgs('migrate', nodes, src, to, prefix, '--max-messages', '101'));
    const afterSecond = await readStored(nodes.dst, dst, { idleMs: 1500 });
    console.log(`after --max-messages 101: ${afterSecond.length} on the target`);
    const third = await migrate(srcArgs('migrate', nodes, src, to, prefix));
    const stored = await readStored(nodes.dst, dst, { idleMs: 2000 });
    const c = countBy(
      'max-messages',
      Array.from({ length: 300 }, (_, n) => `body ${n}`),
      stored.map((s) => s.body.toString()),
    );
    expect({
      codes: [first.code, second.code, third.code],
      afterFirst: afterFirst.length,
      afterSecond: afterSecond.length,
      ...c,
    }).toEqual({
      codes: [4, 4, 0],
      afterFirst: 37,
      afterSecond: 138,
      expected: 300,
      got: 300,
      lost: 0,
      duplicated: 0,
      unexpected: 0,
      outOfOrder: 0,
    });
  });

  it('8. the same route run twice at once (stream to stream, one scope): every entry once', async () => {
    const prefix = scopeName('twice');
    const src = 'twice-src';
    const dst = 'twice-dst';
    await createStream(nodes.src, src);
    await createStream(nodes.dst, dst);
    const N = 3000;
    await writeStream(
      nodes.src,
      src,
      Array.from({ length: N / 2 }, (_, n) => streamMessage(n)),
    );
    const to = ['--target', nodes.dst, '--target-stream', dst];
    const a = startCli(srcArgs('run', nodes, src, to, prefix, '--lease', '3s'));
    const b = startCli(srcArgs('run', nodes, src, to, prefix, '--lease', '3s'));
    await sleep(1500);
    await writeStream(
      nodes.src,
      src,
      Array.from({ length: N / 2 }, (_, n) => streamMessage(N / 2 + n)),
    );
    // B is killed mid-way and started again, A runs on.
    await sleep(1000);
    b.signal('SIGKILL');
    await b.done;
    const b2 = startCli(srcArgs('run', nodes, src, to, prefix, '--lease', '3s'));
    let stored = await readStored(nodes.dst, dst, { idleMs: 1500 });
    for (let i = 0; i < 40 && stored.length < N; i++) {
      await sleep(1000);
      stored = await readStored(nodes.dst, dst, { idleMs: 1500 });
    }
    await sleep(5000);
    a.signal('SIGTERM');
    b2.signal('SIGTERM');
    const [ra, rb] = await Promise.all([a.done, b2.done]);
    for (const l of linesOf(outputOf(ra), /standby|taken|owner|fenc/i).slice(0, 4)) console.log('A>', l);
    for (const l of linesOf(outputOf(rb), /standby|taken|owner|fenc/i).slice(0, 4)) console.log('B>', l);
    stored = await readStored(nodes.dst, dst, { idleMs: 2000 });
    const c = countBy(
      'two bridges on one route',
      Array.from({ length: N }, (_, n) => `body ${n}`),
      stored.map((s) => s.body.toString()),
    );
    const flagged = stored.filter((s) => s.inDoubt || s.mentionsInDoubt).length;
    console.log(`flagged ${flagged}`);
    expect({ ...c, flagged }).toEqual({
      expected: N,
      got: N,
      lost: 0,
      duplicated: 0,
      unexpected: 0,
      outOfOrder: 0,
      flagged: 0,
    });
  });
});
