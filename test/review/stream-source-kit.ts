import { randomBytes } from 'node:crypto';
import { rmSync } from 'node:fs';
import amqp from 'amqplib';
import { Redis } from 'ioredis';
import { StreamClient } from '../../src/stream/client.js';
import { newRunDir, RabbitNode, RedisServer } from '../harness/servers.js';
import { type CliResult, migrateWithReport, type RunningCli } from '../helpers.js';

/**
 * Shared helpers of the stream-source review: a source node and a target node, both serving the
 * stream protocol, and a Redis of their own; a raw stream publisher (entries written byte for byte,
 * sub-batches included); a slow-line proxy.
 */
export class StreamNodes {
  runDir = '';
  source!: RabbitNode;
  target!: RabbitNode;
  redis!: RedisServer;

  async start(): Promise<void> {
    this.runDir = newRunDir();
    this.source = new RabbitNode(this.runDir, 'ssrc', { stream: true });
    this.target = new RabbitNode(this.runDir, 'stgt', { stream: true });
    this.redis = new RedisServer(this.runDir, 'sredis', false);
    await Promise.all([this.source.start(), this.target.start(), this.redis.start()]);
  }

  async stop(): Promise<void> {
    await Promise.allSettled([this.source?.stop(true), this.target?.stop(true), this.redis?.stop(true)]);
    if (this.runDir) rmSync(this.runDir, { recursive: true, force: true });
  }

  get src(): string {
    return this.source.streamUrl;
  }
  get dst(): string {
    return this.target.streamUrl;
  }
}

const u8 = (n: number) => Buffer.from([n]);
function u16(n: number): Buffer {
  const b = Buffer.alloc(2);
  b.writeUInt16BE(n);
  return b;
}
export function u32(n: number): Buffer {
  const b = Buffer.alloc(4);
  b.writeUInt32BE(n);
  return b;
}
function u64(n: bigint): Buffer {
  const b = Buffer.alloc(8);
  b.writeBigUInt64BE(n);
  return b;
}

/** A plain entry as stored: [u32 size][message]. */
export function plainEntry(message: Buffer): Buffer {
  return Buffer.concat([u32(message.length), message]);
}

/** A sub-batch entry: head, u16 records, u32 uncompressed length, u32 length, then `body`. */
export function subBatchEntry(
  compression: number,
  records: number,
  uncompressedLength: number,
  body: Buffer,
): Buffer {
  return Buffer.concat([
    u8(0x80 | (compression << 4)),
    u16(records),
    u32(uncompressedLength),
    u32(body.length),
    body,
  ]);
}

/** The concatenated [u32 size][message] records of a sub-batch, before compression. */
export function records(messages: Buffer[]): Buffer {
  return Buffer.concat(messages.map(plainEntry));
}

/**
 * Publishes entries over the stream protocol, each given as its stored bytes (a plain entry with its
 * size, or a sub-batch), one Publish frame per entry, waiting for each confirm (one entry per chunk
 * where the broker lets it). Returns the publishing IDs confirmed and any publish errors.
 */
export async function publishEntries(
  url: string,
  stream: string,
  entries: Buffer[],
): Promise<{ confirmed: number; errors: string[] }> {
  const client = await StreamClient.connect({ url, connectionName: 'review raw writer' });
  const errors: string[] = [];
  let confirmed = 0;
  try {
    await client.declarePublisher(9, `raw-${randomBytes(4).toString('hex')}`, stream);
    const raw = client as unknown as { write(frame: Buffer): boolean };
    for (let i = 0; i < entries.length; i++) {
      const entry = entries[i] as Buffer;
      const done = new Promise<void>((resolve) => {
        const timer = setTimeout(() => {
          errors.push(`entry ${i}: no confirm in 5 s`);
          resolve();
        }, 5000);
        const onConfirm = () => {
          clearTimeout(timer);
          confirmed++;
          client.off('confirm', onConfirm);
          client.off('publish-error', onError);
          resolve();
        };
        const onError = (...args: unknown[]) => {
          clearTimeout(timer);
          errors.push(
            `entry ${i}: ${JSON.stringify(args, (_k, v) => (typeof v === 'bigint' ? String(v) : v))}`,
          );
          client.off('confirm', onConfirm);
          client.off('publish-error', onError);
          resolve();
        };
        client.on('confirm', onConfirm);
        client.on('publish-error', onError);
      });
      // Publish: key 2, version 1, publisher 9, 1 message: publishing id, then the entry as stored.
      const body = Buffer.concat([u16(2), u16(1), u8(9), u32(1), u64(BigInt(i + 1)), entry]);
      raw.write(Buffer.concat([u32(body.length), body]));
      await done;
      if (!client.isOpen) {
        errors.push(`entry ${i}: connection closed`);
        break;
      }
    }
  } finally {
    await client.close().catch(() => {});
  }
  return { confirmed, errors };
}

