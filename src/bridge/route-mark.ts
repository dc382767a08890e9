import { hash } from 'node:crypto';
import { DUPLICATE_ID_HEADER, IN_DOUBT_HEADER, ROUTE_HEADER, SOURCE_USER_HEADER } from '../headers.js';
import { encodeValue, rawField } from '../wire/fields.js';
import type { ContentHeader } from '../wire/properties.js';

/** How many routes a message's `x-dedup-route` mark remembers (the last ones it went through). */
const MAX_ROUTE_MARKS = 16;

const IN_DOUBT_FIELD = rawField(IN_DOUBT_HEADER, encodeValue({ type: 't', value: true }));
// The header fields a forwarded copy gets anew, and `_HQ_DUPL_ID` too when the bridge sets it.
const REPLACED: readonly string[] = [IN_DOUBT_HEADER, SOURCE_USER_HEADER, ROUTE_HEADER];
const REPLACED_WITH_ID: readonly string[] = [...REPLACED, DUPLICATE_ID_HEADER];
// With --strip-cc also the sender-selected distribution headers: RabbitMQ routes a copy of the
// message to each routing key they list, on the target as on the source.
const CC_HEADERS: readonly string[] = ['CC', 'BCC'];
const REPLACED_NO_CC: readonly string[] = [...REPLACED, ...CC_HEADERS];
const REPLACED_WITH_ID_NO_CC: readonly string[] = [...REPLACED_WITH_ID, ...CC_HEADERS];

/** What a forwarded copy's header is made from, besides the source's header. */
export interface Forwarding {
  /** The routes the message went through, from its mark (see routeMarksOf). */
  marks: readonly string[];
  /** The `_HQ_DUPL_ID` field to set (its name and value bytes), unless the message has its own. */
  idField: Buffer | undefined;
  /** Flag it `x-dedup-in-doubt`: a copy of it may be on the target already. */
  inDoubt: boolean;
}

/**
 * The content header of forwarded copies: the source's, changed only as documented
 * (docs/guarantee.md): `_HQ_DUPL_ID` set when the ID came from elsewhere, `x-dedup-in-doubt`
 * removed or added, `x-dedup-route` ending with this route, a `user_id` the target would refuse
 * moved to a header, and with --strip-cc no `CC` or `BCC`.
 */
export class ForwardedHeader {
  private readonly replaced: { own: readonly string[]; withId: readonly string[] };
  /** This route's mark alone, the usual case: made once. */
  private readonly ownMark: Buffer;
  /** This route's token in marks (see routeToken). */
  private readonly token: string;

  constructor(
    /** Names this route (source cluster, vhost and queue); its token marks what it forwards. */
    readonly route: string,
    /** The user the target connection logs in as: a `user_id` naming another becomes a header. */
    private readonly targetUser: string | undefined,
    stripCc: boolean,
  ) {
    this.replaced = stripCc
      ? { own: REPLACED_NO_CC, withId: REPLACED_WITH_ID_NO_CC }
      : { own: REPLACED, withId: REPLACED_WITH_ID };
    this.token = routeToken(route);
    this.ownMark = markField([this.token]);
  }

  /** Whether this route forwarded the message before (it came back: a loop). */
  loopedBack(marks: readonly string[]): boolean {
    return marks.includes(this.token);
  }

  of(header: ContentHeader, forwarding: Forwarding): Buffer {
    const { idField } = forwarding;
    // x-dedup-source-user-id is the bridge's to write: a producer could forge one, so one that came
    // with the message is dropped, and set only from a user_id the source broker vouched for.
    const remove = idField ? this.replaced.withId : this.replaced.own;
    const append: Buffer[] = [];
    if (idField) append.push(idField);
    const userId = header.userIdBytes;
    const foreignUser = userId !== undefined && userId.toString('utf8') !== this.targetUser;
    if (foreignUser) {
      // RabbitMQ refuses a user_id that is not the publishing user; keep it as a header instead.
      append.push(rawField(SOURCE_USER_HEADER, encodeValue({ type: 'S', value: userId })));
    }
    if (forwarding.inDoubt) append.push(IN_DOUBT_FIELD);
    // The routes it went through, this one last, so that a loop back here is seen.
    const { marks } = forwarding;
    append.push(
      marks.length === 0 ? this.ownMark : markField([...marks, this.token].slice(-MAX_ROUTE_MARKS)),
    );
    return header.splice({ remove, append, dropUserId: foreignUser });
  }
}

/**
 * A route's token in the `x-dedup-route` mark: the first 9 bytes of the SHA-256 of its name
 * (`<source cluster>/<vhost>/<queue>`), as 12 base64url characters. The mark is one long string of
 * tokens: fixed-width and bounded whatever the names (bench/mark-cost.ts found no form of the mark
 * measurably cheaper for the broker than another, bar JSON, which costs more). Two routes of one
 * message's path share a token with a chance of about 2^-72.
 */
export function routeToken(route: string): string {
  return hash('sha256', route, 'buffer').subarray(0, 9).toString('base64url');
}

const TOKEN_LENGTH = 12;
const TOKEN = /^[A-Za-z0-9_-]{12}$/;

/**
 * The route tokens a message went through, from its `x-dedup-route` mark: one long string of
 * tokens separated by spaces, this version's form. Anything else there is no mark of ours (it is
 * replaced on forward).
 */
export function routeMarksOf(header: ContentHeader): string[] {
  const span = header.field(ROUTE_HEADER);
  if (!span) return [];
  const value = header.valueOf(span);
  if (value.type !== 'S' || value.value.length === 0) return [];
  const tokens = value.value.toString('latin1').split(' ');
  if (tokens.length > MAX_ROUTE_MARKS) return [];
  for (const token of tokens) if (token.length !== TOKEN_LENGTH || !TOKEN.test(token)) return [];
  return tokens;
}

/** The mark: one long string of route tokens, this route's last. */
function markField(tokens: readonly string[]): Buffer {
  return rawField(ROUTE_HEADER, encodeValue({ type: 'S', value: Buffer.from(tokens.join(' '), 'latin1') }));
}
