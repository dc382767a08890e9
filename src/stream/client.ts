import { EventEmitter } from 'node:events';
import { connect as netConnect, type Socket } from 'node:net';
import { type ConnectionOptions, connect as tlsConnect } from 'node:tls';
import zlib from 'node:zlib';
import { parseStreamUrl, type StreamEndpoint } from '../config/stream-url.js';

/**
 * A minimal client of RabbitMQ's stream protocol (deps/rabbitmq_stream/docs/PROTOCOL.adoc), our
 * own, over node:net or node:tls. It does what the stream target needs and nothing more: connect
 * and authenticate (PLAIN), create and delete streams, declare named publishers, publish with
 * publishing IDs and learn each ID's confirm or error, query a publisher's last stored ID, read
 * a stream back (for tests and checks), and close.
 *
 * Why not rabbitmq-stream-js-client 1.0.0: it sends ExchangeCommandVersions at connect, a command
 * RabbitMQ 3.9/3.10 does not know, and those brokers close the connection over it; and its AMQP
 * 1.0 message encoder is lossy (numbers as 32-bit ints, 0, "" and false as null, no booleans,
 * tables or arrays). This client sends only commands every broker since 3.9 knows, each at
 * version 1 (which 3.11+ still answer at version 1), so 3.10 and 3.13/4.x both serve it; messages
 * are bytes the caller encodes (see amqp10.ts).
 *
 * Every response code but OK becomes a StreamResponseError naming the code; a password never
 * appears in an error's text.
 */

// ---- protocol constants ---------------------------------------------------------------------

export const Command = {
  DeclarePublisher: 0x0001,
  Publish: 0x0002,
  PublishConfirm: 0x0003,
  PublishError: 0x0004,
  QueryPublisherSequence: 0x0005,
  DeletePublisher: 0x0006,
  Subscribe: 0x0007,
  Deliver: 0x0008,
  Credit: 0x0009,
  StoreOffset: 0x000a,
  QueryOffset: 0x000b,
  Unsubscribe: 0x000c,
  Create: 0x000d,
  Delete: 0x000e,
  Metadata: 0x000f,
  MetadataUpdate: 0x0010,
  PeerProperties: 0x0011,
  SaslHandshake: 0x0012,
  SaslAuthenticate: 0x0013,
  Tune: 0x0014,
  Open: 0x0015,
  Close: 0x0016,
  Heartbeat: 0x0017,
} as const;

const RESPONSE = 0x8000;

/** The stream protocol's response codes, by number. */
const RESPONSE_CODES: Readonly<Record<number, string>> = {
  1: 'OK',
  2: 'STREAM_DOES_NOT_EXIST',
  3: 'SUBSCRIPTION_ID_ALREADY_EXISTS',
  4: 'SUBSCRIPTION_ID_DOES_NOT_EXIST',
  5: 'STREAM_ALREADY_EXISTS',
  6: 'STREAM_NOT_AVAILABLE',
  7: 'SASL_MECHANISM_NOT_SUPPORTED',
  8: 'AUTHENTICATION_FAILURE',
  9: 'SASL_ERROR',
  10: 'SASL_CHALLENGE',
  11: 'SASL_AUTHENTICATION_FAILURE_LOOPBACK',
  12: 'VIRTUAL_HOST_ACCESS_FAILURE',
  13: 'UNKNOWN_FRAME',
  14: 'FRAME_TOO_LARGE',
  15: 'INTERNAL_ERROR',
  16: 'ACCESS_REFUSED',
  17: 'PRECONDITION_FAILED',
  18: 'PUBLISHER_DOES_NOT_EXIST',
  19: 'NO_OFFSET',
};

const OK = 0x01;
const AUTHENTICATION_FAILURE = 0x08;
const SASL_AUTHENTICATION_FAILURE_LOOPBACK = 0x0b;

/** A code's name; one the table does not know is named by its number. */
function codeName(code: number): string {
  return RESPONSE_CODES[code] ?? `UNKNOWN_CODE_0x${code.toString(16).padStart(2, '0')}`;
}

// ---- errors ----------------------------------------------------------------------------------

class StreamError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
  }
}

/** The broker answered a request with a code other than OK. */
export class StreamResponseError extends StreamError {
  readonly codeName: string;
  constructor(
    readonly command: string,
    readonly code: number,
    detail: string,
  ) {
    super(
      `stream ${command}${detail ? ` ${detail}` : ''} failed: ${codeName(code)} (0x${code.toString(16)})`,
    );
    this.codeName = codeName(code);
  }
}

/** The broker refused our user name and password (or the mechanism). */
export class StreamAuthenticationError extends StreamResponseError {}

/**
 * The connection is gone (closed by either side, cut, timed out); what was pending is lost. `code`
 * is the socket's error code when a socket error ended it (ECONNREFUSED, a TLS certificate's …).
 */
class StreamConnectionClosedError extends StreamError {
  readonly code: string | undefined;
  constructor(message: string, cause?: unknown) {
    super(message, cause === undefined ? undefined : { cause });
    const code = (cause as { code?: unknown } | undefined)?.code;
    this.code = typeof code === 'string' ? code : undefined;
  }
}