/** 0-9-1 publish into a stream queue of `amqpUrl` (confirmed). */
export async function publish091(
  amqpUrl: string,
  messages: { exchange?: string; routingKey: string; body: Buffer; options?: amqp.Options.Publish }[],
): Promise<void> {
  const conn = await amqp.connect(amqpUrl);
  conn.on('error', () => {});
  try {
    const ch = await conn.createConfirmChannel();
    ch.on('error', () => {});
    for (const m of messages) ch.publish(m.exchange ?? '', m.routingKey, m.body, m.options ?? {});
    await ch.waitForConfirms();
  } finally {
    await conn.close().catch(() => {});
  }
}

export function scopeName(label: string): string {
  return `rv-${label}-${randomBytes(3).toString('hex')}`;
}

/** Bridge args for a stream source. */
export function srcArgs(
  command: 'run' | 'migrate',
  nodes: StreamNodes,
  stream: string,
  target: string[],
  prefix: string,
  ...extra: string[]
): string[] {
  return [
    command,
    '--source',
    nodes.src,
    '--source-stream',
    stream,
    ...target,
    '--redis',
    nodes.redis.url,
    '--redis-prefix',
    prefix,
    ...(command === 'migrate' ? ['--idle-timeout', '500ms'] : []),
    ...extra,
  ];
}

export async function migrate(
  args: string[],
): Promise<CliResult & { report: Record<string, unknown> | undefined }> {
  const r = await migrateWithReport(args);
  const out = `${r.stdout}\n${r.stderr}`;
  const tail = out
    .split('\n')
    .filter((l) => /error|warn|fatal|forwarded|cannot|refus|unreadable|stopped|exit|held|offset/i.test(l))
    .slice(-8)
    .map((l) => l.slice(0, 400));
  console.log(`migrate exit ${r.code}; report ${JSON.stringify(r.report)}\n  ${tail.join('\n  ')}`);
  return r;
}

export function linesOf(text: string, pattern: RegExp): string[] {
  return text
    .split('\n')
    .filter((l) => pattern.test(l))
    .map((l) => l.slice(0, 400));
}

export function outputOf(cli: RunningCli | CliResult): string {
  return 'output' in cli ? cli.output() : `${cli.stdout}\n${cli.stderr}`;
}

/** Counts by key: lost, duplicated, unexpected; prints the figures. */
export function countBy(label: string, expected: readonly string[], got: readonly string[]) {
  const want = new Set(expected);
  const seen = new Map<string, number>();
  for (const k of got) seen.set(k, (seen.get(k) ?? 0) + 1);
  let duplicated = 0;
  let unexpected = 0;
  for (const [k, n] of seen) {
    if (!want.has(k)) unexpected += n;
    else duplicated += n - 1;
  }
  const lost = [...want].filter((k) => !seen.has(k)).length;
  let outOfOrder = 0;
  const firstIdx = got.filter((k, i) => got.indexOf(k) === i && want.has(k));
  const order = expected.filter((k) => seen.has(k));
  for (let i = 0; i < firstIdx.length; i++) if (firstIdx[i] !== order[i]) outOfOrder++;
  const c = { expected: want.size, got: got.length, lost, duplicated, unexpected, outOfOrder };
  console.log(
    `count ${label}: expected ${c.expected} · got ${c.got} · lost ${lost} · duplicated ${duplicated} · unexpected ${unexpected} · out of order ${outOfOrder}`,
  );
  return c;
}

/** Reads a queue of `amqpUrl` (get, ack) until empty. */
export async function drainQueue(amqpUrl: string, queue: string): Promise<amqp.GetMessage[]> {
  const conn = await amqp.connect(amqpUrl);
  const ch = await conn.createChannel();
  const out: amqp.GetMessage[] = [];
  for (;;) {
    const m = await ch.get(queue, { noAck: true });
    if (!m) break;
    out.push(m);
  }
  await conn.close();
  return out;
}

export async function redisKeys(url: string, pattern: string): Promise<string[]> {
  const r = new Redis(url);
  try {
    return await r.keys(pattern);
  } finally {
    r.disconnect();
  }
}

export async function redisDel(url: string, keys: string[]): Promise<void> {
  if (keys.length === 0) return;
  const r = new Redis(url);
  try {
    await r.del(...keys);
  } finally {
    r.disconnect();
  }
}

export async function redisGet(url: string, key: string): Promise<string | null> {
  const r = new Redis(url);
  try {
    return await r.get(key);
  } finally {
    r.disconnect();
  }
}
