import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';
import type { MessageProperties } from 'amqplib';
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import {
  decodeTable,
  decodeValue,
  encodeField,
  encodeTable,
  encodeValue,
  type Field,
  type FieldSpan,
  FieldTableError,
  type FieldValue,
  indexTable,
  MAX_TABLE_DEPTH,
  skipValue,
  toAmqplibTable,
  toAmqplibValue,
} from '../../src/wire/fields.js';
import {
  BASIC_PROPERTIES,
  ContentHeader,
  ContentHeaderError,
  contentHeaderOf,
  type PropertyName,
  propertiesFor,
  RAW_HEADER,
} from '../../src/wire/properties.js';
import {
  array,
  type BasicProperties,
  basicProperties,
  bool,
  bytes,
  contentHeaderFrame,
  decimal,
  deepValue,
  field,
  float32,
  float32Bits,
  float64,
  float64Bits,
  hex,
  int8,
  int16,
  int32,
  int64,
  longString,
  nested,
  PROPERTY_ORDER,
  table,
  tagged,
  timestamp,
  uint8,
  uint16,
  uint32,
  voidValue,
} from '../wire.js';

// amqplib's own decoders, loaded by path as amqplib loads them: the reference for what an
// application reading `message.properties` sees.
const require = createRequire(import.meta.url);
const amqplibLib = join(dirname(require.resolve('amqplib')), 'lib');
const amqplibCodec = require(join(amqplibLib, 'codec.js')) as {
  decodeFields(body: Buffer): Record<string, unknown>;
};
const amqplibDefs = require(join(amqplibLib, 'defs.js')) as {
  decode(id: number, bytes: Buffer): MessageProperties;
};
const BASIC_CLASS = 60;

/** Byte-for-byte equality, shown as hex when it fails. */
function expectBytes(actual: Buffer, expected: Buffer): void {
  expect(actual.toString('hex')).toBe(expected.toString('hex'));
}

/** The key order of a decoded value, all the way down, next to its leaves (toEqual ignores order). */
function shape(value: unknown): unknown {
  if (Array.isArray(value)) return value.map(shape);
  if (value !== null && typeof value === 'object' && !Buffer.isBuffer(value)) {
    return Object.keys(value).map((key) => [key, shape((value as Record<string, unknown>)[key])]);
  }
  return value;
}

const name = (text: string): Buffer => Buffer.from(text, 'utf8');

describe('test/wire.ts builds the bytes the AMQP 0-9-1 errata give', () => {
  it('typed values: tag, then big-endian bytes', () => {
    expectBytes(int64(2n ** 62n + 1n), hex('6c 40 00 00 00 00 00 00 01'));
    expectBytes(int16(-2), hex('73 ff fe'));
    expectBytes(uint16(0xffff), hex('75 ff ff'));
    expectBytes(int32(-1), hex('49 ff ff ff ff'));
    expectBytes(uint32(1), hex('69 00 00 00 01'));
    expectBytes(uint8(255), hex('42 ff'));
    expectBytes(float32(-0), hex('66 80 00 00 00'));
    expectBytes(float64(-0), hex('64 80 00 00 00 00 00 00 00'));
    expectBytes(decimal(2, 314), hex('44 02 00 00 01 3a'));
    expectBytes(timestamp(2n ** 64n - 1n), hex('54 ff ff ff ff ff ff ff ff'));
    expectBytes(longString(hex('80 00 00 01')), hex('53 00 00 00 04 80 00 00 01'));
    expectBytes(bytes('ab'), hex('78 00 00 00 02 61 62'));
    expectBytes(bool(true), hex('74 01'));
    expectBytes(voidValue(), hex('56'));
  });

  it('tables, arrays and deep nesting', () => {
    expectBytes(field('k', int32(1)), hex('01 6b 49 00 00 00 01'));
    expectBytes(field('k', 'Z', hex('01')), hex('01 6b 5a 01'));
    expectBytes(nested(table(field('a', voidValue()))), hex('46 00 00 00 03 01 61 56'));
    expectBytes(array(int8(-1), bool(true)), hex('41 00 00 00 04 62 ff 74 01'));
    expectBytes(deepValue(2), hex('41 00 00 00 05 41 00 00 00 00'));
    expectBytes(deepValue(2, 'F'), hex('46 00 00 00 07 01 61 46 00 00 00 00'));
    expect(deepValue(12_000)).toHaveLength(60_000);
  });

  it('properties: flag bit 0x8000 >> i for property i, values in wire order', () => {
    expectBytes(basicProperties(), hex('00 00'));
    expectBytes(basicProperties({ contentType: 'a', clusterId: 'c' }), hex('80 04 01 61 01 63'));
    expectBytes(
      basicProperties({ timestamp: 1n, deliveryMode: 2, headers: table() }),
      hex('30 40 00 00 00 00 02 00 00 00 00 00 00 00 01'),
    );
    expect(PROPERTY_ORDER).toEqual(BASIC_PROPERTIES.map(([property]) => property));
    expectBytes(
      contentHeaderFrame(1, 5, basicProperties()),
      hex('02 0001 0000000e 003c 0000 0000000000000005 0000 ce'),
    );
  });
});