/** A request got no answer in time. */
class StreamTimeoutError extends StreamError {}

/** A message or frame that the protocol cannot carry (too large for the negotiated frame max). */
export class StreamFrameError extends StreamError {}

// ---- byte writing and reading ----------------------------------------------------------------

class Writer {
  private buf: Buffer;
  private at = 4; // the frame's size goes in front

  constructor(size = 256) {
    this.buf = Buffer.allocUnsafe(size);
  }

  private room(n: number): void {
    if (this.at + n <= this.buf.length) return;
    const next = Buffer.allocUnsafe(Math.max(this.buf.length * 2, this.at + n));
    this.buf.copy(next, 0, 0, this.at);
    this.buf = next;
  }

  u8(v: number): this {
    this.room(1);
    this.at = this.buf.writeUInt8(v, this.at);
    return this;
  }
  u16(v: number): this {
    this.room(2);
    this.at = this.buf.writeUInt16BE(v, this.at);
    return this;
  }
  i16(v: number): this {
    this.room(2);
    this.at = this.buf.writeInt16BE(v, this.at);
    return this;
  }
  u32(v: number): this {
    this.room(4);
    this.at = this.buf.writeUInt32BE(v, this.at);
    return this;
  }
  i32(v: number): this {
    this.room(4);
    this.at = this.buf.writeInt32BE(v, this.at);
    return this;
  }
  u64(v: bigint): this {
    this.room(8);
    this.at = this.buf.writeBigUInt64BE(v, this.at);
    return this;
  }
  i64(v: bigint): this {
    this.room(8);
    this.at = this.buf.writeBigInt64BE(v, this.at);
    return this;
  }
  raw(bytes: Uint8Array): this {
    this.room(bytes.length);
    this.buf.set(bytes, this.at);
    this.at += bytes.length;
    return this;
  }
  /** A protocol string: int16 length and UTF-8 bytes; null is length -1. */
  string(v: string | null): this {
    if (v === null) return this.i16(-1);
    const bytes = Buffer.from(v, 'utf8');
    if (bytes.length > 0x7fff)
      throw new StreamFrameError(`a string of ${bytes.length} bytes (32767 at most)`);
    return this.i16(bytes.length).raw(bytes);
  }
  /** Protocol bytes: int32 length and the bytes; null is length -1. */
  bytes(v: Uint8Array | null): this {
    if (v === null) return this.i32(-1);
    return this.i32(v.length).raw(v);
  }
  map(entries: Record<string, string>): this {
    const pairs = Object.entries(entries);
    this.i32(pairs.length);
    for (const [key, value] of pairs) this.string(key).string(value);
    return this;
  }
  get size(): number {
    return this.at - 4;
  }
  /** The frame: its size (without the size field) in front. */
  frame(): Buffer {
    this.buf.writeUInt32BE(this.at - 4, 0);
    return this.buf.subarray(0, this.at);
  }
}

function request(key: number, correlationId?: number): Writer {
  const w = new Writer().u16(key).u16(1);
  if (correlationId !== undefined) w.u32(correlationId);
  return w;
}

/** Reads a frame's body; any read past its end is a FrameTruncated error. */
export class Reader {
  at: number;
  constructor(
    readonly buf: Buffer,
    at = 0,
    readonly end = buf.length,
  ) {
    this.at = at;
  }
  private need(n: number): number {
    const at = this.at;
    if (at + n > this.end) throw new StreamFrameError(`frame truncated at byte ${at} (needs ${n} more)`);
    this.at = at + n;
    return at;
  }
  u8(): number {
    return this.buf.readUInt8(this.need(1));
  }
  u16(): number {
    return this.buf.readUInt16BE(this.need(2));
  }
  i16(): number {
    return this.buf.readInt16BE(this.need(2));
  }
  u32(): number {
    return this.buf.readUInt32BE(this.need(4));
  }
  i32(): number {
    return this.buf.readInt32BE(this.need(4));
  }
  u64(): bigint {
    return this.buf.readBigUInt64BE(this.need(8));
  }
  i64(): bigint {
    return this.buf.readBigInt64BE(this.need(8));
  }
  slice(n: number): Buffer {
    const at = this.need(n);
    return this.buf.subarray(at, at + n);
  }
  string(): string | null {
    const n = this.i16();
    return n < 0 ? null : this.slice(n).toString('utf8');
  }
  bytes(): Buffer | null {
    const n = this.i32();
    return n < 0 ? null : this.slice(n);
  }
  map(): Record<string, string> {
    const out: Record<string, string> = {};
    const count = this.i32();
    for (let i = 0; i < count; i++) {
      const key = this.string() ?? '';
      out[key] = this.string() ?? '';
    }
    return out;
  }
  get remaining(): number {
    return this.end - this.at;
  }
}

// ---- chunks (Deliver) ------------------------------------------------------------------------

/** One message read from a stream, with its offset. */
export interface StreamMessage {
  offset: bigint;
  /** The stored message bytes (AMQP 1.0 sections, for messages RabbitMQ or amqp10.ts wrote). */
  data: Buffer;
  /** Why this offset's message cannot be read (its data is then empty). */
  unreadable?: string;
}

