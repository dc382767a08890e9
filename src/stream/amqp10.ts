import { decodeValue, type FieldValue } from '../wire/fields.js';
import { BASIC_PROPERTIES, type ContentHeader, type PropertyName } from '../wire/properties.js';

/**
 * An AMQP 0-9-1 message (its raw content header and body) as the AMQP 1.0 message bytes RabbitMQ
 * itself stores when a 0-9-1 client publishes that message into a stream, so that a consumer
 * reading the stream over 0-9-1 (`x-stream-offset`) receives what it would have received had the
 * message been published straight into the stream, and a stream-protocol consumer reads the very
 * bytes RabbitMQ would have written.
 *
 * The mapping is RabbitMQ's own (rabbit_msg_record, the same in 3.9 and 3.10; 3.11 and 3.12 keep
 * it and also take headers named x-amqp-1.0-* as whole AMQP 1.0 sections, which this encoder does
 * not do), re-derived here and tested against 3.10.8, with the byte forms of its AMQP 1.0 generator (the compact encodings of small
 * integers, one-byte lengths below 255). Reading the stream back over 0-9-1, 3.10 turns each 1.0
 * value back into the 0-9-1 type it came from; the table says where that is not exact.
 *
 * | 0-9-1                         | AMQP 1.0 (stored)                                   | back over 0-9-1    |
 * |-------------------------------|-----------------------------------------------------|--------------------|
 * | content-type                  | properties.content-type, symbol                     | same               |
 * | content-encoding              | properties.content-encoding, symbol                 | same               |
 * | delivery-mode                 | message-annotations x-basic-delivery-mode, ubyte    | same               |
 * | priority                      | message-annotations x-basic-priority, ubyte         | same               |
 * | correlation-id                | properties.correlation-id, utf8 (bytes as they are) | same               |
 * | reply-to                      | properties.reply-to, utf8                           | same               |
 * | expiration                    | message-annotations x-basic-expiration, utf8        | same               |
 * | message-id                    | properties.message-id, utf8                         | same               |
 * | timestamp (s)                 | properties.creation-time, timestamp (ms = s × 1000) | same (1)           |
 * | type                          | application-properties x-basic-type, utf8           | same               |
 * | user-id                       | properties.user-id, binary                          | same               |
 * | app-id                        | application-properties x-basic-app-id, utf8         | same               |
 * | cluster-id                    | (not stored)                                        | absent (2)         |
 * | headers, in order, repeats too| application-properties, key utf8, after the two above| in order (4)     |
 * |   S long string               |   utf8 (the bytes as they are, UTF-8 or not)        | S                  |
 * |   x byte array                |   binary                                            | x                  |
 * |   t boolean                   |   boolean (0x56 00/01; any non-zero octet is true)  | t 0 / t 1 (4)      |
 * |   b / B (signed/unsigned 8)   |   byte / ubyte                                      | b / B              |
 * |   s / u (signed/unsigned 16)  |   short / ushort                                    | s / u              |
 * |   I / i (signed/unsigned 32)  |   int / uint (compact forms for small values)       | I / i              |
 * |   l (signed 64)               |   long (compact form for -128..127)                 | l                  |
 * |   f / d                       |   float / double                                    | f / d              |
 * |   T timestamp (s)             |   timestamp (ms = s × 1000)                         | T (1)              |
 * |   V void                      |   null                                              | V                  |
 * |   F table, A array            |   (dropped, as RabbitMQ drops them)                 | absent (2)         |
 * |   D decimal                   |   (none: RabbitMQ cannot store one, see below)      | — (3)              |
 * | exchange, routing key         | message-annotations x-exchange, x-routing-key, utf8 | the delivery's     |
 * | body                          | one data section                                    | same               |
 *
 * Sections are written in RabbitMQ's order: message-annotations, properties (left out when none of
 * its fields is set), application-properties (left out when empty), data. The properties section
 * is its full 13-field list, unset fields null, as RabbitMQ writes it.
 *
 * (1) A timestamp is stored in milliseconds as a signed 64-bit integer: from 2^63 / 1000 s on
 *     (year 292,471,208) it wraps, modulo 2^64, as it does in RabbitMQ, so it reads back as
 *     RabbitMQ's would (2^64 - 1 comes back whole, 2^63 as 0); `lost` names one that changes.
 * (2) RabbitMQ's own 0-9-1 publish into a stream loses these too; the encoder does the same, so
 *     what the consumer receives is what it would have received. `lost` lists them per message.
 * (3) A header with a decimal (or a NaN or infinite float) cannot be published into a stream over
 *     0-9-1 at all on 3.10 (see the codec test); such a message is refused here (UnencodableError),
 *     never stored in a form no 0-9-1 consumer could read.
 * (4) RabbitMQ's own quirks, kept: a boolean octet other than 0/1 comes back as 1; a header
 *     named x-basic-type or x-basic-app-id beside no such property is read back as that property
 *     (and leaves the headers).
 *
 * Brokers from 3.13 on store and read streams through another mapping (mc_amqpl: type as a
 * message annotation, app-id as group-id, x- headers as annotations, a header section). These bytes
 * are for 3.9 to 3.12: `mappingFor(version)` says which brokers they fit, and refuses the others.
 */

