import { isUtf8 } from 'node:buffer';
import { createHash } from 'node:crypto';
import type { IdStrategy } from '../config/id-from.js';
import { DUPLICATE_ID_HEADER } from '../headers.js';
import { encodeValue, type FieldSpan, type FieldValue } from '../wire/fields.js';
import type { ContentHeader } from '../wire/properties.js';

/** IDs longer than this many bytes are keyed by their SHA-256, so keys stay small. */
export const MAX_ID_BYTES = 200;

// Keys of non-text IDs carry a type prefix; a text ID that happens to start with one is keyed by
// its bytes, so no two different IDs can share a key.
const RESERVED_PREFIXES = ['bytes:', 'num:', 'bool:', 'sha256:'];

// Fixed namespace for content IDs: changing it would change every content-derived ID.
const CONTENT_NAMESPACE = Buffer.from('3f1c7a529b0e4d4e8f5a6c2b9d1e0a47', 'hex');

// Headers that differ between deliveries of the same message, or that the bridge itself writes.
const VOLATILE_HEADER = /^(x-death|x-first-death-|x-last-death-|x-delivery-count|x-dedup-)/;

/** The parts of an AMQP message the ID strategies look at: its raw content header among them. */
export interface IdSource {
  content: Buffer;
  /** As the broker sent them: bytes where the connection kept them (see routingBytesOf). */
  exchange: string | Buffer;
  routingKey: string | Buffer;
  header: ContentHeader;
  /** The source's own name for the message (a stream's position of it), for `--id-from offset`. */
  position?: string | undefined;
}

export interface DedupId {
  /** The cache key of the ID (without prefix and scope). */
  key: string;
  /**
   * What `_HQ_DUPL_ID` carries on the target, as field value bytes (type tag and value): the ID
   * header's own bytes, or the key as a long string for IDs from the message ID or the content.
   */
  value: Buffer;
  /** True when the ID is the message's own `_HQ_DUPL_ID`, which then travels untouched. */
  own: boolean;
  strategy: string;
}

interface IdResult {
  id: DedupId | undefined;
  /** Strategies that matched a header of a type that cannot be an ID, e.g. "header:X (table)". */
  rejected: string[];
}

/** Applies the strategies in order; the first that the message has wins. */
export function deriveId(message: IdSource, strategies: readonly IdStrategy[]): IdResult {
  const rejected: string[] = [];
  const header = message.header;
  for (const strategy of strategies) {
    if (strategy.kind === 'header') {
      const span = header.field(strategy.name);
      if (span === undefined) continue;
      const key = keyOfSpan(header, span);
      if (key === undefined) {
        rejected.push(`header:${strategy.name} (${typeName(header.valueOf(span))})`);
        continue;
      }
      return {
        id: {
          key,
          value: header.valueBytes(span),
          own: strategy.name === DUPLICATE_ID_HEADER,
          strategy: `header:${strategy.name}`,
        },
        rejected,
      };
    }
    if (strategy.kind === 'offset') {
      if (message.position === undefined) continue;
      // As `_HQ_DUPL_ID` text: a later hop reading that header keys it the same.
      const text = Buffer.from(message.position, 'utf8');
      return {
        id: {
          key: keyOfBytes(text),
          value: encodeValue({ type: 'S', value: text }),
          own: false,
          strategy: 'offset',
        },
        rejected,
      };
    }
    if (strategy.kind === 'message-id') {
      const bytes = header.messageIdBytes;
      if (bytes === undefined || bytes.length === 0) continue;
      // `_HQ_DUPL_ID` carries the message_id's own bytes, which key back to the same ID.
      const value = encodeValue({ type: 'S', value: Buffer.from(bytes) });
      return { id: { key: keyOfBytes(bytes), value, own: false, strategy: 'message-id' }, rejected };
    }
    const key = contentId(message);
    return { id: { key, value: longString(key), own: false, strategy: 'content' }, rejected };
  }
  return { id: undefined, rejected };
}

function longString(text: string): Buffer {
  return encodeValue({ type: 'S', value: Buffer.from(text, 'utf8') });
}