/** Every type RabbitMQ reads, at its edges: the bytes, and the typed value they must decode to. */
const TYPED: [string, Buffer, FieldValue][] = [
  ['t 00 (false)', bool(false), { type: 't', value: false }],
  ['t 01 (true)', bool(true), { type: 't', value: true }],
  ['t 02 (true, its octet kept)', bool(2), { type: 't', value: true, octet: 2 }],
  ['b int8 min', int8(-128), { type: 'b', value: -128 }],
  ['b int8 max', int8(127), { type: 'b', value: 127 }],
  ['B uint8 max', uint8(255), { type: 'B', value: 255 }],
  ['s int16 min (signed, as RabbitMQ reads s)', int16(-32768), { type: 's', value: -32768 }],
  ['s int16 max', int16(32767), { type: 's', value: 32767 }],
  ['u uint16 max', uint16(65535), { type: 'u', value: 65535 }],
  ['I int32 min', int32(-2147483648), { type: 'I', value: -2147483648 }],
  ['I int32 max', int32(2147483647), { type: 'I', value: 2147483647 }],
  ['i uint32 max', uint32(4294967295), { type: 'i', value: 4294967295 }],
  ['l int64 min', int64(-(2n ** 63n)), { type: 'l', value: -(2n ** 63n) }],
  ['l int64 max', int64(2n ** 63n - 1n), { type: 'l', value: 2n ** 63n - 1n }],
  ['l 2^62+1 (past double precision)', int64(2n ** 62n + 1n), { type: 'l', value: 2n ** 62n + 1n }],
  ['l -1', int64(-1n), { type: 'l', value: -1n }],
  ['T 0', timestamp(0n), { type: 'T', value: 0n }],
  ['T uint64 max', timestamp(2n ** 64n - 1n), { type: 'T', value: 2n ** 64n - 1n }],
  ['f 0.1', float32(0.1), { type: 'f', value: Math.fround(0.1) }],
  ['f -0.0', float32(-0), { type: 'f', value: -0 }],
  ['f -Infinity', float32(Number.NEGATIVE_INFINITY), { type: 'f', value: Number.NEGATIVE_INFINITY }],
  [
    'f NaN with payload 7fc00001',
    float32Bits(0x7fc00001),
    { type: 'f', value: Number.NaN, nanBits: hex('7fc00001') },
  ],
  [
    'f signalling NaN ff800001',
    float32Bits(0xff800001),
    { type: 'f', value: Number.NaN, nanBits: hex('ff800001') },
  ],
  ['d 0.1', float64(0.1), { type: 'd', value: 0.1 }],
  ['d -0.0', float64(-0), { type: 'd', value: -0 }],
  ['d smallest subnormal', float64(5e-324), { type: 'd', value: 5e-324 }],
  ['d Infinity', float64(Number.POSITIVE_INFINITY), { type: 'd', value: Number.POSITIVE_INFINITY }],
  [
    'd NaN with payload 7ff8000000000001',
    float64Bits(0x7ff8000000000001n),
    { type: 'd', value: Number.NaN, nanBits: hex('7ff8000000000001') },
  ],
  [
    'd signalling NaN fff0000000000001',
    float64Bits(0xfff0000000000001n),
    { type: 'd', value: Number.NaN, nanBits: hex('fff0000000000001') },
  ],
  ['D 3.14', decimal(2, 314), { type: 'D', places: 2, digits: 314 }],
  ['D extremes', decimal(255, 0xffffffff), { type: 'D', places: 255, digits: 0xffffffff }],
  ['S UTF-8', longString('ünï ✓ 日本'), { type: 'S', value: name('ünï ✓ 日本') }],
  ['S empty', longString(''), { type: 'S', value: Buffer.alloc(0) }],
  ['S invalid UTF-8 80 00 00 01', longString(hex('80 00 00 01')), { type: 'S', value: hex('80 00 00 01') }],
  ['x bytes', bytes(hex('00 ff 80')), { type: 'x', value: hex('00 ff 80') }],
  ['x empty', bytes(Buffer.alloc(0)), { type: 'x', value: Buffer.alloc(0) }],
  ['V void', voidValue(), { type: 'V' }],
  ['F empty table', nested(table()), { type: 'F', value: [] }],
  [
    'F three tables deep',
    nested(
      table(
        field('a', int8(1)),
        field('b', nested(table(field('c', nested(table(field('d', longString('x')))))))),
      ),
    ),
    {
      type: 'F',
      value: [
        { name: name('a'), value: { type: 'b', value: 1 } },
        {
          name: name('b'),
          value: {
            type: 'F',
            value: [
              {
                name: name('c'),
                value: { type: 'F', value: [{ name: name('d'), value: { type: 'S', value: name('x') } }] },
              },
            ],
          },
        },
      ],
    },
  ],
  ['A empty array', array(), { type: 'A', value: [] }],
  [
    'A of mixed values, arrays and tables',
    array(
      int8(1),
      longString('s'),
      array(bool(false), array()),
      nested(table(field('k', voidValue()))),
      int64(2n ** 62n + 1n),
    ),
    {
      type: 'A',
      value: [
        { type: 'b', value: 1 },
        { type: 'S', value: name('s') },
        {
          type: 'A',
          value: [
            { type: 't', value: false },
            { type: 'A', value: [] },
          ],
        },
        { type: 'F', value: [{ name: name('k'), value: { type: 'V' } }] },
        { type: 'l', value: 2n ** 62n + 1n },
      ],
    },
  ],
];

