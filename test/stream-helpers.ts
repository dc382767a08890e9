import { randomBytes } from 'node:crypto';
import amqp, { type ConsumeMessage } from 'amqplib';
import { installLosslessReader, routingBytesOf } from '../src/amqp/internals.js';
import { type Chunk, StreamClient, type StreamMessage } from '../src/stream/client.js';
import { contentHeaderOf } from '../src/wire/properties.js';

/**
 * Reading a stream the stream target wrote, for the tests: over the stream protocol (the stored
 * AMQP 1.0 bytes, read here by a decoder of the tests' own, not the bridge's encoder) and over
 * AMQP 0-9-1 (what a 0-9-1 consumer with `x-stream-offset` receives, content header byte for byte).
 */

export const DEDUP_ID = '_HQ_DUPL_ID';
const IN_DOUBT = 'x-dedup-in-doubt';

// ---- AMQP 1.0, decoded by hand ----------------------------------------------------------------

/** A stored message's sections: what the counts need (application-properties, the body). */
export interface Stored {
  offset: bigint;
  /** The stored bytes as they are. */
  raw: Buffer;
  /** Application-properties keys in order, each with its value's constructor and bytes. */
  applicationProperties: { key: string; code: number; value: Buffer }[];
  body: Buffer;
  /** `_HQ_DUPL_ID` as text (a utf8 or binary value's bytes as UTF-8), or undefined. */
  id: string | undefined;
  /** Whether `x-dedup-in-doubt` is among the application-properties (any value). */
  inDoubt: boolean;
  /** Whether any section at all names `x-dedup-in-doubt` (a stricter check than inDoubt). */
  mentionsInDoubt: boolean;
}

/** The size of the value at `at` (constructor included), by the AMQP 1.0 type system's widths. */
function valueEnd(bytes: Buffer, at: number): number {
  const code = bytes[at] as number;
  if (code === 0x00) {
    // described: a descriptor, then the value
    return valueEnd(bytes, valueEnd(bytes, at + 1));
  }
  switch (code >> 4) {
    case 0x4:
      return at + 1;
    case 0x5:
      return at + 2;
    case 0x6:
      return at + 3;
    case 0x7:
      return at + 5;
    case 0x8:
      return at + 9;
    case 0x9:
      return at + 17;
    case 0xa:
    case 0xc:
    case 0xe:
      return at + 2 + (bytes[at + 1] as number);
    case 0xb:
    case 0xd:
    case 0xf:
      return at + 5 + bytes.readUInt32BE(at + 1);
    default:
      throw new Error(`AMQP 1.0: unknown constructor 0x${code.toString(16)} at byte ${at}`);
  }
}

/** The bytes of a variable-width value (utf8, symbol, binary) without its constructor and length. */
function variableBytes(bytes: Buffer, at: number): Buffer {
  const code = bytes[at] as number;
  if (code >> 4 === 0xa) return bytes.subarray(at + 2, at + 2 + (bytes[at + 1] as number));
  if (code >> 4 === 0xb) return bytes.subarray(at + 5, at + 5 + bytes.readUInt32BE(at + 1));
  throw new Error(`AMQP 1.0: 0x${code.toString(16)} at byte ${at} is not a string or binary`);
}

/** The pairs of a map (0xc1 or 0xd1) at `at`, each as [key start, value start, value end]. */
function mapEntries(bytes: Buffer, at: number): [number, number, number][] {
  const code = bytes[at] as number;
  let count: number;
  let p: number;
  if (code === 0xc1) {
    count = bytes[at + 2] as number;
    p = at + 3;
  } else if (code === 0xd1) {
    count = bytes.readUInt32BE(at + 5);
    p = at + 9;
  } else throw new Error(`AMQP 1.0: 0x${code.toString(16)} at byte ${at} is not a map`);
  const out: [number, number, number][] = [];
  for (let i = 0; i < count; i += 2) {
    const valueAt = valueEnd(bytes, p);
    const end = valueEnd(bytes, valueAt);
    out.push([p, valueAt, end]);
    p = end;
  }
  return out;
}

