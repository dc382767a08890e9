import type { ConsumeMessage } from 'amqplib';
import { encodeValue, rawField } from '../amqp/fields.js';
import { routingBytesOf } from '../amqp/internals.js';
import { type ContentHeader, ContentHeaderError, contentHeaderOf } from '../amqp/properties.js';
import { refusalOfClose } from '../amqp/refusal.js';
import type { SourceQueue } from '../amqp/source.js';
import type { PublishOutcome, TargetPublisher } from '../amqp/target.js';
import { backoffDelay, sleep } from '../backoff.js';
import type { IdStrategy } from '../config/id-from.js';
import type { UnforwardablePolicy } from '../config/settings.js';
import type { ClaimState, CommitResult, DedupCache } from '../dedup/cache.js';
import { deriveId } from '../dedup/id.js';
import { ConfigError, describe, FatalConnectError } from '../errors.js';
import { DUPLICATE_ID_HEADER, IN_DOUBT_HEADER, ROUTE_HEADER, SOURCE_USER_HEADER } from '../headers.js';
import type { Logger } from '../log.js';
import { newCounters, type RouteCounters } from './counters.js';
import type { MessageBudget } from './limits.js';
import { clip, PerMessageLog } from './per-message.js';

const IN_DOUBT_FIELD = rawField(IN_DOUBT_HEADER, encodeValue({ type: 't', value: true }));
// The header fields a forwarded copy gets anew (see outgoing), and `_HQ_DUPL_ID` too when the
// bridge sets it: made once, not per message.
const REPLACED: readonly string[] = [IN_DOUBT_HEADER, SOURCE_USER_HEADER, ROUTE_HEADER];
const REPLACED_WITH_ID: readonly string[] = [...REPLACED, DUPLICATE_ID_HEADER];
// With --strip-cc also the sender-selected distribution headers: RabbitMQ routes a copy of the
// message to each routing key they list, on the target as on the source.
const CC_HEADERS: readonly string[] = ['CC', 'BCC'];
const REPLACED_NO_CC: readonly string[] = [...REPLACED, ...CC_HEADERS];
const REPLACED_WITH_ID_NO_CC: readonly string[] = [...REPLACED_WITH_ID, ...CC_HEADERS];

/** The stages whose latency metrics watch: the Redis claim and commit, and the target's confirm. */
export type LatencyStage = 'claim' | 'commit' | 'confirm';

interface RouteSettings {
  name: string;
  sourceQueue: string;
  /** '' is the default exchange (then the routing key is the target queue). */
  targetExchange: string;
  /** undefined: use each message's own routing key. */
  targetRoutingKey: string | undefined;
  /** The user the target connection logs in as: a `user_id` property naming another is moved to a header. */
  targetUser: string | undefined;
  scope: string;
  redisPrefix: string;
  idFrom: readonly IdStrategy[];
  batchSize: number;
  leaseMs: number;
  onUnforwardable: UnforwardablePolicy;
  parkQueue: string | undefined;
  /** Backoff before the bridge retries a message the target refused (it holds it meanwhile). */
  requeueDelay: { initialMs: number; maxMs: number };
  /** Names this route (source cluster, vhost and queue) in the `x-dedup-route` mark of what it forwards. */
  routeMark: string;
  /** Messages the route may still take (migrate --max-messages, shared by a job's routes). */
  budget: MessageBudget;
  /** Waits before publishing this many messages (migrate --max-rate). */
  throttle: ((count: number) => Promise<void>) | undefined;
  /** Remove `CC` and `BCC` from the headers on forward (--strip-cc). */
  stripCc: boolean;
  /** Test hook: called between a batch's confirms and its commit (the documented window). */
  afterConfirm: (() => void) | undefined;
}

/** One source message on its way through claim → publish → commit → ack. */
interface Entry {
  message: ConsumeMessage;
  /** The content header as the source delivered it (undefined when it cannot be read). */
  header: ContentHeader | undefined;
  /** Full Redis key; undefined when the message has no ID. */
  key: string | undefined;
  /** The `_HQ_DUPL_ID` field for the target (its name and value bytes), unless the message's own. */
  idField: Buffer | undefined;
  /** The wire value of `_HQ_DUPL_ID` on the target, by which a return is matched to its publish. */
  matchKey: string;
  /** The ID as the cache keys it (for log lines), when it has one. */
  idText?: string;
  state: ClaimState | undefined;
  /** True for the copy of its ID that is in flight; later copies wait in `inFlight`. */
  leading: boolean;
  /** Times the broker closed the target channel while this was in flight. */
  suspect: number;
  /** Why the bridge refuses it, when it does (said in the log and the park reason). */
  refusal?: string;
  /** The broker's words when it last closed the target channel while this was in flight. */
  closedBy?: string;
  /** performance.now() when the claim now held was asked for (0: no claim). */
  claimedAt: number;
  /** Until when our lease surely holds: asked for at claimedAt or a renewal, plus the lease. */
  leaseUntil: number;
  /** Past this the message is not written to the target (see LEASE_WRITE_SHARE). */
  writeBy: number;
  /** A publish of it was sent and is unanswered (see fenceWrites; `written` once it is on its way). */
  outstanding: boolean;
  written?: boolean;
  /** A copy of ours may be on the target: every later copy goes flagged, whatever the claim says. */
  doubt: boolean;
  /** Confirmed, its commit sent: a renewal that finds no claim may have run after the commit. */
  committing: boolean;
}

/** Why a message is refused; 'unreadable', 'unpublishable' and 'loop' come with the detail. */
type Failure = 'unroutable' | 'nacked' | 'no-id' | 'unreadable' | 'unpublishable' | 'loop';

