import { encodeTable, type Field, type FieldValue } from '../wire/fields.js';
import { ContentHeader } from '../wire/properties.js';

/**
 * A message read from a stream (its stored AMQP 1.0 sections) as the AMQP 0-9-1 message the
 * pipeline forwards: the inverse of amqp10.ts's table, RabbitMQ 3.9–3.12's mapping, so that a
 * message a 0-9-1 client published into the stream comes out as that client sent it (bar what
 * RabbitMQ itself did not store: tables, arrays, cluster-id). Messages other clients wrote over
 * the stream protocol map the same way, value by value (see docs/streams.md); a body that is not
 * one data section (an amqp-value, an amqp-sequence) has no 0-9-1 form and is refused, unless the
 * copy goes into a stream (`anyBody`), which writes the stored bytes.
 *
 * `replaceApplicationProperties` is the other half of a stream-to-stream copy: the stored bytes as
 * they are, but for the bridge's own entries.
 */

/** The stored bytes have no 0-9-1 form (or are not AMQP 1.0 sections at all). */
class UndecodableError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'UndecodableError';
  }
}

export interface DecodedMessage {
  header: ContentHeader;
  body: Buffer;
  /** As the 0-9-1 publish named them (message annotations x-exchange and x-routing-key). */
  exchange: Buffer;
  routingKey: Buffer;
}

/** The message-id's place in the 0-9-1 property list. */
const MESSAGE_ID_INDEX = 8;
const HEADER = 0x70;
const DELIVERY_ANNOTATIONS = 0x71;
const MESSAGE_ANNOTATIONS = 0x72;
const PROPERTIES = 0x73;
const APPLICATION_PROPERTIES = 0x74;
const DATA = 0x75;
const AMQP_SEQUENCE = 0x76;
const AMQP_VALUE = 0x77;
const FOOTER = 0x78;

/** One AMQP 1.0 value as read: its constructor, and its bytes [at, end). */
interface Value {
  code: number;
  at: number;
  end: number;
  /** Where the value's payload starts (after constructor and any size/count). */
  payload: number;
}

/** Reads the value at `at` (a described one as its descriptor's constructor 0x00). */
function valueAt(bytes: Buffer, at: number): Value {
  const code = need(bytes, at, 1)[at] as number;
  if (code === 0x00) {
    const descriptor = valueAt(bytes, at + 1);
    const inner = valueAt(bytes, descriptor.end);
    return { code, at, end: inner.end, payload: inner.at };
  }
  const width = code >> 4;
  switch (width) {
    case 0x4:
      return { code, at, end: at + 1, payload: at + 1 };
    case 0x5:
      return { code, at, end: need(bytes, at, 2) && at + 2, payload: at + 1 };
    case 0x6:
      return { code, at, end: need(bytes, at, 3) && at + 3, payload: at + 1 };
    case 0x7:
      return { code, at, end: need(bytes, at, 5) && at + 5, payload: at + 1 };
    case 0x8:
      return { code, at, end: need(bytes, at, 9) && at + 9, payload: at + 1 };
    case 0x9:
      return { code, at, end: need(bytes, at, 17) && at + 17, payload: at + 1 };
    case 0xa:
    case 0xc:
    case 0xe: {
      const size = need(bytes, at, 2)[at + 1] as number;
      need(bytes, at, 2 + size);
      return { code, at, end: at + 2 + size, payload: at + 2 };
    }
    case 0xb:
    case 0xd:
    case 0xf: {
      const size = need(bytes, at, 5).readUInt32BE(at + 1);
      need(bytes, at, 5 + size);
      return { code, at, end: at + 5 + size, payload: at + 5 };
    }
    default:
      throw new UndecodableError(`no AMQP 1.0 type 0x${code.toString(16)} at byte ${at}`);
  }
}

function need(bytes: Buffer, at: number, size: number): Buffer {
  if (at + size > bytes.length) throw new UndecodableError(`AMQP 1.0 value cut short at byte ${at}`);
  return bytes;
}

