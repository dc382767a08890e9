/**
 * Bytes for tests, built by hand: AMQP 0-9-1 field tables as RabbitMQ writes them, basic content
 * header properties and frames. Nothing here uses the bridge's own codec (src/wire/fields.ts) or a
 * client library, so a test can hold the code under test to bytes no Node client wrote.
 *
 * A typed value builder returns the value as it stands in a table or an array: its type tag, then
 * its bytes. A table is its body (the fields one after another, without the 4-byte length), which
 * `nested` and `basicProperties({ headers })` frame with its length.
 *
 *   const headers = table(field('_HQ_DUPL_ID', longString('order-1')), field('n', int64(2n ** 62n + 1n)));
 *   const properties = basicProperties({ messageId: 'm-1', headers });
 */

/** Bytes written in hex, with white space anywhere for reading (`hex('0102 0304')`). */
export function hex(text: string): Buffer {
  return Buffer.from(text.replace(/\s+/g, ''), 'hex');
}

/** A short string: one length octet and up to 255 bytes (a string is taken as UTF-8). */
export function shortstr(value: string | Uint8Array): Buffer {
  const bytes = toBytes(value);
  if (bytes.length > 255) throw new RangeError(`shortstr of ${bytes.length} bytes (255 at most)`);
  return Buffer.concat([Buffer.from([bytes.length]), bytes]);
}

/** A long string: a 4-byte big-endian length and the bytes (a string is taken as UTF-8). No tag. */
function longstr(value: string | Uint8Array): Buffer {
  const bytes = toBytes(value);
  const length = Buffer.alloc(4);
  length.writeUInt32BE(bytes.length, 0);
  return Buffer.concat([length, bytes]);
}

/**
 * One table entry: the name as a shortstr, then a value. Either a tagged value from the builders
 * below (`field('n', int32(1))`), or a tag character and the bytes after it, for any tag at all,
 * unknown ones included (`field('n', 'Z', Buffer.from([1]))`).
 */
export function field(name: string | Uint8Array, value: Buffer): Buffer;
export function field(name: string | Uint8Array, tag: string, body: Uint8Array): Buffer;
export function field(name: string | Uint8Array, valueOrTag: Buffer | string, body?: Uint8Array): Buffer {
  const value = typeof valueOrTag === 'string' ? tagged(valueOrTag, body ?? Buffer.alloc(0)) : valueOrTag;
  return Buffer.concat([shortstr(name), value]);
}

/** A table body: the given fields (from `field`) in order. Frame it with `nested` or `longstr`. */
export function table(...fields: Buffer[]): Buffer {
  return Buffer.concat(fields);
}

/** A value with any one-character tag: the tag byte, then `body` as is. */
export function tagged(tag: string, body: Uint8Array = Buffer.alloc(0)): Buffer {
  if (tag.length !== 1 || tag.charCodeAt(0) > 0xff) throw new RangeError(`tag ${JSON.stringify(tag)}`);
  return Buffer.concat([Buffer.from([tag.charCodeAt(0)]), body]);
}

// ---- typed values (tag + bytes), one per RabbitMQ field type --------------------------------

/** `t`: boolean; a number gives that octet as is (RabbitMQ reads any non-zero octet as true). */
export function bool(value: boolean | number): Buffer {
  return tagged('t', Buffer.from([typeof value === 'number' ? value : value ? 1 : 0]));
}

/** `b`: signed 8-bit integer. */
export function int8(value: number): Buffer {
  return fixed('b', 1, (out) => out.writeInt8(value, 0));
}

/** `B`: unsigned 8-bit integer. */
export function uint8(value: number): Buffer {
  return fixed('B', 1, (out) => out.writeUInt8(value, 0));
}

/** `s`: signed 16-bit integer (RabbitMQ's reading of `s`, not the spec's short string). */
export function int16(value: number): Buffer {
  return fixed('s', 2, (out) => out.writeInt16BE(value, 0));
}

/** `u`: unsigned 16-bit integer. */
export function uint16(value: number): Buffer {
  return fixed('u', 2, (out) => out.writeUInt16BE(value, 0));
}

/** `I`: signed 32-bit integer. */
export function int32(value: number): Buffer {
  return fixed('I', 4, (out) => out.writeInt32BE(value, 0));
}

/** `i`: unsigned 32-bit integer. */
export function uint32(value: number): Buffer {
  return fixed('i', 4, (out) => out.writeUInt32BE(value, 0));
}