describe('decodeTable / encodeTable: every type, byte for byte', () => {
  it.each(TYPED)('%s', (_label, value, expected) => {
    const body = table(field('v', value));
    const fields = decodeTable(body);
    expect(fields).toEqual([{ name: name('v'), value: expected }]);
    expectBytes(encodeTable(fields), body);
    expectBytes(encodeValue(expected), value);
    expect(decodeValue(value, 0, value.length)).toEqual([expected, value.length]);
  });

  it('keeps the sign of -0.0 and the exact bits of a NaN', () => {
    const [f, d, nan] = decodeTable(
      table(field('f', float32(-0)), field('d', float64(-0)), field('n', float64Bits(0x7ff0000000000abcn))),
    ).map((entry) => entry.value) as [FieldValue, FieldValue, FieldValue];
    expect(f.type === 'f' && Object.is(f.value, -0)).toBe(true);
    expect(d.type === 'd' && Object.is(d.value, -0)).toBe(true);
    expectBytes(encodeValue(nan), hex('64 7ff0000000000abc'));
  });

  it('reads an empty table as no fields, and writes no fields as no bytes', () => {
    expect(decodeTable(Buffer.alloc(0))).toEqual([]);
    expect(encodeTable([])).toHaveLength(0);
    expect(indexTable(Buffer.alloc(0), 0, 0)).toEqual([]);
  });

  it('keeps repeated names, each with its value, in order', () => {
    const body = table(
      field('a', int8(1)),
      field('b', longString('x')),
      field('a', int8(2)),
      field('a', int8(3)),
    );
    const fields = decodeTable(body);
    expect(fields.map((entry) => [entry.name.toString(), entry.value])).toEqual([
      ['a', { type: 'b', value: 1 }],
      ['b', { type: 'S', value: name('x') }],
      ['a', { type: 'b', value: 2 }],
      ['a', { type: 'b', value: 3 }],
    ]);
    expectBytes(encodeTable(fields), body);
  });

  it('treats "__proto__" and "!" as ordinary field names', () => {
    const body = table(
      field('__proto__', nested(table(field('polluted', bool(true))))),
      field('!', longString('timestamp')),
      field('value', int8(1)),
    );
    const fields = decodeTable(body);
    expect(fields.map((entry) => entry.name.toString())).toEqual(['__proto__', '!', 'value']);
    expectBytes(encodeTable(fields), body);

    const decoded = toAmqplibTable(fields);
    expect(Object.getPrototypeOf(decoded)).toBe(Object.prototype);
    expect(Object.keys(decoded)).toEqual(['__proto__', '!', 'value']);
    expect(Object.getOwnPropertyDescriptor(decoded, '__proto__')?.value).toEqual({ polluted: true });
    expect((decoded as { polluted?: unknown }).polluted).toBeUndefined();
    expect(({} as { polluted?: unknown }).polluted).toBeUndefined();
    expect(decoded['!']).toBe('timestamp');
  });

  it('keeps names as bytes: not UTF-8, empty, 255 bytes long', () => {
    const body = table(
      field(hex('ff 80'), int8(1)),
      field('', int8(2)),
      field('n'.repeat(255), int8(3)),
      field('größe', int8(4)),
    );
    const fields = decodeTable(body);
    expect(fields.map((entry) => entry.name)).toEqual([
      hex('ff 80'),
      Buffer.alloc(0),
      name('n'.repeat(255)),
      name('größe'),
    ]);
    expectBytes(encodeTable(fields), body);
  });

  it('refuses to encode a name over 255 bytes', () => {
    expect(() => encodeTable([{ name: Buffer.alloc(256, 0x61), value: { type: 'V' } }])).toThrow(
      FieldTableError,
    );
  });

  it('encodeField gives the bytes of one table entry', () => {
    expectBytes(
      encodeField('_HQ_DUPL_ID', { type: 'S', value: name('id-1') }),
      field('_HQ_DUPL_ID', longString('id-1')),
    );
  });
});

describe('indexTable / skipValue', () => {
  it('gives each top-level field its span, within [start, end) of a larger buffer', () => {
    const fields = [field('a', int8(1)), field('_HQ_DUPL_ID', longString('id')), field('t', nested(table()))];
    const body = table(...fields);
    const buffer = Buffer.concat([hex('ee ee ee'), body, hex('ff ff')]);
    const spans = indexTable(buffer, 3, 3 + body.length);
    expect(spans).toEqual([
      { start: 3, valueAt: 5, end: 7, name: 'a' },
      { start: 7, valueAt: 19, end: 26, name: '_HQ_DUPL_ID' },
      { start: 26, valueAt: 28, end: 33, name: 't' },
    ]);
    expectBytes(buffer.subarray(spans[1]?.valueAt, spans[1]?.end), longString('id'));
  });

  it('skips a value to its end, nested ones included', () => {
    for (const [, value] of TYPED) {
      const buffer = Buffer.concat([hex('00'), value, hex('56 56')]);
      expect(skipValue(buffer, 1, buffer.length)).toBe(1 + value.length);
    }
  });

  it('does not read past `end`, even when the buffer goes on', () => {
    const value = int32(7);
    expect(() => skipValue(value, 0, value.length - 1)).toThrow(FieldTableError);
    expect(() => indexTable(table(field('n', value)), 0, 4)).toThrow(FieldTableError);
  });
});