/** The items of a list (0x45, 0xc0, 0xd0) or map (0xc1, 0xd1) value. */
function itemsOf(bytes: Buffer, value: Value): Value[] {
  if (value.code === 0x45) return [];
  let count: number;
  let at: number;
  if (value.code === 0xc0 || value.code === 0xc1) {
    count = bytes[value.at + 2] as number;
    at = value.at + 3;
  } else if (value.code === 0xd0 || value.code === 0xd1) {
    count = bytes.readUInt32BE(value.at + 5);
    at = value.at + 9;
  } else throw new UndecodableError(`0x${value.code.toString(16)} at byte ${value.at} is not a list or map`);
  const out: Value[] = [];
  for (let i = 0; i < count; i++) {
    const item = valueAt(bytes, at);
    out.push(item);
    at = item.end;
  }
  if (at !== value.end)
    throw new UndecodableError(`a list or map at byte ${value.at} does not end where its size says`);
  return out;
}

/** The sections of a stored message: each [descriptor code, the section's value, its start]. */
function sectionsOf(bytes: Buffer): { descriptor: number; value: Value; start: number }[] {
  const out: { descriptor: number; value: Value; start: number }[] = [];
  let at = 0;
  while (at < bytes.length) {
    if (bytes[at] !== 0x00 || bytes[at + 1] !== 0x53) {
      throw new UndecodableError(`no AMQP 1.0 section at byte ${at}`);
    }
    const descriptor = need(bytes, at, 3)[at + 2] as number;
    const value = valueAt(bytes, at + 3);
    out.push({ descriptor, value, start: at });
    at = value.end;
  }
  return out;
}

const isString = (code: number) => code === 0xa1 || code === 0xb1 || code === 0xa3 || code === 0xb3;
const isBinary = (code: number) => code === 0xa0 || code === 0xb0;

/** The bytes of a string, symbol or binary value. */
function bytesOf(bytes: Buffer, value: Value): Buffer {
  return bytes.subarray(value.payload, value.end);
}

/** A map's keys as text (strings or symbols), with their values. */
function mapOf(bytes: Buffer, value: Value): [Buffer, Value][] {
  const items = itemsOf(bytes, value);
  const out: [Buffer, Value][] = [];
  for (let i = 0; i + 1 < items.length; i += 2) {
    const key = items[i] as Value;
    if (!isString(key.code)) continue;
    out.push([bytesOf(bytes, key), items[i + 1] as Value]);
  }
  return out;
}

/** An AMQP 1.0 scalar as a 0-9-1 field value, as RabbitMQ 3.10 converts it; undefined: dropped. */
function fieldValueOf(bytes: Buffer, value: Value): FieldValue | undefined {
  const p = value.payload;
  switch (value.code) {
    case 0x40:
      return { type: 'V' };
    case 0x41:
      return { type: 't', value: true };
    case 0x42:
      return { type: 't', value: false };
    case 0x56: {
      const octet = bytes[p] as number;
      return octet === 0 || octet === 1 ? { type: 't', value: octet === 1 } : { type: 't', value: true };
    }
    case 0x51:
      return { type: 'b', value: bytes.readInt8(p) };
    case 0x50:
      return { type: 'B', value: bytes[p] as number };
    case 0x61:
      return { type: 's', value: bytes.readInt16BE(p) };
    case 0x60:
      return { type: 'u', value: bytes.readUInt16BE(p) };
    case 0x71:
      return { type: 'I', value: bytes.readInt32BE(p) };
    case 0x54:
      return { type: 'I', value: bytes.readInt8(p) };
    case 0x70:
      return { type: 'i', value: bytes.readUInt32BE(p) };
    case 0x52:
      return { type: 'i', value: bytes[p] as number };
    case 0x43:
      return { type: 'i', value: 0 };
    case 0x81:
      return { type: 'l', value: bytes.readBigInt64BE(p) };
    case 0x55:
      return { type: 'l', value: BigInt(bytes.readInt8(p)) };
    case 0x72:
      return { type: 'f', value: bytes.readFloatBE(p) };
    case 0x82:
      return { type: 'd', value: bytes.readDoubleBE(p) };
    case 0x83:
      return { type: 'T', value: BigInt.asUintN(64, bytes.readBigInt64BE(p) / 1000n) };
    case 0xa1:
    case 0xb1:
    case 0xa3:
    case 0xb3:
      return { type: 'S', value: Buffer.from(bytesOf(bytes, value)) };
    case 0xa0:
    case 0xb0:
      return { type: 'x', value: Buffer.from(bytesOf(bytes, value)) };
    default:
      return undefined;
  }
}

