import type { IdStrategy } from '../config/id-from.js';
import { deriveId } from '../dedup/id.js';
import { DUPLICATE_ID_HEADER } from '../headers.js';
import type { Source } from '../ports.js';
import { rawField } from '../wire/fields.js';
import { type ContentHeader, ContentHeaderError } from '../wire/properties.js';
import type { RouteCounters } from './counters.js';
import type { Entry, Failure } from './entry.js';
import { namedOf, type PerMessageLog } from './per-message.js';
import { type ForwardedHeader, routeMarksOf } from './route-mark.js';

/** Why a delivery is not forwarded, when it is not. */
export interface NotAdmitted {
  why: Failure;
  detail?: string;
}

/**
 * Reads a delivery for forwarding: its content header, the routes it went through, and its ID
 * under the --id-from strategies. What cannot be read, came back to this route, or has no ID is
 * not forwarded (the refusal policy decides what becomes of it).
 */
export class Admission {
  constructor(
    private readonly source: Source,
    private readonly idFrom: readonly IdStrategy[],
    private readonly keyOf: (idKey: string) => string,
    private readonly forwarded: ForwardedHeader,
    private readonly counters: RouteCounters,
    private readonly perMessage: PerMessageLog,
  ) {}

  /** Fills in the entry's header, marks and ID; or says why it is not forwarded. */
  admit(entry: Entry): NotAdmitted | undefined {
    const message = entry.message;
    let header: ContentHeader;
    try {
      header = this.source.headerOf(message);
    } catch (error) {
      if (!(error instanceof ContentHeaderError)) throw error;
      return { why: 'unreadable', detail: error.message };
    }
    entry.header = header;
    // Its headers cannot be read (nested too deep, say): refused, never a dropped connection.
    if (header.tableError !== undefined) return { why: 'unreadable', detail: header.tableError };
    const marks = routeMarksOf(header);
    entry.marks = marks;
    if (this.forwarded.loopedBack(marks)) {
      // This route forwarded it before and the target routed it back into the source queue: as a
      // duplicate it would be acked and deleted. It is refused instead, loudly.
      this.counters.looped++;
      this.perMessage.error(
        { ...namedOf(message), route: this.forwarded.route },
        'a message this route forwarded came back to its source queue: the target routes into the source (a loop); it is not acked',
      );
      return {
        why: 'loop',
        detail: 'forwarded by this route before: the target routes back into the source queue',
      };
    }
    const routing = this.source.routingOf(message);
    entry.routingKey = routing.routingKey;
    const { id, rejected } = deriveId(
      {
        content: message.content,
        exchange: routing.exchange,
        routingKey: routing.routingKey,
        header,
        position: this.source.positionOf?.(message),
      },
      this.idFrom,
    );
    if (rejected.length > 0) {
      this.counters.badIdHeader++;
      this.perMessage.warn(
        { ...namedOf(message), rejected, usedStrategy: id?.strategy ?? 'none' },
        'message has an ID header of a type that cannot be an ID; the next --id-from strategy decided',
      );
    }
    if (!id) {
      this.counters.noId++;
      this.perMessage.warn(
        { ...namedOf(message), strategies: this.idFrom.length },
        'message has no ID under any --id-from strategy; it is not forwarded',
      );
      return { why: 'no-id' };
    }
    entry.key = this.keyOf(id.key);
    entry.idField = id.own ? undefined : rawField(DUPLICATE_ID_HEADER, id.value);
    entry.idText = id.key;
    entry.id = id.value.toString('latin1');
    return undefined;
  }
}