// ---- property tests ---------------------------------------------------------------------------

/** A value as bytes (built by test/wire.ts) and the typed value it must decode to. */
interface Built {
  bytes: Buffer;
  value: FieldValue;
}

interface BuiltTable {
  body: Buffer;
  fields: Field[];
}

const smallBytes = fc.uint8Array({ maxLength: 12 }).map((array) => Buffer.from(array));

const names = fc.oneof(
  fc.constantFrom('a', 'b', '_HQ_DUPL_ID', '__proto__', '!', '').map(name),
  fc.string({ maxLength: 8 }).map(name),
  smallBytes,
);

const NAN32 = 0x7f800000;
const NAN64 = 0x7ff0000000000000n;

const scalars: fc.Arbitrary<Built> = fc.oneof(
  fc.boolean().map((value): Built => ({ bytes: bool(value), value: { type: 't', value } })),
  fc
    .integer({ min: 2, max: 255 })
    .map((octet): Built => ({ bytes: bool(octet), value: { type: 't', value: true, octet } })),
  fc
    .integer({ min: -128, max: 127 })
    .map((value): Built => ({ bytes: int8(value), value: { type: 'b', value } })),
  fc
    .integer({ min: 0, max: 255 })
    .map((value): Built => ({ bytes: uint8(value), value: { type: 'B', value } })),
  fc
    .integer({ min: -32768, max: 32767 })
    .map((value): Built => ({ bytes: int16(value), value: { type: 's', value } })),
  fc
    .integer({ min: 0, max: 65535 })
    .map((value): Built => ({ bytes: uint16(value), value: { type: 'u', value } })),
  fc.integer().map((value): Built => ({ bytes: int32(value), value: { type: 'I', value } })),
  fc
    .integer({ min: 0, max: 0xffffffff })
    .map((value): Built => ({ bytes: uint32(value), value: { type: 'i', value } })),
  fc
    .bigInt({ min: -(2n ** 63n), max: 2n ** 63n - 1n })
    .map((value): Built => ({ bytes: int64(value), value: { type: 'l', value } })),
  fc
    .bigInt({ min: 0n, max: 2n ** 64n - 1n })
    .map((value): Built => ({ bytes: timestamp(value), value: { type: 'T', value } })),
  fc.float({ noNaN: true }).map((value): Built => ({ bytes: float32(value), value: { type: 'f', value } })),
  fc.double({ noNaN: true }).map((value): Built => ({ bytes: float64(value), value: { type: 'd', value } })),
  fc.tuple(fc.boolean(), fc.integer({ min: 1, max: 0x7fffff })).map(([negative, payload]): Built => {
    const bits = ((negative ? 0x80000000 : 0) | NAN32 | payload) >>> 0;
    const bytes = float32Bits(bits);
    return { bytes, value: { type: 'f', value: Number.NaN, nanBits: bytes.subarray(1) } };
  }),
  fc.tuple(fc.boolean(), fc.bigInt({ min: 1n, max: 2n ** 52n - 1n })).map(([negative, payload]): Built => {
    const bytes = float64Bits((negative ? 2n ** 63n : 0n) | NAN64 | payload);
    return { bytes, value: { type: 'd', value: Number.NaN, nanBits: bytes.subarray(1) } };
  }),
  fc
    .tuple(fc.integer({ min: 0, max: 255 }), fc.integer({ min: 0, max: 0xffffffff }))
    .map(
      ([places, digits]): Built => ({ bytes: decimal(places, digits), value: { type: 'D', places, digits } }),
    ),
  smallBytes.map((value): Built => ({ bytes: longString(value), value: { type: 'S', value } })),
  smallBytes.map((value): Built => ({ bytes: bytes(value), value: { type: 'x', value } })),
  fc.constant<Built>({ bytes: voidValue(), value: { type: 'V' } }),
);

function builtTable(entries: [Buffer, Built][]): BuiltTable {
  return {
    body: table(...entries.map(([entryName, built]) => field(entryName, built.bytes))),
    fields: entries.map(([entryName, built]) => ({ name: entryName, value: built.value })),
  };
}

/** Random tables, nested at most 4 deep, at most 6 entries a level. */
function tables(fieldNames: fc.Arbitrary<Buffer>): fc.Arbitrary<BuiltTable> {
  const { value } = fc.letrec<{ value: Built; table: Built; array: Built }>((tie) => ({
    value: fc.oneof({ maxDepth: 4, depthIdentifier: 'field-table' }, scalars, tie('table'), tie('array')),
    table: fc.array(fc.tuple(fieldNames, tie('value')), { maxLength: 6 }).map((entries): Built => {
      const built = builtTable(entries);
      return { bytes: nested(built.body), value: { type: 'F', value: built.fields } };
    }),
    array: fc.array(tie('value'), { maxLength: 6 }).map(
      (items): Built => ({
        bytes: array(...items.map((item) => item.bytes)),
        value: { type: 'A', value: items.map((item) => item.value) },
      }),
    ),
  }));
  return fc.array(fc.tuple(fieldNames, value), { maxLength: 8 }).map(builtTable);
}

