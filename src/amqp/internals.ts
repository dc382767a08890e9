import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';
import type { Channel, ChannelModel } from 'amqplib';
import { RuntimeFailure } from '../errors.js';
import { propertiesFor } from '../wire/properties.js';

/**
 * Every amqplib internal the bridge relies on, in one place, for the exact version pinned in
 * package.json. amqplib decodes each field table into JavaScript values and re-encodes them by
 * guessing their types, which loses types, 64-bit precision and bytes that are not UTF-8; so the
 * bridge reads each content header as raw bytes and writes its publishes as frames of its own.
 * `checkAmqplib()` runs at start and names the version when these are not as expected.
 */

export const AMQPLIB_VERSION = '2.3.1';

const require = createRequire(import.meta.url);
// amqplib's package "exports" hide lib/; its own files are reached by path, the same modules
// amqplib itself loaded.
const amqplibDir = dirname(require.resolve('amqplib'));

interface FrameModule {
  decodeFrame(frame: { type: number; channel: number; size: number; payload: Buffer }): unknown;
}

interface ChannelRecord {
  channel: unknown;
  buffer: { write(chunk: Buffer): boolean };
}

/** amqplib's Connection (the object behind a ChannelModel). */
interface Connection {
  rest: Buffer;
  maxFrameSize: number;
  frameMax: number;
  stream: {
    read(): Buffer | null;
    cork?(): void;
    uncork?(): void;
    destroy(): void;
    resetAndDestroy?(): void;
    readonly writableLength: number;
  };
  recvSinceLastCheck: boolean;
  sentSinceLastCheck: boolean;
  channels: (ChannelRecord | undefined)[];
  recvFrame(): unknown;
  /** Ends the connection as after a socket error: fails the channels and emits 'close'. */
  onSocketError(error: Error): void;
  muxer: Muxer;
}

const WRITE_GATE = Symbol('dedup-bridge write gate');

interface Muxer {
  _readIncoming(): void;
  /** True while the socket is full: frames wait in the channels' buffers for its 'drain'. */
  blocked: boolean;
  [WRITE_GATE]?: WriteGate;
}

/** amqplib's Channel, as the bridge uses it. */
interface ChannelInternals {
  ch: number;
  connection: Connection;
  pushConfirmCallback(callback: (error: unknown) => void): void;
}

/** amqplib is not the version, or not shaped as, this build expects. */
export class AmqplibInternalsError extends RuntimeFailure {
  constructor(what: string) {
    super(
      `amqplib ${installedVersion()} is not as dedup-bridge expects (${what}); install the pinned amqplib ${AMQPLIB_VERSION} (npm ci)`,
    );
    this.name = 'AmqplibInternalsError';
  }
}

function installedVersion(): string {
  try {
    return (require(join(amqplibDir, 'package.json')) as { version: string }).version;
  } catch {
    return '(unknown version)';
  }
}

let frameModule: FrameModule | undefined;

function frames(): FrameModule {
  if (!frameModule) {
    const loaded = require(join(amqplibDir, 'lib', 'frame.js')) as Partial<FrameModule>;
    if (typeof loaded.decodeFrame !== 'function') {
      throw new AmqplibInternalsError('lib/frame.js has no decodeFrame');
    }
    frameModule = loaded as FrameModule;
  }
  return frameModule;
}

function connectionOf(model: ChannelModel): Connection {
  return (model as unknown as { connection: Connection }).connection;
}

/** Fails with one clear line when amqplib is not the version whose internals this build uses. */
export function checkAmqplib(model?: ChannelModel): void {
  const version = installedVersion();
  if (version !== AMQPLIB_VERSION) throw new AmqplibInternalsError(`version ${version}`);
  frames();
  if (!model) return;
  const connection = connectionOf(model) as Partial<Connection> | undefined;
  const missing = [
    ['connection', connection],
    ['connection.rest', connection?.rest],
    ['connection.stream', connection?.stream],
    ['connection.channels', connection?.channels],
    ['connection.recvFrame', connection?.recvFrame],
    ['connection.onSocketError', connection?.onSocketError],
    ['connection.muxer', connection?.muxer?._readIncoming],
    ['connection.frameMax', connection?.frameMax],
  ].find(([, value]) => value === undefined);
  if (missing) throw new AmqplibInternalsError(`no ${missing[0]}`);
}

