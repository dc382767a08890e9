import { describe, expect, it } from 'vitest';
import { decodeMessage, replaceApplicationProperties } from '../../src/stream/amqp10-read.js';
import { basicProperties, field, int8, longString, table } from '../wire.js';

// Stored AMQP 1.0 entries, built byte by byte as stream clients of other languages write them,
// read as the 0-9-1 message the bridge forwards into a queue (its content header byte for byte).

const section = (descriptor: number, ...value: number[] | Buffer[]) =>
  Buffer.concat([
    Buffer.from([0x00, 0x53, descriptor]),
    ...value.map((v) => (Buffer.isBuffer(v) ? v : Buffer.from([v]))),
  ]);
const str8 = (code: number, text: string) =>
  Buffer.concat([Buffer.from([code, Buffer.byteLength(text)]), Buffer.from(text)]);
const list8 = (...items: Buffer[]) => {
  const body = Buffer.concat(items);
  return Buffer.concat([Buffer.from([0xc0, body.length + 1, items.length]), body]);
};
const map8 = (...pairs: Buffer[]) => {
  const body = Buffer.concat(pairs);
  return Buffer.concat([Buffer.from([0xc1, body.length + 1, pairs.length]), body]);
};
const list32 = (...items: Buffer[]) => {
  const body = Buffer.concat(items);
  const head = Buffer.alloc(9);
  head.writeUInt8(0xd0, 0);
  head.writeUInt32BE(body.length + 4, 1);
  head.writeUInt32BE(items.length, 5);
  return Buffer.concat([head, body]);
};
const NULL = Buffer.from([0x40]);
const data = (text: string) => section(0x75, str8(0xa0, text));

describe('decodeMessage', () => {
  it('maps a header section, ulong and uuid ids (with their types as headers, as RabbitMQ 3.10 does), creation time and typed application properties', () => {
    const ulong = Buffer.from([0x80, 0, 0, 0, 0, 0, 0, 0x01, 0x00]);
    const uuid = Buffer.concat([Buffer.from([0x98]), Buffer.from('00112233445566778899aabbccddeeff', 'hex')]);
    const created = Buffer.from([0x83, 0, 0, 0x01, 0x8b, 0xcf, 0xe5, 0x68, 0x00]); // ms
    const entry = Buffer.concat([
      section(0x70, list8(Buffer.from([0x41]), Buffer.from([0x50, 0x05]))),
      section(
        0x73,
        list8(ulong, NULL, NULL, NULL, NULL, uuid, str8(0xa3, 'text/plain'), NULL, NULL, created),
      ),
      section(0x74, map8(str8(0xa1, 'k'), str8(0xa1, 'v'), str8(0xa1, 'b'), Buffer.from([0x51, 0xff]))),
      data('body'),
    ]);
    const decoded = decodeMessage(entry, 'events');
    const seconds = BigInt(0x018bcfe56800) / 1000n;
    expect(decoded.header.bytes.toString('hex')).toBe(
      basicProperties({
        contentType: 'text/plain',
        headers: table(
          field('k', longString('v')),
          field('b', int8(-1)),
          field('x-message-id-type', longString('ulong')),
          field('x-correlation-id-type', longString('uuid')),
        ),
        deliveryMode: 2,
        priority: 5,
        correlationId: '00112233-4455-6677-8899-aabbccddeeff',
        messageId: '256',
        timestamp: seconds,
      }).toString('hex'),
    );
    expect(decoded.body.toString()).toBe('body');
    expect([decoded.exchange.toString(), decoded.routingKey.toString()]).toEqual(['', 'events']);
  });

  it('refuses a body with no 0-9-1 form unless the stored bytes are what is written', () => {
    const value = section(0x77, str8(0xa1, 'value'));
    expect(() => decodeMessage(value, 's')).toThrow(/amqp-value or amqp-sequence/);
    expect(() => decodeMessage(Buffer.concat([data('a'), data('b')]), 's')).toThrow(/2 data sections/);
    expect(decodeMessage(value, 's', { anyBody: true }).header.bytes.toString('hex')).toBe('0000');
    expect(() => decodeMessage(Buffer.from([0x00, 0x53, 0x75, 0xa0, 0x09, 0x41]), 's')).toThrow(/cut short/);
  });

  it('leaves a property over 255 bytes out of the header of a copy into a stream, and refuses it into a queue', () => {
    const long = 'm'.repeat(300);
    const str32 = Buffer.concat([Buffer.from([0xb1, 0, 0, 1, 0x2c]), Buffer.from(long)]);
    const entry = Buffer.concat([
      section(0x73, list32(str32, NULL, NULL, NULL, str8(0xa1, 'replies'))),
      data('body'),
    ]);
    expect(() => decodeMessage(entry, 's')).toThrow(/a property of 300 bytes has no 0-9-1 form/);
    const copied = decodeMessage(entry, 's', { anyBody: true });
    expect(copied.header.bytes.toString('hex')).toBe(basicProperties({ replyTo: 'replies' }).toString('hex'));
    expect(copied.body.toString()).toBe('body');
    // A route that may key the entry on its message-id keeps it: held, not keyed on what follows.
    expect(() => decodeMessage(entry, 's', { anyBody: true, keepMessageId: true })).toThrow(
      /a property of 300 bytes has no 0-9-1 form/,
    );
  });
});

describe('replaceApplicationProperties', () => {
  it('keeps every other byte, replaces named entries and appends at the end', () => {
    const props = section(0x73, list8(str8(0xa1, 'id')));
    const entry = Buffer.concat([
      props,
      section(0x74, map8(str8(0xa1, 'a'), str8(0xa1, '1'), str8(0xa1, 'x-dedup-route'), str8(0xa1, 'old'))),
      data('b'),
    ]);
    const copy = replaceApplicationProperties(
      entry,
      ['x-dedup-route'],
      [['x-dedup-route', Buffer.from('new')]],
    );
    expect(copy.subarray(0, props.length).equals(props)).toBe(true);
    expect(copy.subarray(copy.length - data('b').length).equals(data('b'))).toBe(true);
    expect(copy.includes(Buffer.from('old'))).toBe(false);
    const applicationProperties = section(
      0x74,
      map8(str8(0xa1, 'a'), str8(0xa1, '1'), str8(0xa1, 'x-dedup-route'), str8(0xa1, 'new')),
    );
    expect(copy.equals(Buffer.concat([props, applicationProperties, data('b')]))).toBe(true);
  });

  it('inserts the section before the body when the entry has none', () => {
    const entry = Buffer.concat([section(0x73, list8(NULL)), data('b')]);
    const copy = replaceApplicationProperties(entry, [], [['k', Buffer.from('v')]]);
    expect(
      copy.equals(
        Buffer.concat([
          section(0x73, list8(NULL)),
          section(0x74, map8(str8(0xa1, 'k'), str8(0xa1, 'v'))),
          data('b'),
        ]),
      ),
    ).toBe(true);
  });
});