describe('property: random tables', () => {
  it('decode gives the typed fields the bytes were built from, and encode gives back the bytes', () => {
    fc.assert(
      fc.property(tables(names), ({ body, fields }) => {
        const decoded = decodeTable(body);
        expect(decoded).toEqual(fields);
        expectBytes(encodeTable(decoded), body);
        const spans = indexTable(body, 0, body.length);
        expect(spans.map((span) => span.name)).toEqual(fields.map((entry) => entry.name.toString('utf8')));
        expect(spans.map((span) => span.end)).toEqual(
          spans.map((_, i) => spans[i + 1]?.start ?? body.length),
        );
      }),
      { numRuns: 400 },
    );
  });

  it('encode → decode → encode is the identity on typed tables', () => {
    fc.assert(
      fc.property(tables(names), ({ fields }) => {
        const once = encodeTable(fields);
        const back = decodeTable(once);
        expect(back).toEqual(fields);
        expectBytes(encodeTable(back), once);
      }),
      { numRuns: 400 },
    );
  });

  it('toAmqplibTable gives what amqplib decodes (its names other than "__proto__")', () => {
    const plainNames = names.filter((entry) => entry.toString('utf8') !== '__proto__');
    fc.assert(
      fc.property(tables(plainNames), ({ body, fields }) => {
        const ours = toAmqplibTable(fields);
        const theirs = amqplibCodec.decodeFields(body);
        expect(ours).toEqual(theirs);
        expect(shape(ours)).toEqual(shape(theirs));
      }),
      { numRuns: 400 },
    );
  });
});

describe('unreadable tables', () => {
  it('throws FieldTableError for every truncation inside a field', () => {
    const first = field('k', longString('abc'));
    const whole = table(first, field('n', nested(table(field('i', int32(7)), field('a', array(int8(1)))))));
    for (let length = 1; length < whole.length; length++) {
      if (length === first.length) continue; // a whole first field: a valid, shorter table
      const cut = whole.subarray(0, length);
      expect(() => decodeTable(cut), `cut at ${length}`).toThrow(FieldTableError);
      expect(() => indexTable(cut, 0, cut.length), `cut at ${length}`).toThrow(FieldTableError);
    }
  });

  it('throws FieldTableError for a length that runs past the input', () => {
    const huge = field('s', 'S', hex('ff ff ff ff 61'));
    expect(() => decodeTable(huge)).toThrow(FieldTableError);
    expect(() => decodeTable(huge)).toThrow(/truncated/);
  });

  it('throws FieldTableError for a nested table or array whose content runs past its own length', () => {
    // F claims 3 bytes, but its field (01 62 62 01) is 4: the byte after it belongs to the parent.
    const table3 = table(field('t', 'F', Buffer.concat([hex('00 00 00 03'), field('b', int8(1))])));
    expect(() => decodeTable(table3)).toThrow(FieldTableError);
    const array3 = table(
      field('a', 'A', Buffer.concat([hex('00 00 00 04'), int32(1)])),
      field('z', voidValue()),
    );
    expect(() => decodeTable(array3)).toThrow(FieldTableError);
  });

  it.each([
    ['at the top level', table(field('k', 'Z', hex('01')))],
    ['a zero byte as tag', table(field('k', tagged('\u0000')))],
    ['in a nested table', table(field('t', nested(table(field('k', 'Z', hex('01'))))))],
    ['in an array', table(field('a', array(int8(1), tagged('U', hex('00 01')))))],
  ])('throws FieldTableError for an unknown type tag %s', (_label, body) => {
    expect(() => decodeTable(body)).toThrow(FieldTableError);
    expect(() => decodeTable(body)).toThrow(/unknown type tag/);
    expect(() => indexTable(body, 0, body.length)).toThrow(FieldTableError);
  });

  it('reads 64 levels of nesting (the table and 63 inside it), and refuses 65', () => {
    expect(MAX_TABLE_DEPTH).toBe(64);
    for (const tag of ['A', 'F'] as const) {
      const deepest = table(field('v', deepValue(63, tag)));
      expectBytes(encodeTable(decodeTable(deepest)), deepest);
      expect(indexTable(deepest, 0, deepest.length)).toHaveLength(1);
      const tooDeep = table(field('v', deepValue(64, tag)));
      expect(() => decodeTable(tooDeep)).toThrow(FieldTableError);
      expect(() => decodeTable(tooDeep)).toThrow(/nested deeper than 64/);
      expect(() => indexTable(tooDeep, 0, tooDeep.length)).toThrow(FieldTableError);
    }
  });

  it('refuses 12,000 levels of nesting with FieldTableError, not a stack overflow', () => {
    for (const tag of ['A', 'F'] as const) {
      const value = deepValue(12_000, tag);
      const body = table(field('deep', value));
      expect(() => decodeTable(body)).toThrow(FieldTableError);
      expect(() => indexTable(body, 0, body.length)).toThrow(FieldTableError);
      expect(() => skipValue(value, 0, value.length)).toThrow(FieldTableError);
      expect(() => decodeValue(value, 0, value.length)).toThrow(FieldTableError);
    }
  });
});