/** How many routes a message's `x-dedup-route` mark remembers (the last ones it went through). */
const MAX_ROUTE_MARKS = 16;

/** Thrown inside work that a stop abandoned when its time ran out. */
class Abandoned extends Error {}

// An ACL refusal, of the call itself or of a command inside a script.
const REDIS_NO_PERMISSION = /NOPERM|can't run this command/;

// Claim calls out at once; the messages that arrive meanwhile wait and go as the next batch.
const MAX_CLAIMS_OUT = 2;
// The most IDs one commit call takes (a Redis script blocks the server while it runs).
const MAX_COMMIT_IDS = 1000;
// How long a message whose ID another owner holds waits before it is claimed again.
const BUSY_RECHECK_MS = 250;
// A message is written to the target only while at least this share of its lease is left, so
// that a process that stalled (paused, starved of CPU, cut off from Redis) after its claim does
// not publish under a lease another owner may already have taken over.
const LEASE_WRITE_SHARE = 1 / 3;
// A publish that is out and unconfirmed when its lease is down to this share (Redis renewed
// nothing meanwhile) makes the bridge reset the target connection: what has not left this host is
// then never sent, so it cannot land after another owner's copy as an unflagged second copy.
const LEASE_RESET_SHARE = 1 / 5;
// Remembered retry counts of failing IDs, for their backoff; bounded, oldest forgotten first.
const MAX_RETRY_MEMORY = 10_000;
// Remembered IDs that were in flight when the target closed its channel: when one comes back it
// goes alone at once, so that a poison message kills the ordinary channel once, not each retry.
const MAX_SUSPECT_MEMORY = 10_000;

function secondsSince(started: number): number {
  return (performance.now() - started) / 1000;
}

/**
 * The forwarding protocol for one route. Every source message is acked only after the target
 * confirmed it and its ID was committed, or after the cache showed its ID already committed.
 */
export class Pipeline {
  readonly counters: RouteCounters = newCounters();
  /** Told how long a stage took and for how many messages (the metrics set it). */
  onLatency: (stage: LatencyStage, seconds: number, messages: number) => void = () => {};
  /** Messages delivered to us and not yet acked or returned. */
  private held = 0;
  /**
   * Of those, messages the target refused (or that cannot be forwarded), held to be retried after
   * a backoff: from their first failure until they are forwarded or given back.
   */
  private readonly retrying = new Set<Entry>();
  private lastProgressAt = Date.now();
  private failuresSinceProgress = 0;

  private readonly batch: Entry[] = [];
  private flushScheduled = false;
  /** Claim calls sent and not yet answered (see flush). */
  private claimsOut = 0;
  /** Confirmed batches waiting for the commit call out to come back (see commitSoon). */
  private readonly commitQueue: {
    keys: string[];
    resolve: (results: CommitResult[]) => void;
    reject: (error: unknown) => void;
  }[] = [];
  private committing = false;
  /** IDs in flight in this process → copies of the same ID waiting for its outcome. */
  private readonly inFlight = new Map<string, Entry[]>();
  /** Entries holding a claim that is not yet committed or released (their leases are renewed). */
  private readonly claimed = new Set<Entry>();
  private readonly timers = new Map<NodeJS.Timeout, () => void>();
  private readonly active = new Set<Promise<void>>();
  private readonly retryCounts = new Map<string, number>();
  private readonly suspectIds = new Set<string>();
  private ownRouteField: Buffer | undefined;
  /** The header fields a forwarded copy drops or gets anew, with the message's own ID or with ours. */
  private readonly replaced: { own: readonly string[]; withId: readonly string[] };
  /** Lines about single messages, capped per kind and interval, their message text clipped. */
  private readonly perMessage: PerMessageLog;
  private renewTimer: NodeJS.Timeout | undefined;
  private fenceTimer: NodeJS.Timeout | undefined;
  private renewing = false;
  /** Set while Redis calls fail, so that an outage is logged once, not once per batch. */
  private redisFailing = false;
  /** When the current streak of failed Redis calls began (Date.now()); undefined once one succeeds. */
  private failingSince: number | undefined;
  /** The first line of the streak's last error (an error reply such as OOM). */
  private lastRedisError: string | undefined;
  private suspects: Promise<void> = Promise.resolve();
  private stopping = false;
  /** Set when a stop ran out of time: publishes still waiting for the target give up. */
  private abandoned = false;
  private failed: ((error: Error) => void) | undefined;
  private idleWaiters: (() => void)[] = [];

  constructor(
    private readonly settings: RouteSettings,
    private readonly source: SourceQueue,
    private readonly target: TargetPublisher,
    private readonly cache: DedupCache,
    private readonly log: Logger,
  ) {
    this.perMessage = new PerMessageLog(log);
    this.replaced = settings.stripCc
      ? { own: REPLACED_NO_CC, withId: REPLACED_WITH_ID_NO_CC }
      : { own: REPLACED, withId: REPLACED_WITH_ID };
  }

  /** Starts consuming; `onFatal` is told of failures this pipeline cannot recover from. */
  async start(onFatal: (error: Error) => void): Promise<void> {
    this.failed = onFatal;
    const renewEvery = Math.max(100, Math.floor(this.settings.leaseMs / 3));
    this.renewTimer = setInterval(() => this.renewLeases(), renewEvery);
    const fenceEvery = Math.max(50, Math.floor(this.settings.leaseMs / 10));
    this.fenceTimer = setInterval(() => this.fenceWrites(), fenceEvery);
    await this.source.consume((message) => this.receive(message));
  }

