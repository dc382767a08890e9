/**
 * The two sides the pipeline forwards between, as it sees them. A source or target type (a queue
 * over AMQP 0-9-1, a RabbitMQ stream over the stream protocol) is one adapter of these; the
 * pipeline knows nothing of channels, confirms or offsets.
 *
 * The message in between is an AMQP 0-9-1 message as the source sent it: its raw content header
 * (read losslessly by src/wire) and its body. An adapter of another protocol maps to and from that
 * form, as RabbitMQ itself does between its protocols.
 */
import type { BridgeError } from './errors.js';
import type { ContentHeader } from './wire/properties.js';

/** One message as the source delivered it, until the pipeline settles it. */
export interface Delivery {
  readonly content: Buffer;
  readonly fields: {
    /** As text, for log lines (the bytes the source sent are routingOf's). */
    readonly routingKey: string;
    readonly exchange: string;
    /** Delivered before (and not settled then). */
    readonly redelivered: boolean;
  };
  readonly properties: { readonly messageId?: unknown };
  /**
   * The message as a stream source stored it (AMQP 1.0 sections): a stream target writes these
   * bytes, with only the bridge's own headers set, rather than a copy mapped through 0-9-1.
   */
  readonly amqp10?: Buffer;
}

export interface Source {
  /** Starts delivering; each delivery is settled once with ack, requeue, deadLetter or park. */
  consume(onDelivery: (delivery: Delivery) => void): Promise<void>;
  /** Stops delivering (what is held stays held until settled). */
  stopConsuming(): Promise<void>;
  /** Before a stop: lets what is already on its way arrive, where a return would cost (quorum). */
  quiesce?(): Promise<void>;
  /** Its content header as the source sent it; throws ContentHeaderError when it cannot be read. */
  headerOf(delivery: Delivery): ContentHeader;
  /** The exchange and routing key it was published with, as the bytes the source broker sent. */
  routingOf(delivery: Delivery): { exchange: string | Buffer; routingKey: string | Buffer };
  /** Done with it: the source forgets it. False when it can no longer be settled (see holds). */
  ack(delivery: Delivery): boolean;
  /** Given back: the source delivers it again later. */
  requeue(delivery: Delivery): boolean;
  /** Handed to the source's dead-letter handling (RabbitMQ drops it where the queue has none). */
  deadLetter(delivery: Delivery): boolean;
  /** Moved to the park queue with `reason`; false (nothing moved) when it could not be. */
  park(delivery: Delivery, reason: string): Promise<boolean>;
  /** Whether it is still ours to settle: false once the source took it back (a lost connection). */
  holds(delivery: Delivery): boolean;
  /**
   * The source's own name for this message, where it has one (a stream's position of it, as
   * `<cluster>/<vhost>/<stream>@<offset>`): the ID under `--id-from offset`.
   */
  positionOf?(delivery: Delivery): string | undefined;
}

/**
 * A source as the bridge runs it: the Source the pipeline consumes, and what the bridge, migrate
 * and the metrics read of it. One adapter per source type (a queue over 0-9-1, a stream).
 */
export interface SourceSide extends Source {
  /**
   * Messages left to read: a queue's ready messages, a stream's messages between the read
   * position and the end it reads to; undefined when unknown (a stream followed for ever).
   */
  depth(): Promise<number | undefined>;
  /** Whether the route consumes (see RouteStatus.consuming), and whether it paused itself. */
  consumption(): { consuming: boolean; paused: boolean };
  /** Body bytes held, their peak, and bytes returned unread (--max-in-flight-bytes). */
  readonly bytes: { readonly held: number; readonly peak: number; readonly returned: number };
  /** Stops the consumer with every settlement sent (a queue's held acks, a stream's position). */
  closeConsumer(): Promise<void>;
}

/** One publish: the pipeline fills the message fields, the target the answer fields. */
export interface Publish {
  /** The raw content header to send: property flags and list, changed as docs/guarantee.md says. */
  properties: Buffer;
  content: Buffer;
  /** The routing key it came with (bytes as the source sent them); a target may route otherwise. */
  routingKey: string | Buffer;
  /**
   * The wire value of its `_HQ_DUPL_ID` field. One publish per ID is in flight at a time, so a
   * target may match answers (a basic.return, say) and remember messages by it.
   */
  id: string;
  /** Its claim key in the cache (an exact target records which claim each write belongs to). */
  readonly key?: string | undefined;
  /** The message as its source stream stored it, when it came from one (see Delivery.amqp10). */
  readonly amqp10?: Buffer | undefined;
  /** The `_HQ_DUPL_ID` field the pipeline set in `properties` (name and value), if it set one. */
  readonly idField?: Buffer | undefined;
  /**
   * performance.now() past which it must not be written (its lease is no longer known to hold):
   * checked at the write itself, after any wait for the connection, an alarm or a full buffer.
   */
  writeBy: number;
  /** Set by the target while the message is written (handed to the connection) and unanswered. */
  written?: boolean;
  /** Set by the target with a refusal: why, in words for the log line and the park reason. */
  refusal?: string;
}