describe("toAmqplibTable: what amqplib's decodeFields gives", () => {
  it('for every type RabbitMQ writes', () => {
    const body = table(...TYPED.map(([label, value]) => field(label, value)));
    const ours = toAmqplibTable(decodeTable(body));
    const theirs = amqplibCodec.decodeFields(body);
    expect(ours).toEqual(theirs);
    expect(shape(ours)).toEqual(shape(theirs));
  });

  it('loses what amqplib loses: 64-bit precision, bytes that are not UTF-8, types', () => {
    const fields = decodeTable(
      table(
        field('l', int64(2n ** 62n + 1n)),
        field('s', longString(hex('80 00 00 01'))),
        field('T', timestamp(1700000000n)),
        field('D', decimal(2, 314)),
        field('d', float64(42)),
      ),
    );
    expect(toAmqplibTable(fields)).toEqual({
      l: 2 ** 62,
      s: '\uFFFD\u0000\u0000\u0001',
      T: { '!': 'timestamp', value: 1700000000 },
      D: { '!': 'decimal', value: { places: 2, digits: 314 } },
      d: 42,
    });
  });

  it('keeps the last value of a repeated name, in the place of its first', () => {
    const body = table(field('a', int8(1)), field('b', int8(2)), field('a', int8(3)));
    const ours = toAmqplibTable(decodeTable(body));
    expect(shape(ours)).toEqual([
      ['a', 3],
      ['b', 2],
    ]);
    expect(shape(ours)).toEqual(shape(amqplibCodec.decodeFields(body)));
  });

  it('toAmqplibValue of an array of tables', () => {
    const value = array(nested(table(field('k', bytes('v')))), voidValue());
    const [typed] = decodeValue(value, 0, value.length);
    expect(toAmqplibValue(typed)).toEqual([{ k: name('v') }, null]);
  });
});

// ---- content header ---------------------------------------------------------------------------

const HEADERS = table(
  field('a', int8(1)),
  field('_HQ_DUPL_ID', longString('id-1')),
  field('b', longString(hex('80 00 00 01'))),
);

const EVERY_PROPERTY: BasicProperties = {
  contentType: 'application/json',
  contentEncoding: 'gzip',
  headers: HEADERS,
  deliveryMode: 2,
  priority: 9,
  correlationId: 'corr-1',
  replyTo: 'amq.rabbitmq.reply-to',
  expiration: '60000',
  messageId: 'm-1',
  timestamp: 1700000000n,
  type: 'order.created',
  userId: 'guest',
  appId: 'shop',
  clusterId: 'cluster-7',
};

/** One property alone, for each of the fourteen. */
const ONE_PROPERTY: Record<PropertyName, BasicProperties> = {
  contentType: { contentType: 'text/plain' },
  contentEncoding: { contentEncoding: 'gzip' },
  headers: { headers: table(field('k', bool(true))) },
  deliveryMode: { deliveryMode: 2 },
  priority: { priority: 255 },
  correlationId: { correlationId: 'c' },
  replyTo: { replyTo: 'r' },
  expiration: { expiration: '1000' },
  messageId: { messageId: 'm' },
  timestamp: { timestamp: 2n ** 64n - 1n },
  type: { type: 't' },
  userId: { userId: 'u' },
  appId: { appId: 'a' },
  clusterId: { clusterId: 'cl' },
};

const NO_EDIT = { remove: [], append: [], dropUserId: false };