/** The content header and body cannot be stored as RabbitMQ would store them. */
export class UnencodableError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'UnencodableError';
  }
}

export interface EncodeOptions {
  /** The exchange the message was published to, as a 0-9-1 consumer of the stream will see it. */
  exchange?: string | Buffer;
  /** Its routing key; RabbitMQ stores both with every 0-9-1 publish (the stream name, direct). */
  routingKey?: string | Buffer;
}

export interface Encoded {
  bytes: Buffer;
  /** What a 0-9-1 consumer of the stream will not see, as with a direct publish (e.g. "cluster-id"). */
  lost: string[];
}

/** The mapping for a broker version, or why there is none. */
export function mappingFor(version: string | undefined): 'rabbit_msg_record' {
  const match = /^(\d+)\.(\d+)/.exec(version ?? '');
  const major = Number(match?.[1]);
  const minor = Number(match?.[2]);
  if (match && major === 3 && minor >= 9 && minor <= 12) return 'rabbit_msg_record';
  throw new UnencodableError(
    `RabbitMQ ${version ?? '(unknown version)'}: messages are encoded for 3.9 to 3.12 only (3.13 and later map 0-9-1 properties to AMQP 1.0 differently)`,
  );
}

// ---- AMQP 1.0 primitive encodings (those RabbitMQ's generator chooses) -----------------------

const NULL = 0x40;
const DESCRIBED = 0x00;
const MESSAGE_ANNOTATIONS = 0x72;
const PROPERTIES = 0x73;
const APPLICATION_PROPERTIES = 0x74;
const DATA = 0x75;

/** utf8, symbol and binary: the one-byte-length form below 255 bytes, as RabbitMQ writes them. */
function variable(short: number, long: number, bytes: Buffer): Buffer {
  if (bytes.length < 255) return Buffer.concat([Buffer.from([short, bytes.length]), bytes]);
  const head = Buffer.alloc(5);
  head[0] = long;
  head.writeUInt32BE(bytes.length, 1);
  return Buffer.concat([head, bytes]);
}

const utf8 = (bytes: Buffer) => variable(0xa1, 0xb1, bytes);
const binary = (bytes: Buffer) => variable(0xa0, 0xb0, bytes);
/** RabbitMQ's generator writes every symbol with a one-byte length (property values fit). */
function symbol(bytes: Buffer): Buffer {
  if (bytes.length > 255) throw new UnencodableError(`a symbol of ${bytes.length} bytes`);
  return Buffer.concat([Buffer.from([0xa3, bytes.length]), bytes]);
}

function fixed(code: number, size: number, write: (out: Buffer) => void): Buffer {
  const out = Buffer.alloc(1 + size);
  out[0] = code;
  write(out);
  return out;
}

const ubyte = (v: number) => Buffer.from([0x50, v]);

/** What a timestamp (s) comes back as from 3.10, stored as ms in a signed 64-bit integer. */
function roundTrip(seconds: bigint): bigint {
  return BigInt.asUintN(64, BigInt.asIntN(64, seconds * 1000n) / 1000n);
}

/** Milliseconds as RabbitMQ's generator writes them: the low 64 bits, signed. */
function timestamp(seconds: bigint): Buffer {
  return fixed(0x83, 8, (out) => out.writeBigInt64BE(BigInt.asIntN(64, seconds * 1000n), 1));
}