const FRAME_METHOD = 1;
const FRAME_HEADER = 2;
const FRAME_BODY = 3;
const FRAME_END = 0xce;
const BASIC_CLASS = 60;
const BASIC_PUBLISH = 40;
/** Frame type, channel and size before a payload, and the end octet after it. */
const FRAME_OVERHEAD = 8;

/**
 * Makes a connection read every message's content header as raw bytes: `message.properties` are
 * then amqplib's (headers decoded only when read) with the exact bytes attached (see
 * properties.ts). A header that cannot be decoded no longer drops the connection: the message
 * arrives, marked unreadable, and the bridge refuses it with the reason.
 */
export function installLosslessReader(model: ChannelModel): void {
  checkAmqplib(model);
  // The bridge's own connections: it reads the raw header only, so properties decode lazily.
  readLosslessly(connectionOf(model), true);
}

/** The same, for the connection of a channel an application opened (the idempotent consumer). */
export function installLosslessReaderFor(channel: Channel): void {
  checkAmqplib();
  const connection = (channel as unknown as Partial<ChannelInternals>).connection;
  if (typeof connection?.recvFrame !== 'function' || connection.rest === undefined) {
    throw new AmqplibInternalsError('a channel has no connection.recvFrame');
  }
  readLosslessly(connection, false);
}

const LOSSLESS = Symbol('dedup-bridge.lossless-reader');

function readLosslessly(connection: Connection, lazy: boolean): void {
  const marked = connection as Connection & { [LOSSLESS]?: true };
  if (marked[LOSSLESS]) return;
  marked[LOSSLESS] = true;
  const { decodeFrame } = frames();
  // Frames are read at an offset into the socket's data (amqplib's `rest`), not by cutting a view
  // of what is left after each one: two views and an object less per frame, three per message.
  let at = 0;
  const deliveries = new DeliveryDecoder();
  connection.recvFrame = function recvFrame(this: Connection) {
    for (;;) {
      const data = this.rest;
      const available = data.length - at;
      const size = available >= 7 ? data.readUInt32BE(at + 3) : -1;
      if (size >= 0 && this.maxFrameSize > 0 && size > this.maxFrameSize) {
        throw new Error(`Frame size ${size} exceeds maxFrameSize ${this.maxFrameSize}`);
      }
      if (size < 0 || available < size + FRAME_OVERHEAD) {
        const incoming = this.stream.read();
        if (incoming === null) return false;
        this.recvSinceLastCheck = true;
        this.rest = available === 0 ? incoming : Buffer.concat([data.subarray(at), incoming]);
        at = 0;
        continue;
      }
      const type = data[at] as number;
      const channel = data.readUInt16BE(at + 1);
      const start = at + 7;
      const end = start + size;
      if (data[end] !== FRAME_END) throw new Error('Invalid frame');
      at = end + 1;
      if (type === FRAME_HEADER && size >= 14 && data.readUInt16BE(start) === BASIC_CLASS) {
        // A copy: the payload is a part of the whole socket read.
        const header = Buffer.allocUnsafe(size - 12);
        data.copy(header, 0, start + 12, end);
        return {
          id: BASIC_CLASS,
          channel,
          // The body size as two 32-bit halves (no BigInt per message).
          size: data.readUInt32BE(start + 4) * 0x1_0000_0000 + data.readUInt32BE(start + 8),
          fields: propertiesFor(header, lazy),
        };
      }
      if (type === FRAME_BODY) {
        // A body is a part of the socket read it came in, which holds many messages: kept as a
        // view, one message in flight would keep the whole read alive (tens of MB at prefetch 500).
        if (size * 4 < data.buffer.byteLength) {
          const content = Buffer.allocUnsafe(size);
          data.copy(content, 0, start, end);
          return { channel, content };
        }
        return { channel, content: data.subarray(start, end) };
      }
      if (type === FRAME_METHOD && size >= 4 && data.readUInt32BE(start) === BASIC_DELIVER) {
        const fields = deliveries.decode(data, start + 4, end);
        if (fields) return { id: BASIC_DELIVER, channel, fields };
      }
      const payload = data.subarray(start, end);
      const decoded = decodeFrame({ type, channel, size, payload });
      if (type === FRAME_METHOD) keepRoutingBytes(decoded as { id?: number; fields?: object }, payload);
      return decoded;
    }
  };
}