describe('ContentHeader', () => {
  it('reads all fourteen properties, cluster_id included, as amqplib decodes them', () => {
    const bytes = basicProperties(EVERY_PROPERTY);
    const header = new ContentHeader(bytes);
    expect(header.flags).toBe(0xfffc);
    for (const [property] of BASIC_PROPERTIES) expect(header.has(property), property).toBe(true);
    expectBytes(header.shortstrBytes('clusterId') as Buffer, name('cluster-7'));
    expectBytes(header.messageIdBytes as Buffer, name('m-1'));
    expectBytes(header.userIdBytes as Buffer, name('guest'));
    const properties = header.toAmqplib();
    expect({ ...properties }).toEqual({
      contentType: 'application/json',
      contentEncoding: 'gzip',
      headers: { a: 1, _HQ_DUPL_ID: 'id-1', b: '\uFFFD\u0000\u0000\u0001' },
      deliveryMode: 2,
      priority: 9,
      correlationId: 'corr-1',
      replyTo: 'amq.rabbitmq.reply-to',
      expiration: '60000',
      messageId: 'm-1',
      timestamp: 1700000000,
      type: 'order.created',
      userId: 'guest',
      appId: 'shop',
      clusterId: 'cluster-7',
    });
    expect({ ...properties }).toEqual(amqplibDefs.decode(BASIC_CLASS, bytes));
  });

  it.each(Object.entries(ONE_PROPERTY))('reads %s alone, at its flag bit', (property, properties) => {
    const bytes = basicProperties(properties);
    const header = new ContentHeader(bytes);
    const index = BASIC_PROPERTIES.findIndex(([entry]) => entry === property);
    expect(header.flags).toBe(0x8000 >> index);
    for (const [other] of BASIC_PROPERTIES) expect(header.has(other), other).toBe(other === property);
    expect({ ...header.toAmqplib() }).toEqual(amqplibDefs.decode(BASIC_CLASS, bytes));
    expect(header.splice(NO_EDIT)).toBe(bytes);
  });

  it('reads no properties as amqplib does', () => {
    const header = new ContentHeader(basicProperties());
    expect(header.flags).toBe(0);
    expect(header.fields).toBeUndefined();
    expect(header.field('_HQ_DUPL_ID')).toBeUndefined();
    expect({ ...header.toAmqplib() }).toEqual(amqplibDefs.decode(BASIC_CLASS, basicProperties()));
  });

  it('keeps the bytes of shortstr properties that are not UTF-8', () => {
    const header = new ContentHeader(basicProperties({ messageId: hex('ff 00 80'), clusterId: hex('c3') }));
    expectBytes(header.messageIdBytes as Buffer, hex('ff 00 80'));
    expectBytes(header.shortstrBytes('clusterId') as Buffer, hex('c3'));
    expect(header.shortstrBytes('appId')).toBeUndefined();
  });

  it('finds header fields by name, the last of a repeated name, with their exact value bytes', () => {
    const header = new ContentHeader(
      basicProperties({
        messageId: 'm',
        headers: table(
          field('id', int8(1)),
          field('n', int64(2n ** 62n + 1n)),
          field('id', longString('two')),
        ),
      }),
    );
    const spanOf = (fieldName: string): FieldSpan => {
      const span = header.field(fieldName);
      if (span === undefined) throw new Error(`no field ${fieldName}`);
      return span;
    };
    expectBytes(header.valueBytes(spanOf('id')), longString('two'));
    expect(header.valueOf(spanOf('id'))).toEqual({ type: 'S', value: name('two') });
    expect(header.valueOf(spanOf('n'))).toEqual({ type: 'l', value: 2n ** 62n + 1n });
    expect(header.field('ID')).toBeUndefined();
  });

  it('returns the very same buffer from a splice without changes', () => {
    const bytes = basicProperties(EVERY_PROPERTY);
    const header = new ContentHeader(bytes);
    expect(header.splice(NO_EDIT)).toBe(bytes);
    expect(header.splice({ remove: ['absent'], append: [], dropUserId: false })).toBe(bytes);
    const anonymous = basicProperties({ messageId: 'm' });
    expect(new ContentHeader(anonymous).splice({ remove: ['x'], append: [], dropUserId: true })).toBe(
      anonymous,
    );
  });

  it('splices out only the named fields and appends at the end, every other byte kept', () => {
    const kept = [
      field('a', int8(1)),
      field('_HQ_DUPL_ID', longString('id-1')),
      field('n', int64(2n ** 62n + 1n)),
      field('s', longString(hex('80 00 00 01'))),
      field('nan', float64Bits(0x7ff8000000000001n)),
      field('x-dedup-in-doubt-not', bool(true)),
      field('t', nested(table(field('x-dedup-in-doubt', bool(true))))),
    ];
    const source = basicProperties({
      ...EVERY_PROPERTY,
      headers: table(kept[0] as Buffer, field('x-dedup-in-doubt', bool(true)), ...kept.slice(1)),
    });
    const added = [field('x-dedup-source', longString('bridge')), field('_HQ_DUPL_ID', int32(7))];
    const out = new ContentHeader(source).splice({
      remove: ['x-dedup-in-doubt', 'absent'],
      append: added,
      dropUserId: false,
    });
    expectBytes(out, basicProperties({ ...EVERY_PROPERTY, headers: table(...kept, ...added) }));
  });

  it('removes every field of a repeated name', () => {
    const source = basicProperties({
      headers: table(field('r', int8(1)), field('k', int8(2)), field('r', int8(3)), field('R', int8(4))),
    });
    const out = new ContentHeader(source).splice({ remove: ['r'], append: [], dropUserId: false });
    expectBytes(out, basicProperties({ headers: table(field('k', int8(2)), field('R', int8(4))) }));
  });

  it('keeps an empty table when every field is removed', () => {
    const source = basicProperties({ messageId: 'm', headers: table(field('r', int8(1))) });
    const out = new ContentHeader(source).splice({ remove: ['r'], append: [], dropUserId: false });
    expectBytes(out, basicProperties({ messageId: 'm', headers: table() }));
  });

  it('drops user_id when asked, and only then', () => {
    const source = basicProperties(EVERY_PROPERTY);
    const { userId: _dropped, ...rest } = EVERY_PROPERTY;
    expectBytes(
      new ContentHeader(source).splice({ remove: [], append: [], dropUserId: true }),
      basicProperties(rest),
    );
    const append = [field('z', voidValue())];
    expectBytes(
      new ContentHeader(source).splice({ remove: ['a'], append, dropUserId: true }),
      basicProperties({
        ...rest,
        headers: table(
          field('_HQ_DUPL_ID', longString('id-1')),
          field('b', longString(hex('80 00 00 01'))),
          ...append,
        ),
      }),
    );
    expectBytes(
      new ContentHeader(source).splice({ remove: [], append, dropUserId: false }),
      basicProperties({ ...EVERY_PROPERTY, headers: Buffer.concat([HEADERS, ...append]) }),
    );
  });

  it('creates the table, in its place among the properties, when there is none', () => {
    const { headers: _none, ...rest } = EVERY_PROPERTY;
    const append = [field('_HQ_DUPL_ID', longString('content-id'))];
    const out = new ContentHeader(basicProperties(rest)).splice({ remove: ['x'], append, dropUserId: false });
    expectBytes(out, basicProperties({ ...rest, headers: table(...append) }));
    const bare = new ContentHeader(basicProperties()).splice({ remove: [], append, dropUserId: false });
    expectBytes(bare, basicProperties({ headers: table(...append) }));
  });

  it.each([
    ['nested too deep', deepValue(MAX_TABLE_DEPTH), /nested deeper than 64/, true],
    ['nested 12,000 deep', deepValue(12_000, 'F'), /nested deeper than 64/, true],
    ['with an unknown type tag', tagged('Z', hex('01')), /unknown type tag/, false],
  ])(
    'reports a table %s in tableError, and still splices exactly',
    (_label, value, reason, topLevelWhole) => {
      const body = table(field('a', int8(1)), field('bad', value), field('_HQ_DUPL_ID', longString('id')));
      const bytes = basicProperties({ ...EVERY_PROPERTY, headers: body });
      const header = new ContentHeader(bytes);
      expect(header.tableError).toMatch(reason);
      expect(header.toAmqplib().messageId).toBe('m-1');
      expect(header.splice(NO_EDIT)).toBe(bytes);
      const append = [field('x-dedup-source', longString('bridge'))];
      const { userId: _dropped, ...rest } = EVERY_PROPERTY;
      const spliced = header.splice({ remove: ['a', '_HQ_DUPL_ID'], append, dropUserId: true });
      if (topLevelWhole) {
        // Its top level is whole: fields are found, taken out and added there; the deep value stays.
        expect(header.fields?.map((span) => span.name)).toEqual(['a', 'bad', '_HQ_DUPL_ID']);
        const id = header.field('_HQ_DUPL_ID');
        expect(id && header.valueBytes(id)).toEqual(longString('id'));
        expectBytes(
          spliced,
          basicProperties({ ...rest, headers: Buffer.concat([field('bad', value), ...append]) }),
        );
        // An application still reads what amqplib would, unless the nesting exhausts the stack.
        expect(() => header.toAmqplib().headers).not.toThrow();
      } else {
        expect(header.fields).toBeUndefined();
        expect(header.field('_HQ_DUPL_ID')).toBeUndefined();
        expect(header.toAmqplib().headers).toBeUndefined();
        expectBytes(spliced, basicProperties({ ...rest, headers: Buffer.concat([body, ...append]) }));
      }
    },
  );

  it('decodes for applications a table deeper than the bridge reads, as amqplib did', () => {
    const body = table(field('a', int8(1)), field('deep', deepValue(MAX_TABLE_DEPTH + 1)));
    const headers = new ContentHeader(basicProperties({ headers: body })).toAmqplib().headers as Record<
      string,
      unknown
    >;
    expect(headers.a).toBe(1);
    expect(Array.isArray(headers.deep)).toBe(true);
  });

  it('leaves tableError unset for a readable table', () => {
    expect(new ContentHeader(basicProperties(EVERY_PROPERTY)).tableError).toBeUndefined();
  });

  it.each([
    ['no property flags', hex('80')],
    ['the continuation flag', hex('00 01')],
    ['a shortstr cut short', Buffer.concat([hex('00 80'), hex('05 61 62')])],
    [
      'a table longer than the header',
      Buffer.concat([hex('20 00'), hex('00 00 00 09'), field('a', int8(1))]),
    ],
    ['a timestamp cut short', hex('00 40 00 00 00 01')],
    ['a missing octet', hex('10 00')],
  ])('refuses a content header with %s (ContentHeaderError)', (_label, bytes) => {
    expect(() => new ContentHeader(bytes)).toThrow(ContentHeaderError);
    const properties = propertiesFor(bytes);
    expect({ ...properties }).toEqual({});
    expect(() => contentHeaderOf(properties)).toThrow(ContentHeaderError);
  });
});

