/**
 * AMQP 0-9-1 field tables, as RabbitMQ reads and writes them, without losing anything: each field
 * keeps its type tag and exact value (64-bit integers as BigInt, long strings as bytes), and a
 * table keeps its order and any repeated names. Decoding is bounded (nesting depth, and the input
 * itself, which a content header frame bounds), so a hostile table is an error, never a stack
 * overflow.
 *
 * The bridge itself does not re-encode tables: it indexes the top level of the header table and
 * splices fields in and out as raw bytes. The typed form is for IDs, for tests and for tools.
 */

/** A field value with its AMQP type tag (RabbitMQ's set; `s` is a signed 16-bit integer). */
export type FieldValue =
  | { type: 't'; value: boolean; octet?: number }
  | { type: 'b' | 'B' | 's' | 'u' | 'I' | 'i'; value: number }
  | { type: 'l' | 'T'; value: bigint }
  | { type: 'f' | 'd'; value: number; nanBits?: Buffer }
  | { type: 'D'; places: number; digits: number }
  | { type: 'S' | 'x'; value: Buffer }
  | { type: 'V' }
  | { type: 'F'; value: Field[] }
  | { type: 'A'; value: FieldValue[] };

/** One entry of a table: its name as the bytes on the wire (a shortstr), and its value. */
export interface Field {
  name: Buffer;
  value: FieldValue;
}

/** Tables nested deeper than this are refused (RabbitMQ's own x-death is 3 deep). */
export const MAX_TABLE_DEPTH = 64;

/** A table that cannot be read: truncated, an unknown type tag, or nested too deep. */
export class FieldTableError extends Error {}

/** Fixed sizes of the scalar types, after their tag. */
const FIXED_SIZE: Record<string, number> = {
  t: 1,
  b: 1,
  B: 1,
  s: 2,
  u: 2,
  I: 4,
  i: 4,
  l: 8,
  T: 8,
  f: 4,
  d: 8,
  D: 5,
  V: 0,
};

const TAG_S = 0x53;
const TAG_x = 0x78;
const TAG_F = 0x46;
const TAG_A = 0x41;

function truncated(at: number): FieldTableError {
  return new FieldTableError(`field table truncated at byte ${at}`);
}

function need(end: number, at: number, size: number): void {
  if (at + size > end) throw truncated(at);
}

/**
 * Returns where the field value starting (at its tag) at `at` ends, checking its structure down to
 * the bottom. Throws FieldTableError for anything RabbitMQ could not have written.
 */
export function skipValue(buf: Buffer, at: number, end: number, depth = 1, deep = true): number {
  need(end, at, 1);
  const tag = buf[at] as number;
  const fixed = FIXED_SIZE[String.fromCharCode(tag)];
  if (fixed !== undefined) {
    need(end, at + 1, fixed);
    return at + 1 + fixed;
  }
  if (tag !== TAG_S && tag !== TAG_x && tag !== TAG_F && tag !== TAG_A) {
    throw new FieldTableError(
      `field table has an unknown type tag ${JSON.stringify(String.fromCharCode(tag))} (0x${tag.toString(16)}) at byte ${at}`,
    );
  }
  need(end, at + 1, 4);
  const length = buf.readUInt32BE(at + 1);
  const start = at + 5;
  need(end, start, length);
  const stop = start + length;
  if (deep && (tag === TAG_F || tag === TAG_A)) {
    if (depth >= MAX_TABLE_DEPTH) {
      throw new FieldTableError(`field table nested deeper than ${MAX_TABLE_DEPTH} levels`);
    }
    if (tag === TAG_F) skipTableBody(buf, start, stop, depth + 1);
    else for (let p = start; p < stop; ) p = skipValue(buf, p, stop, depth + 1);
  }
  return stop;
}

function skipTableBody(buf: Buffer, start: number, stop: number, depth: number): void {
  for (let p = start; p < stop; ) {
    const nameLength = buf[p] as number;
    need(stop, p + 1, nameLength);
    p = skipValue(buf, p + 1 + nameLength, stop, depth);
  }
}

/** Where one top-level field lies in a table's bytes. */
export interface FieldSpan {
  /** Start of its name's length octet: the field is bytes [start, end). */
  start: number;
  /** Start of its value (the type tag). */
  valueAt: number;
  end: number;
  name: string;
}

/**
 * Indexes the fields of a table body (without its 4-byte length) in `buf[start, end)`, checking
 * every nested value (`deep`), or only the top level: nested tables and arrays are skipped by their
 * length, so a table too deep to check can still be read and spliced at its top. Names are read
 * as UTF-8 for lookups; the bytes stay as they were.
 */
