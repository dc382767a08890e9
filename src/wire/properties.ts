import type { MessageProperties } from 'amqplib';
import {
  decodeTable,
  decodeValue,
  type FieldSpan,
  FieldTableError,
  type FieldValue,
  indexTable,
  toAmqplibTable,
} from './fields.js';

/**
 * The content header of a basic message, kept as the broker sent it: the property flags and the
 * property list, byte for byte. The bridge forwards these bytes, splicing in only its documented
 * changes, so every property (cluster_id included) and every header field keeps its type, value
 * and order. amqplib's decoded properties stay available for applications and logs.
 */

/** The fourteen basic properties, in wire order, with their flag bits. */
export const BASIC_PROPERTIES = [
  ['contentType', 'shortstr'],
  ['contentEncoding', 'shortstr'],
  ['headers', 'table'],
  ['deliveryMode', 'octet'],
  ['priority', 'octet'],
  ['correlationId', 'shortstr'],
  ['replyTo', 'shortstr'],
  ['expiration', 'shortstr'],
  ['messageId', 'shortstr'],
  ['timestamp', 'longlong'],
  ['type', 'shortstr'],
  ['userId', 'shortstr'],
  ['appId', 'shortstr'],
  ['clusterId', 'shortstr'],
] as const;

export type PropertyName = (typeof BASIC_PROPERTIES)[number][0];

const HEADERS = 2;
const USER_ID = 11;
const MESSAGE_ID = 8;

function flagOf(index: number): number {
  return 0x8000 >> index;
}

const PROPERTY_KINDS = BASIC_PROPERTIES.map(([, kind]) => kind);
/** How many properties before the one at `index` are present (their flags are the higher bits). */
function presentBefore(flags: number, index: number): number {
  let before = flags & (0xffff0000 >>> index) & 0xffff;
  let count = 0;
  while (before !== 0) {
    before &= before - 1;
    count++;
  }
  return count;
}

/** Where a message's raw content header lives on its amqplib properties object. */
export const RAW_HEADER = Symbol.for('dedup-bridge.content-header');

/** A content header that cannot be read: the message is refused with this reason. */
export class ContentHeaderError extends Error {}

export class ContentHeader {
  readonly flags: number;
  /**
   * Where each present property ends in `bytes`, in wire order: properties lie back to back from
   * offset 2, so the k-th present one starts where the one before it ends. One small array per
   * delivery, sized by what is present (most headers carry two or three properties).
   */
  private readonly ends: number[];
  /** The header table's top-level fields (undefined when there is no table, or it is unreadable). */
  readonly fields: FieldSpan[] | undefined;
  /** Why the header table cannot be read (nested too deep, an unknown type), if it cannot. */
  readonly tableError: string | undefined;

  /** `bytes`: the property flags and property list (the header frame after class, weight and size). */
  constructor(readonly bytes: Buffer) {
    if (bytes.length < 2) throw new ContentHeaderError('content header has no property flags');
    this.flags = bytes.readUInt16BE(0);
    if (this.flags & 1) {
      throw new ContentHeaderError('content header flags continue past the fourteen basic properties');
    }
    // Made at its size: an array grown from empty takes room for sixteen at its first push.
    this.ends = new Array<number>(presentBefore(this.flags, PROPERTY_KINDS.length));
    let present = 0;
    let p = 2;
    for (let index = 0; index < PROPERTY_KINDS.length; index++) {
      if (!(this.flags & flagOf(index))) continue;
      const kind = PROPERTY_KINDS[index];
      if (kind === 'shortstr') p += 1 + (bytes[p] ?? 0);
      else if (kind === 'octet') p += 1;
      else if (kind === 'longlong') p += 8;
      else p += 4 + (p + 4 <= bytes.length ? bytes.readUInt32BE(p) : 0);
      if (p > bytes.length)
        throw new ContentHeaderError(`content header truncated in its ${BASIC_PROPERTIES[index]?.[0]}`);
      this.ends[present++] = p;
    }
    const tableStart = this.startOf(HEADERS);
    if (tableStart >= 0) {
      const tableEnd = this.endOf(HEADERS);
      try {
        this.fields = indexTable(bytes, tableStart + 4, tableEnd);
      } catch (error) {
        if (!(error instanceof FieldTableError)) throw error;
        this.tableError = `header table: ${error.message}`;
        // Its top level may still be whole: then fields can be found, removed and added there.
        try {
          this.fields = indexTable(bytes, tableStart + 4, tableEnd, false);
        } catch (shallow) {
          if (!(shallow instanceof FieldTableError)) throw shallow;
        }
      }
    }
  }