describe('propertiesFor', () => {
  it("gives amqplib's properties with the raw header attached, not enumerable", () => {
    const bytes = basicProperties(EVERY_PROPERTY);
    const properties = propertiesFor(bytes);
    expect({ ...properties }).toEqual(amqplibDefs.decode(BASIC_CLASS, bytes));
    const header = contentHeaderOf(properties);
    expect(header).toBeInstanceOf(ContentHeader);
    expect(header.bytes).toBe(bytes);
    expect(Object.getOwnPropertyDescriptor(properties, RAW_HEADER)?.enumerable).toBe(false);
    expect(RAW_HEADER in { ...properties }).toBe(false);
  });

  it("lazily (the bridge's own connections): each property reads as amqplib decodes it", () => {
    const bytes = basicProperties(EVERY_PROPERTY);
    const lazy = propertiesFor(bytes, true) as unknown as Record<string, unknown>;
    const expected = amqplibDefs.decode(BASIC_CLASS, bytes) as unknown as Record<string, unknown>;
    expect(Object.keys(expected).length).toBe(14);
    for (const [name, value] of Object.entries(expected)) expect(lazy[name]).toEqual(value);
    expect(contentHeaderOf(lazy as never).bytes).toBe(bytes);
    // A header with none of them set reads as undefined throughout, not as the other message's.
    const empty = propertiesFor(hex('00 00'), true) as unknown as Record<string, unknown>;
    for (const name of Object.keys(expected)) expect(empty[name]).toBeUndefined();
  });

  it('lazily, an unreadable header still carries its reason', () => {
    const properties = propertiesFor(hex('00 01'), true);
    expect(() => contentHeaderOf(properties)).toThrow(/continuation|flags continue/);
    expect((properties as unknown as Record<string, unknown>).messageId).toBeUndefined();
  });

  it('refuses properties that were not read through the lossless reader', () => {
    expect(() => contentHeaderOf(amqplibDefs.decode(BASIC_CLASS, basicProperties()))).toThrow(
      ContentHeaderError,
    );
  });
});