  /**
   * Since when every Redis call of this route has failed (an error reply such as OOM or READONLY;
   * while the connection is down calls wait instead), with the last error's first line; undefined
   * while calls succeed. The bridge counts it as an outage for --retry-for.
   */
  get redisFailingSince(): { since: number; error: string } | undefined {
    if (this.failingSince === undefined) return undefined;
    return { since: this.failingSince, error: this.lastRedisError ?? 'no answer' };
  }

  /** The target's max_message_size, once it refused a message for being larger. */
  get targetSizeLimit(): number | undefined {
    return this.target.sizeLimit;
  }

  /** Messages delivered to us and not yet acked or returned to the source. */
  get heldCount(): number {
    return this.held;
  }

  /**
   * True when what we hold is messages that failed and are being retried (and copies of their IDs
   * waiting behind them): nothing else is being forwarded.
   */
  get onlyFailuresHeld(): boolean {
    if (this.held === 0 || this.retrying.size === 0) return false;
    let behind = 0;
    for (const waiting of this.inFlight.values()) behind += waiting.length;
    return this.held === this.retrying.size + behind;
  }

  /** When a message was last forwarded, skipped as a duplicate, parked or dead-lettered. */
  get lastProgress(): number {
    return this.lastProgressAt;
  }

  get msSinceProgress(): number {
    return Date.now() - this.lastProgressAt;
  }

  get failedSinceProgress(): number {
    return this.failuresSinceProgress;
  }

  get limitReached(): boolean {
    return this.settings.budget.exhausted;
  }

  /** Resolves when nothing is held (or at once if nothing is). */
  whenIdle(): Promise<void> {
    if (this.held === 0) return Promise.resolve();
    return new Promise((resolve) => this.idleWaiters.push(resolve));
  }

  /**
   * Stops taking messages, returns the ones waiting (for a backoff, another owner or a copy in
   * flight) to the source, and lets the ones being forwarded finish for up to `timeoutMs`.
   * Returns how many were still unfinished; their claims are left to expire as in-doubt.
   */
  async stop(timeoutMs: number): Promise<number> {
    this.stopping = true;
    await this.source.stopConsuming();
    for (const [timer, fire] of this.timers) {
      clearTimeout(timer);
      fire();
    }
    this.timers.clear();
    for (const waiters of this.inFlight.values()) {
      for (const waiter of waiters.splice(0)) this.giveBack(waiter);
    }
    const deadline = sleep(timeoutMs).then(() => 'timeout' as const);
    while (this.active.size > 0 || this.batch.length > 0) {
      this.flush();
      const result = await Promise.race([Promise.allSettled([...this.active]), deadline]);
      if (result === 'timeout') {
        this.abandoned = true;
        break;
      }
    }
    if (this.renewTimer) clearInterval(this.renewTimer);
    if (this.fenceTimer) clearInterval(this.fenceTimer);
    this.perMessage.flush();
    // A source reconnect waiting to consume again must not wait any longer.
    for (const wake of this.idleWaiters.splice(0)) wake();
    return this.held;
  }

  private receive(message: ConsumeMessage): void {
    if (this.stopping || !this.settings.budget.tryTake()) {
      // Delivered after we stopped or hit the limit: not ours to handle.
      this.source.nack(message, true);
      if (this.limitReached) void this.source.stopConsuming();
      return;
    }
    this.held++;
    this.counters.consumed++;
    if (message.fields.redelivered) this.counters.redelivered++;
    if (this.limitReached) void this.source.stopConsuming();

    const blank: Entry = {
      message,
      header: undefined,
      key: undefined,
      idField: undefined,
      matchKey: '',
      state: undefined,
      leading: false,
      suspect: 0,
      claimedAt: 0,
      leaseUntil: 0,
      writeBy: 0,
      outstanding: false,
      doubt: false,
      committing: false,
    };
    let header: ContentHeader;
    try {
      header = contentHeaderOf(message.properties);
    } catch (error) {
      if (!(error instanceof ContentHeaderError)) throw error;
      this.track(this.handleFailure(blank, 'unreadable', error.message));
      return;
    }
    blank.header = header;
    if (header.tableError !== undefined) {
      // Its headers cannot be read (nested too deep, say): refused, never a dropped connection.
      this.track(this.handleFailure(blank, 'unreadable', header.tableError));
      return;
    }
    const marks = routeMarksOf(header);
    if (marks.includes(this.settings.routeMark)) {
      // This route forwarded it before and the target routed it back into the source queue: as a
      // duplicate it would be acked and deleted. It is refused instead, loudly.
      this.counters.looped++;
      this.perMessage.error(
        { ...this.named(message), route: this.settings.routeMark },
        'a message this route forwarded came back to its source queue: the target routes into the source (a loop); it is not acked',
      );
      this.track(
        this.handleFailure(
          blank,
          'loop',
          'forwarded by this route before: the target routes back into the source queue',
        ),
      );
      return;
    }
    const routing = routingBytesOf(message.fields);
    const { id, rejected } = deriveId(
      {
        content: message.content,
        exchange: routing?.exchange ?? message.fields.exchange,
        routingKey: routing?.routingKey ?? message.fields.routingKey,
        header,
      },
      this.settings.idFrom,
    );
    if (rejected.length > 0) {
      this.counters.badIdHeader++;
      this.perMessage.warn(
        { ...this.named(message), rejected, usedStrategy: id?.strategy ?? 'none' },
        'message has an ID header of a type that cannot be an ID; the next --id-from strategy decided',
      );
    }
    if (!id) {
      this.counters.noId++;
      this.perMessage.warn(
        { ...this.named(message), strategies: this.settings.idFrom.length },
        'message has no ID under any --id-from strategy; it is not forwarded',
      );
      this.track(this.handleFailure(blank, 'no-id'));
      return;
    }
    const key = this.cache.keyOf(id.key);
    // The same entry, now with its ID (one object per message on the forwarding path).
    const entry = blank;
    entry.suspect = this.suspectIds.has(key) ? 1 : 0;
    entry.key = key;
    entry.idField = id.own ? undefined : rawField(DUPLICATE_ID_HEADER, id.value);
    entry.idText = id.key;
    entry.matchKey = id.value.toString('latin1');
    const waiting = this.inFlight.get(key);
    if (waiting) {
      // A copy of this ID is already on its way: wait for its outcome, then claim.
      waiting.push(entry);
      return;
    }
    this.inFlight.set(key, []);
    entry.leading = true;
    this.enqueue(entry);
  }