/**
 * Decodes basic.deliver as amqplib does, with the raw exchange and routing key kept (see
 * routingBytesOf). A queue's deliveries mostly share their consumer tag, exchange and routing key:
 * the last ones' text and bytes are reused when the bytes match, not made again per message.
 */
class DeliveryDecoder {
  private tag = new LastShortString();
  private exchange = new LastShortString();
  private routingKey = new LastShortString();
  private routing: RoutingBytes | undefined;

  /** The deliver's fields, or undefined when the payload is short (amqplib's decoder then says why). */
  decode(data: Buffer, start: number, end: number): object | undefined {
    // Every part is found to fit before any is kept: a short frame must leave what is kept as it was.
    const tagAt = start;
    if (!fits(data, tagAt, end)) return undefined;
    const numberAt = tagAt + 1 + (data[tagAt] as number);
    const exchangeAt = numberAt + 9;
    if (!fits(data, exchangeAt, end)) return undefined;
    const keyAt = exchangeAt + 1 + (data[exchangeAt] as number);
    if (!fits(data, keyAt, end)) return undefined;
    this.tag.read(data, tagAt);
    const deliveryTag = data.readUInt32BE(numberAt) * 0x1_0000_0000 + data.readUInt32BE(numberAt + 4);
    const redelivered = ((data[numberAt + 8] as number) & 1) === 1;
    const exchangeChanged = this.exchange.read(data, exchangeAt);
    const keyChanged = this.routingKey.read(data, keyAt);
    if (exchangeChanged || keyChanged || this.routing === undefined) {
      this.routing = { exchange: this.exchange.bytes, routingKey: this.routingKey.bytes };
    }
    const fields = {
      consumerTag: this.tag.text,
      deliveryTag,
      redelivered,
      exchange: this.exchange.text,
      routingKey: this.routingKey.text,
    };
    Object.defineProperty(fields, ROUTING_BYTES, { value: this.routing, enumerable: false });
    return fields;
  }
}

/** Whether a short string at `at` (its length octet) ends by `end`. */
function fits(data: Buffer, at: number, end: number): boolean {
  return at < end && at + 1 + (data[at] as number) <= end;
}

/** A short string read from frames, with its text and bytes kept while the next ones match. */
class LastShortString {
  text = '';
  bytes: Buffer = NO_BYTES;

  /** Keeps the short string at `at` (its length octet); false when it is the one already kept. */
  read(data: Buffer, at: number): boolean {
    const length = data[at] as number;
    const kept = this.bytes;
    if (length === kept.length && data.compare(kept, 0, length, at + 1, at + 1 + length) === 0) return false;
    // Copied: a view would keep the whole socket read alive.
    const bytes = length === 0 ? NO_BYTES : Buffer.allocUnsafe(length);
    data.copy(bytes, 0, at + 1, at + 1 + length);
    this.bytes = bytes;
    this.text = bytes.toString('utf8');
    return true;
  }
}