/** Decodes one stored message (its sections); throws on bytes that are not AMQP 1.0 sections. */
function decodeStored(message: StreamMessage): Stored {
  const bytes = message.data;
  const applicationProperties: Stored['applicationProperties'] = [];
  let body = Buffer.alloc(0);
  let at = 0;
  while (at < bytes.length) {
    if (bytes[at] !== 0x00 || bytes[at + 1] !== 0x53) {
      throw new Error(`AMQP 1.0: no section descriptor at byte ${at} of offset ${message.offset}`);
    }
    const descriptor = bytes[at + 2] as number;
    const valueAt = at + 3;
    const end = valueEnd(bytes, valueAt);
    if (descriptor === 0x74) {
      for (const [keyAt, v] of mapEntries(bytes, valueAt)) {
        const valueBytes = bytes.subarray(v, valueEnd(bytes, v));
        applicationProperties.push({
          key: variableBytes(bytes, keyAt).toString('utf8'),
          code: bytes[v] as number,
          value: Buffer.from(valueBytes),
        });
      }
    } else if (descriptor === 0x75) {
      body = Buffer.concat([body, variableBytes(bytes, valueAt)]);
    }
    at = end;
  }
  const idEntry = applicationProperties.find((entry) => entry.key === DEDUP_ID);
  const id =
    idEntry && (idEntry.code >> 4 === 0xa || idEntry.code >> 4 === 0xb)
      ? variableBytes(idEntry.value, 0).toString('utf8')
      : idEntry
        ? `(${idEntry.value.toString('hex')})`
        : undefined;
  return {
    offset: message.offset,
    raw: bytes,
    applicationProperties,
    body,
    id,
    inDoubt: applicationProperties.some((entry) => entry.key === IN_DOUBT),
    mentionsInDoubt: bytes.includes(Buffer.from(IN_DOUBT)),
  };
}

// ---- reading a stream -------------------------------------------------------------------------

/** Every message of a stream, over the stream protocol, decoded; `count` when known, else until idle. */
export async function readStored(
  streamUrl: string,
  stream: string,
  { count, idleMs = 1500 }: { count?: number; idleMs?: number } = {},
): Promise<Stored[]> {
  const client = await StreamClient.connect({ url: streamUrl, connectionName: 'test reader' });
  try {
    const read = await client.readStream(stream, { count, idleMs });
    return read.map(decodeStored);
  } finally {
    await client.close();
  }
}

/** The last publishing ID the broker stored for a producer name on a stream (0: none). */
export async function publisherSequence(
  streamUrl: string,
  producer: string,
  stream: string,
): Promise<bigint> {
  const client = await StreamClient.connect({ url: streamUrl, connectionName: 'test query' });
  try {
    return await client.queryPublisherSequence(producer, stream);
  } finally {
    await client.close();
  }
}

export interface StreamCount {
  expected: number;
  stored: number;
  lost: number;
  /** Extra copies of an expected ID, flagged or not. */
  duplicated: number;
  /** Messages with an ID that was never sent (or none). */
  unexpected: number;
  /** Messages that carry `x-dedup-in-doubt` (first copies included): a copy of any kind. */
  flagged: number;
}

/**
 * Counts a stream's messages by `_HQ_DUPL_ID` against the IDs sent, and prints the figures. For
 * the stream target every one of lost, duplicated, unexpected and flagged must be 0.
 */
export function countStored(label: string, expectedIds: Iterable<string>, stored: Stored[]): StreamCount {
  const expected = new Set(expectedIds);
  const seen = new Map<string, number>();
  let unexpected = 0;
  for (const message of stored) {
    if (message.id === undefined || !expected.has(message.id)) {
      unexpected++;
      continue;
    }
    seen.set(message.id, (seen.get(message.id) ?? 0) + 1);
  }
  let duplicated = 0;
  for (const times of seen.values()) duplicated += times - 1;
  const count: StreamCount = {
    expected: expected.size,
    stored: stored.length,
    lost: [...expected].filter((id) => !seen.has(id)).length,
    duplicated,
    unexpected,
    flagged: stored.filter((message) => message.inDoubt || message.mentionsInDoubt).length,
  };
  process.stdout.write(
    `stream ${label}: expected ${count.expected} · stored ${count.stored} · lost ${count.lost} · duplicated ${count.duplicated} · unexpected ${count.unexpected} · flagged in-doubt ${count.flagged}\n`,
  );
  return count;
}