  private enqueue(entry: Entry): void {
    this.batch.push(entry);
    if (this.batch.length >= this.settings.batchSize) {
      this.flush();
    } else if (!this.flushScheduled) {
      this.flushScheduled = true;
      setImmediate(() => this.flush());
    }
  }

  private flush(): void {
    this.flushScheduled = false;
    // Claims out at once are bounded: under load the next batch fills while they are answered, so
    // a busy bridge makes fewer, larger Redis calls (each call costs both ends far more than an ID).
    while (this.batch.length > 0 && this.claimsOut < MAX_CLAIMS_OUT) {
      const entries = this.batch.splice(0, this.settings.batchSize);
      this.track(this.forward(entries));
    }
  }

  private track(work: Promise<void>): void {
    const tracked = work.catch((error: unknown) => {
      // A stop that ran out of time left this batch: its messages stay unacked, claims in doubt.
      if (!(error instanceof Abandoned)) this.fail(error);
    });
    this.active.add(tracked);
    void tracked.finally(() => this.active.delete(tracked));
  }

  private fail(error: unknown): void {
    const failure = error instanceof Error ? error : new Error(String(error));
    if (this.failed) this.failed(failure);
    else this.log.error({ error: describe(error) }, 'pipeline failed');
  }

  /** claim → publish → commit → ack, for one batch of distinct IDs. */
  private async forward(entries: Entry[]): Promise<void> {
    const keys = entries.map((entry) => entry.key as string);
    const claimStarted = performance.now();
    this.claimsOut++;
    let states: ClaimState[];
    // When the claim that answered was asked for: the lease runs from no earlier than that.
    let askedAt = 0;
    try {
      states = await this.redis('claim', () => {
        askedAt = performance.now();
        return this.cache.claim(keys);
      });
    } finally {
      this.claimsOut--;
      if (this.batch.length > 0) this.flush();
    }
    this.onLatency('claim', secondsSince(claimStarted), entries.length);
    const toPublish: Entry[] = [];
    const busy: Entry[] = [];
    const { leaseMs } = this.settings;
    entries.forEach((entry, index) => {
      const claimed = states[index] as ClaimState;
      // Our own claim seen again answers 'new'; a copy of ours may still be out there.
      const state = claimed === 'new' && entry.doubt ? 'in-doubt' : claimed;
      entry.state = state;
      if (state === 'dup') {
        this.counters.duplicates++;
        this.progress();
        this.settle(entry, () => this.source.ack(entry.message));
      } else if (state === 'busy') {
        busy.push(entry);
      } else {
        entry.claimedAt = askedAt;
        entry.leaseUntil = askedAt + leaseMs;
        entry.writeBy = entry.leaseUntil - leaseMs * LEASE_WRITE_SHARE;
        this.claimed.add(entry);
        toPublish.push(entry);
      }
    });
    if (busy.length > 0) {
      this.later(
        BUSY_RECHECK_MS,
        busy,
        (entry) => this.enqueue(entry),
        (entry) => this.giveBack(entry),
      );
    }
    if (toPublish.length === 0) return;
    if (this.settings.throttle) await this.settings.throttle(toPublish.length);

    const outcomes = await this.publishBatch(toPublish);
    const confirmed: Entry[] = [];
    const refused: [Entry, Failure, string?][] = [];
    const lost: Entry[] = [];
    const fenced: Entry[] = [];
    // Refused for their size: the broker checks it before routing, so no queue stored them.
    const tooLarge = new Set<Entry>();
    toPublish.forEach((entry, index) => {
      const outcome = outcomes[index] as PublishOutcome;
      if (outcome === 'confirmed') confirmed.push(entry);
      else if (outcome === 'fenced') fenced.push(entry);
      else if (outcome === 'returned') refused.push([entry, 'unroutable']);
      else if (outcome === 'nacked') refused.push([entry, 'nacked', entry.refusal]);
      else if (outcome === 'too-large') {
        tooLarge.add(entry);
        // Retried (if it is) alone on the trial channel: the limit may have been raised meanwhile.
        entry.suspect = Math.max(entry.suspect, 1);
        this.rememberSuspect(entry.key as string);
        refused.push([entry, 'nacked', entry.refusal]);
      } else if (outcome === 'unpublishable') refused.push([entry, 'unpublishable', entry.refusal]);
      else lost.push(entry);
    });

    if (fenced.length > 0) {
      // Not sent: the lease was not known to hold any more. Claimed again before any publish;
      // whoever holds the ID meanwhile decides (busy, or a duplicate once it committed).
      this.counters.fenced += fenced.length;
      this.perMessage.warn(
        { count: fenced.length, leaseMs },
        'lease not known to hold at publish time (the process stalled, or Redis renewed nothing): not sent; claiming again',
      );
      for (const entry of fenced) {
        this.claimed.delete(entry);
        this.enqueue(entry);
      }
    }

    if (confirmed.length > 0) {
      for (const entry of confirmed) entry.committing = true;
      this.settings.afterConfirm?.();
      const commitStarted = performance.now();
      const results = await this.commitSoon(confirmed.map((entry) => entry.key as string));
      this.onLatency('commit', secondsSince(commitStarted), confirmed.length);
      confirmed.forEach((entry, index) => {
        this.claimed.delete(entry);
        if (results[index] === 'taken') this.counters.claimTakenOver++;
        this.counters.forwarded++;
        if (entry.state === 'in-doubt') this.counters.inDoubt++;
        this.retryCounts.delete(entry.key as string);
        this.suspectIds.delete(entry.key as string);
        this.settle(entry, () => this.source.ack(entry.message));
      });
      this.progress();
    }

    if (refused.length > 0) {
      const refusedEntries = refused.map(([entry]) => entry);
      // A claim that is in doubt stays so: an earlier copy may be on the target, and the next
      // attempt, by anyone, must flag its copy. A nack too leaves its ID in doubt: published to an
      // exchange bound to several queues, one queue may refuse it while another stored it.
      const nacked = new Set(
        refused.filter(([entry, why]) => why === 'nacked' && !tooLarge.has(entry)).map(([entry]) => entry),
      );
      const keysOf = (inDoubt: boolean) =>
        refusedEntries
          .filter((entry) => (entry.state === 'in-doubt' || nacked.has(entry)) === inDoubt)
          .map((entry) => entry.key as string);
      await this.redis('release', () => this.cache.release(keysOf(false)));
      await this.redis('release', () => this.cache.release(keysOf(true), { keepInDoubt: true }));
      for (const entry of refusedEntries) this.claimed.delete(entry);
      await Promise.all(refused.map(([entry, why, detail]) => this.handleFailure(entry, why, detail)));
    }

    if (lost.length > 0) {
      // Only when stopping gave up waiting for the target: the target may hold these, so keep the
      // claims (they run out as in-doubt, and the next attempt is flagged) and leave the messages
      // unacked for the source to give back.
      for (const entry of lost) {
        this.claimed.delete(entry);
        this.counters.returned++;
        this.settle(entry, () => false);
      }
    }
  }