const BASIC_DELIVER = (BASIC_CLASS << 16) | 60;
const BASIC_GET_OK = (BASIC_CLASS << 16) | 71;
const BASIC_RETURN = (BASIC_CLASS << 16) | 50;
const ROUTING_BYTES = Symbol.for('dedup-bridge.routing-bytes');
const NO_BYTES = Buffer.alloc(0);

/** The exchange and routing key of a delivery as the broker sent them (amqplib decodes them as UTF-8). */
interface RoutingBytes {
  exchange: Buffer;
  routingKey: Buffer;
}

// Keeps the raw exchange and routing key of a deliver, get-ok or return on its decoded fields.
function keepRoutingBytes(decoded: { id?: number; fields?: object }, payload: Buffer): void {
  let p = 4;
  // Copies (a view would keep the whole socket read alive), and none for an empty name.
  const shortstr = () => {
    const length = payload[p] as number;
    let bytes = NO_BYTES;
    if (length > 0) {
      // Copied without a view in between (a view of a large read is costly to make).
      bytes = Buffer.allocUnsafe(length);
      payload.copy(bytes, 0, p + 1, p + 1 + length);
    }
    p += 1 + length;
    return bytes;
  };
  if (decoded.id === BASIC_DELIVER) {
    p += 1 + (payload[p] as number); // consumer tag, not kept
    p += 9; // delivery tag, redelivered
  } else if (decoded.id === BASIC_GET_OK) {
    p += 9;
  } else if (decoded.id === BASIC_RETURN) {
    p += 2; // reply code
    shortstr(); // reply text
  } else {
    return;
  }
  const exchange = shortstr();
  const routingKey = shortstr();
  if (decoded.fields && p <= payload.length) {
    Object.defineProperty(decoded.fields, ROUTING_BYTES, {
      value: { exchange, routingKey },
      enumerable: false,
    });
  }
}

/** The raw exchange and routing key of a message read through a connection of the bridge's. */
export function routingBytesOf(fields: object): RoutingBytes | undefined {
  return (fields as Record<symbol, RoutingBytes | undefined>)[ROUTING_BYTES];
}

/**
 * Drops the connection with a TCP reset: what the kernel still holds to send is discarded, not
 * sent first as a close would. The fence for publishes written under a lease that is running out
 * (see Pipeline): bytes that never left this host cannot reach the broker after another owner's.
 */
export function resetConnection(model: ChannelModel, reason: string): void {
  const connection = connectionOf(model);
  const socket = connection.stream;
  try {
    if (typeof socket.resetAndDestroy === 'function') socket.resetAndDestroy();
    else socket.destroy();
  } catch {
    // A TLS socket has no TCP handle to reset (ERR_INVALID_HANDLE_TYPE): closed instead, what
    // this process holds is dropped, but its kernel still sends what it had taken.
    socket.destroy();
  }
  // amqplib learns that its socket ended only from an 'end' or 'error', and a destroy emits
  // neither: untold, it would wait for a heartbeat to fail, every unconfirmed publish unanswered
  // and the link not reconnecting meanwhile. Told now, it closes its channels at once.
  connection.onSocketError(new Error(`connection reset by the bridge: ${reason}`));
}

/**
 * Sends the frames of one write cycle in one socket write. amqplib writes every frame to the
 * socket on its own: with Nagle off that is a system call and a TCP segment per publish, which
 * costs the bridge and the receiving broker more CPU than the publish itself. Corking the socket
 * around the muxer's loop turns a burst of publishes into one writev, without delaying any frame.
 */