/** The IDs that are missing or stored more than once, for a failure message (at most 20 of each). */
export function offenders(expectedIds: Iterable<string>, stored: Stored[]): string {
  const seen = new Map<string, bigint[]>();
  for (const message of stored) {
    const key = message.id ?? '(none)';
    seen.set(key, [...(seen.get(key) ?? []), message.offset]);
  }
  const lost = [...expectedIds].filter((id) => !seen.has(id));
  const copies = [...seen].filter(([, offsets]) => offsets.length > 1);
  const flagged = stored.filter((m) => m.inDoubt || m.mentionsInDoubt).map((m) => `${m.id}@${m.offset}`);
  return JSON.stringify({
    lost: lost.slice(0, 20),
    lostCount: lost.length,
    copies: copies.slice(0, 20).map(([id, offsets]) => `${id} at offsets ${offsets.join(',')}`),
    flagged: flagged.slice(0, 20),
  });
}

// ---- over AMQP 0-9-1 ----------------------------------------------------------------------------

/** One message as a 0-9-1 consumer of a stream receives it. */
export interface Delivered091 {
  exchange: string;
  routingKey: string;
  /** The content header as delivered, byte for byte (property flags, properties, table). */
  header: Buffer;
  body: Buffer;
  /** `_HQ_DUPL_ID` as amqplib decodes it (text), for counting. */
  id: string | undefined;
  inDoubt: boolean;
  /** The `x-stream-offset` RabbitMQ adds to each delivery. */
  offset: number | undefined;
}

/**
 * Reads the first `count` messages of a stream over AMQP 0-9-1: a consumer with
 * `x-stream-offset: first`, a prefetch and manual acks, as a 0-9-1 application reads one. The
 * content headers are the raw bytes the broker sent (read through the bridge's lossless reader).
 */
export async function read091(amqpUrl: string, stream: string, count: number): Promise<Delivered091[]> {
  const model = await amqp.connect(amqpUrl);
  model.on('error', () => {});
  installLosslessReader(model);
  const out: Delivered091[] = [];
  try {
    const channel = await model.createChannel();
    await channel.prefetch(500);
    await new Promise<void>((resolve, reject) => {
      if (count === 0) {
        resolve();
        return;
      }
      let timer = setTimeout(
        () => reject(new Error(`only ${out.length} of ${count} read from ${stream}`)),
        15_000,
      );
      channel
        .consume(
          stream,
          (message: ConsumeMessage | null) => {
            if (!message) return;
            const routing = routingBytesOf(message.fields);
            const headers = message.properties.headers ?? {};
            const id = headers[DEDUP_ID];
            out.push({
              exchange: routing?.exchange.toString('latin1') ?? message.fields.exchange,
              routingKey: routing?.routingKey.toString('latin1') ?? message.fields.routingKey,
              header: Buffer.from(contentHeaderOf(message.properties).bytes),
              body: message.content,
              id: id === undefined ? undefined : Buffer.isBuffer(id) ? id.toString('utf8') : String(id),
              inDoubt: IN_DOUBT in headers,
              offset: typeof headers['x-stream-offset'] === 'number' ? headers['x-stream-offset'] : undefined,
            });
            channel.ack(message);
            clearTimeout(timer);
            if (out.length >= count) resolve();
            else
              timer = setTimeout(
                () => reject(new Error(`only ${out.length} of ${count} read from ${stream}`)),
                15_000,
              );
          },
          { arguments: { 'x-stream-offset': 'first' } },
        )
        .catch(reject);
    });
  } finally {
    await model.close().catch(() => {});
  }
  return out;
}

// ---- watching a stream grow -----------------------------------------------------------------------

/**
 * Counts a stream's messages as the broker commits them, over one subscription (from the first
 * offset) kept open for as long as a scenario runs, and samples the count every read so that a
 * moment (a kill, a log line) can be matched to how much of the transfer was on the stream then.
 * When the connection goes (the target restarting, say) it connects again and goes on from the
 * next offset, skipping what it counted already. A cheap probe: `rabbitmqctl` costs a second of CPU
 * a call, and a 0-9-1 passive declare of a stream says 0 messages on 3.10.
 */