  /**
   * Publishes a batch until the target answers each message, with one promise for the batch. A
   * publish lost with its connection may or may not be on the target: it is sent again, flagged
   * in-doubt, once the target is back.
   */
  private publishBatch(entries: Entry[]): Promise<PublishOutcome[]> {
    const started = performance.now();
    const outcomes = new Array<PublishOutcome>(entries.length);
    let left = entries.length;
    return new Promise((resolve, reject) => {
      const answered = (index: number, outcome: PublishOutcome) => {
        outcomes[index] = outcome;
        (entries[index] as Entry).outstanding = false;
        // Per confirmed message, at its own confirm: the metric is per forwarded message, and a
        // batch's slowest answer (or a returned message) is not every message's confirm.
        if (outcome === 'confirmed') this.onLatency('confirm', secondsSince(started), 1);
        if (--left > 0) return;
        resolve(outcomes);
      };
      entries.forEach((entry, index) => {
        entry.outstanding = true;
        entry.written = false;
        const first = (outcome: PublishOutcome) => {
          if (outcome === 'lost' || outcome === 'killed' || outcome === 'discarded') {
            this.publishAgain(entry, outcome).then((again) => answered(index, again), reject);
          } else {
            answered(index, outcome);
          }
        };
        try {
          if (entry.suspect > 0) this.alone(() => this.publish(entry, true)).then(first, reject);
          else this.send(entry, first);
        } catch (error) {
          reject(error);
        }
      });
    });
  }

  /**
   * The rest of a publish after a first attempt was lost, its channel killed, or dropped unread by
   * the broker after it closed the channel over an earlier message (discarded: never stored, so it
   * goes again as it was, unflagged).
   */
  private async publishAgain(entry: Entry, firstOutcome: PublishOutcome): Promise<PublishOutcome> {
    let outcome = firstOutcome;
    for (let attempt = 1; ; attempt++) {
      if (outcome !== 'lost' && outcome !== 'killed' && outcome !== 'discarded') return outcome;
      if (this.abandoned) return 'lost';
      if (outcome !== 'discarded') {
        // Written and not answered: from here on a copy of ours may be on the target.
        entry.doubt = true;
        if (outcome === 'killed') {
          entry.suspect++;
          this.rememberSuspect(entry.key as string);
          if (entry.suspect >= 2) {
            // Alone on its own channel: the close was this message's doing, and its words say why.
            entry.refusal = refusalOfClose(entry.closedBy).detail;
            return 'nacked';
          }
        }
        if (entry.state !== 'in-doubt') {
          entry.state = 'in-doubt';
          this.counters.resentInDoubt++;
        }
      }
      // A publish lost at once again (a channel that is gone but not yet replaced) must not spin:
      // back off, which also lets the event loop run the reconnect, signals and health checks.
      await sleep(backoffDelay(attempt, 10, 1000));
      outcome = await this.publishOnce(entry);
    }
  }

  /**
   * One publish. A message that was in flight when the broker closed the channel goes alone, so
   * that a message the broker refuses that way (over its max_message_size, say) shows itself.
   */
  private publishOnce(entry: Entry): Promise<PublishOutcome> {
    entry.written = false;
    return entry.suspect > 0 ? this.alone(() => this.publish(entry, true)) : this.publish(entry, false);
  }

  /** The `x-dedup-route` field for a forwarded copy: the marks it came with, and this route's. */
  private routeField(header: ContentHeader): Buffer {
    const came = routeMarksOf(header);
    if (came.length === 0) {
      const own = this.ownRouteField ?? markField([this.settings.routeMark]);
      this.ownRouteField = own;
      return own;
    }
    return markField([...came, this.settings.routeMark].slice(-MAX_ROUTE_MARKS));
  }

