import type { ClaimState, Delivery, Publish } from '../ports.js';
import type { ContentHeader } from '../wire/properties.js';

/**
 * One source message on its way through claim → publish → commit → ack; also its publish to the
 * target (one object per message on the forwarding path).
 */
export interface Entry extends Publish {
  message: Delivery;
  /** The content header as the source delivered it (undefined when it cannot be read). */
  header: ContentHeader | undefined;
  /** The routes it went through, from its `x-dedup-route` mark. */
  marks: readonly string[];
  /** Full cache key; undefined when the message has no ID. */
  key: string | undefined;
  /** The `_HQ_DUPL_ID` field for the target (its name and value bytes), unless the message's own. */
  idField: Buffer | undefined;
  /** The ID as the cache keys it (for log lines), when it has one. */
  idText?: string;
  state: ClaimState | undefined;
  /** True for the copy of its ID that is in flight; later copies wait for its outcome. */
  leading: boolean;
  /** performance.now() when the claim now held was asked for (0: no claim). */
  claimedAt: number;
  /** Until when our lease surely holds: asked for at claimedAt or a renewal, plus the lease. */
  leaseUntil: number;
  /** A publish of it was sent and is unanswered (see Leases; `written` once it is on its way). */
  outstanding: boolean;
  /** A copy of ours may be on the target: every later copy goes flagged, whatever the claim says. */
  doubt: boolean;
  /** Stored, its commit sent: a renewal that finds no claim may have run after the commit. */
  committing: boolean;
}

/** Why a message is not forwarded; 'unreadable', 'unpublishable' and 'loop' come with the detail. */
export type Failure = 'unroutable' | 'nacked' | 'no-id' | 'unreadable' | 'unpublishable' | 'loop';

// An Entry's properties before its first publish.
const EMPTY = Buffer.alloc(0);

export function newEntry(message: Delivery): Entry {
  return {
    message,
    header: undefined,
    marks: [],
    key: undefined,
    idField: undefined,
    properties: EMPTY,
    content: message.content,
    amqp10: message.amqp10,
    routingKey: '',
    id: '',
    state: undefined,
    leading: false,
    claimedAt: 0,
    leaseUntil: 0,
    writeBy: 0,
    outstanding: false,
    doubt: false,
    committing: false,
  };
}