  has(property: PropertyName): boolean {
    return this.startOf(indexOf(property)) >= 0;
  }

  /** Where a property's bytes start (-1: absent, or no property of that index), and where they end. */
  private startOf(index: number): number {
    if (index < 0 || index >= PROPERTY_KINDS.length || !(this.flags & flagOf(index))) return -1;
    const rank = presentBefore(this.flags, index);
    return rank === 0 ? 2 : (this.ends[rank - 1] as number);
  }

  /** Only for a present property (startOf(index) >= 0). */
  private endOf(index: number): number {
    return this.ends[presentBefore(this.flags, index)] as number;
  }

  /** The raw bytes of a shortstr property (without its length), or undefined when absent. */
  shortstrBytes(property: PropertyName): Buffer | undefined {
    return this.shortstrAt(indexOf(property));
  }

  get messageIdBytes(): Buffer | undefined {
    return this.shortstrAt(MESSAGE_ID);
  }

  get userIdBytes(): Buffer | undefined {
    return this.shortstrAt(USER_ID);
  }

  private shortstrAt(index: number): Buffer | undefined {
    const start = this.startOf(index);
    return start >= 0 ? this.bytes.subarray(start + 1, this.endOf(index)) : undefined;
  }

  /** The last top-level header field of this name (as most clients read a repeated name). */
  field(name: string): FieldSpan | undefined {
    const fields = this.fields;
    if (!fields) return undefined;
    for (let i = fields.length - 1; i >= 0; i--) {
      const span = fields[i] as FieldSpan;
      if (span.name === name) return span;
    }
    return undefined;
  }

  /** A field's value bytes: its type tag and value, exactly as on the wire. */
  valueBytes(span: FieldSpan): Buffer {
    return this.bytes.subarray(span.valueAt, span.end);
  }

  /** A field's typed value. */
  valueOf(span: FieldSpan): FieldValue {
    return decodeValue(this.bytes, span.valueAt, span.end)[0];
  }

  /**
   * The properties as amqplib decodes them, for applications and logs. `headers` is decoded on its
   * first read (the costly part, which the bridge itself never needs).
   */
  toAmqplib(): MessageProperties {
    const out: Record<string, unknown> = {};
    if (this.flags === 0) return out as unknown as MessageProperties;
    BASIC_PROPERTIES.forEach(([name, kind], index) => {
      if (kind !== 'table' || this.startOf(index) < 0) {
        out[name] = this.propertyAt(index);
        return;
      }
      let decoded: unknown;
      let known = false;
      Object.defineProperty(out, name, {
        enumerable: true,
        configurable: true,
        get: () => {
          if (!known) {
            decoded = this.propertyAt(index);
            known = true;
          }
          return decoded;
        },
        set: (value: unknown) => {
          decoded = value;
          known = true;
        },
      });
    });
    return out as unknown as MessageProperties;
  }

  /** One property as amqplib decodes it (undefined when absent). */
  propertyAt(index: number): unknown {
    const start = this.startOf(index);
    // Not `start < 0`: an index past the fourteen reads undefined, which is no property either.
    if (!(start >= 0)) return undefined;
    const end = this.endOf(index);
    const kind = PROPERTY_KINDS[index];
    if (kind === 'shortstr') return this.bytes.toString('utf8', start + 1, end);
    if (kind === 'octet') return this.bytes[start];
    if (kind === 'longlong') return Number(this.bytes.readBigUInt64BE(start));
    return this.decodeForAmqplib(start + 4, end);
  }

  /**
   * The header table as amqplib decodes it. A table too deep for the bridge's limit is still
   * decoded for an application (amqplib had no limit) unless it exhausts the stack.
   */
  private decodeForAmqplib(start: number, end: number): Record<string, unknown> | undefined {
    try {
      const limit = this.tableError === undefined ? undefined : Number.POSITIVE_INFINITY;
      return toAmqplibTable(decodeTable(this.bytes.subarray(start, end), limit));
    } catch (error) {
      if (error instanceof FieldTableError || error instanceof RangeError) return undefined;
      throw error;
    }
  }