/** A compound (list or map) of encoded items, short form when RabbitMQ uses it. */
function compound(shortCode: number, longCode: number, count: number, items: Buffer[]): Buffer {
  const body = Buffer.concat(items);
  if (count < 255 && body.length + 1 < 256) {
    return Buffer.concat([Buffer.from([shortCode, body.length + 1, count]), body]);
  }
  const head = Buffer.alloc(9);
  head[0] = longCode;
  head.writeUInt32BE(body.length + 4, 1);
  head.writeUInt32BE(count, 5);
  return Buffer.concat([head, body]);
}

function map(pairs: [Buffer, Buffer][]): Buffer {
  return compound(0xc1, 0xd1, pairs.length * 2, pairs.flat());
}

function section(descriptor: number, value: Buffer): Buffer {
  return Buffer.concat([Buffer.from([DESCRIBED, 0x53, descriptor]), value]);
}

/** A header value as RabbitMQ stores it, or null when RabbitMQ drops it. */
function headerValue(value: FieldValue, name: string): Buffer | null {
  switch (value.type) {
    case 'S':
      return utf8(value.value);
    case 'x':
      return binary(value.value);
    case 't':
      return Buffer.from([0x56, value.value ? 1 : 0]);
    case 'b':
      return fixed(0x51, 1, (out) => out.writeInt8(value.value, 1));
    case 'B':
      return ubyte(value.value);
    case 's':
      return fixed(0x61, 2, (out) => out.writeInt16BE(value.value, 1));
    case 'u':
      return fixed(0x60, 2, (out) => out.writeUInt16BE(value.value, 1));
    case 'I':
      return value.value < 128 && value.value > -129
        ? fixed(0x54, 1, (out) => out.writeInt8(value.value, 1))
        : fixed(0x71, 4, (out) => out.writeInt32BE(value.value, 1));
    case 'i':
      if (value.value === 0) return Buffer.from([0x43]);
      if (value.value < 256) return Buffer.from([0x52, value.value]);
      return fixed(0x70, 4, (out) => out.writeUInt32BE(value.value, 1));
    case 'l':
      return value.value < 128n && value.value > -129n
        ? fixed(0x55, 1, (out) => out.writeInt8(Number(value.value), 1))
        : fixed(0x81, 8, (out) => out.writeBigInt64BE(value.value, 1));
    case 'f':
      if (!Number.isFinite(value.value)) throw unencodable(name, 'a NaN or infinite float');
      return fixed(0x72, 4, (out) => out.writeFloatBE(value.value, 1));
    case 'd':
      if (!Number.isFinite(value.value)) throw unencodable(name, 'a NaN or infinite double');
      return fixed(0x82, 8, (out) => out.writeDoubleBE(value.value, 1));
    case 'T':
      return timestamp(value.value);
    case 'V':
      return Buffer.from([NULL]);
    case 'D':
      throw unencodable(name, 'a decimal');
    case 'F':
    case 'A':
      return null;
  }
}

function unencodable(name: string, what: string): UnencodableError {
  return new UnencodableError(
    `header ${JSON.stringify(name)} holds ${what}, which RabbitMQ cannot store in a stream from AMQP 0-9-1`,
  );
}

/** Properties whose absence from the stored message a 0-9-1 consumer would notice. */
const NOT_STORED: readonly PropertyName[] = ['clusterId'];

/**
 * Encodes a 0-9-1 message as RabbitMQ 3.9–3.12 would store it in a stream. Throws
 * UnencodableError for a header RabbitMQ cannot store (decimal, NaN or infinite floats) and for
 * an unreadable header table.
 */
