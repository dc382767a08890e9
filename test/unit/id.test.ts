import { createHash } from 'node:crypto';
import { describe, expect, it } from 'vitest';
import {
  DEFAULT_ID_FROM,
  type DedupId,
  deriveId,
  type IdSource,
  type IdStrategy,
  keyOfValue,
  MAX_ID_BYTES,
  parseIdFrom,
} from '../../src/dedup/id.js';
import { ConfigError } from '../../src/errors.js';

const UUID_V5 = /^[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/;
const SHA256_KEY = /^sha256:[0-9a-f]{64}$/;

const header = (name: string): IdStrategy => ({ kind: 'header', name });
const HDR: IdStrategy[] = [header('X-ID')];

function msg(overrides: Partial<IdSource> = {}): IdSource {
  return {
    content: Buffer.from('{"order":1}'),
    exchange: 'orders',
    routingKey: 'orders.created',
    ...overrides,
  };
}

/** The ID a message gets from a single header strategy on header "X-ID". */
function idOfHeader(value: unknown): DedupId {
  const { id, rejected } = deriveId(msg({ headers: { 'X-ID': value } }), HDR);
  expect(rejected).toEqual([]);
  if (id === undefined) throw new Error(`no ID derived for ${String(value)}`);
  return id;
}

function keyOfHeader(value: unknown): string {
  return idOfHeader(value).key;
}

function catchError(fn: () => unknown): unknown {
  try {
    fn();
  } catch (error) {
    return error;
  }
  throw new Error('expected the function to throw');
}

describe('parseIdFrom', () => {
  it('parses the default list in order', () => {
    expect(parseIdFrom(DEFAULT_ID_FROM)).toEqual([
      { kind: 'header', name: '_HQ_DUPL_ID' },
      { kind: 'header', name: '_AMQ_DUPL_ID' },
      { kind: 'message-id' },
      { kind: 'content' },
    ]);
  });

  it('keeps the given order, trims spaces and skips empty items', () => {
    expect(parseIdFrom(' content , message-id,,header:My-Id ,')).toEqual([
      { kind: 'content' },
      { kind: 'message-id' },
      { kind: 'header', name: 'My-Id' },
    ]);
  });

  it('accepts a single strategy', () => {
    expect(parseIdFrom('message-id')).toEqual([{ kind: 'message-id' }]);
    expect(parseIdFrom('header:x')).toEqual([{ kind: 'header', name: 'x' }]);
  });

  it('keeps a header name that itself contains a colon', () => {
    expect(parseIdFrom('header:a:b')).toEqual([{ kind: 'header', name: 'a:b' }]);
  });

  it.each([
    ['bogus'],
    ['header:'],
    ['header'],
    ['messageid'],
    ['Content'],
    ['message-id,uuid'],
    ['header:_HQ_DUPL_ID,header: '],
  ])('rejects %j with a ConfigError naming --id-from', (text) => {
    const error = catchError(() => parseIdFrom(text));
    expect(error).toBeInstanceOf(ConfigError);
    expect((error as ConfigError).message).toMatch(/^--id-from: /);
    expect((error as ConfigError).exitCode).toBe(2);
  });

  it('names the offending item in the error', () => {
    expect(() => parseIdFrom('message-id,frobnicate')).toThrow(/"frobnicate"/);
  });

  it.each([[''], ['  '], [','], [' , ,']])('rejects the empty list %j', (text) => {
    const error = catchError(() => parseIdFrom(text));
    expect(error).toBeInstanceOf(ConfigError);
    expect((error as ConfigError).message).toMatch(/^--id-from: empty list/);
  });
});

describe('deriveId: strategy order', () => {
  const all = parseIdFrom('header:A,header:B,message-id,content');

  it('takes the first strategy the message has', () => {
    const { id, rejected } = deriveId(msg({ headers: { A: 'from-a', B: 'from-b' }, messageId: 'm-1' }), all);
    expect(id).toEqual({ key: 'from-a', headerValue: 'from-a', strategy: 'header:A' });
    expect(rejected).toEqual([]);
  });

  it('falls through to the next strategy when a header is missing', () => {
    expect(deriveId(msg({ headers: { B: 'from-b' }, messageId: 'm-1' }), all).id?.strategy).toBe('header:B');
    expect(deriveId(msg({ headers: {}, messageId: 'm-1' }), all).id).toEqual({
      key: 'm-1',
      headerValue: 'm-1',
      strategy: 'message-id',
    });
    const { id } = deriveId(msg({ headers: { other: 'x' } }), all);
    expect(id?.strategy).toBe('content');
    expect(id?.key).toMatch(UUID_V5);
  });

  it('depends on the order of the list', () => {
    const message = msg({ headers: { A: 'from-a', B: 'from-b' }, messageId: 'm-1' });
    expect(deriveId(message, parseIdFrom('header:B,header:A')).id?.key).toBe('from-b');
    expect(deriveId(message, parseIdFrom('message-id,header:A')).id?.key).toBe('m-1');
    expect(deriveId(message, parseIdFrom('content,message-id')).id?.strategy).toBe('content');
  });

  it('gives no ID when no strategy matches and content is not listed', () => {
    expect(deriveId(msg(), parseIdFrom('header:A,message-id'))).toEqual({ id: undefined, rejected: [] });
    expect(deriveId(msg({ messageId: '' }), parseIdFrom('message-id'))).toEqual({
      id: undefined,
      rejected: [],
    });
  });

  it('gives no ID for an empty strategy list', () => {
    expect(deriveId(msg({ messageId: 'm' }), [])).toEqual({ id: undefined, rejected: [] });
  });

  it('matches header names exactly (case-sensitive)', () => {
    const { id } = deriveId(msg({ headers: { 'x-id': 'lower' } }), parseIdFrom('header:X-ID,message-id'));
    expect(id).toBeUndefined();
  });
});

describe('deriveId: header values', () => {
  it('keys a plain string by itself and passes the original value on', () => {
    expect(idOfHeader('order-42')).toEqual({
      key: 'order-42',
      headerValue: 'order-42',
      strategy: 'header:X-ID',
    });
  });

  it('gives a string and a Buffer with the same UTF-8 bytes the same key', () => {
    for (const text of ['order-42', 'ünïcödé ✓ 日本', 'a', '🎉'.repeat(10)]) {
      expect(keyOfHeader(Buffer.from(text, 'utf8'))).toBe(keyOfHeader(text));
    }
  });

  it('keeps the original Buffer as headerValue', () => {
    const bytes = Buffer.from('order-42');
    const id = idOfHeader(bytes);
    expect(id.headerValue).toBe(bytes);
    expect(id.key).toBe('order-42');
  });

  it('keys bytes that are not UTF-8 as bytes:<hex>', () => {
    const bytes = Buffer.from([0xff, 0xfe, 0x00, 0x41, 0xc3]);
    expect(keyOfHeader(bytes)).toBe('bytes:fffe0041c3');
    // HornetQ's byte[] IDs are often UUID bytes.
    const uuidBytes = Buffer.from('0f8fad5bd9cb469fa16570867728950e', 'hex');
    expect(keyOfHeader(uuidBytes)).toBe('bytes:0f8fad5bd9cb469fa16570867728950e');
  });

  it('gives the same bytes the same key every time, and different bytes different keys', () => {
    const a = Buffer.from([0x80, 0x81, 0x82]);
    const b = Buffer.from([0x80, 0x81, 0x82]);
    const c = Buffer.from([0x80, 0x81, 0x83]);
    expect(keyOfHeader(a)).toBe(keyOfHeader(b));
    expect(keyOfHeader(a)).toBe(keyOfHeader(a));
    expect(keyOfHeader(a)).not.toBe(keyOfHeader(c));
  });

  it('does not treat a replacement character that decoded from bad bytes as text', () => {
    // 0xff decodes to U+FFFD, whose UTF-8 is ef bf bd: these are different IDs.
    expect(keyOfHeader(Buffer.from([0xff]))).toBe('bytes:ff');
    expect(keyOfHeader('\uFFFD')).toBe('\uFFFD');
    expect(keyOfHeader(Buffer.from([0xef, 0xbf, 0xbd]))).toBe('\uFFFD');
  });

  it('keys numbers and booleans with a type prefix', () => {
    expect(keyOfHeader(42)).toBe('num:42');
    expect(keyOfHeader(-1.5)).toBe('num:-1.5');
    expect(keyOfHeader(0)).toBe('num:0');
    expect(keyOfHeader(12345678901234567890n)).toBe('num:12345678901234567890');
    expect(keyOfHeader(true)).toBe('bool:true');
    expect(keyOfHeader(false)).toBe('bool:false');
  });

  it('keeps a number or boolean as the headerValue', () => {
    expect(idOfHeader(42).headerValue).toBe(42);
    expect(idOfHeader(false).headerValue).toBe(false);
  });

  it('does not confuse a number with the string of its digits', () => {
    expect(keyOfHeader('42')).toBe('42');
    expect(keyOfHeader('42')).not.toBe(keyOfHeader(42));
    expect(keyOfHeader('true')).not.toBe(keyOfHeader(true));
  });

  describe('a text ID that starts with a reserved prefix', () => {
    it('does not collide with the bytes it imitates', () => {
      const imitation = 'bytes:ff';
      const real = Buffer.from([0xff]);
      expect(keyOfHeader(real)).toBe('bytes:ff');
      expect(keyOfHeader(imitation)).not.toBe(keyOfHeader(real));
      expect(keyOfHeader(imitation)).toBe(`bytes:${Buffer.from(imitation).toString('hex')}`);
    });

    it('does not collide with the number or boolean it imitates', () => {
      expect(keyOfHeader('num:1')).not.toBe(keyOfHeader(1));
      expect(keyOfHeader('num:1')).not.toBe('num:1');
      expect(keyOfHeader('bool:true')).not.toBe(keyOfHeader(true));
    });

    it('does not collide with the hash of a long ID', () => {
      const long = 'L'.repeat(MAX_ID_BYTES + 1);
      const hashed = keyOfHeader(long);
      expect(hashed).toMatch(SHA256_KEY);
      expect(keyOfHeader(hashed)).not.toBe(hashed);
    });

    it('does not collide with the hex-encoded key of another text', () => {
      // "bytes:ab" is re-keyed as bytes:<hex of "bytes:ab">; a string with that exact text is
      // itself reserved and re-keyed again, so the two stay apart.
      const first = keyOfHeader('bytes:ab');
      expect(keyOfHeader(first)).not.toBe(first);
    });

    it('gets the same key as a string and as the same bytes in a Buffer', () => {
      for (const text of ['bytes:ab', 'num:1', 'bool:true', 'sha256:00']) {
        expect(keyOfHeader(Buffer.from(text))).toBe(keyOfHeader(text));
      }
    });

    it('keeps the original string as headerValue', () => {
      expect(idOfHeader('num:1').headerValue).toBe('num:1');
    });

    it('only counts as reserved at the start', () => {
      expect(keyOfHeader('order-bytes:ab')).toBe('order-bytes:ab');
      expect(keyOfHeader('bytes')).toBe('bytes');
    });
  });

  describe('long IDs', () => {
    it(`keeps an ID of exactly ${MAX_ID_BYTES} bytes as is`, () => {
      const text = 'a'.repeat(MAX_ID_BYTES);
      expect(keyOfHeader(text)).toBe(text);
    });

    it(`keys an ID over ${MAX_ID_BYTES} bytes as sha256:<64 hex>, stably`, () => {
      const text = 'a'.repeat(MAX_ID_BYTES + 1);
      const key = keyOfHeader(text);
      expect(key).toMatch(SHA256_KEY);
      expect(key).toBe(`sha256:${createHash('sha256').update(text).digest('hex')}`);
      expect(keyOfHeader('a'.repeat(MAX_ID_BYTES + 1))).toBe(key);
      expect(keyOfHeader(`${'a'.repeat(MAX_ID_BYTES)}b`)).not.toBe(key);
    });

    it('counts bytes, not characters', () => {
      // 101 two-byte characters are 202 bytes: over the limit although only 101 characters.
      const text = 'é'.repeat(101);
      expect(text.length).toBeLessThan(MAX_ID_BYTES);
      expect(keyOfHeader(text)).toMatch(SHA256_KEY);
      expect(keyOfHeader('é'.repeat(100))).toBe('é'.repeat(100));
    });

    it('gives a long Buffer the same hashed key as the same long string', () => {
      const text = 'x'.repeat(500);
      expect(keyOfHeader(Buffer.from(text))).toBe(keyOfHeader(text));
    });

    it('hashes long non-UTF-8 bytes stably', () => {
      const bytes = Buffer.alloc(300, 0xff);
      const key = keyOfHeader(bytes);
      expect(key).toMatch(SHA256_KEY);
      expect(keyOfHeader(Buffer.alloc(300, 0xff))).toBe(key);
      expect(keyOfHeader(Buffer.alloc(301, 0xff))).not.toBe(key);
    });

    it('keeps the full original value as headerValue', () => {
      const text = 'z'.repeat(1000);
      expect(idOfHeader(text).headerValue).toBe(text);
    });
  });

  describe('values that cannot be an ID', () => {
    it.each([
      ['a table', { a: 1 }, 'table'],
      ['an empty table', {}, 'table'],
      ['an array', ['a', 'b'], 'array'],
      ['null (void)', null, 'void'],
      ['an empty string', '', 'empty'],
      ['NaN', Number.NaN, 'number'],
      ['Infinity', Number.POSITIVE_INFINITY, 'number'],
    ])('rejects %s and lets the next strategy decide', (_label, value, type) => {
      const strategies = parseIdFrom('header:X-ID,message-id');
      const { id, rejected } = deriveId(msg({ headers: { 'X-ID': value }, messageId: 'm-7' }), strategies);
      expect(rejected).toEqual([`header:X-ID (${type})`]);
      expect(id).toEqual({ key: 'm-7', headerValue: 'm-7', strategy: 'message-id' });
      expect(keyOfValue(value)).toBeUndefined();
    });

    it('rejects an empty Buffer and lets the next strategy decide', () => {
      const strategies = parseIdFrom('header:X-ID,message-id');
      const { id, rejected } = deriveId(
        msg({ headers: { 'X-ID': Buffer.alloc(0) }, messageId: 'm-7' }),
        strategies,
      );
      expect(rejected).toHaveLength(1);
      expect(rejected[0]).toMatch(/^header:X-ID \(/);
      expect(id).toEqual({ key: 'm-7', headerValue: 'm-7', strategy: 'message-id' });
      expect(keyOfValue(Buffer.alloc(0))).toBeUndefined();
    });

    it('names an empty Buffer "empty", like an empty string, not "table"', () => {
      const { rejected } = deriveId(msg({ headers: { 'X-ID': Buffer.alloc(0) } }), HDR);
      expect(rejected).toEqual(['header:X-ID (empty)']);
    });

    it('reports every rejected header, in order, even when nothing matches', () => {
      const strategies = parseIdFrom('header:A,header:B,header:C');
      const result = deriveId(msg({ headers: { A: [], C: null } }), strategies);
      expect(result).toEqual({ id: undefined, rejected: ['header:A (array)', 'header:C (void)'] });
    });

    it('lets a later header win after an earlier one is rejected', () => {
      const strategies = parseIdFrom('header:A,header:B,content');
      const { id, rejected } = deriveId(msg({ headers: { A: { nested: true }, B: 'good' } }), strategies);
      expect(rejected).toEqual(['header:A (table)']);
      expect(id).toEqual({ key: 'good', headerValue: 'good', strategy: 'header:B' });
    });

    it('skips a header that is present but undefined without rejecting it', () => {
      const { id, rejected } = deriveId(msg({ headers: { 'X-ID': undefined }, messageId: 'm' }), [
        ...HDR,
        { kind: 'message-id' },
      ]);
      expect(rejected).toEqual([]);
      expect(id?.strategy).toBe('message-id');
    });
  });
});

describe('deriveId: message-id', () => {
  const strategies = parseIdFrom('message-id');

  it('keys the AMQP message_id, with the key as headerValue', () => {
    expect(deriveId(msg({ messageId: 'abc-123' }), strategies).id).toEqual({
      key: 'abc-123',
      headerValue: 'abc-123',
      strategy: 'message-id',
    });
  });

  it('applies the same reserved-prefix and length rules as headers', () => {
    const reserved = deriveId(msg({ messageId: 'num:1' }), strategies).id;
    expect(reserved?.key).toBe(keyOfHeader('num:1'));
    expect(reserved?.key).not.toBe('num:1');
    const long = 'm'.repeat(MAX_ID_BYTES + 10);
    expect(deriveId(msg({ messageId: long }), strategies).id?.key).toBe(keyOfHeader(long));
  });

  it('gives the same key as a header with the same text', () => {
    expect(deriveId(msg({ messageId: 'same' }), strategies).id?.key).toBe(keyOfHeader('same'));
  });

  it('is skipped when there is no message_id', () => {
    expect(deriveId(msg(), strategies).id).toBeUndefined();
  });
});

describe('deriveId: content', () => {
  const strategies = parseIdFrom('content');
  const contentKey = (message: IdSource): string => {
    const { id } = deriveId(message, strategies);
    if (id === undefined) throw new Error('content strategy gave no ID');
    expect(id.strategy).toBe('content');
    expect(id.headerValue).toBe(id.key);
    return id.key;
  };
  const headers = { tenant: 'acme', priority: 3, tags: ['a', 'b'], meta: { k: 'v' } };
  const base = (): IdSource => msg({ headers: { ...headers } });

  it('is a version-5 UUID', () => {
    expect(contentKey(base())).toMatch(UUID_V5);
    expect(contentKey(msg({ content: Buffer.alloc(0), exchange: '', routingKey: '' }))).toMatch(UUID_V5);
  });

  it('collapses identical messages into one ID', () => {
    expect(contentKey(base())).toBe(contentKey(base()));
    const copy: IdSource = {
      content: Buffer.from('{"order":1}'),
      exchange: 'orders',
      routingKey: 'orders.created',
      headers: { meta: { k: 'v' }, tags: ['a', 'b'], priority: 3, tenant: 'acme' },
    };
    expect(contentKey(copy)).toBe(contentKey(base()));
  });

  it('ignores the message_id', () => {
    expect(contentKey({ ...base(), messageId: 'one' })).toBe(contentKey({ ...base(), messageId: 'two' }));
  });

  it('treats no headers and empty headers alike', () => {
    expect(contentKey(msg())).toBe(contentKey(msg({ headers: {} })));
  });

  it.each([
    ['x-death', [{ count: 1, queue: 'q', reason: 'rejected' }]],
    ['x-first-death-queue', 'q'],
    ['x-first-death-reason', 'rejected'],
    ['x-last-death-exchange', 'dlx'],
    ['x-delivery-count', 4],
    ['x-dedup-attempt', 2],
    ['x-dedup-source', 'bridge'],
  ])('ignores the redelivery header %s', (name, value) => {
    const plain = contentKey(base());
    expect(contentKey(msg({ headers: { ...headers, [name]: value } }))).toBe(plain);
  });

  it('ignores all volatile headers at once', () => {
    const redelivered = msg({
      headers: {
        ...headers,
        'x-death': [{ count: 3 }],
        'x-delivery-count': 7,
        'x-dedup-attempt': 9,
        'x-first-death-queue': 'q',
      },
    });
    expect(contentKey(redelivered)).toBe(contentKey(base()));
  });

  it('changes when the body changes', () => {
    expect(contentKey({ ...base(), content: Buffer.from('{"order":2}') })).not.toBe(contentKey(base()));
    expect(contentKey({ ...base(), content: Buffer.from('{"order":1} ') })).not.toBe(contentKey(base()));
  });

  it('changes when the routing key changes', () => {
    expect(contentKey({ ...base(), routingKey: 'orders.updated' })).not.toBe(contentKey(base()));
  });

  it('changes when the exchange changes', () => {
    expect(contentKey({ ...base(), exchange: 'orders2' })).not.toBe(contentKey(base()));
    expect(contentKey({ ...base(), exchange: '' })).not.toBe(contentKey(base()));
  });

  it('does not mix up exchange and routing key', () => {
    const a = msg({ exchange: 'ab', routingKey: 'c' });
    const b = msg({ exchange: 'a', routingKey: 'bc' });
    const swapped = msg({ exchange: 'c', routingKey: 'ab' });
    expect(contentKey(a)).not.toBe(contentKey(b));
    expect(contentKey(a)).not.toBe(contentKey(swapped));
  });

  it('changes when another header is added, removed or changed', () => {
    const plain = contentKey(base());
    expect(contentKey(msg({ headers: { ...headers, extra: 'x' } }))).not.toBe(plain);
    expect(contentKey(msg({ headers: { ...headers, tenant: 'other' } }))).not.toBe(plain);
    expect(contentKey(msg({ headers: { ...headers, priority: 4 } }))).not.toBe(plain);
    expect(contentKey(msg({ headers: { ...headers, tags: ['a'] } }))).not.toBe(plain);
    expect(contentKey(msg({ headers: { ...headers, meta: { k: 'w' } } }))).not.toBe(plain);
    const { tenant: _dropped, ...rest } = headers;
    expect(contentKey(msg({ headers: rest }))).not.toBe(plain);
  });

  it('tells header value types apart', () => {
    const key = (value: unknown) => contentKey(msg({ headers: { h: value } }));
    expect(key('1')).not.toBe(key(1));
    expect(key('true')).not.toBe(key(true));
    expect(key('abc')).not.toBe(key(Buffer.from('abc')));
    expect(key(['a', 'b'])).not.toBe(key('ab'));
    expect(key(['a', 'b'])).not.toBe(key(['ab']));
    expect(key(null)).not.toBe(key('null'));
  });

  it('does not let a header name and value run together', () => {
    expect(contentKey(msg({ headers: { ab: 'c' } }))).not.toBe(contentKey(msg({ headers: { a: 'bc' } })));
  });

  it('does not let a header value spill into the body', () => {
    const a = msg({ headers: { h: 'x' }, content: Buffer.from('yz') });
    const b = msg({ headers: { h: 'xy' }, content: Buffer.from('z') });
    expect(contentKey(a)).not.toBe(contentKey(b));
  });

  it('is what deriveId falls back to when earlier strategies do not match', () => {
    const { id } = deriveId(base(), parseIdFrom(DEFAULT_ID_FROM));
    expect(id?.strategy).toBe('content');
    expect(id?.key).toBe(contentKey(base()));
  });
});