  /**
   * The content header to publish: these bytes with the header fields named in `remove` taken out,
   * `append` (encoded fields) added at the end of the table, and `user_id` dropped if asked. Every
   * other byte is the source's. Without changes, the very same buffer. An unreadable table is kept
   * whole (nothing can be removed from it; appending is still exact).
   */
  splice(edit: { remove: readonly string[]; append: readonly Buffer[]; dropUserId: boolean }): Buffer {
    const tableStart = this.startOf(HEADERS);
    const fields = tableStart >= 0 ? this.fields : undefined;
    // The table body's bytes that stay: all but the removed fields (fields lie back to back).
    let body = tableStart >= 0 ? this.endOf(HEADERS) - tableStart - 4 : 0;
    let removed = 0;
    if (fields) {
      for (let i = 0; i < fields.length; i++) {
        const span = fields[i] as FieldSpan;
        if (!edit.remove.includes(span.name)) continue;
        body -= span.end - span.start;
        removed++;
      }
    }
    const dropUser = edit.dropUserId && this.startOf(USER_ID) >= 0;
    if (removed === 0 && edit.append.length === 0 && !dropUser) return this.bytes;
    let flags = this.flags;
    if (dropUser) flags &= ~flagOf(USER_ID);
    const hasTable = tableStart >= 0 || edit.append.length > 0;
    if (hasTable) flags |= flagOf(HEADERS);
    for (let i = 0; i < edit.append.length; i++) body += (edit.append[i] as Buffer).length;
    let size = 2 + (hasTable ? 4 + body : 0);
    for (let index = 0; index < PROPERTY_KINDS.length; index++) {
      const start = this.startOf(index);
      if (start >= 0 && index !== HEADERS && !(index === USER_ID && dropUser))
        size += this.endOf(index) - start;
    }
    // Written once into a buffer of its size (no list of parts to concatenate).
    const out = Buffer.allocUnsafe(size);
    const bytes = this.bytes;
    let p = out.writeUInt16BE(flags, 0);
    for (let index = 0; index < PROPERTY_KINDS.length; index++) {
      const start = this.startOf(index);
      if (index === HEADERS) {
        if (!hasTable) continue;
        p = out.writeUInt32BE(body, p);
        if (start >= 0) {
          // The runs between removed fields, in order.
          let run = start + 4;
          if (fields && removed > 0) {
            for (let i = 0; i < fields.length; i++) {
              const span = fields[i] as FieldSpan;
              if (!edit.remove.includes(span.name)) continue;
              p += bytes.copy(out, p, run, span.start);
              run = span.end;
            }
          }
          p += bytes.copy(out, p, run, this.endOf(HEADERS));
        }
        for (let i = 0; i < edit.append.length; i++) p += (edit.append[i] as Buffer).copy(out, p);
        continue;
      }
      if (start < 0 || (index === USER_ID && dropUser)) continue;
      p += bytes.copy(out, p, start, this.endOf(index));
    }
    return out;
  }
}

function indexOf(property: PropertyName): number {
  return BASIC_PROPERTIES.findIndex(([name]) => name === property);
}

/**
 * amqplib's properties for a message, with its raw content header attached (not enumerable). A
 * header that cannot be read gives empty properties, and the reason in place of the raw header:
 * the bridge refuses that message instead of losing its connection over it. `lazy` (the bridge's
 * own connections, which read the raw header only): each property is decoded when first read, from
 * getters on the prototype, so a message costs no decoding the bridge does not ask for; such an
 * object has no own enumerable properties (not for spreading: applications get the eager form).
 */
export function propertiesFor(bytes: Buffer, lazy = false): MessageProperties {
  let raw: ContentHeader | string;
  try {
    raw = new ContentHeader(bytes);
  } catch (error) {
    if (!(error instanceof ContentHeaderError)) throw error;
    raw = error.message;
  }
  if (lazy) return new LazyProperties(raw) as unknown as MessageProperties;
  const properties = typeof raw === 'string' ? ({} as MessageProperties) : raw.toAmqplib();
  Object.defineProperty(properties, RAW_HEADER, { value: raw, enumerable: false });
  return properties;
}

class LazyProperties {
  readonly [RAW_HEADER]: ContentHeader | string;
  constructor(raw: ContentHeader | string) {
    this[RAW_HEADER] = raw;
  }
}
BASIC_PROPERTIES.forEach(([name], index) => {
  Object.defineProperty(LazyProperties.prototype, name, {
    get(this: LazyProperties) {
      const raw = this[RAW_HEADER];
      return typeof raw === 'string' ? undefined : raw.propertyAt(index);
    },
  });
});

/** The raw content header of a message read through a connection the bridge set up. */
export function contentHeaderOf(properties: MessageProperties): ContentHeader {
  const raw = (properties as unknown as Record<symbol, unknown>)[RAW_HEADER];
  if (raw instanceof ContentHeader) return raw;
  if (typeof raw === 'string') throw new ContentHeaderError(raw);
  throw new ContentHeaderError(
    'message was not read through a connection with the lossless reader installed',
  );
}