/** `l`: signed 64-bit integer. */
export function int64(value: bigint): Buffer {
  return fixed('l', 8, (out) => out.writeBigInt64BE(value, 0));
}

/** `T`: timestamp, an unsigned 64-bit integer (seconds). */
export function timestamp(value: bigint): Buffer {
  return fixed('T', 8, (out) => out.writeBigUInt64BE(value, 0));
}

/** `f`: 32-bit float (the number rounded to float32, as every client writes it). */
export function float32(value: number): Buffer {
  return fixed('f', 4, (out) => out.writeFloatBE(value, 0));
}

/** `f` from its raw bits, e.g. a NaN with a payload: `float32Bits(0x7fc00001)`. */
export function float32Bits(bits: number): Buffer {
  return fixed('f', 4, (out) => out.writeUInt32BE(bits, 0));
}

/** `d`: 64-bit float. `float64(-0)` writes the sign bit. */
export function float64(value: number): Buffer {
  return fixed('d', 8, (out) => out.writeDoubleBE(value, 0));
}

/** `d` from its raw bits, e.g. a NaN with a payload: `float64Bits(0x7ff8000000000001n)`. */
export function float64Bits(bits: bigint): Buffer {
  return fixed('d', 8, (out) => out.writeBigUInt64BE(bits, 0));
}

/** `D`: decimal, `digits` (unsigned 32-bit) scaled down by 10^`places` (octet). */
export function decimal(places: number, digits: number): Buffer {
  return fixed('D', 5, (out) => {
    out.writeUInt8(places, 0);
    out.writeUInt32BE(digits, 1);
  });
}

/** `S`: long string; bytes as given (need not be UTF-8), a string as UTF-8. */
export function longString(value: string | Uint8Array): Buffer {
  return tagged('S', longstr(value));
}

/** `x`: byte array. */
export function bytes(value: string | Uint8Array): Buffer {
  return tagged('x', longstr(value));
}

/** `V`: void (no bytes after the tag). */
export function voidValue(): Buffer {
  return tagged('V');
}

/** `F`: a nested table, from a table body (`table(...)`). */
export function nested(body: Buffer): Buffer {
  return tagged('F', longstr(body));
}

/** `A`: an array of tagged values. */
export function array(...values: Buffer[]): Buffer {
  return tagged('A', longstr(Buffer.concat(values)));
}

/**
 * `depth` arrays (tag `A`) or tables (tag `F`, one field "a" each), each inside the one around it,
 * the innermost empty, as one tagged value: `deepValue(2)` is `A [A []]`, `deepValue(2, 'F')` is
 * `F {a: F {}}`. Built in one pass: 12,000 levels cost 60 to 84 kB, not a quadratic copy.
 */
export function deepValue(depth: number, tag: 'A' | 'F' = 'A'): Buffer {
  const step = tag === 'A' ? 5 : 7;
  const total = step * (depth - 1) + 5;
  const out = Buffer.alloc(depth > 0 ? total : 0);
  for (let level = 0; level < depth; level++) {
    const at = step * level;
    out[at] = tag.charCodeAt(0);
    out.writeUInt32BE(total - at - 5, at + 1);
    if (tag === 'F' && level < depth - 1) {
      out[at + 5] = 1;
      out[at + 6] = 0x61; // "a"
    }
  }
  return out;
}

// ---- basic content header -------------------------------------------------------------------

/** The basic class's properties; absent ones are left out (their flag bit clear). */
export interface BasicProperties {
  contentType?: string | Uint8Array;
  contentEncoding?: string | Uint8Array;
  /** A table body (`table(...)`); its 4-byte length is added here. */
  headers?: Buffer;
  deliveryMode?: number;
  priority?: number;
  correlationId?: string | Uint8Array;
  replyTo?: string | Uint8Array;
  expiration?: string | Uint8Array;
  messageId?: string | Uint8Array;
  /** Seconds since the epoch, as the unsigned 64-bit integer on the wire. */
  timestamp?: bigint;
  type?: string | Uint8Array;
  userId?: string | Uint8Array;
  appId?: string | Uint8Array;
  clusterId?: string | Uint8Array;
}

/** The fourteen properties in wire order; property i has flag bit 0x8000 >> i. */
export const PROPERTY_ORDER = [
  'contentType',
  'contentEncoding',
  'headers',
  'deliveryMode',
  'priority',
  'correlationId',
  'replyTo',
  'expiration',
  'messageId',
  'timestamp',
  'type',
  'userId',
  'appId',
  'clusterId',
] as const satisfies readonly (keyof BasicProperties)[];