export interface Chunk {
  chunkType: number;
  firstOffset: bigint;
  timestamp: bigint;
  epoch: bigint;
  numEntries: number;
  numRecords: number;
  messages: StreamMessage[];
}

const CHUNK_USER = 0;

/**
 * Parses the osiris chunk of a Deliver (from its magic/version octet to the frame's end). A
 * filter's bloom between the header and the data (brokers with stream filtering) is skipped, and
 * so is the trailer after the data when the broker sends it.
 */
export function parseChunk(r: Reader): Chunk {
  const magicVersion = r.u8();
  if (magicVersion >> 4 !== 5) throw new StreamFrameError(`chunk magic 0x${magicVersion.toString(16)}`);
  const chunkType = r.u8();
  const numEntries = r.u16();
  const numRecords = r.u32();
  const timestamp = r.i64();
  const epoch = r.u64();
  const firstOffset = r.u64();
  r.i32(); // crc
  const dataLength = r.u32();
  const trailerLength = r.u32();
  const bloomSize = r.u8(); // 0 on brokers before stream filtering (3.13)
  r.slice(3); // reserved
  // What follows: maybe a bloom filter, then the data, then maybe the trailer (3.10 leaves it out).
  const rest = r.end - r.at;
  const fits = (skip: number) => rest === skip + dataLength || rest === skip + dataLength + trailerLength;
  const skip = bloomSize > 0 && fits(bloomSize) ? bloomSize : fits(0) ? 0 : -1;
  if (skip < 0) {
    throw new StreamFrameError(
      `chunk of ${rest} bytes after its header, for data ${dataLength}, trailer ${trailerLength}, filter ${bloomSize}`,
    );
  }
  r.slice(skip);
  const dataEnd = r.at + dataLength;
  const messages =
    chunkType === CHUNK_USER
      ? readEntries(new Reader(r.buf, r.at, dataEnd), firstOffset, numEntries, numRecords)
      : [];
  r.at = r.end;
  return { chunkType, firstOffset, timestamp, epoch, numEntries, numRecords, messages };
}

const COMPRESSION = ['none', 'gzip', 'snappy', 'lz4', 'zstd'];
// Node 23.8+ has zstd; typed here until @types/node is.
const zstd = (zlib as unknown as { zstdDecompressSync?: typeof zlib.gunzipSync }).zstdDecompressSync;

/**
 * A chunk's entries. A plain entry is one message; a sub-batch (a client's sub-entry batching, as
 * the Java, .NET and Python clients write it) holds several, maybe compressed. What cannot be read
 * is no fault of the connection: each offset it occupies comes out as an unreadable message that
 * names why, so the reader holds it and reads the rest; failing the frame would read the same
 * chunk again after every reconnect, for ever.
 */
function readEntries(
  data: Reader,
  firstOffset: bigint,
  numEntries: number,
  numRecords: number,
): StreamMessage[] {
  const out: StreamMessage[] = [];
  const end = firstOffset + BigInt(numRecords);
  let offset = firstOffset;
  const unreadable = (count: bigint, why: string) => {
    for (const stop = offset + count; offset < stop && offset < end; offset++) {
      out.push({ offset, data: Buffer.alloc(0), unreadable: why });
    }
  };
  try {
    for (let entry = 0; entry < numEntries && offset < end; entry++) {
      const head = data.u8();
      if ((head & 0x80) === 0) {
        data.at -= 1;
        const size = data.u32();
        out.push({ offset: offset++, data: Buffer.from(data.slice(size)) });
        continue;
      }
      const compression = (head & 0x70) >> 4;
      const records = data.u16();
      const uncompressed = data.u32();
      const length = data.u32();
      const batch = data.slice(length);
      let plain: Buffer;
      try {
        plain = decompress(compression, batch, uncompressed);
      } catch (error) {
        unreadable(BigInt(records), (error as Error).message);
        continue;
      }
      const body = new Reader(plain, 0, plain.length);
      for (let i = 0; i < records; i++) {
        // Records past the chunk's count would take the next chunk's offsets.
        if (offset >= end) break;
        if (body.end - body.at < 4 || body.end - body.at - 4 < plain.readUInt32BE(body.at)) {
          unreadable(BigInt(records - i), `a sub-batch of ${records} messages whose bytes end after ${i}`);
          break;
        }
        out.push({ offset: offset++, data: Buffer.from(body.slice(body.u32())) });
      }
    }
  } catch {
    // The entries run past the chunk's data: what is left of its offsets cannot be told apart.
  }
  unreadable(end - offset, `the chunk at offset ${firstOffset} ends before its ${numRecords} messages do`);
  return out;
}

/** A sub-batch's bytes, uncompressed: gzip and zstd; snappy and lz4 have no codec in Node. */
function decompress(compression: number, batch: Buffer, uncompressed: number): Buffer {
  const name = COMPRESSION[compression] ?? `type ${compression}`;
  // The stated size bounds the output: a batch that inflates past it is not what was written.
  const limit = { maxOutputLength: Math.max(uncompressed, 1) };
  try {
    if (compression === 0) return batch;
    if (compression === 1) return zlib.gunzipSync(batch, limit);
    if (compression === 4 && zstd) return zstd(batch, limit);
  } catch (error) {
    throw new Error(
      `a sub-batch compressed with ${name} that does not decompress: ${(error as Error).message}`,
    );
  }
  throw new Error(
    `a sub-batch compressed with ${name}, which this bridge cannot read (it reads gzip, and zstd on Node 22.15 or later); have the producer use one of those, or none`,
  );
}