export function indexTable(buf: Buffer, start: number, end: number, deep = true): FieldSpan[] {
  const spans: FieldSpan[] = [];
  for (let p = start; p < end; ) {
    const nameLength = buf[p] as number;
    need(end, p + 1, nameLength);
    const valueAt = p + 1 + nameLength;
    const stop = skipValue(buf, valueAt, end, 1, deep);
    spans.push({ start: p, valueAt, end: stop, name: buf.toString('utf8', p + 1, valueAt) });
    p = stop;
  }
  return spans;
}

// ---- the typed form ---------------------------------------------------------------------------

/**
 * Decodes a field value at `at` (its tag) into the typed form; returns it and where it ends.
 * Tables and arrays nested `limit` deep are refused, as skipValue does.
 */
export function decodeValue(
  buf: Buffer,
  at: number,
  end: number,
  depth = 1,
  limit = MAX_TABLE_DEPTH,
): [FieldValue, number] {
  // This level's tag and length; the levels below are checked as they are decoded.
  const stop = skipValue(buf, at, end, depth, false);
  const tag = String.fromCharCode(buf[at] as number);
  if ((tag === 'F' || tag === 'A') && depth >= limit) {
    throw new FieldTableError(`field table nested deeper than ${limit} levels`);
  }
  const p = at + 1;
  switch (tag) {
    case 't': {
      const octet = buf[p] as number;
      return [
        octet === 0 || octet === 1 ? { type: 't', value: octet === 1 } : { type: 't', value: true, octet },
        stop,
      ];
    }
    case 'b':
      return [{ type: 'b', value: buf.readInt8(p) }, stop];
    case 'B':
      return [{ type: 'B', value: buf.readUInt8(p) }, stop];
    case 's':
      return [{ type: 's', value: buf.readInt16BE(p) }, stop];
    case 'u':
      return [{ type: 'u', value: buf.readUInt16BE(p) }, stop];
    case 'I':
      return [{ type: 'I', value: buf.readInt32BE(p) }, stop];
    case 'i':
      return [{ type: 'i', value: buf.readUInt32BE(p) }, stop];
    case 'l':
      return [{ type: 'l', value: buf.readBigInt64BE(p) }, stop];
    case 'T':
      return [{ type: 'T', value: buf.readBigUInt64BE(p) }, stop];
    case 'f': {
      const value = buf.readFloatBE(p);
      return [
        Number.isNaN(value)
          ? { type: 'f', value, nanBits: Buffer.from(buf.subarray(p, p + 4)) }
          : { type: 'f', value },
        stop,
      ];
    }
    case 'd': {
      const value = buf.readDoubleBE(p);
      return [
        Number.isNaN(value)
          ? { type: 'd', value, nanBits: Buffer.from(buf.subarray(p, p + 8)) }
          : { type: 'd', value },
        stop,
      ];
    }
    case 'D':
      return [{ type: 'D', places: buf.readUInt8(p), digits: buf.readUInt32BE(p + 1) }, stop];
    case 'V':
      return [{ type: 'V' }, stop];
    case 'S':
    case 'x':
      return [{ type: tag, value: Buffer.from(buf.subarray(p + 4, stop)) }, stop];
    case 'F':
      return [{ type: 'F', value: decodeTableBody(buf, p + 4, stop, depth + 1, limit) }, stop];
    default: {
      const items: FieldValue[] = [];
      for (let q = p + 4; q < stop; ) {
        const [item, next] = decodeValue(buf, q, stop, depth + 1, limit);
        items.push(item);
        q = next;
      }
      return [{ type: 'A', value: items }, stop];
    }
  }
}

function decodeTableBody(buf: Buffer, start: number, end: number, depth: number, limit: number): Field[] {
  const fields: Field[] = [];
  for (let p = start; p < end; ) {
    const nameLength = buf[p] as number;
    need(end, p + 1, nameLength);
    const name = Buffer.from(buf.subarray(p + 1, p + 1 + nameLength));
    const [value, next] = decodeValue(buf, p + 1 + nameLength, end, depth, limit);
    fields.push({ name, value });
    p = next;
  }
  return fields;
}

/**
 * Decodes a table body (the bytes after its 4-byte length) into its ordered, typed fields, refusing
 * nesting `limit` deep (no limit: as deep as the stack allows, a RangeError past that).
 */
export function decodeTable(body: Buffer, limit = MAX_TABLE_DEPTH): Field[] {
  return decodeTableBody(body, 0, body.length, 1, limit);
}