/**
 * The cache key of a field value as it came off the wire, or undefined when its type cannot be an
 * ID. Long strings and byte arrays by their bytes (valid UTF-8 is the same ID as that text);
 * integers of every width, and finite floats, by their exact numeric value (so `I 42`, `l 42` and
 * `d 42.0` are one ID, `f 0.1` and `d 0.1` are two); booleans as such. Void, tables, arrays,
 * decimals, timestamps, NaN and infinities are not IDs.
 */
export function keyOfField(value: FieldValue): string | undefined {
  switch (value.type) {
    case 'S':
    case 'x':
      return value.value.length > 0 ? keyOfBytes(value.value) : undefined;
    case 'b':
    case 'B':
    case 's':
    case 'u':
    case 'I':
    case 'i':
    case 'f':
    case 'd':
      return keyOfNumber(value.value);
    case 'l':
      return `num:${value.value}`;
    case 't':
      return `bool:${value.value}`;
    default:
      return undefined;
  }
}

const TAG_LONG_STRING = 0x53; // 'S'
const TAG_BYTES = 0x78; // 'x'

/**
 * The key of a header field, as keyOfField gives it. A long string or byte array, what IDs mostly
 * are, is keyed from the header's own bytes, without a typed value and a copy of them.
 */
function keyOfSpan(header: ContentHeader, span: FieldSpan): string | undefined {
  const bytes = header.bytes;
  const tag = bytes[span.valueAt];
  if (tag === TAG_LONG_STRING || tag === TAG_BYTES) {
    // The span was checked when the table was indexed: its value's length ends it.
    const start = span.valueAt + 5;
    return span.end > start ? keyOfBytes(bytes.subarray(start, span.end)) : undefined;
  }
  return keyOfField(header.valueOf(span));
}

/**
 * The cache key of an ID given as a JavaScript value (the library's producers, the cache tools): it
 * is the key the bridge computes for the field amqplib encodes from that value.
 */
export function keyOfValue(value: unknown): string | undefined {
  // The bytes amqplib writes for it (a lone surrogate becomes U+FFFD).
  if (typeof value === 'string') return value.length > 0 ? keyOfBytes(Buffer.from(value, 'utf8')) : undefined;
  if (Buffer.isBuffer(value)) return value.length > 0 ? keyOfBytes(value) : undefined;
  if (typeof value === 'number') return keyOfNumber(value);
  if (typeof value === 'bigint') return `num:${value}`;
  if (typeof value === 'boolean') return `bool:${value}`;
  return undefined;
}

// A number's exact value (-0 is 0, as IEEE compares them). JavaScript's shortest text for a double is exact below 2^53 and never
// looks like an integer when the double is not one; between 2^53 and 10^21 (where 64-bit integers
// live) an integral double is written with all its digits, so that it cannot meet an `l` of another
// value. From 10^21 on the text has an exponent, which no integer key has (as earlier versions).
function keyOfNumber(value: number): string | undefined {
  if (!Number.isFinite(value)) return undefined;
  if (Number.isInteger(value) && !Number.isSafeInteger(value) && Math.abs(value) < 1e21) {
    return `num:${BigInt(value)}`;
  }
  return capLength(`num:${value}`);
}

function keyOfText(text: string): string {
  if (RESERVED_PREFIXES.some((prefix) => text.startsWith(prefix))) {
    return capLength(`bytes:${Buffer.from(text, 'utf8').toString('hex')}`);
  }
  return capLength(text);
}

// The same bytes give the same key whether they arrive as a long string or a byte array: bytes
// that are valid UTF-8 are keyed as that text, others by their hex form.
export function keyOfBytes(bytes: Buffer): string {
  if (isUtf8(bytes)) return keyOfText(bytes.toString('utf8'));
  return capLength(`bytes:${bytes.toString('hex')}`);
}

function capLength(key: string): string {
  if (Buffer.byteLength(key, 'utf8') <= MAX_ID_BYTES) return key;
  return `sha256:${createHash('sha256').update(key, 'utf8').digest('hex')}`;
}