  /** What names a message in a log line: its ID (or message_id) and routing key, clipped. */
  private named(message: ConsumeMessage, id?: string): Record<string, string> {
    const named: Record<string, string> = { routingKey: clip(message.fields.routingKey) };
    const shown = id ?? message.properties.messageId;
    if (shown !== undefined) named.id = clip(String(shown));
    return named;
  }

  private rememberSuspect(key: string): void {
    this.suspectIds.delete(key);
    this.suspectIds.add(key);
    if (this.suspectIds.size > MAX_SUSPECT_MEMORY) {
      const oldest = this.suspectIds.values().next().value;
      if (oldest !== undefined) this.suspectIds.delete(oldest);
    }
  }

  /** Runs publishes of suspect messages one at a time. */
  private alone<T>(work: () => Promise<T>): Promise<T> {
    const turn = this.suspects.then(work, work);
    this.suspects = turn.then(
      () => undefined,
      () => undefined,
    );
    return turn;
  }

  /**
   * Publishes the message with its content header as the source delivered it, changed only as
   * documented: `_HQ_DUPL_ID` set when the ID came from elsewhere, `x-dedup-in-doubt` removed or
   * added, and a `user_id` the target would refuse moved to a header.
   */
  private publish(entry: Entry, alone: boolean): Promise<PublishOutcome> {
    if (!alone) return new Promise((resolve) => this.send(entry, resolve));
    const { bytes, routingKey } = this.outgoing(entry);
    return this.target.publishAlone(
      this.settings.targetExchange,
      routingKey,
      bytes,
      entry.message.content,
      entry.matchKey,
      entry,
    );
  }

  /** Publishes on the ordinary channel and tells `answered` what the target said. */
  private send(entry: Entry, answered: (outcome: PublishOutcome) => void): void {
    const { bytes, routingKey } = this.outgoing(entry);
    this.target.send(
      this.settings.targetExchange,
      routingKey,
      bytes,
      entry.message.content,
      entry.matchKey,
      entry,
      answered,
    );
  }

  /** The content header and routing key a message is forwarded with. */
  private outgoing(entry: Entry): { bytes: Buffer; routingKey: string | Buffer } {
    const message = entry.message;
    const header = entry.header as ContentHeader;
    // x-dedup-source-user-id is the bridge's to write: a producer could forge one, so one that came
    // with the message is dropped, and set only from a user_id the source broker vouched for.
    const remove = entry.idField ? this.replaced.withId : this.replaced.own;
    const append: Buffer[] = [];
    if (entry.idField) append.push(entry.idField);
    const userId = header.userIdBytes;
    const foreignUser = userId !== undefined && userId.toString('utf8') !== this.settings.targetUser;
    if (foreignUser) {
      // RabbitMQ refuses a user_id that is not the publishing user; keep it as a header instead.
      append.push(rawField(SOURCE_USER_HEADER, encodeValue({ type: 'S', value: userId })));
    }
    if (entry.state === 'in-doubt') append.push(IN_DOUBT_FIELD);
    // The routes it went through, this one last, so that a loop back here is seen.
    append.push(this.routeField(header));
    const bytes = header.splice({ remove, append, dropUserId: foreignUser });
    // The message's own routing key as the broker sent it (amqplib's text form may have lost bytes).
    const routingKey =
      this.settings.targetRoutingKey ??
      routingBytesOf(message.fields)?.routingKey ??
      message.fields.routingKey;
    return { bytes, routingKey };
  }

  /** Unroutable, refused, or without an ID: park, dead-letter, or requeue after a backoff. */
  private async handleFailure(entry: Entry, why: Failure, detail?: string): Promise<void> {
    if (why === 'unroutable') this.counters.unroutable++;
    if (why === 'nacked') this.counters.nacked++;
    if (why === 'unreadable' || why === 'unpublishable') this.counters.unforwardable++;
    const named = this.named(entry.message, entry.idText);
    if (detail !== undefined) {
      this.perMessage.warn({ ...named, reason: why, detail }, `message refused: ${detail}`, `refused ${why}`);
    }
    this.failuresSinceProgress++;
    const { onUnforwardable, parkQueue } = this.settings;
    const reason = detail === undefined ? why : `${why}: ${detail}`;
    if (onUnforwardable === 'park' && parkQueue !== undefined) {
      if (await this.source.park(entry.message, reason)) {
        this.counters.parked++;
        this.progress();
        this.perMessage.warn({ ...named, reason: why, parkQueue }, 'message parked');
        this.settle(entry, () => this.source.ack(entry.message));
        return;
      }
      this.perMessage.warn({ ...named, parkQueue }, 'parking failed; the message goes back to the source');
    } else if (onUnforwardable === 'dead-letter') {
      this.counters.deadLettered++;
      this.progress();
      this.perMessage.warn(
        { ...named, reason: why },
        "message rejected to the source queue's dead-letter exchange (RabbitMQ drops it if the queue has none)",
      );
      this.settle(entry, () => this.source.nack(entry.message, false));
      return;
    }
    const retryKey = entry.key ?? '';
    const attempt = (this.retryCounts.get(retryKey) ?? 0) + 1;
    this.rememberRetry(retryKey, attempt);
    const delay = backoffDelay(
      attempt,
      this.settings.requeueDelay.initialMs,
      this.settings.requeueDelay.maxMs,
    );
    // Held, not returned to the source: RabbitMQ puts a returned message back at the head of the
    // queue and delivers it again at once, so a return buys no time, and a quorum queue counts it
    // toward its delivery limit, past which the broker drops the message. A message with an ID goes
    // through claim → publish again after the backoff (it stays the leading copy of its ID; its
    // claim was released); one without (no ID, unreadable, a loop) can never be forwarded and stays
    // held until the route stops, when it is given back once, like every message held then.
    const again = entry.key !== undefined;
    this.perMessage.warn(
      { ...named, reason: why, attempt, delayMs: delay },
      again
        ? 'message not forwarded; the bridge holds it unacked and retries it after a backoff'
        : 'message not forwarded; the bridge holds it unacked until the route stops, then gives it back to the source queue',
    );
    this.retrying.add(entry);
    const retry = (held: Entry) => {
      if (!this.source.holds(held.message)) {
        // Its channel is gone: the broker put it back in the queue, and delivers it again.
        this.settle(held, () => false);
      } else if (held.key === undefined) {
        this.later(this.settings.requeueDelay.maxMs, [held], retry, (gone) => this.giveBack(gone));
      } else {
        this.counters.retried++;
        this.enqueue(held);
      }
    };
    this.later(delay, [entry], retry, (held) => this.giveBack(held));
  }