/**
 * The property flags (2 bytes) and property list of a basic content header: what follows class
 * id, weight and body size in a header frame's payload.
 */
export function basicProperties(properties: BasicProperties = {}): Buffer {
  let flags = 0;
  const list: Buffer[] = [];
  PROPERTY_ORDER.forEach((name, index) => {
    const value = properties[name];
    if (value === undefined) return;
    flags |= 0x8000 >> index;
    if (name === 'headers') list.push(longstr(value as Buffer));
    else if (name === 'deliveryMode' || name === 'priority') list.push(Buffer.from([value as number]));
    else if (name === 'timestamp') {
      const stamp = Buffer.alloc(8);
      stamp.writeBigUInt64BE(value as bigint, 0);
      list.push(stamp);
    } else list.push(shortstr(value as string | Uint8Array));
  });
  const head = Buffer.alloc(2);
  head.writeUInt16BE(flags, 0);
  return Buffer.concat([head, ...list]);
}

// ---- frames ---------------------------------------------------------------------------------

/** A frame: type octet, channel, payload size, payload, frame-end octet 0xCE. */
export function frame(type: 1 | 2 | 3 | 8, channel: number, payload: Buffer): Buffer {
  const head = Buffer.alloc(7);
  head.writeUInt8(type, 0);
  head.writeUInt16BE(channel, 1);
  head.writeUInt32BE(payload.length, 3);
  return Buffer.concat([head, payload, Buffer.from([0xce])]);
}

/** A basic content header frame: class 60, weight 0, the body size, then `properties`. */
export function contentHeaderFrame(channel: number, bodySize: number, properties: Buffer): Buffer {
  const head = Buffer.alloc(12);
  head.writeUInt16BE(60, 0);
  head.writeUInt16BE(0, 2);
  head.writeBigUInt64BE(BigInt(bodySize), 4);
  return frame(2, channel, Buffer.concat([head, properties]));
}

// ---- internals ------------------------------------------------------------------------------

function toBytes(value: string | Uint8Array): Buffer {
  return typeof value === 'string' ? Buffer.from(value, 'utf8') : Buffer.from(value);
}

function fixed(tag: string, size: number, write: (out: Buffer) => void): Buffer {
  const body = Buffer.alloc(size);
  write(body);
  return tagged(tag, body);
}

const MAX_I64 = 2n ** 63n - 1n;
const MIN_I64 = -(2n ** 63n);

/**
 * A header field of every scalar type at its edges (zeros, extremes, -0, a subnormal, text that is
 * not UTF-8, long values, repeated and empty names), as a Java, .NET or Python producer can send
 * them: the stream tests' corpus.
 */
export function everyScalarField(): Buffer[] {
  return [
    field('bool-true', bool(true)),
    field('bool-false', bool(false)),
    field('bool-octet-2', bool(2)),
    field('i8', int8(-128)),
    field('i8-zero', int8(0)),
    field('u8', uint8(255)),
    field('i16', int16(-32768)),
    field('u16', uint16(65535)),
    field('i32-small', int32(-5)),
    field('i32-min', int32(-(2 ** 31))),
    field('i32-zero', int32(0)),
    field('u32-zero', uint32(0)),
    field('u32-small', uint32(200)),
    field('u32-max', uint32(4_294_967_295)),
    field('i64-zero', int64(0n)),
    field('i64-small', int64(-128n)),
    field('i64-max', int64(MAX_I64)),
    field('i64-min', int64(MIN_I64)),
    field('i64-snowflake', int64(2n ** 62n + 1n)),
    field('f32', float32(1.5)),
    field('f32-zero', float32(0)),
    field('f32-neg-zero', float32(-0)),
    field('f64', float64(Math.PI)),
    field('f64-neg-zero', float64(-0)),
    field('f64-tiny', float64(5e-324)),
    field('ts', timestamp(1_700_000_000n)),
    field('ts-zero', timestamp(0n)),
    field('S', longString('text é')),
    field('S-empty', longString('')),
    field('S-not-utf8', longString(Buffer.from([0x80, 0x00, 0xff, 0x01]))),
    field('S-long', longString('x'.repeat(300))),
    field('x-bytes', bytes(Buffer.from([0, 1, 2, 254, 255]))),
    field('x-empty', bytes('')),
    field('x-long', bytes(Buffer.alloc(400, 7))),
    field('void', voidValue()),
    field('repeated', int32(1)),
    field('repeated', longString('second')),
    field('k'.repeat(255), longString('a 255-byte name')),
    field('', longString('an empty name')),
  ];
}