export class StreamWatch {
  /** Messages counted (offsets 0 … count-1). */
  count = 0;
  /** Every message counted, in offset order. */
  readonly messages: StreamMessage[] = [];
  private readonly samples: { at: number; count: number }[] = [];
  private client: StreamClient | undefined;
  private stopped = false;
  private readonly loop: Promise<void>;
  private waiters: (() => void)[] = [];

  constructor(
    private readonly streamUrl: string,
    private readonly stream: string,
  ) {
    this.loop = this.run();
  }

  private async run(): Promise<void> {
    while (!this.stopped) {
      let client: StreamClient | undefined;
      try {
        client = await StreamClient.connect({
          url: this.streamUrl,
          connectionName: 'test watch',
          timeoutMs: 3000,
        });
        this.client = client;
        const open = client;
        const closed = new Promise<void>((resolve) => open.once('close', () => resolve()));
        client.on('chunk', (_id: number, chunk: Chunk) => this.onChunk(chunk));
        const from = this.count === 0 ? ('first' as const) : { offset: BigInt(this.count) };
        await client.subscribe(1, this.stream, from, 10);
        await closed;
      } catch {
        // the stream or its node is not there (yet), or not available yet after a restart: again
      }
      client?.destroy();
      this.client = undefined;
      if (!this.stopped) await new Promise((resolve) => setTimeout(resolve, 200));
    }
  }

  private onChunk(chunk: Chunk): void {
    for (const message of chunk.messages) {
      // A subscription from an offset starts at the chunk that holds it.
      if (message.offset !== BigInt(this.count)) continue;
      this.messages.push(message);
      this.count++;
    }
    this.samples.push({ at: Date.now(), count: this.count });
    for (const wake of this.waiters.splice(0)) wake();
  }

  /** Resolves true once at least `atLeast` messages are counted, false after `timeoutMs`. */
  async until(atLeast: number, timeoutMs = 120_000): Promise<boolean> {
    const deadline = Date.now() + timeoutMs;
    while (this.count < atLeast) {
      const left = deadline - Date.now();
      if (left <= 0) return false;
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, Math.min(left, 500));
        this.waiters.push(() => {
          clearTimeout(timer);
          resolve();
        });
      });
    }
    return true;
  }

  /** The count last sampled at or before `time` (ms since the epoch); 0 before the first chunk. */
  at(time: number): number {
    let found = 0;
    for (const sample of this.samples) {
      if (sample.at > time) break;
      found = sample.count;
    }
    return found;
  }

  /** The count first sampled after `time`; undefined when none was. */
  after(time: number): number | undefined {
    return this.samples.find((sample) => sample.at > time)?.count;
  }

  async stop(): Promise<void> {
    this.stopped = true;
    await this.client?.close();
    this.client?.destroy();
    await this.loop;
  }
}

// ---- writing a stream as another client would ------------------------------------------------------

function str8(code: number, text: string | Buffer): Buffer {
  const bytes = Buffer.isBuffer(text) ? text : Buffer.from(text, 'utf8');
  if (bytes.length > 255) throw new Error('short forms only here');
  return Buffer.concat([Buffer.from([code, bytes.length]), bytes]);
}
const utf8 = (text: string) => str8(0xa1, text);
const symbol = (text: string) => str8(0xa3, text);

function map8(pairs: Buffer[][]): Buffer {
  const body = Buffer.concat(pairs.flat());
  return Buffer.concat([Buffer.from([0xc1, body.length + 1, pairs.length * 2]), body]);
}

function section(descriptor: number, value: Buffer): Buffer {
  return Buffer.concat([Buffer.from([0x00, 0x53, descriptor]), value]);
}

/**
 * A message as a stream client writes it: message-id, application-properties, one data section. */