export function coalesceWrites(model: ChannelModel): void {
  checkAmqplib(model);
  const connection = connectionOf(model);
  const socket = connection.stream;
  if (typeof socket.cork !== 'function' || typeof socket.uncork !== 'function') {
    throw new AmqplibInternalsError('the socket cannot be corked');
  }
  const muxer = connection.muxer;
  const readIncoming = muxer._readIncoming.bind(muxer);
  muxer._readIncoming = () => {
    const gate = muxer[WRITE_GATE];
    socket.cork?.();
    try {
      readIncoming();
      // Asked with the cycle's frames held by the corked socket, right before the one write that
      // hands them to the kernel: a stall that strikes between the two is the only one whose
      // frames leave unchecked, so the shorter that stretch, the better. On a no the gate reset
      // the connection, and the destroyed socket drops what it held.
      if (gate && !gate.mayWrite()) return;
    } finally {
      socket.uncork?.();
    }
    // Written means taken by the kernel: not left in amqplib's buffers nor in the socket's own.
    gate?.wrote(!muxer.blocked && socket.writableLength === 0);
  };
}

/**
 * Asked in each write cycle of a connection (see coalesceWrites), before its frames are handed to
 * the kernel. A publish's frames wait in amqplib's buffers until the next cycle, a setImmediate
 * later: a process stopped in between (SIGSTOP, a VM paused) writes them when it resumes, before
 * any timer of its own has run.
 */
export interface WriteGate {
  /** False: the frames must not leave this host (the gate has reset the connection). */
  mayWrite(): boolean;
  /** After a cycle: whether it wrote everything queued, or the socket filled and some wait. */
  wrote(all: boolean): void;
}

/**
 * Puts a gate before the writes of a connection whose writes are coalesced. connectAmqp checked
 * every connection it made for amqplib's muxer (see checkAmqplib); one without it (a unit test's
 * stand-in) has no write cycle to gate.
 */
export function gateWrites(model: ChannelModel, gate: WriteGate): void {
  const muxer = (connectionOf(model) as Partial<Connection> | undefined)?.muxer;
  if (muxer) muxer[WRITE_GATE] = gate;
}

/** The channel was closed, or is closing: the publish was not sent. */
export class ChannelGoneError extends Error {}

/** The message cannot be published as it is (its content header does not fit a frame). */
class UnpublishableError extends Error {}

/**
 * Publishes a message whose content header is given as raw bytes (property flags and list), on a
 * channel of a connection the bridge opened. With `onConfirm`, the channel must be a confirm
 * channel: the callback gets null for an ack, an error for a nack or a closed channel, exactly as
 * amqplib's own publish. Returns false when the channel's buffer is full (wait for 'drain').
 */