/**
 * Why a target refused a message. 'rejected' may leave a copy stored (published to several
 * queues, one refused it and another stored it), so its ID stays in doubt; the others store none.
 */
type Refusal =
  | 'unroutable' // nothing was bound to take it
  | 'rejected' // refused (a queue over its length limit, say)
  | 'too-large' // over the target's size limit
  | 'unpublishable'; // cannot be sent as it is (never sent)

/** What became of one publish. */
export type PublishOutcome =
  | 'stored' // the target holds it
  | Refusal
  | 'unknown' // maybe stored (the connection went before the answer): sent again, flagged
  | 'unsent' // surely not stored (never sent, or dropped unread): sent again as it was
  | 'fenced'; // not sent: its writeBy had passed (claimed again first)

export interface Target {
  /** Publishes one message and tells `answered` its outcome, once (a callback: no promise each). */
  send(publish: Publish, answered: (outcome: PublishOutcome) => void): void;
  /**
   * Drops what has not left this host and makes every unanswered publish end 'unknown' (a
   * process whose leases run out must not deliver late); the target connects again.
   */
  reset(reason: string): void;
  /** The target's size limit, once it refused a message for being larger (for stall advice). */
  readonly sizeLimit: number | undefined;
  /**
   * True for a target that answers every publish as stored or not, even after a failure (a
   * stream with a named producer): its own copies never need the in-doubt flag, and a claim an
   * earlier owner of its producer left ('reclaimed') is a plain new one (the target settled that
   * owner's writes when it took the producer over). Another route's left claim stays in doubt.
   */
  readonly exact?: boolean;
  /** Told of the claims committed after their publish was stored (an exact target's bookkeeping). */
  committed?(keys: readonly string[]): void;
  /** True once the target failed for good (it told onFatal): a publish is not tried again. */
  readonly ended?: boolean;
  /**
   * Set by the pipeline on an exact target, which writes in order: asks Redis now for the leases
   * of publishes whose writeBy passed while they waited (for Redis, say), and moves writeBy on for
   * those still ours. Fenced instead, they would be claimed again and written after the messages
   * behind them.
   */
  renewLeases?: (publishes: readonly Publish[]) => Promise<void>;
  /**
   * Set by the pipeline: told when the target reset its connection on its own because frames of
   * publishes past their writeBy were still on this host (the process stalled before writing them).
   */
  onStaleWrites?: () => void;
}

/**
 * What the cache said about an ID at claim: 'new' (ours now), 'dup' (committed: on the target
 * already), 'busy' (another owner holds it), 'in-doubt' (ours now; an earlier owner's copy may be
 * on the target, so ours goes flagged), 'reclaimed' (in doubt, left by an earlier owner of the
 * same stream producer: an exact target settled that owner's writes, so for it this is 'new').
 */
export type ClaimState = 'new' | 'dup' | 'busy' | 'in-doubt' | 'reclaimed';

/**
 * What a commit found: our claim ('committed'), the ID committed already ('already'), another
 * owner's claim ('taken', committed anyway), or nothing at all ('restored': the cache had lost it).
 */
export type CommitResult = 'committed' | 'already' | 'taken' | 'restored';

/** The dedup cache as the pipeline uses it: claims with a lease, commits, releases, renewals. */
export interface Claims {
  /** The cache key of an ID (which a message's later copies share). */
  keyOf(idKey: string): string;
  claim(keys: readonly string[]): Promise<ClaimState[]>;
  commit(keys: readonly string[]): Promise<CommitResult[]>;
  /** Gives up our claims; with keepInDoubt they stay, expired and flagged, for the next owner. */
  release(keys: readonly string[], options?: { keepInDoubt?: boolean }): Promise<number>;
  /** Extends our leases: true renewed, false no longer ours (committed, taken over, released). */
  renewEach(keys: readonly string[]): Promise<boolean[]>;
}

/**
 * A target as the bridge runs it: the Target the pipeline publishes to, and its connection's life
 * (connect, reconnect with backoff, close) and health. One adapter per target type.
 */
export interface TargetSide extends Target {
  /** The server in use, for log lines and outage lines ("target broker at …", password hidden). */
  readonly where: string;
  /** Connects for the first time and checks the destination exists; rejects with the user's error. */
  start(): Promise<void>;
  /** Ends every wait and closes the connection. */
  close(): Promise<void>;
  readonly isUp: boolean;
  /** When the connection went down; undefined while it is up. */
  readonly downSince: number | undefined;
  /** Since when the target has refused to take publishes (a resource alarm), and why. */
  readonly blockedSince: { since: number; reason: string } | undefined;
  /**
   * Whether a publish here goes straight into `queue` of the broker `identity` names (as
   * `<cluster>/<vhost>`, see AmqpLink.identity): a route from that queue would be a loop.
   */
  feeds(identity: string | undefined, queue: string): boolean;
  /** Told of failures retrying cannot fix (no permission to write): the bridge stops. */
  onFatal: (error: BridgeError) => void;
}