/** Encodes typed fields back into a table body; decodeTable's output comes back byte for byte. */
export function encodeTable(fields: readonly Field[]): Buffer {
  const parts: Buffer[] = [];
  for (const field of fields) {
    if (field.name.length > 255) throw new FieldTableError('a field name is longer than 255 bytes');
    parts.push(Buffer.from([field.name.length]), field.name, encodeValue(field.value));
  }
  return Buffer.concat(parts);
}

/** Encodes one typed value, with its tag. */
export function encodeValue(value: FieldValue): Buffer {
  const tag = value.type.charCodeAt(0);
  switch (value.type) {
    case 't':
      return Buffer.from([tag, value.octet ?? (value.value ? 1 : 0)]);
    case 'V':
      return Buffer.from([tag]);
    case 'S':
    case 'x':
      return withLength(tag, value.value);
    case 'F':
      return withLength(tag, encodeTable(value.value));
    case 'A':
      return withLength(tag, Buffer.concat(value.value.map(encodeValue)));
    case 'D': {
      const out = Buffer.alloc(6);
      out[0] = tag;
      out.writeUInt8(value.places, 1);
      out.writeUInt32BE(value.digits, 2);
      return out;
    }
    default:
      return encodeScalar(tag, value);
  }
}

function encodeScalar(
  tag: number,
  value: Extract<FieldValue, { type: 'b' | 'B' | 's' | 'u' | 'I' | 'i' | 'l' | 'T' | 'f' | 'd' }>,
): Buffer {
  const out = Buffer.alloc(1 + (FIXED_SIZE[value.type] as number));
  out[0] = tag;
  switch (value.type) {
    case 'b':
      out.writeInt8(value.value, 1);
      break;
    case 'B':
      out.writeUInt8(value.value, 1);
      break;
    case 's':
      out.writeInt16BE(value.value, 1);
      break;
    case 'u':
      out.writeUInt16BE(value.value, 1);
      break;
    case 'I':
      out.writeInt32BE(value.value, 1);
      break;
    case 'i':
      out.writeUInt32BE(value.value, 1);
      break;
    case 'l':
      out.writeBigInt64BE(value.value, 1);
      break;
    case 'T':
      out.writeBigUInt64BE(value.value, 1);
      break;
    case 'f':
      if (value.nanBits) value.nanBits.copy(out, 1);
      else out.writeFloatBE(value.value, 1);
      break;
    default:
      if (value.nanBits) value.nanBits.copy(out, 1);
      else out.writeDoubleBE(value.value, 1);
  }
  return out;
}

function withLength(tag: number, body: Buffer): Buffer {
  const head = Buffer.alloc(5);
  head[0] = tag;
  head.writeUInt32BE(body.length, 1);
  return Buffer.concat([head, body]);
}

/** A field (name and encoded value) as table bytes, for splicing into a table. */
export function encodeField(name: string, value: FieldValue): Buffer {
  return encodeTable([{ name: Buffer.from(name, 'utf8'), value }]);
}

// ---- amqplib's view ---------------------------------------------------------------------------

/**
 * The JavaScript value amqplib 2.x would decode for a field, for code that reads
 * `message.properties.headers` (applications using the library, logs). It loses what amqplib loses
 * (types, 64-bit precision, bytes that are not UTF-8): the bridge never forwards from it.
 */
export function toAmqplibValue(value: FieldValue): unknown {
  switch (value.type) {
    case 't':
      return value.value;
    case 'l':
      return Number(value.value);
    case 'T':
      return { '!': 'timestamp', value: Number(value.value) };
    case 'D':
      return { '!': 'decimal', value: { places: value.places, digits: value.digits } };
    case 'S':
      return value.value.toString('utf8');
    case 'x':
      return value.value;
    case 'V':
      return null;
    case 'F':
      return toAmqplibTable(value.value);
    case 'A':
      return value.value.map(toAmqplibValue);
    default:
      return value.value;
  }
}

export function toAmqplibTable(fields: readonly Field[]): Record<string, unknown> {
  const table: Record<string, unknown> = {};
  for (const field of fields) {
    // defineProperty: a field named "__proto__" is a field, not the object's prototype.
    Object.defineProperty(table, field.name.toString('utf8'), {
      value: toAmqplibValue(field.value),
      enumerable: true,
      writable: true,
      configurable: true,
    });
  }
  return table;
}

/** A field from its name and its value's wire bytes (type tag and value), for splicing. */
export function rawField(name: string, valueBytes: Buffer): Buffer {
  const nameBytes = Buffer.from(name, 'utf8');
  return Buffer.concat([Buffer.from([nameBytes.length]), nameBytes, valueBytes]);
}