// ---- the client ------------------------------------------------------------------------------

export type OffsetSpec =
  | 'first'
  | 'last'
  | 'next'
  | { offset: bigint }
  /** Milliseconds since the epoch. */
  | { timestamp: bigint };

export interface PublishedMessage {
  publishingId: bigint;
  data: Uint8Array;
}

export interface PublishErrorEntry {
  publishingId: bigint;
  code: number;
  codeName: string;
}

interface Broker {
  reference: number;
  host: string;
  port: number;
}

export interface StreamMetadata {
  stream: string;
  code: number;
  codeName: string;
  leader: Broker | undefined;
  replicas: Broker[];
}

export interface StreamConnectOptions {
  /** A rabbitmq-stream:// or rabbitmq-stream+tls:// URL, or its parts. */
  url: string | StreamEndpoint;
  /** More tls.connect options (CA, client certificate) for a TLS URL. */
  tls?: ConnectionOptions;
  /** Our frame max (0: take the broker's); the smaller of ours and the broker's is used. */
  frameMax?: number;
  /** Our heartbeat in seconds (0: take the broker's); the smaller non-zero one is used. */
  heartbeat?: number;
  /** A request's time to answer, ms (default 10 s); connecting as a whole has the same budget. */
  timeoutMs?: number;
  /** Shown to the broker as connection_name. */
  connectionName?: string;
}

interface Pending {
  command: string;
  detail: string;
  parse: (r: Reader) => unknown;
  resolve: (value: unknown) => void;
  reject: (error: Error) => void;
  timer: NodeJS.Timeout;
}

export interface StreamClientEvents {
  /** Publishing IDs the broker confirmed (stored, or dropped as at or below the last stored ID). */
  confirm: [publisherId: number, publishingIds: bigint[]];
  /** Publishing IDs the broker refused, each with its code. */
  'publish-error': [publisherId: number, errors: PublishErrorEntry[]];
  /** A chunk for a subscription (credit is renewed by the client after each one). */
  chunk: [subscriptionId: number, chunk: Chunk];
  /** The broker says something changed on a stream (e.g. it was deleted); the publisher is gone. */
  'metadata-update': [stream: string, code: number];
  /** The connection ended; `error` says why unless we closed it. */
  close: [error: Error | undefined];
}

const DEFAULT_TIMEOUT_MS = 10_000;

export class StreamClient extends EventEmitter<StreamClientEvents> {
  /** The broker's peer properties (product, version, ...). */
  serverProperties: Record<string, string> = {};
  /** What Open answered (e.g. advertised_host, advertised_port). */
  connectionProperties: Record<string, string> = {};
  frameMax = 0;
  heartbeat = 0;
  readonly endpoint: StreamEndpoint;

  private socket!: Socket;
  private rest: Buffer = Buffer.alloc(0);
  private nextCorrelation = 1;
  private readonly pending = new Map<number, Pending>();
  private closed: Error | undefined | null = null; // null: open
  private closing = false;
  private lastReceived = Date.now();
  private heartbeatTimer: NodeJS.Timeout | undefined;
  private tuned: ((tune: { frameMax: number; heartbeat: number }) => void) | undefined;
  private readonly timeoutMs: number;
  private readonly subscriptions = new Set<number>();
  /** Subscriptions whose credit the caller grants (see subscribe's `manualCredit`). */
  private readonly manual = new Set<number>();

  private constructor(
    endpoint: StreamEndpoint,
    private readonly options: StreamConnectOptions,
  ) {
    super();
    this.endpoint = endpoint;
    this.timeoutMs = options.timeoutMs ?? DEFAULT_TIMEOUT_MS;
  }

  /** The broker's version as it says (its `version` peer property), e.g. "3.10.8". */
  get serverVersion(): string | undefined {
    return this.serverProperties.version;
  }

  /** `user@host:port/vhost`, never the password. */
  get where(): string {
    const { username, host, port, vhost } = this.endpoint;
    return `${username}@${host}:${port}/${encodeURIComponent(vhost)}`;
  }

  static async connect(options: StreamConnectOptions): Promise<StreamClient> {
    const endpoint = typeof options.url === 'string' ? parseStreamUrl(options.url) : options.url;
    const client = new StreamClient(endpoint, options);
    await client.open();
    return client;
  }