const TYPE_NAMES: Record<string, string> = {
  V: 'void',
  F: 'table',
  A: 'array',
  D: 'decimal',
  T: 'timestamp',
};

function typeName(value: FieldValue): string {
  if (value.type === 'S' || value.type === 'x') return 'empty';
  if (value.type === 'f' || value.type === 'd') return Number.isNaN(value.value) ? 'NaN' : 'infinite';
  return TYPE_NAMES[value.type] ?? value.type;
}

/**
 * UUIDv5 of a SHA-256 over body, exchange, routing key and the stable headers. Headers are sorted by
 * name (a producer's map order does not matter) and hashed by type and exact bytes: an `I 5` and an
 * `l 5`, or a decimal and a table that spells it out, are different messages.
 */
export function contentId(message: IdSource): string {
  const hash = createHash('sha256');
  hashName(hash, message.exchange);
  hashName(hash, message.routingKey);
  const header = message.header;
  const fields = (header.fields ?? [])
    .filter((span) => !VOLATILE_HEADER.test(span.name))
    .map((span) => ({
      name: header.bytes.subarray(span.start + 1, span.valueAt),
      value: () => header.valueOf(span),
    }));
  hashFields(hash, fields);
  hash.update(`body:${message.content.length}\n`);
  hash.update(message.content);
  return nameBasedUuid(CONTENT_NAMESPACE, hash.digest());
}

/** An RFC 9562 version 5 UUID (SHA-1 of namespace and name), as the uuid package's v5 makes it. */
function nameBasedUuid(namespace: Buffer, name: Buffer): string {
  const bytes = createHash('sha1').update(namespace).update(name).digest().subarray(0, 16);
  bytes[6] = ((bytes[6] as number) & 0x0f) | 0x50;
  bytes[8] = ((bytes[8] as number) & 0x3f) | 0x80;
  const hex = bytes.toString('hex');
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

type Hash = ReturnType<typeof createHash>;

// An exchange or routing key: as text where it is UTF-8, else its bytes behind a mark that text's
// form never starts with.
function hashName(hash: Hash, name: string | Buffer): void {
  const text = typeof name === 'string' ? name : isUtf8(name) ? name.toString('utf8') : undefined;
  if (text !== undefined) {
    hash.update(`${text.length}:${text}\n`);
  } else {
    hash.update(`#${name.length}:`);
    hash.update(name);
    hash.update('\n');
  }
}

interface HashedField {
  name: Buffer;
  value: () => FieldValue;
}

// Fields sorted by name; a repeated name is hashed once per value, in their order.
function hashFields(hash: Hash, fields: HashedField[]): void {
  const byName = new Map<string, HashedField[]>();
  for (const field of fields) {
    // A name that is not UTF-8 sorts by its hex form after the others.
    const name = isUtf8(field.name) ? field.name.toString('utf8') : `\uffff${field.name.toString('hex')}`;
    const same = byName.get(name);
    if (same) same.push(field);
    else byName.set(name, [field]);
  }
  for (const name of [...byName.keys()].sort()) {
    for (const field of byName.get(name) as HashedField[]) {
      if (isUtf8(field.name)) {
        hash.update(`${name.length}:${name}=`);
      } else {
        // Its raw bytes, behind a mark no UTF-8 name's form starts with (those start with a digit).
        hash.update(`#${field.name.length}:`);
        hash.update(field.name);
        hash.update('=');
      }
      hashValue(hash, field.value());
    }
  }
}

// Each value by its AMQP type tag and exact bytes (the wire's own encoding, which is self-delimiting),
// so no two different headers hash alike; tables by their fields sorted by name, at any depth.
function hashValue(hash: Hash, value: FieldValue): void {
  switch (value.type) {
    case 'A':
      hash.update(`A${value.value.length}[`);
      for (const item of value.value) hashValue(hash, item);
      hash.update(']');
      return;
    case 'F':
      hash.update(`F${value.value.length}{`);
      hashFields(
        hash,
        value.value.map((field) => ({ name: field.name, value: () => field.value })),
      );
      hash.update('}');
      return;
    default:
      hash.update(encodeValue(value));
  }
}