  private rememberRetry(key: string, attempt: number): void {
    this.retryCounts.delete(key);
    this.retryCounts.set(key, attempt);
    if (this.retryCounts.size > MAX_RETRY_MEMORY) {
      const oldest = this.retryCounts.keys().next().value;
      if (oldest !== undefined) this.retryCounts.delete(oldest);
    }
  }

  /** Runs `then` for each entry after `ms`, or `onStop` at once when the pipeline stops. */
  private later(
    ms: number,
    entries: Entry[],
    then: (entry: Entry) => void,
    onStop: (entry: Entry) => void,
  ): void {
    if (this.stopping) {
      for (const entry of entries) onStop(entry);
      return;
    }
    const timer = setTimeout(() => {
      this.timers.delete(timer);
      for (const entry of entries) (this.stopping ? onStop : then)(entry);
    }, ms);
    this.timers.set(timer, () => {
      for (const entry of entries) onStop(entry);
    });
  }

  /** Returns a message we have not claimed to the source (used when stopping). */
  private giveBack(entry: Entry): void {
    this.counters.returned++;
    this.settle(entry, () => this.source.nack(entry.message, true));
  }

  /** Ends our hold on a message: ack/nack it, then let a waiting copy of its ID go on. */
  private settle(entry: Entry, respond: () => boolean): void {
    respond();
    this.held--;
    this.retrying.delete(entry);
    if (entry.leading && entry.key !== undefined) {
      entry.leading = false;
      const waiting = this.inFlight.get(entry.key) ?? [];
      const next = waiting.shift();
      if (!next || this.stopping) {
        this.inFlight.delete(entry.key);
        if (next) this.giveBack(next);
        for (const other of waiting.splice(0)) this.giveBack(other);
      } else {
        next.leading = true;
        this.enqueue(next);
      }
    }
    if (this.held === 0) {
      for (const wake of this.idleWaiters.splice(0)) wake();
    }
  }

  private progress(): void {
    this.lastProgressAt = Date.now();
    this.failuresSinceProgress = 0;
  }

  private renewLeases(): void {
    // While Redis is away a renewal waits; do not queue another behind it.
    if (this.claimed.size === 0 || this.renewing) return;
    const entries = [...this.claimed];
    const keys = entries.map((entry) => entry.key as string);
    this.renewing = true;
    const askedAt = performance.now();
    const { leaseMs } = this.settings;
    this.cache
      .renewEach(keys)
      .then((renewed) => {
        let lost = 0;
        let lostOut = 0;
        entries.forEach((entry, index) => {
          // Settled meanwhile, or claimed anew after this renewal was asked for: not its answer.
          if (!this.claimed.has(entry) || entry.claimedAt > askedAt) return;
          // Its commit (on its way) deletes the claim: "no longer ours" may only mean committed.
          if (!renewed[index] && entry.committing) return;
          if (renewed[index]) {
            entry.leaseUntil = Math.max(entry.leaseUntil, askedAt + leaseMs);
            entry.writeBy = entry.leaseUntil - leaseMs * LEASE_WRITE_SHARE;
            return;
          }
          // No longer ours (taken over after ours ran out, or released): never written again
          // without a new claim. A publish already out may land beside the new owner's copy.
          lost++;
          if (entry.outstanding && entry.written) lostOut++;
          entry.leaseUntil = 0;
          entry.writeBy = 0;
          // Not renewed again (each round would find it lost anew): a new claim adds it back.
          this.claimed.delete(entry);
        });
        if (lost === 0) return;
        this.counters.leaseLost += lost;
        this.log.warn(
          { lost, unconfirmed: lostOut },
          'leases no longer ours (they ran out and another owner took the IDs over): not published again without a new claim',
        );
        if (lostOut > 0) this.resetTarget(`${lostOut} unconfirmed publish(es) lost their lease`);
      })
      .catch((error: unknown) => {
        this.log.warn({ error: describe(error) }, 'lease renewal failed; will retry');
      })
      .finally(() => {
        this.renewing = false;
      });
  }

  /**
   * Resets the target connection when a publish that is out and unconfirmed is about to outlive
   * its lease (Redis renewed nothing for most of it): bytes still queued on this host are then
   * dropped, not delivered after another owner took the ID over and sent its flagged copy.
   */
  private fenceWrites(): void {
    const { leaseMs } = this.settings;
    const resetAt = performance.now() + leaseMs * LEASE_RESET_SHARE;
    let expiring = 0;
    for (const entry of this.claimed) {
      // Written, not just waiting for the connection or a trial ahead of it: only those bytes can
      // sit in a buffer and land late.
      if (entry.outstanding && entry.written && entry.leaseUntil < resetAt) expiring++;
    }
    if (expiring > 0) {
      this.resetTarget(
        `the leases of ${expiring} unconfirmed publish(es) run out and Redis has not renewed them`,
      );
    }
  }