  private async open(): Promise<void> {
    const { host, port, tls } = this.endpoint;
    const deadline = setTimeout(
      () => this.fail(new StreamTimeoutError(`stream connect to ${this.where} timed out`)),
      this.timeoutMs,
    );
    try {
      await new Promise<void>((resolve, reject) => {
        const onError = (error: Error) =>
          reject(new StreamConnectionClosedError(`stream connect to ${this.where}: ${error.message}`, error));
        this.socket = tls
          ? tlsConnect(
              { host, port, servername: isIp(host) ? undefined : host, ...this.options.tls },
              resolve,
            )
          : netConnect({ host, port }, resolve);
        this.socket.once('error', onError);
        // Over TLS, 'connect' is the TCP connection: the handshake (and its certificate errors)
        // comes after it, so the error handler stays until 'secureConnect'.
        this.socket.once(tls ? 'secureConnect' : 'connect', () => this.socket.off('error', onError));
      });
      this.socket.setNoDelay(true);
      this.socket.on('data', (data: Buffer) => this.onData(data));
      this.socket.on('error', (error) =>
        this.fail(
          new StreamConnectionClosedError(`stream connection to ${this.where}: ${error.message}`, error),
        ),
      );
      this.socket.on('close', () =>
        this.fail(new StreamConnectionClosedError(`stream connection to ${this.where} closed`)),
      );
      await this.handshake();
    } catch (error) {
      this.fail(error instanceof Error ? error : new Error(String(error)));
      throw error;
    } finally {
      clearTimeout(deadline);
    }
  }

  private async handshake(): Promise<void> {
    const properties: Record<string, string> = {
      product: 'dedup-bridge',
      platform: `Node.js ${process.version}`,
      copyright: '',
      information: 'https://github.com/dedup-bridge',
      version: '0.1.0',
    };
    if (this.options.connectionName) properties.connection_name = this.options.connectionName;
    this.serverProperties = (await this.call('PeerProperties', (id) =>
      request(Command.PeerProperties, id).map(properties),
    )) as Record<string, string>;
    const mechanisms = (await this.call('SaslHandshake', (id) =>
      request(Command.SaslHandshake, id),
    )) as string[];
    if (!mechanisms.includes('PLAIN')) {
      throw new StreamAuthenticationError(
        'SaslHandshake',
        0x07,
        `(the broker offers ${mechanisms.join(', ')})`,
      );
    }
    const tune = new Promise<{ frameMax: number; heartbeat: number }>((resolve) => {
      this.tuned = resolve;
    });
    const { username, password } = this.endpoint;
    const opaque = Buffer.concat([
      Buffer.from([0]),
      Buffer.from(username, 'utf8'),
      Buffer.from([0]),
      Buffer.from(password, 'utf8'),
    ]);
    await this.call('SaslAuthenticate', (id) =>
      request(Command.SaslAuthenticate, id).string('PLAIN').bytes(opaque),
    );
    opaque.fill(0);
    const offered = await this.within(tune, 'Tune');
    this.frameMax = pick(this.options.frameMax ?? 0, offered.frameMax);
    this.heartbeat = pick(this.options.heartbeat ?? 0, offered.heartbeat);
    this.write(new Writer().u16(Command.Tune).u16(1).u32(this.frameMax).u32(this.heartbeat).frame());
    this.startHeartbeats();
    this.connectionProperties = (await this.call('Open', (id) =>
      request(Command.Open, id).string(this.endpoint.vhost),
    )) as Record<string, string>;
  }

  private within<T>(promise: Promise<T>, what: string): Promise<T> {
    return new Promise<T>((resolve, reject) => {
      const timer = setTimeout(
        () =>
          reject(
            new StreamTimeoutError(`stream ${what} from ${this.where}: no answer in ${this.timeoutMs} ms`),
          ),
        this.timeoutMs,
      );
      promise.then(
        (value) => {
          clearTimeout(timer);
          resolve(value);
        },
        (error) => {
          clearTimeout(timer);
          reject(error);
        },
      );
    });
  }

  private startHeartbeats(): void {
    if (this.heartbeat === 0) return;
    const period = (this.heartbeat * 1000) / 2;
    this.heartbeatTimer = setInterval(() => {
      if (Date.now() - this.lastReceived > this.heartbeat * 2000) {
        this.fail(
          new StreamConnectionClosedError(`stream connection to ${this.where}: no heartbeat from the broker`),
        );
        return;
      }
      this.write(new Writer(8).u16(Command.Heartbeat).u16(1).frame());
    }, period);
    this.heartbeatTimer.unref();
  }

  // ---- requests -----------------------------------------------------------------------------

  /** True until the connection ends. */
  get isOpen(): boolean {
    return this.closed === null && !this.closing;
  }

  private write(frame: Buffer): boolean {
    if (this.closed !== null) throw this.closedError();
    return this.socket.write(frame);
  }

  private closedError(): Error {
    return this.closed ?? new StreamConnectionClosedError(`stream connection to ${this.where} closed`);
  }

