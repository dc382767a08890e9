import { isDeepStrictEqual } from 'node:util';
import { describe, expect, it } from 'vitest';
import {
  BASIC_PROPERTIES,
  ContentHeader,
  contentHeaderOf,
  propertiesFor,
} from '../../src/wire/properties.js';
import {
  array,
  type BasicProperties,
  basicProperties,
  bool,
  bytes,
  deepValue,
  field,
  float64,
  int8,
  int32,
  int64,
  longString,
  nested,
  PROPERTY_ORDER,
  table,
  voidValue,
} from '../wire.js';

// The forwarded content header is written straight into one buffer from runs of the source's bytes
// (ContentHeader.splice). These tests hold it to a reference built from the message's description
// alone (test/wire.ts, no bridge codec): the same properties with the removed fields left out of
// the table, the appended fields at its end, user_id dropped when asked. Thousands of random headers,
// from a fixed seed so that a failure can be replayed.

/** A small deterministic generator (mulberry32). */
function random(seed: number): () => number {
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// Few names, so that repeated fields and removals of present fields are common.
const NAMES = [
  '_HQ_DUPL_ID',
  'x-dedup-in-doubt',
  'x-dedup-source-user-id',
  'x-dedup-route',
  'a',
  'b',
  '',
  'é-name',
  'n'.repeat(255),
];

interface Field {
  name: string;
  bytes: Buffer;
}

const PROPERTY_NAMES = BASIC_PROPERTIES.map(([name]) => name);

function generator(seed: number) {
  const next = random(seed);
  const int = (below: number) => Math.floor(next() * below);
  const pick = <T>(items: readonly T[]): T => items[int(items.length)] as T;
  const rawBytes = (most: number) => Buffer.from(Array.from({ length: int(most + 1) }, () => int(256)));

  const value = (depth = 0): Buffer => {
    const kinds = depth > 2 ? 7 : 9;
    switch (int(kinds)) {
      case 0:
        return longString(rawBytes(40));
      case 1:
        return int8(int(256) - 128);
      case 2:
        return int32(int(2 ** 31) - 2 ** 30);
      case 3:
        return int64(BigInt(int(2 ** 31)) * 2n ** 31n + 1n);
      case 4:
        return bool(int(3));
      case 5:
        return bytes(rawBytes(20));
      case 6:
        return pick([voidValue(), float64(next() * 1e6)]);
      case 7:
        return nested(table(...Array.from({ length: int(3) }, () => field(pick(NAMES), value(depth + 1)))));
      default:
        return array(...Array.from({ length: int(4) }, () => value(depth + 1)));
    }
  };
  const aField = (): Field => {
    const name = pick(NAMES);
    return { name, bytes: field(name, value()) };
  };
  const shortText = () => (int(2) === 0 ? rawBytes(int(2) === 0 ? 255 : 12) : `text-${int(1000)}`);

  return {
    int,
    pick,
    aField,
    /** A random property set; `fields` undefined means no header table. */
    properties(): { spec: BasicProperties; fields: Field[] | undefined } {
      const spec: BasicProperties = {};
      for (const name of PROPERTY_ORDER) {
        if (name === 'headers' || int(2) === 0) continue;
        if (name === 'deliveryMode' || name === 'priority') spec[name] = int(256);
        else if (name === 'timestamp') spec.timestamp = BigInt(int(2 ** 31)) * 2n ** 33n;
        else spec[name] = shortText();
      }
      const fields = int(4) === 0 ? undefined : Array.from({ length: int(7) }, aField);
      if (fields) spec.headers = table(...fields.map((f) => f.bytes));
      return { spec, fields };
    },
  };
}

interface Edit {
  remove: string[];
  append: Buffer[];
  dropUserId: boolean;
}

/** What the splice must write, from the description: kept fields in order, then the appended ones. */
function reference(spec: BasicProperties, fields: Field[] | undefined, edit: Edit): Buffer {
  const out: BasicProperties = { ...spec };
  if (edit.dropUserId) delete out.userId;
  const kept = (fields ?? []).filter((f) => !edit.remove.includes(f.name)).map((f) => f.bytes);
  if (fields !== undefined || edit.append.length > 0) out.headers = table(...kept, ...edit.append);
  return basicProperties(out);
}

describe('the content header splice', () => {
  it('matches a reference built from the description, over 5,000 random headers and edits', () => {
    const gen = generator(0x5eed);
    for (let round = 0; round < 5000; round++) {
      const { spec, fields } = gen.properties();
      const edit: Edit = {
        remove: NAMES.filter(() => gen.int(3) === 0),
        append: Array.from({ length: gen.int(4) }, () => gen.aField().bytes),
        dropUserId: gen.int(2) === 0,
      };
      const source = basicProperties(spec);
      const spliced = new ContentHeader(source).splice(edit);
      const expected = reference(spec, fields, edit);
      expect(spliced.toString('hex'), `round ${round}`).toBe(expected.toString('hex'));
      // What it wrote reads back whole.
      expect(new ContentHeader(spliced).tableError, `round ${round}`).toBeUndefined();
    }
  });

  it('removes the first, a middle, the last and every copy of a repeated field', () => {
    const f = (name: string, n: number) => field(name, int32(n));
    const fields = [f('first', 1), f('dup', 2), f('mid', 3), f('dup', 4), f('last', 5)];
    const spec = { messageId: 'm', headers: table(...fields), userId: 'u', appId: 'app' };
    const header = new ContentHeader(basicProperties(spec));
    const cases: [string[], Buffer[]][] = [
      [['first'], [fields[1], fields[2], fields[3], fields[4]] as Buffer[]],
      [['mid'], [fields[0], fields[1], fields[3], fields[4]] as Buffer[]],
      [['last'], [fields[0], fields[1], fields[2], fields[3]] as Buffer[]],
      [['dup'], [fields[0], fields[2], fields[4]] as Buffer[]],
      [['first', 'mid', 'last', 'dup'], []],
      [['first', 'last'], [fields[1], fields[2], fields[3]] as Buffer[]],
    ];
    for (const [remove, kept] of cases) {
      const spliced = header.splice({ remove, append: [], dropUserId: false });
      expect(spliced.toString('hex'), remove.join()).toBe(
        basicProperties({ ...spec, headers: table(...kept) }).toString('hex'),
      );
    }
    // Every field removed and one appended: the table holds only the new one.
    const appended = field('_HQ_DUPL_ID', longString('id-1'));
    expect(
      header.splice({ remove: ['first', 'mid', 'last', 'dup'], append: [appended], dropUserId: true }),
    ).toEqual(basicProperties({ messageId: 'm', headers: appended, appId: 'app' }));
  });

  it('adds a table where there was none, keeps an empty one, and drops user_id alone', () => {
    const appended = field('x-dedup-route', array(longString('c/v/q')));
    const bare = new ContentHeader(basicProperties({ userId: 'someone', clusterId: 'c' }));
    expect(bare.splice({ remove: ['a'], append: [appended], dropUserId: false })).toEqual(
      basicProperties({ headers: appended, userId: 'someone', clusterId: 'c' }),
    );
    expect(bare.splice({ remove: ['a'], append: [], dropUserId: true })).toEqual(
      basicProperties({ clusterId: 'c' }),
    );
    // No change at all: the very same bytes.
    const empty = basicProperties({ headers: table() });
    expect(new ContentHeader(empty).splice({ remove: ['a'], append: [], dropUserId: true })).toBe(
      new ContentHeader(empty).bytes,
    );
    // No properties at all, then one field.
    expect(
      new ContentHeader(basicProperties({})).splice({ remove: [], append: [appended], dropUserId: true }),
    ).toEqual(basicProperties({ headers: appended }));
  });

  it('splices a table nested too deep at its top level, and keeps an unreadable table whole', () => {
    const id = field('_HQ_DUPL_ID', longString('deep-1'));
    const deep = field('deep', deepValue(200));
    const stale = field('x-dedup-in-doubt', bool(true));
    const tooDeep = new ContentHeader(basicProperties({ headers: table(stale, deep, id), priority: 3 }));
    expect(tooDeep.tableError).toBeDefined();
    const route = field('x-dedup-route', array());
    expect(tooDeep.splice({ remove: ['x-dedup-in-doubt'], append: [route], dropUserId: false })).toEqual(
      basicProperties({ headers: table(deep, id, route), priority: 3 }),
    );
    // An unknown type at the top level: no field can be found, the table goes on as it came.
    const unknown = table(stale, field('odd', 'Z', Buffer.from([1, 2])), id);
    const unreadable = new ContentHeader(basicProperties({ headers: unknown, userId: 'u' }));
    expect(unreadable.tableError).toBeDefined();
    expect(unreadable.fields).toBeUndefined();
    expect(unreadable.splice({ remove: ['x-dedup-in-doubt'], append: [route], dropUserId: true })).toEqual(
      basicProperties({ headers: table(unknown, route) }),
    );
  });
});

describe('the properties of a delivered message', () => {
  it('read the same lazily (the bridge) as eagerly (applications), for every property of random headers', () => {
    const gen = generator(0xbead);
    const differ: string[] = [];
    for (let round = 0; round < 1000; round++) {
      const source = basicProperties(gen.properties().spec);
      const lazy = propertiesFor(Buffer.from(source), true) as unknown as Record<string, unknown>;
      const eager = propertiesFor(Buffer.from(source), false) as unknown as Record<string, unknown>;
      const read = (properties: Record<string, unknown>) => PROPERTY_NAMES.map((name) => properties[name]);
      if (!isDeepStrictEqual(read(lazy), read(eager))) differ.push(`round ${round}`);
      // Both carry the raw bytes the bridge forwards.
      if (!contentHeaderOf(lazy as never).bytes.equals(source)) differ.push(`round ${round}: lazy bytes`);
      if (!contentHeaderOf(eager as never).bytes.equals(source)) differ.push(`round ${round}: eager bytes`);
    }
    expect(differ).toEqual([]);
  });

  it('have nothing past the fourteen: an index out of range is no property, not the header misread', () => {
    const source = basicProperties({
      contentType: 'text/plain',
      headers: table(field('k', longString('v'))),
      appId: 'app',
    });
    const header = new ContentHeader(source);
    for (const index of [-1, 14, 15, Number.NaN]) expect(header.propertyAt(index)).toBeUndefined();
    expect(header.propertyAt(0)).toBe('text/plain');
    // Only an expiration, whose bytes (flags included) also read as a field table: out of range
    // must not decode them as one.
    const tableLike = new ContentHeader(Buffer.from(`01007401006201${'0056'.repeat(56)}`, 'hex'));
    expect(tableLike.propertyAt(7)).toBe(`\u0001\u0000b\u0001${'\u0000V'.repeat(56)}`);
    for (const index of [-1, 14, 15, Number.NaN]) expect(tableLike.propertyAt(index)).toBeUndefined();
  });

  it('are plain, spreadable values for an application', () => {
    const source = basicProperties({
      messageId: 'm-7',
      headers: table(field('n', int32(7)), field('s', longString('x'))),
      timestamp: 1_700_000_000n,
      priority: 4,
    });
    const eager = propertiesFor(source, false);
    const copy = { ...eager };
    expect(copy).toMatchObject({
      messageId: 'm-7',
      headers: { n: 7, s: 'x' },
      timestamp: 1_700_000_000,
      priority: 4,
    });
    expect(Object.keys(copy)).toEqual([...PROPERTY_NAMES]);
    expect(JSON.parse(JSON.stringify(eager))).toMatchObject({ messageId: 'm-7', headers: { n: 7 } });
  });

  it('of an unreadable header are empty, lazily and eagerly, and carry the reason', () => {
    const truncated = basicProperties({ messageId: 'm-1' }).subarray(0, 4);
    for (const lazy of [true, false]) {
      const properties = propertiesFor(Buffer.from(truncated), lazy);
      expect(properties.messageId).toBeUndefined();
      expect(() => contentHeaderOf(properties)).toThrow(/truncated in its messageId/);
    }
  });
});