export function streamMessage(
  n: number,
  options: { messageId?: string; body?: string; symbol?: boolean } = {},
): Buffer {
  const long = Buffer.alloc(9);
  long[0] = 0x81;
  long.writeBigInt64BE(BigInt(n) * 1_000_003n, 1);
  const properties = Buffer.concat([
    Buffer.from([0xc0]),
    // list8: size, count, then message-id and the rest null
    (() => {
      const items = Buffer.concat([
        options.messageId === undefined ? Buffer.from([0x40]) : utf8(options.messageId),
        Buffer.from([0x40, 0x40, 0x40]), // user-id, to, subject
        Buffer.from([0x40, 0x40]), // reply-to, correlation-id
        symbol('text/plain'),
      ]);
      return Buffer.concat([Buffer.from([items.length + 1, 7]), items]);
    })(),
  ]);
  const applicationProperties = map8([
    [utf8('n'), utf8(String(n))],
    [utf8('big'), long],
    // A symbol value: RabbitMQ 3.10 cannot hand such a message to a 0-9-1 consumer at all.
    [utf8('kind'), options.symbol ? symbol('stream-written') : utf8('stream-written')],
  ]);
  const data = Buffer.from(options.body ?? `body ${n}`);
  return Buffer.concat([
    section(0x73, properties),
    section(0x74, applicationProperties),
    section(0x75, Buffer.concat([Buffer.from([0xb0]), u32(data.length), data])),
  ]);
}

function u32(n: number): Buffer {
  const out = Buffer.alloc(4);
  out.writeUInt32BE(n, 0);
  return out;
}

export async function createStream(url: string, name: string): Promise<void> {
  const client = await StreamClient.connect({ url, connectionName: 'test' });
  try {
    await client.create(name);
  } finally {
    await client.close();
  }
}

/** Writes messages over the stream protocol, waiting for every confirm. */
export async function writeStream(url: string, stream: string, messages: readonly Buffer[]): Promise<void> {
  const client = await StreamClient.connect({ url, connectionName: 'test writer' });
  try {
    // A name of its own per call: its publishing IDs start at 1 each time.
    await client.declarePublisher(7, `writer-${randomBytes(4).toString('hex')}`, stream);
    const confirmed = new Promise<void>((resolve) => {
      let left = messages.length;
      client.on('confirm', (_id, ids) => {
        left -= ids.length;
        if (left <= 0) resolve();
      });
    });
    for (let i = 0; i < messages.length; i += 100) {
      client.publish(
        7,
        messages.slice(i, i + 100).map((data, k) => ({ publishingId: BigInt(i + k + 1), data })),
      );
    }
    await confirmed;
  } finally {
    await client.close();
  }
}

/**
 * Writes `records` as one sub-batch entry, as the Java, .NET and Python clients' sub-entry batching
 * does: a Publish whose entry starts with 0x80 | compression << 4, the record count, the records'
 * size and the batch's. `compress` makes the batch from the records' bytes (each a u32 size and
 * the message); our client never writes this form, so the frame is built here byte by byte.
 */
export async function writeSubBatch(
  url: string,
  stream: string,
  records: readonly Buffer[],
  compression: number,
  compress: (plain: Buffer) => Buffer,
): Promise<void> {
  const client = await StreamClient.connect({ url, connectionName: 'test sub-batch writer' });
  try {
    await client.declarePublisher(9, `sub-batch-${randomBytes(4).toString('hex')}`, stream);
    const confirmed = new Promise<void>((resolve) => client.on('confirm', () => resolve()));
    const plain = Buffer.concat(records.flatMap((record) => [u32(record.length), record]));
    const batch = compress(plain);
    const entry = Buffer.alloc(11);
    entry[0] = 0x80 | (compression << 4);
    entry.writeUInt16BE(records.length, 1);
    entry.writeUInt32BE(plain.length, 3);
    entry.writeUInt32BE(batch.length, 7);
    const head = Buffer.alloc(4 + 2 + 2 + 1 + 4 + 8);
    head.writeUInt32BE(head.length - 4 + entry.length + batch.length, 0);
    head.writeUInt16BE(2, 4); // Publish
    head.writeUInt16BE(1, 6);
    head[8] = 9;
    head.writeUInt32BE(1, 9);
    head.writeBigUInt64BE(1n, 13);
    (client as unknown as { write(frame: Buffer): boolean }).write(Buffer.concat([head, entry, batch]));
    await confirmed;
  } finally {
    await client.close();
  }
}