  private call(
    command: keyof typeof Command,
    build: (correlationId: number) => Writer,
    detail = '',
  ): Promise<unknown> {
    if (this.closed !== null) return Promise.reject(this.closedError());
    const id = this.nextCorrelation;
    this.nextCorrelation = this.nextCorrelation >= 0xffffffff ? 1 : this.nextCorrelation + 1;
    const frame = build(id).frame();
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.pending.delete(id);
        reject(
          new StreamTimeoutError(
            `stream ${command}${detail} on ${this.where}: no answer in ${this.timeoutMs} ms`,
          ),
        );
      }, this.timeoutMs);
      this.pending.set(id, {
        command,
        detail: detail.trim(),
        parse: PARSERS[command] ?? parseCodeOnly,
        resolve,
        reject,
        timer,
      });
      try {
        this.write(frame);
      } catch (error) {
        clearTimeout(timer);
        this.pending.delete(id);
        reject(error);
      }
    });
  }

  /** Creates a stream; `arguments` as the protocol takes them (e.g. `max-length-bytes`). */
  async create(stream: string, args: Record<string, string> = {}): Promise<void> {
    await this.call('Create', (id) => request(Command.Create, id).string(stream).map(args), ` "${stream}"`);
  }

  async delete(stream: string): Promise<void> {
    await this.call('Delete', (id) => request(Command.Delete, id).string(stream), ` "${stream}"`);
  }

  /**
   * Declares publisher `publisherId` (0-255, this connection's) on `stream`. With a reference
   * (at most 256 bytes), the broker deduplicates its publishing IDs: an ID at or below the last one
   * stored for that reference on that stream is confirmed and not stored.
   */
  async declarePublisher(
    publisherId: number,
    publisherReference: string | null,
    stream: string,
  ): Promise<void> {
    checkByteId(publisherId, 'publisher ID');
    if (publisherReference !== null && Buffer.byteLength(publisherReference) > 256) {
      throw new StreamFrameError('a publisher reference is at most 256 bytes');
    }
    await this.call(
      'DeclarePublisher',
      (id) => request(Command.DeclarePublisher, id).u8(publisherId).string(publisherReference).string(stream),
      ` ${publisherId} "${publisherReference ?? ''}" on "${stream}"`,
    );
  }

  async deletePublisher(publisherId: number): Promise<void> {
    checkByteId(publisherId, 'publisher ID');
    await this.call(
      'DeletePublisher',
      (id) => request(Command.DeletePublisher, id).u8(publisherId),
      ` ${publisherId}`,
    );
  }

  /** The last publishing ID stored for `publisherReference` on `stream`; 0 when none is. */
  async queryPublisherSequence(publisherReference: string, stream: string): Promise<bigint> {
    return (await this.call(
      'QueryPublisherSequence',
      (id) => request(Command.QueryPublisherSequence, id).string(publisherReference).string(stream),
      ` "${publisherReference}" on "${stream}"`,
    )) as bigint;
  }

  async metadata(streams: readonly string[]): Promise<StreamMetadata[]> {
    return (await this.call('Metadata', (id) => {
      const w = request(Command.Metadata, id).i32(streams.length);
      for (const stream of streams) w.string(stream);
      return w;
    })) as StreamMetadata[];
  }

  /**
   * Publishes messages for a declared publisher, in the given order, in as few frames as the frame
   * max allows. Each publishing ID's outcome comes as a 'confirm' or 'publish-error' event. Returns
   * false when the socket's buffer is full (wait for drain()).
   */
  publish(publisherId: number, messages: readonly PublishedMessage[]): boolean {
    checkByteId(publisherId, 'publisher ID');
    // Header: size 4, key 2, version 2, publisher 1, count 4; each message: ID 8, length 4, bytes.
    const limit = this.frameMax > 0 ? this.frameMax : Number.POSITIVE_INFINITY;
    let writable = true;
    for (let i = 0; i < messages.length; ) {
      let size = 13;
      let j = i;
      while (j < messages.length) {
        const add = 12 + (messages[j] as PublishedMessage).data.length;
        if (size + add > limit) break;
        size += add;
        j++;
      }
      if (j === i) {
        const one = messages[i] as PublishedMessage;
        throw new StreamFrameError(
          `message ${one.publishingId} (${one.data.length} bytes) does not fit the frame max of ${this.frameMax} bytes`,
        );
      }
      const w = new Writer(size)
        .u16(Command.Publish)
        .u16(1)
        .u8(publisherId)
        .u32(j - i);
      for (let k = i; k < j; k++) {
        const message = messages[k] as PublishedMessage;
        w.u64(message.publishingId).bytes(message.data);
      }
      writable = this.write(w.frame());
      i = j;
    }
    return writable;
  }

  /** Resolves when the socket can take more (or at once if it can). */
  drain(): Promise<void> {
    if (!this.socket.writableNeedDrain) return Promise.resolve();
    return new Promise((resolve) => {
      const done = () => {
        this.socket.off('drain', done);
        this.off('close', done);
        resolve();
      };
      this.socket.on('drain', done);
      this.on('close', done);
    });
  }

  /**
   * Subscribes to a stream from `offset`, with `credit` chunks in flight; chunks come as 'chunk'
   * events and the credit is renewed one chunk at a time.
   */
  async subscribe(
    subscriptionId: number,
    stream: string,
    offset: OffsetSpec,
    credit = 10,
    { manualCredit = false } = {},
  ): Promise<void> {
    checkByteId(subscriptionId, 'subscription ID');
    // Known before the answer: the first chunks can come in the same read as the answer, and a
    // chunk of an unknown subscription gets no credit back (the subscription then starves).
    this.subscriptions.add(subscriptionId);
    if (manualCredit) this.manual.add(subscriptionId);
    else this.manual.delete(subscriptionId);
    try {
      await this.call(
        'Subscribe',
        (id) => {
          const w = request(Command.Subscribe, id).u8(subscriptionId).string(stream);
          if (offset === 'first') w.u16(1);
          else if (offset === 'last') w.u16(2);
          else if (offset === 'next') w.u16(3);
          else if ('offset' in offset) w.u16(4).u64(offset.offset);
          else w.u16(5).i64(offset.timestamp);
          return w.u16(credit).i32(0);
        },
        ` ${subscriptionId} to "${stream}"`,
      );
    } catch (error) {
      this.subscriptions.delete(subscriptionId);
      throw error;
    }
  }

  /** Grants `chunks` more chunks to a subscription made with `manualCredit`. */
  credit(subscriptionId: number, chunks: number): void {
    if (!this.subscriptions.has(subscriptionId) || this.closed !== null || chunks <= 0) return;
    this.write(new Writer(9).u16(Command.Credit).u16(1).u8(subscriptionId).u16(chunks).frame());
  }

  async unsubscribe(subscriptionId: number): Promise<void> {
    this.subscriptions.delete(subscriptionId);
    await this.call(
      'Unsubscribe',
      (id) => request(Command.Unsubscribe, id).u8(subscriptionId),
      ` ${subscriptionId}`,
    );
  }

  /**
   * Reads a stream from its first message until `count` messages are read, or none more came for
   * `idleMs`. For tests and checks; `subscriptionId` must be free on this connection.
   */
  async readStream(
    stream: string,
    { count = Number.POSITIVE_INFINITY, idleMs = 1000, subscriptionId = 255 } = {},
  ): Promise<StreamMessage[]> {
    const out: StreamMessage[] = [];
    let onChunk: ((id: number, chunk: Chunk) => void) | undefined;
    let onClose: ((error: Error | undefined) => void) | undefined;
    try {
      await new Promise<void>((resolve, reject) => {
        let timer = setTimeout(resolve, idleMs);
        onChunk = (id, chunk) => {
          if (id !== subscriptionId) return;
          out.push(...chunk.messages);
          clearTimeout(timer);
          if (out.length >= count) resolve();
          else timer = setTimeout(resolve, idleMs);
        };
        onClose = (error) => {
          clearTimeout(timer);
          reject(error ?? this.closedError());
        };
        this.on('chunk', onChunk);
        this.on('close', onClose);
        this.subscribe(subscriptionId, stream, 'first').catch((error: Error) => {
          clearTimeout(timer);
          reject(error);
        });
      });
    } finally {
      if (onChunk) this.off('chunk', onChunk);
      if (onClose) this.off('close', onClose);
    }
    if (this.isOpen && this.subscriptions.has(subscriptionId)) await this.unsubscribe(subscriptionId);
    return out;
  }

  /** Closes the connection politely (Close, then the socket); never throws. */
  async close(reason = 'closed by the client'): Promise<void> {
    if (this.closed !== null || this.closing) return;
    try {
      await this.call('Close', (id) => request(Command.Close, id).u16(OK).string(reason));
    } catch {
      // the connection is ending either way
    }
    this.closing = true;
    this.finish(undefined);
  }

  /** Drops the connection at once, with no Close (a cut connection, for tests). */
  destroy(): void {
    this.finish(
      new StreamConnectionClosedError(`stream connection to ${this.where} destroyed by the client`),
    );
  }

  private fail(error: Error): void {
    this.finish(error);
  }

  private finish(error: Error | undefined): void {
    if (this.closed !== null) return;
    this.closed = error ?? new StreamConnectionClosedError(`stream connection to ${this.where} closed`);
    if (this.heartbeatTimer) clearInterval(this.heartbeatTimer);
    for (const [id, pending] of this.pending) {
      clearTimeout(pending.timer);
      pending.reject(this.closed);
      this.pending.delete(id);
    }
    this.socket?.destroy();
    this.emit('close', error);
  }

  // ---- incoming frames ----------------------------------------------------------------------

  private onData(data: Buffer): void {
    this.lastReceived = Date.now();
    this.rest = this.rest.length === 0 ? data : Buffer.concat([this.rest, data]);
    let at = 0;
    while (this.rest.length - at >= 4) {
      const size = this.rest.readUInt32BE(at);
      if (this.rest.length - at - 4 < size) break;
      const frame = new Reader(this.rest, at + 4, at + 4 + size);
      at += 4 + size;
      try {
        this.onFrame(frame);
      } catch (error) {
        this.fail(
          error instanceof StreamError
            ? error
            : new StreamError(`stream frame from ${this.where} unreadable: ${String(error)}`),
        );
        return;
      }
      if (this.closed !== null) return;
    }
    this.rest = at === this.rest.length ? Buffer.alloc(0) : this.rest.subarray(at);
  }

  private onFrame(r: Reader): void {
    const key = r.u16();
    r.u16(); // version
    if (key & RESPONSE) {
      const command = key & ~RESPONSE;
      if (command === Command.Credit) {
        const code = r.u16();
        const subscriptionId = r.u8();
        this.fail(new StreamResponseError('Credit', code, `for subscription ${subscriptionId}`));
        return;
      }
      const id = r.u32();
      const pending = this.pending.get(id);
      if (!pending) return; // answered after its timeout
      this.pending.delete(id);
      clearTimeout(pending.timer);
      try {
        pending.resolve(pending.parse(r));
      } catch (error) {
        if (error instanceof StreamResponseError && error.command === '') {
          const Kind =
            error.code === AUTHENTICATION_FAILURE || error.code === SASL_AUTHENTICATION_FAILURE_LOOPBACK
              ? StreamAuthenticationError
              : StreamResponseError;
          const detail =
            Kind === StreamAuthenticationError
              ? `for user "${this.endpoint.username}" at ${this.where}`
              : `${pending.detail} on ${this.where}`;
          pending.reject(new Kind(pending.command, error.code, detail));
        } else pending.reject(error as Error);
      }
      return;
    }
    switch (key) {
      case Command.PublishConfirm: {
        const publisherId = r.u8();
        const count = r.i32();
        const ids: bigint[] = new Array(count);
        for (let i = 0; i < count; i++) ids[i] = r.u64();
        this.emit('confirm', publisherId, ids);
        return;
      }
      case Command.PublishError: {
        const publisherId = r.u8();
        const count = r.i32();
        const errors: PublishErrorEntry[] = [];
        for (let i = 0; i < count; i++) {
          const publishingId = r.u64();
          const code = r.u16();
          errors.push({ publishingId, code, codeName: codeName(code) });
        }
        this.emit('publish-error', publisherId, errors);
        return;
      }
      case Command.Deliver: {
        const subscriptionId = r.u8();
        const chunk = parseChunk(r);
        if (
          this.subscriptions.has(subscriptionId) &&
          !this.manual.has(subscriptionId) &&
          this.closed === null
        ) {
          this.write(new Writer(9).u16(Command.Credit).u16(1).u8(subscriptionId).u16(1).frame());
        }
        this.emit('chunk', subscriptionId, chunk);
        return;
      }
      case Command.MetadataUpdate: {
        const code = r.u16();
        const stream = r.string() ?? '';
        this.emit('metadata-update', stream, code);
        return;
      }
      case Command.Tune: {
        const frameMax = r.u32();
        const heartbeat = r.u32();
        this.tuned?.({ frameMax, heartbeat });
        this.tuned = undefined;
        return;
      }
      case Command.Close: {
        const id = r.u32();
        const code = r.u16();
        const reason = r.string() ?? '';
        try {
          this.write(
            new Writer(10)
              .u16(Command.Close | RESPONSE)
              .u16(1)
              .u32(id)
              .u16(OK)
              .frame(),
          );
        } catch {
          // gone already
        }
        this.fail(
          new StreamConnectionClosedError(
            `stream connection to ${this.where} closed by the broker: ${codeName(code)}${reason ? ` (${reason})` : ''}`,
          ),
        );
        return;
      }
      case Command.Heartbeat:
        return;
      default:
        // A command this client does not use (e.g. ConsumerUpdate of a newer broker): ignored.
        return;
    }
  }
}