  private resetTarget(reason: string): void {
    this.counters.fenceResets++;
    this.target.reset(reason);
  }

  /**
   * Commits the keys with the next commit call. One call is out at a time: the batches confirmed
   * meanwhile go together in the next, so a busy bridge makes one commit call for several batches.
   */
  private commitSoon(keys: string[]): Promise<CommitResult[]> {
    return new Promise((resolve, reject) => {
      this.commitQueue.push({ keys, resolve, reject });
      if (!this.committing) void this.drainCommits();
    });
  }

  private async drainCommits(): Promise<void> {
    this.committing = true;
    try {
      while (this.commitQueue.length > 0) {
        let count = 1;
        let size = this.commitQueue[0]?.keys.length ?? 0;
        for (const next of this.commitQueue.slice(1)) {
          if (size + next.keys.length > MAX_COMMIT_IDS) break;
          size += next.keys.length;
          count++;
        }
        const group = this.commitQueue.splice(0, count);
        try {
          const results = await this.redis('commit', () =>
            this.cache.commit(group.flatMap((item) => item.keys)),
          );
          this.noteCommits(results);
          let at = 0;
          for (const item of group) {
            item.resolve(results.slice(at, at + item.keys.length));
            at += item.keys.length;
          }
        } catch (error) {
          for (const item of group) item.reject(error);
        }
      }
    } finally {
      this.committing = false;
    }
  }

  /**
   * Counts and logs the commits that found something other than our claim: no record at all (Redis
   * lost the claim), or the ID committed already. Either can mean two copies on the target.
   */
  private noteCommits(results: readonly CommitResult[]): void {
    let lost = 0;
    let already = 0;
    for (const result of results) {
      if (result === 'restored') lost++;
      else if (result === 'already') already++;
    }
    if (lost > 0) {
      this.counters.claimsLost += lost;
      this.perMessage.warn(
        { claimsLost: lost },
        `Redis had lost the claims of ${lost} confirmed message(s) (FLUSHDB, a restart or a failover without persistence): committed again, but duplicates are possible for what was in flight (another process may have claimed and forwarded the same IDs) and for IDs committed before the loss`,
        'Redis had lost claims',
      );
    }
    if (already > 0) {
      this.counters.alreadyCommitted += already;
      this.perMessage.warn(
        { alreadyCommitted: already },
        `${already} confirmed message(s) had their IDs committed already: another process forwarded them first (the target may hold two copies), or a commit was sent again after a reconnect`,
        'IDs committed already',
      );
    }
  }

  /** Runs a cache call until it succeeds: a message never moves on without its claim or commit. */
  private async redis<T>(what: string, call: () => Promise<T>): Promise<T> {
    for (let attempt = 1; ; attempt++) {
      if (this.abandoned) throw new Abandoned();
      try {
        const result = await call();
        this.failingSince = undefined;
        if (this.redisFailing) {
          this.redisFailing = false;
          this.log.info({ what }, 'Redis answers again');
        }
        return result;
      } catch (error) {
        // A cache layout this process cannot follow (see DedupCache): retrying cannot fix that.
        if (error instanceof ConfigError) throw error;
        // The Redis user lacks a command the bridge needs: retrying cannot fix that.
        if (REDIS_NO_PERMISSION.test(describe(error))) {
          throw new FatalConnectError(
            `Redis refused the ${what} call (${describe(error)}); give the user the ACL that docs/security.md, Least privilege, lists`,
          );
        }
        // A streak of failures is an outage from its first (see redisFailingSince).
        this.failingSince ??= Date.now();
        this.lastRedisError = describe(error).split('\n')[0];
        // One line per outage, not one per batch in flight.
        if (!this.redisFailing) {
          this.redisFailing = true;
          this.log.warn(
            { what, error: describe(error) },
            'Redis call failed; holding the messages unacked and retrying',
          );
        }
        await sleep(backoffDelay(attempt, 100, 5000));
      }
    }
  }
}

/**
 * The routes a message went through, from its `x-dedup-route` mark: an AMQP array of route names
 * (long strings), or one string holding a JSON array of them. Anything else there is no mark of ours.
 */
function routeMarksOf(header: ContentHeader): string[] {
  const span = header.field(ROUTE_HEADER);
  if (!span) return [];
  const value = header.valueOf(span);
  if (value.type === 'A') {
    return value.value.flatMap((item) => (item.type === 'S' ? [item.value.toString('utf8')] : []));
  }
  if (value.type !== 'S') return [];
  try {
    const marks: unknown = JSON.parse(value.value.toString('utf8'));
    return Array.isArray(marks) ? marks.filter((mark): mark is string => typeof mark === 'string') : [];
  } catch {
    return [];
  }
}

/**
 * The mark as an AMQP array of long strings. Not as one string holding JSON, though RabbitMQ spends
 * about 8 ms less per 1,000 publishes on that: a bridge before 2026-12-01 reads only the array, and
 * replaces any other value with its own array, so a loop through it, or through an older replica of
 * the same route during a rolling update, would be acked as duplicates. The string form is read, so
 * a later version can write it once no bridge that reads only the array is left.
 */
function markField(marks: string[]): Buffer {
  const value = marks.map((mark) => ({ type: 'S' as const, value: Buffer.from(mark, 'utf8') }));
  return rawField(ROUTE_HEADER, encodeValue({ type: 'A', value }));
}