export function encodeMessage(header: ContentHeader, body: Buffer, options: EncodeOptions = {}): Encoded {
  const lost: string[] = [];
  const short = (name: PropertyName) => header.shortstrBytes(name);

  // message-annotations: x-routing-key, x-exchange, then priority, delivery mode, expiration.
  const annotations: [Buffer, Buffer][] = [];
  const annotate = (key: string, value: Buffer) => annotations.push([symbol(Buffer.from(key)), value]);
  if (options.routingKey !== undefined) annotate('x-routing-key', utf8(bytesOf(options.routingKey)));
  if (options.exchange !== undefined) annotate('x-exchange', utf8(bytesOf(options.exchange)));
  const octet = (name: PropertyName) => {
    const value = header.has(name) ? header.propertyAt(PROPERTY_INDEX[name]) : undefined;
    return typeof value === 'number' ? value : undefined;
  };
  const priority = octet('priority');
  if (priority !== undefined) annotate('x-basic-priority', ubyte(priority));
  const deliveryMode = octet('deliveryMode');
  if (deliveryMode !== undefined) annotate('x-basic-delivery-mode', ubyte(deliveryMode));
  const expiration = short('expiration');
  if (expiration !== undefined) annotate('x-basic-expiration', utf8(expiration));

  // properties: the 13-field list, as RabbitMQ fills it.
  const messageId = short('messageId');
  const userId = short('userId');
  const replyTo = short('replyTo');
  const correlationId = short('correlationId');
  const contentType = short('contentType');
  const contentEncoding = short('contentEncoding');
  const stamp = header.has('timestamp') ? header.bytes.readBigUInt64BE(timestampAt(header)) : undefined;
  if (stamp !== undefined && roundTrip(stamp) !== stamp) {
    lost.push(`property timestamp (comes back as ${roundTrip(stamp)})`);
  }
  const nul = Buffer.from([NULL]);
  const fields = [
    messageId === undefined ? nul : utf8(messageId),
    userId === undefined ? nul : binary(userId),
    nul, // to
    nul, // subject
    replyTo === undefined ? nul : utf8(replyTo),
    correlationId === undefined ? nul : utf8(correlationId),
    contentType === undefined ? nul : symbol(contentType),
    contentEncoding === undefined ? nul : symbol(contentEncoding),
    nul, // absolute-expiry-time
    stamp === undefined ? nul : timestamp(stamp),
    nul, // group-id
    nul, // group-sequence
    nul, // reply-to-group-id
  ];
  const hasProperties = fields.some((field) => field !== nul);

  // application-properties: x-basic-type, x-basic-app-id, then the headers in order.
  const applicationProperties: [Buffer, Buffer][] = [];
  const type = short('type');
  if (type !== undefined) applicationProperties.push([utf8(Buffer.from('x-basic-type')), utf8(type)]);
  const appId = short('appId');
  if (appId !== undefined) applicationProperties.push([utf8(Buffer.from('x-basic-app-id')), utf8(appId)]);
  if (header.has('headers')) {
    if (header.tableError !== undefined || header.fields === undefined) {
      throw new UnencodableError(header.tableError ?? 'the header table cannot be read');
    }
    for (const span of header.fields) {
      const name = header.bytes.subarray(span.start + 1, span.valueAt);
      const [value] = decodeValue(header.bytes, span.valueAt, span.end);
      const encoded = headerValue(value, span.name);
      if (value.type === 'T' && roundTrip(value.value) !== value.value) {
        lost.push(
          `header ${JSON.stringify(span.name)} (a timestamp that comes back as ${roundTrip(value.value)})`,
        );
      }
      if (encoded === null) {
        lost.push(`header ${JSON.stringify(span.name)} (${value.type === 'F' ? 'a table' : 'an array'})`);
        continue;
      }
      applicationProperties.push([utf8(name), encoded]);
    }
  }
  for (const name of NOT_STORED) if (header.has(name)) lost.push(`property ${name}`);

  const sections: Buffer[] = [];
  if (annotations.length > 0) sections.push(section(MESSAGE_ANNOTATIONS, map(annotations)));
  if (hasProperties) sections.push(section(PROPERTIES, compound(0xc0, 0xd0, fields.length, fields)));
  if (applicationProperties.length > 0) {
    sections.push(section(APPLICATION_PROPERTIES, map(applicationProperties)));
  }
  sections.push(section(DATA, binary(body)));
  return { bytes: Buffer.concat(sections), lost };
}

function bytesOf(value: string | Buffer): Buffer {
  return typeof value === 'string' ? Buffer.from(value, 'utf8') : value;
}

const PROPERTY_INDEX = Object.fromEntries(BASIC_PROPERTIES.map(([name], index) => [name, index])) as Record<
  PropertyName,
  number
>;

/** Where the timestamp property's 8 bytes start (the header has one). */
function timestampAt(header: ContentHeader): number {
  // The properties before it, in wire order, each of its size on the wire.
  const bytes = header.bytes;
  let p = 2;
  for (let index = 0; index < 9; index++) {
    if (!(header.flags & (0x8000 >> index))) continue;
    if (index === 2) p += 4 + bytes.readUInt32BE(p);
    else if (index === 3 || index === 4) p += 1;
    else p += 1 + (bytes[p] as number);
  }
  return p;
}