/**
 * A message-id or correlation-id as RabbitMQ 3.10 hands it to a 0-9-1 consumer: a string as it is;
 * a ulong in decimal, a uuid in its text form and binary in base64, each with a header
 * `x-message-id-type` (or `x-correlation-id-type`) naming the AMQP 1.0 type.
 */
function idOf(bytes: Buffer, value: Value): { text: Buffer; type?: string } | undefined {
  if (value.code === 0x40) return undefined;
  if (isString(value.code)) return { text: Buffer.from(bytesOf(bytes, value)) };
  if (isBinary(value.code))
    return { text: Buffer.from(bytesOf(bytes, value).toString('base64')), type: 'binary' };
  if (value.code === 0x80)
    return { text: Buffer.from(bytes.readBigUInt64BE(value.payload).toString()), type: 'ulong' };
  if (value.code === 0x53) return { text: Buffer.from(String(bytes[value.payload])), type: 'ulong' };
  if (value.code === 0x44) return { text: Buffer.from('0'), type: 'ulong' };
  if (value.code === 0x98) {
    const hex = bytes.subarray(value.payload, value.payload + 16).toString('hex');
    const text = `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
    return { text: Buffer.from(text), type: 'uuid' };
  }
  return undefined;
}

/**
 * `stream`: the routing key of a message that names none (one a stream client wrote), as RabbitMQ
 * delivers it over 0-9-1: the stream's name, through the default exchange. With `anyBody`, a body
 * with no 0-9-1 form is no error (and the body returned is the stored message's first data
 * section, if any): for a copy into another stream, which writes the stored bytes.
 */
export function decodeMessage(
  data: Buffer,
  stream: string,
  { anyBody = false, keepMessageId = false } = {},
): DecodedMessage {
  const props: Partial<Record<string, Buffer>> = {};
  const fields: Field[] = [];
  // The AMQP 1.0 types of a message-id or correlation-id that is not a string, as headers.
  const idTypes: [string, string][] = [];
  let deliveryMode: number | undefined;
  let priority: number | undefined;
  let timestamp: bigint | undefined;
  let exchange = Buffer.alloc(0);
  let routingKey = Buffer.from(stream, 'utf8');
  const body: Buffer[] = [];
  let bodyKind: 'none' | 'data' | 'other' = 'none';
  for (const { descriptor, value: inner } of sectionsOf(data)) {
    if (descriptor === MESSAGE_ANNOTATIONS) {
      for (const [key, item] of mapOf(data, inner)) {
        const name = key.toString('latin1');
        if (name === 'x-exchange' && isString(item.code)) exchange = Buffer.from(bytesOf(data, item));
        else if (name === 'x-routing-key' && isString(item.code))
          routingKey = Buffer.from(bytesOf(data, item));
        else if (name === 'x-basic-delivery-mode') deliveryMode = numberOf(data, item);
        else if (name === 'x-basic-priority') priority = numberOf(data, item);
        else if (name === 'x-basic-expiration' && isString(item.code)) props.expiration = bytesOf(data, item);
      }
    } else if (descriptor === HEADER) {
      const [durable, priorityItem] = itemsOf(data, inner);
      if (durable?.code === 0x41 || (durable?.code === 0x56 && data[durable.payload] !== 0))
        deliveryMode ??= 2;
      if (priorityItem && priorityItem.code === 0x50) priority ??= data[priorityItem.payload];
    } else if (descriptor === PROPERTIES) {
      const items = itemsOf(data, inner);
      const at = (i: number) => items[i];
      const messageId = at(0) && idOf(data, at(0) as Value);
      if (messageId) {
        props.messageId = messageId.text;
        if (messageId.type) idTypes.push(['x-message-id-type', messageId.type]);
      }
      const userId = at(1);
      if (userId && (isBinary(userId.code) || isString(userId.code))) props.userId = bytesOf(data, userId);
      const replyTo = at(4);
      if (replyTo && isString(replyTo.code)) props.replyTo = bytesOf(data, replyTo);
      const correlationId = at(5) && idOf(data, at(5) as Value);
      if (correlationId) {
        props.correlationId = correlationId.text;
        if (correlationId.type) idTypes.push(['x-correlation-id-type', correlationId.type]);
      }
      const contentType = at(6);
      if (contentType && isString(contentType.code)) props.contentType = bytesOf(data, contentType);
      const contentEncoding = at(7);
      if (contentEncoding && isString(contentEncoding.code))
        props.contentEncoding = bytesOf(data, contentEncoding);
      const created = at(9);
      if (created && created.code === 0x83)
        timestamp = BigInt.asUintN(64, data.readBigInt64BE(created.payload) / 1000n);
    } else if (descriptor === APPLICATION_PROPERTIES) {
      for (const [key, item] of mapOf(data, inner)) {
        const name = key.toString('latin1');
        if (name === 'x-basic-type' && props.type === undefined && isString(item.code)) {
          props.type = bytesOf(data, item);
          continue;
        }
        if (name === 'x-basic-app-id' && props.appId === undefined && isString(item.code)) {
          props.appId = bytesOf(data, item);
          continue;
        }
        if (key.length > 255) {
          // A copy into a stream keeps it in the stored bytes; 0-9-1 has no such field name.
          if (anyBody) continue;
          throw new UndecodableError(`an application property name of ${key.length} bytes has no 0-9-1 form`);
        }
        const converted = fieldValueOf(data, item);
        if (converted !== undefined) fields.push({ name: Buffer.from(key), value: converted });
      }
    } else if (descriptor === DATA) {
      if (!isBinary(inner.code)) throw new UndecodableError('a data section that is not binary');
      body.push(bytesOf(data, inner));
      bodyKind = bodyKind === 'other' ? 'other' : 'data';
    } else if (descriptor === AMQP_VALUE || descriptor === AMQP_SEQUENCE) {
      bodyKind = 'other';
    } else if (descriptor !== DELIVERY_ANNOTATIONS && descriptor !== FOOTER) {
      throw new UndecodableError(`an unknown section 0x${descriptor.toString(16)}`);
    }
  }
  // anyBody: the header alone is wanted (a stream-to-stream copy writes the stored bytes).
  if (bodyKind === 'other' && !anyBody) {
    throw new UndecodableError('its body is an amqp-value or amqp-sequence, which has no AMQP 0-9-1 form');
  }
  if (body.length > 1 && !anyBody) {
    throw new UndecodableError(`its body is ${body.length} data sections, not one`);
  }
  for (const [name, type] of idTypes) {
    fields.push({ name: Buffer.from(name), value: { type: 'S', value: Buffer.from(type) } });
  }
  // The content header: property flags, then each property present, in wire order.
  let flags = 0;
  const list: Buffer[] = [];
  const put = (index: number, bytes: Buffer) => {
    flags |= 0x8000 >> index;
    list.push(bytes);
  };
  // A string property over 255 bytes has no 0-9-1 form. A copy into a stream writes the stored
  // bytes, which keep it: its header, which serves only the ID and the marks, goes without.
  // The message-id, though, when the route may key the entry on it (`keepMessageId`): without it
  // the next --id-from strategy would key the entry, and two entries could share an ID.
  const short = (index: number, value: Buffer | undefined) => {
    if (value === undefined) return;
    if (value.length <= 255) put(index, Buffer.concat([Buffer.from([value.length]), value]));
    else if (!anyBody || (index === MESSAGE_ID_INDEX && keepMessageId))
      throw new UndecodableError(`a property of ${value.length} bytes has no 0-9-1 form (255 at most)`);
  };
  short(0, props.contentType);
  short(1, props.contentEncoding);
  if (fields.length > 0) {
    const table = encodeTable(fields);
    const size = Buffer.alloc(4);
    size.writeUInt32BE(table.length, 0);
    put(2, Buffer.concat([size, table]));
  }
  if (deliveryMode !== undefined) put(3, Buffer.from([deliveryMode]));
  if (priority !== undefined) put(4, Buffer.from([priority]));
  short(5, props.correlationId);
  short(6, props.replyTo);
  short(7, props.expiration);
  short(MESSAGE_ID_INDEX, props.messageId);
  if (timestamp !== undefined) {
    const stamp = Buffer.alloc(8);
    stamp.writeBigUInt64BE(timestamp, 0);
    put(9, stamp);
  }
  short(10, props.type);
  short(11, props.userId);
  short(12, props.appId);
  const head = Buffer.alloc(2);
  head.writeUInt16BE(flags, 0);
  return {
    header: new ContentHeader(Buffer.concat([head, ...list])),
    body: body[0] ?? Buffer.alloc(0),
    exchange,
    routingKey,
  };
}

function numberOf(bytes: Buffer, value: Value): number | undefined {
  const converted = fieldValueOf(bytes, value);
  return converted !== undefined && typeof (converted as { value?: unknown }).value === 'number'
    ? (converted as { value: number }).value
    : undefined;
}

/**
 * The stored message with the application-properties entries named in `remove` taken out and
 * `append` added last, as utf8 strings; every other byte as it was. A message with no
 * application-properties gets them where the section order puts them (before the body).
 */
export function replaceApplicationProperties(
  data: Buffer,
  remove: readonly string[],
  append: readonly (readonly [name: string, value: Buffer])[],
): Buffer {
  const sections = sectionsOf(data);
  const found = sections.find((section) => section.descriptor === APPLICATION_PROPERTIES);
  const entries: Buffer[] = [];
  let count = 0;
  if (found) {
    const items = itemsOf(data, found.value);
    for (let i = 0; i + 1 < items.length; i += 2) {
      const key = items[i] as Value;
      const value = items[i + 1] as Value;
      if (isString(key.code) && remove.includes(bytesOf(data, key).toString('utf8'))) continue;
      entries.push(data.subarray(key.at, value.end));
      count += 2;
    }
  }
  for (const [name, value] of append) {
    entries.push(string(Buffer.from(name, 'utf8')), string(value));
    count += 2;
  }
  const body = Buffer.concat(entries);
  const map =
    body.length + 1 <= 255 && count <= 255
      ? Buffer.concat([Buffer.from([0xc1, body.length + 1, count]), body])
      : Buffer.concat([Buffer.from([0xd1]), u32(body.length + 4), u32(count), body]);
  const section = Buffer.concat([Buffer.from([0x00, 0x53, APPLICATION_PROPERTIES]), map]);
  if (found) return Buffer.concat([data.subarray(0, found.start), section, data.subarray(found.value.end)]);
  const before = sections.find((s) => s.descriptor >= DATA);
  const at = before ? before.start : data.length;
  return Buffer.concat([data.subarray(0, at), section, data.subarray(at)]);
}

function string(bytes: Buffer): Buffer {
  return bytes.length <= 255
    ? Buffer.concat([Buffer.from([0xa1, bytes.length]), bytes])
    : Buffer.concat([Buffer.from([0xb1]), u32(bytes.length), bytes]);
}

function u32(n: number): Buffer {
  const out = Buffer.alloc(4);
  out.writeUInt32BE(n, 0);
  return out;
}