export function publishRaw(
  channel: Channel,
  exchange: string | Buffer,
  routingKey: string | Buffer,
  header: Buffer,
  content: Buffer,
  onConfirm?: (error: unknown) => void,
): boolean {
  const internals = channel as unknown as ChannelInternals;
  const connection = internals.connection;
  const record = connection.channels[internals.ch];
  // amqplib replaces a closing or closed channel's send functions with ones that throw.
  if (
    record?.channel !== channel ||
    Object.hasOwn(channel, 'sendMessage') ||
    Object.hasOwn(connection, 'sendMessage')
  ) {
    throw new ChannelGoneError('channel or connection closed');
  }
  const exchangeBytes =
    typeof exchange !== 'string' ? exchange : exchange === '' ? NO_BYTES : Buffer.from(exchange, 'utf8');
  const keyBytes = typeof routingKey === 'string' ? Buffer.from(routingKey, 'utf8') : routingKey;
  if (exchangeBytes.length > 255 || keyBytes.length > 255) {
    throw new UnpublishableError('exchange or routing key longer than 255 bytes');
  }
  const headerPayload = 12 + header.length;
  const maxPayload = connection.frameMax - FRAME_OVERHEAD;
  if (headerPayload > maxPayload) {
    throw new UnpublishableError(
      `its content header (${headerPayload} bytes) does not fit the target's frame_max (${connection.frameMax} bytes)`,
    );
  }
  const methodPayload = 4 + 2 + 1 + exchangeBytes.length + 1 + keyBytes.length + 1;
  const methodAndHeader = FRAME_OVERHEAD * 2 + methodPayload + headerPayload;
  const bodyFrames = content.length === 0 ? 0 : Math.ceil(content.length / maxPayload);
  const total = methodAndHeader + content.length + bodyFrames * FRAME_OVERHEAD;
  const ch = internals.ch;
  // Small messages in one buffer (one write); large bodies a frame at a time, as amqplib does.
  const small = total <= 65536;
  const out = Buffer.allocUnsafe(small ? total : methodAndHeader);
  let p = frameStart(out, 0, FRAME_METHOD, ch, methodPayload);
  p = out.writeUInt16BE(BASIC_CLASS, p);
  p = out.writeUInt16BE(BASIC_PUBLISH, p);
  p = out.writeUInt16BE(0, p); // reserved (ticket)
  p = out.writeUInt8(exchangeBytes.length, p);
  p += exchangeBytes.copy(out, p);
  p = out.writeUInt8(keyBytes.length, p);
  p += keyBytes.copy(out, p);
  p = out.writeUInt8(onConfirm ? 1 : 0, p); // mandatory with confirms; never immediate
  p = out.writeUInt8(FRAME_END, p);
  p = frameStart(out, p, FRAME_HEADER, ch, headerPayload);
  p = out.writeUInt16BE(BASIC_CLASS, p);
  p = out.writeUInt16BE(0, p); // weight
  // The body size as two 32-bit halves (no BigInt per message).
  p = out.writeUInt32BE(Math.floor(content.length / 0x1_0000_0000), p);
  p = out.writeUInt32BE(content.length % 0x1_0000_0000, p);
  p += header.copy(out, p);
  p = out.writeUInt8(FRAME_END, p);
  const buffer = record.buffer;
  let writable = true;
  if (small) {
    for (let offset = 0; offset < content.length; offset += maxPayload) {
      const slice = content.subarray(offset, Math.min(offset + maxPayload, content.length));
      p = frameStart(out, p, FRAME_BODY, ch, slice.length);
      p += slice.copy(out, p);
      p = out.writeUInt8(FRAME_END, p);
    }
    writable = buffer.write(out);
  } else {
    writable = buffer.write(out);
    for (let offset = 0; offset < content.length; offset += maxPayload) {
      const slice = content.subarray(offset, Math.min(offset + maxPayload, content.length));
      const frame = Buffer.allocUnsafe(slice.length + FRAME_OVERHEAD);
      let q = frameStart(frame, 0, FRAME_BODY, ch, slice.length);
      q += slice.copy(frame, q);
      frame.writeUInt8(FRAME_END, q);
      writable = buffer.write(frame);
    }
  }
  connection.sentSinceLastCheck = true;
  if (onConfirm) internals.pushConfirmCallback(onConfirm);
  return writable;
}

function frameStart(out: Buffer, at: number, type: number, channel: number, size: number): number {
  let p = out.writeUInt8(type, at);
  p = out.writeUInt16BE(channel, p);
  return out.writeUInt32BE(size, p);
}

/** The cluster a connected broker says it belongs to (RabbitMQ's `cluster_name`), if it says. */
export function clusterNameOf(model: ChannelModel): string | undefined {
  const properties = (connectionOf(model) as unknown as { serverProperties?: Record<string, unknown> })
    .serverProperties;
  const name = properties?.cluster_name;
  if (typeof name === 'string') return name;
  return Buffer.isBuffer(name) ? name.toString('utf8') : undefined;
}

/** The version a connected broker says it runs (its `version` server property), if it says. */
export function serverVersionOf(model: ChannelModel): string | undefined {
  const properties = (connectionOf(model) as unknown as { serverProperties?: Record<string, unknown> })
    .serverProperties;
  const version = properties?.version;
  if (typeof version === 'string') return version;
  return Buffer.isBuffer(version) ? version.toString('utf8') : undefined;
}