// ---- response parsers ------------------------------------------------------------------------

/** Reads a response code; not OK throws a StreamResponseError that onFrame names. */
function expectOk(r: Reader): void {
  const code = r.u16();
  if (code !== OK) throw new StreamResponseError('', code, '');
}

function parseCodeOnly(r: Reader): undefined {
  expectOk(r);
  return undefined;
}

function parseBroker(r: Reader): Broker {
  return { reference: r.u16(), host: r.string() ?? '', port: r.u32() };
}

const PARSERS: Partial<Record<keyof typeof Command, (r: Reader) => unknown>> = {
  PeerProperties: (r) => {
    expectOk(r);
    return r.map();
  },
  SaslHandshake: (r) => {
    expectOk(r);
    const count = r.i32();
    const out: string[] = [];
    for (let i = 0; i < count; i++) out.push(r.string() ?? '');
    return out;
  },
  SaslAuthenticate: (r) => {
    expectOk(r);
    return undefined;
  },
  Open: (r) => {
    expectOk(r);
    return r.remaining > 0 ? r.map() : {};
  },
  QueryPublisherSequence: (r) => {
    expectOk(r);
    return r.u64();
  },
  Metadata: (r) => {
    const brokers = new Map<number, Broker>();
    const brokerCount = r.i32();
    for (let i = 0; i < brokerCount; i++) {
      const broker = parseBroker(r);
      brokers.set(broker.reference, broker);
    }
    const out: StreamMetadata[] = [];
    const streamCount = r.i32();
    for (let i = 0; i < streamCount; i++) {
      const stream = r.string() ?? '';
      const code = r.u16();
      const leader = r.u16();
      const replicaCount = r.i32();
      const replicas: Broker[] = [];
      for (let j = 0; j < replicaCount; j++) {
        const replica = brokers.get(r.u16());
        if (replica) replicas.push(replica);
      }
      out.push({ stream, code, codeName: codeName(code), leader: brokers.get(leader), replicas });
    }
    return out;
  },
};

function pick(ours: number, theirs: number): number {
  if (ours === 0) return theirs;
  if (theirs === 0) return ours;
  return Math.min(ours, theirs);
}

function checkByteId(id: number, what: string): void {
  if (!Number.isInteger(id) || id < 0 || id > 255) throw new RangeError(`a ${what} is 0 to 255, not ${id}`);
}

function isIp(host: string): boolean {
  return /^[\d.]+$/.test(host) || host.includes(':');
}
