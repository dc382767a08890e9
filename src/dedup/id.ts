import { createHash } from 'node:crypto';
import { v5 as uuidv5 } from 'uuid';
import { ConfigError } from '../errors.js';

/** Where a message's dedup ID comes from; `--id-from` is an ordered list of these. */
export type IdStrategy = { kind: 'header'; name: string } | { kind: 'message-id' } | { kind: 'content' };

export const DUPLICATE_ID_HEADER = '_HQ_DUPL_ID';
export const DEFAULT_ID_FROM = 'header:_HQ_DUPL_ID,header:_AMQ_DUPL_ID,message-id,content';

/** IDs longer than this many bytes are keyed by their SHA-256, so keys stay small. */
export const MAX_ID_BYTES = 200;

// Keys of non-text IDs carry a type prefix; a text ID that happens to start with one is keyed by
// its bytes, so no two different IDs can share a key.
const RESERVED_PREFIXES = ['bytes:', 'num:', 'bool:', 'sha256:'];

// Fixed namespace for content IDs: changing it would change every content-derived ID.
const CONTENT_NAMESPACE = '3f1c7a52-9b0e-4d4e-8f5a-6c2b9d1e0a47';

// Headers that differ between deliveries of the same message, or that the bridge itself writes.
const VOLATILE_HEADER = /^(x-death|x-first-death-|x-last-death-|x-delivery-count|x-dedup-)/;

export function parseIdFrom(text: string): IdStrategy[] {
  const items = text
    .split(',')
    .map((item) => item.trim())
    .filter((item) => item.length > 0);
  if (items.length === 0) {
    throw new ConfigError('--id-from: empty list; give e.g. header:_HQ_DUPL_ID,message-id,content');
  }
  return items.map((item): IdStrategy => {
    if (item === 'message-id') return { kind: 'message-id' };
    if (item === 'content') return { kind: 'content' };
    if (item.startsWith('header:') && item.length > 'header:'.length) {
      return { kind: 'header', name: item.slice('header:'.length) };
    }
    throw new ConfigError(
      `--id-from: "${item}" is not a strategy; use header:NAME, message-id or content (comma-separated, first match wins)`,
    );
  });
}

export function describeStrategy(strategy: IdStrategy): string {
  return strategy.kind === 'header' ? `header:${strategy.name}` : strategy.kind;
}

/** The parts of an AMQP message the ID strategies look at. */
export interface IdSource {
  content: Buffer;
  exchange: string;
  routingKey: string;
  messageId?: string | undefined;
  headers?: Record<string, unknown> | undefined;
}

export interface DedupId {
  /** The cache key of the ID (without prefix and scope). */
  key: string;
  /** What to put in `_HQ_DUPL_ID` on the target: the header's own value, or the key. */
  headerValue: unknown;
  strategy: string;
}

export interface IdResult {
  id: DedupId | undefined;
  /** Strategies that matched a header of a type that cannot be an ID, e.g. "header:X (table)". */
  rejected: string[];
}

/** Applies the strategies in order; the first that the message has wins. */
export function deriveId(message: IdSource, strategies: readonly IdStrategy[]): IdResult {
  const rejected: string[] = [];
  for (const strategy of strategies) {
    if (strategy.kind === 'header') {
      const value = message.headers?.[strategy.name];
      if (value === undefined) continue;
      const key = keyOfValue(value);
      if (key === undefined) {
        rejected.push(`header:${strategy.name} (${typeName(value)})`);
        continue;
      }
      return { id: { key, headerValue: value, strategy: `header:${strategy.name}` }, rejected };
    }
    if (strategy.kind === 'message-id') {
      if (!message.messageId) continue;
      const key = keyOfText(message.messageId);
      return { id: { key, headerValue: key, strategy: 'message-id' }, rejected };
    }
    const key = contentId(message);
    return { id: { key, headerValue: key, strategy: 'content' }, rejected };
  }
  return { id: undefined, rejected };
}

/** The cache key of a header value, or undefined when the type cannot be an ID. */
export function keyOfValue(value: unknown): string | undefined {
  if (typeof value === 'string') return value.length > 0 ? keyOfText(value) : undefined;
  if (Buffer.isBuffer(value)) return value.length > 0 ? keyOfBytes(value) : undefined;
  if (typeof value === 'number' && Number.isFinite(value)) return capLength(`num:${value}`);
  if (typeof value === 'bigint') return capLength(`num:${value}`);
  if (typeof value === 'boolean') return `bool:${value}`;
  return undefined;
}

function keyOfText(text: string): string {
  if (RESERVED_PREFIXES.some((prefix) => text.startsWith(prefix))) {
    return capLength(`bytes:${Buffer.from(text, 'utf8').toString('hex')}`);
  }
  return capLength(text);
}

// The same bytes give the same key whether they arrive as a string or a Buffer: bytes that are
// valid UTF-8 are keyed as that text, others by their hex form.
function keyOfBytes(bytes: Buffer): string {
  const text = bytes.toString('utf8');
  if (Buffer.from(text, 'utf8').equals(bytes)) return keyOfText(text);
  return capLength(`bytes:${bytes.toString('hex')}`);
}

function capLength(key: string): string {
  if (Buffer.byteLength(key, 'utf8') <= MAX_ID_BYTES) return key;
  return `sha256:${createHash('sha256').update(key, 'utf8').digest('hex')}`;
}

function typeName(value: unknown): string {
  if (value === null) return 'void';
  if (typeof value === 'string' || Buffer.isBuffer(value)) return 'empty';
  if (Array.isArray(value)) return 'array';
  if (typeof value === 'object') {
    const tagged = (value as Record<string, unknown>)['!'];
    return typeof tagged === 'string' ? tagged : 'table';
  }
  return typeof value;
}

/** UUIDv5 of a SHA-256 over body, exchange, routing key and the stable headers. */
export function contentId(message: IdSource): string {
  const hash = createHash('sha256');
  hash.update(`${message.exchange.length}:${message.exchange}\n`);
  hash.update(`${message.routingKey.length}:${message.routingKey}\n`);
  const headers = message.headers ?? {};
  for (const name of Object.keys(headers).sort()) {
    if (VOLATILE_HEADER.test(name)) continue;
    hash.update(`${name.length}:${name}=`);
    hashValue(hash, headers[name]);
  }
  hash.update(`body:${message.content.length}\n`);
  hash.update(message.content);
  return uuidv5(hash.digest(), CONTENT_NAMESPACE);
}

type Hash = ReturnType<typeof createHash>;

// A typed, length-prefixed encoding, so that distinct header sets never hash alike.
function hashValue(hash: Hash, value: unknown): void {
  if (Buffer.isBuffer(value)) {
    hash.update(`x${value.length}:`);
    hash.update(value);
  } else if (typeof value === 'string') {
    hash.update(`s${Buffer.byteLength(value)}:${value}`);
  } else if (Array.isArray(value)) {
    hash.update(`a${value.length}[`);
    for (const item of value) hashValue(hash, item);
    hash.update(']');
  } else if (value !== null && typeof value === 'object') {
    const table = value as Record<string, unknown>;
    const keys = Object.keys(table).sort();
    hash.update(`t${keys.length}{`);
    for (const key of keys) {
      hash.update(`${key.length}:${key}=`);
      hashValue(hash, table[key]);
    }
    hash.update('}');
  } else {
    hash.update(`${typeof value}:${String(value)};`);
  }
}
