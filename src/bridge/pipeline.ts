import { backoffDelay, sleep } from '../backoff.js';
import { Coalescer } from '../coalesce.js';
import type { IdStrategy } from '../config/id-from.js';
import type { UnforwardablePolicy } from '../config/settings.js';
import { describe } from '../errors.js';
import type { Logger } from '../log.js';
import type { ClaimState, Claims, CommitResult, Delivery, PublishOutcome, Source, Target } from '../ports.js';
import type { ContentHeader } from '../wire/properties.js';
import { Admission } from './admission.js';
import { Abandoned, CacheCalls } from './cache-calls.js';
import { newCounters, type RouteCounters } from './counters.js';
import { type Entry, type Failure, newEntry } from './entry.js';
import { Leases } from './leases.js';
import type { MessageBudget } from './limits.js';
import { PerMessageLog } from './per-message.js';
import { Refusals } from './refusals.js';
import { ForwardedHeader } from './route-mark.js';

/** The stages whose latency metrics watch: the Redis claim and commit, and the target's confirm. */
export type LatencyStage = 'claim' | 'commit' | 'confirm';

export interface RouteSettings {
  /** The user the target connection logs in as: a `user_id` property naming another is moved to a header. */
  targetUser: string | undefined;
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

// Claim calls out at once; the messages that arrive meanwhile wait and go as the next batch.
const MAX_CLAIMS_OUT = 2;
// The most IDs one commit call takes (a Redis script blocks the server while it runs).
const MAX_COMMIT_IDS = 1000;
// How long a message whose ID another owner holds waits before it is claimed again.
const BUSY_RECHECK_MS = 250;

function secondsSince(started: number): number {
  return (performance.now() - started) / 1000;
}

/**
 * The forwarding protocol for one route: batch → claim → publish → commit → ack. Every source
 * message is acked only after the target stored it and its ID was committed, or after the cache
 * showed its ID already committed. Reading a delivery (admission.ts), what becomes of a message
 * that cannot be forwarded (refusals.ts), leases and fencing (leases.ts), the forwarded header
 * (route-mark.ts) and retrying cache calls (cache-calls.ts) are modules of their own.
 */
export class Pipeline {
  readonly counters: RouteCounters = newCounters();
  /** Told how long a stage took and for how many messages (the metrics set it). */
  onLatency: (stage: LatencyStage, seconds: number, messages: number) => void = () => {};
  /** Messages delivered to us and not yet acked or returned. */
  private held = 0;
  private lastProgressAt = Date.now();

  private readonly batch: Entry[] = [];
  private flushScheduled = false;
  /** Claim calls sent and not yet answered (see flush). */
  private claimsOut = 0;
  /** One commit call out at a time: the batches stored meanwhile go together in the next. */
  private readonly commits: Coalescer<CommitResult>;
  /** IDs in flight in this process → copies of the same ID waiting for its outcome. */
  private readonly inFlight = new Map<string, Entry[]>();
  private readonly timers = new Map<NodeJS.Timeout, () => void>();
  private readonly active = new Set<Promise<void>>();
  /** Lines about single messages, capped per kind and interval, their message text clipped. */
  private readonly perMessage: PerMessageLog;
  private readonly forwarded: ForwardedHeader;
  private readonly admission: Admission;
  private readonly refusals: Refusals;
  private readonly leases: Leases;
  private readonly calls: CacheCalls;
  private stopping = false;
  private failed: ((error: Error) => void) | undefined;
  private idleWaiters: (() => void)[] = [];

  constructor(
    private readonly settings: RouteSettings,
    private readonly source: Source,
    private readonly target: Target,
    private readonly cache: Claims,
    private readonly log: Logger,
  ) {
    this.perMessage = new PerMessageLog(log);
    this.calls = new CacheCalls(log);
    this.forwarded = new ForwardedHeader(settings.routeMark, settings.targetUser, settings.stripCc);
    this.admission = new Admission(
      source,
      settings.idFrom,
      (idKey) => cache.keyOf(idKey),
      this.forwarded,
      this.counters,
      this.perMessage,
    );
    this.refusals = new Refusals(
      { policy: settings.onUnforwardable, parkQueue: settings.parkQueue, retryDelay: settings.requeueDelay },
      source,
      this.counters,
      this.perMessage,
      {
        settle: (entry, respond) => this.settle(entry, respond),
        progress: () => this.progress(),
        later: (ms, entries, then, onStop) => this.later(ms, entries, then, onStop),
        giveBack: (entry) => this.giveBack(entry),
        forward: (entry) => this.enqueue(entry),
      },
    );
    this.leases = new Leases(settings.leaseMs, cache, target, this.counters, log);
    // An exact target writes in order: a lease that ran out while its message waited is renewed
    // before the message is fenced, so that it keeps its place.
    if (target.exact) target.renewLeases = (publishes) => this.leases.renewNow(publishes as Entry[]);
    this.commits = new Coalescer(MAX_COMMIT_IDS, async (keys) => {
      const results = await this.calls.run('commit', () => this.cache.commit(keys));
      this.noteCommits(results);
      return results;
    });
  }

  /** Starts consuming; `onFatal` is told of failures this pipeline cannot recover from. */
  async start(onFatal: (error: Error) => void): Promise<void> {
    this.failed = onFatal;
    this.leases.start();
    await this.source.consume((message) => this.receive(message));
  }

  /**
   * Since when every Redis call of this route has failed (an error reply such as OOM or READONLY;
   * while the connection is down calls wait instead), with the last error's first line; undefined
   * while calls succeed. The bridge counts it as an outage for --retry-for.
   */
  get redisFailingSince(): { since: number; error: string } | undefined {
    return this.calls.failingStreak;
  }

  /** The target's size limit, once it refused a message for being larger. */
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
    const retrying = this.refusals.retrying.size;
    if (this.held === 0 || retrying === 0) return false;
    let behind = 0;
    for (const waiting of this.inFlight.values()) behind += waiting.length;
    return this.held === retrying + behind;
  }

  /** When a message was last forwarded, skipped as a duplicate, parked or dead-lettered. */
  get lastProgress(): number {
    return this.lastProgressAt;
  }

  get msSinceProgress(): number {
    return Date.now() - this.lastProgressAt;
  }

  get failedSinceProgress(): number {
    return this.refusals.sinceProgress;
  }

  /** Why the last message that has no form the target takes could not be forwarded. */
  get lastUnforwardable(): string | undefined {
    return this.refusals.lastUnforwardable;
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
    // What is on its way is taken and forwarded, not returned (see Source.quiesce).
    if (!this.stopping) await this.source.quiesce?.();
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
        this.calls.abandoned = true;
        break;
      }
    }
    this.leases.stop();
    this.perMessage.flush();
    // A source reconnect waiting to consume again must not wait any longer.
    for (const wake of this.idleWaiters.splice(0)) wake();
    return this.held;
  }

  private receive(message: Delivery): void {
    if (this.stopping || !this.settings.budget.tryTake()) {
      // Delivered after we stopped or hit the limit: not ours to handle.
      this.source.requeue(message);
      if (this.limitReached) void this.source.stopConsuming();
      return;
    }
    this.held++;
    this.counters.consumed++;
    if (message.fields.redelivered) this.counters.redelivered++;
    if (this.limitReached) void this.source.stopConsuming();

    const entry = newEntry(message);
    const refused = this.admission.admit(entry);
    if (refused) {
      this.track(this.refusals.refuse(entry, refused.why, refused.detail));
      return;
    }
    const key = entry.key as string;
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
    // --max-rate waits before the claim, not after: a claim held while its batch waits for the
    // rate is in doubt for the next owner if this process dies, and its copy would go flagged.
    if (this.settings.throttle) await this.settings.throttle(entries.length);
    const toPublish = await this.claim(entries);
    if (toPublish.length === 0) return;

    const outcomes = await this.publishBatch(toPublish);
    const stored: Entry[] = [];
    const refused: [Entry, Failure, string?][] = [];
    const lost: Entry[] = [];
    const fenced: Entry[] = [];
    // Refused by a target that may have stored a copy all the same (see Refusal): left in doubt.
    const maybeStored = new Set<Entry>();
    toPublish.forEach((entry, index) => {
      const outcome = outcomes[index] as PublishOutcome;
      if (outcome === 'stored') stored.push(entry);
      else if (outcome === 'fenced') fenced.push(entry);
      else if (outcome === 'unroutable') refused.push([entry, 'unroutable']);
      else if (outcome === 'rejected') {
        maybeStored.add(entry);
        refused.push([entry, 'nacked', entry.refusal]);
      } else if (outcome === 'too-large') refused.push([entry, 'nacked', entry.refusal]);
      else if (outcome === 'unpublishable') refused.push([entry, 'unpublishable', entry.refusal]);
      else lost.push(entry);
    });

    if (fenced.length > 0) {
      // Not sent: the lease was not known to hold any more. Claimed again before any publish;
      // whoever holds the ID meanwhile decides (busy, or a duplicate once it committed).
      this.counters.fenced += fenced.length;
      this.perMessage.warn(
        { count: fenced.length, leaseMs: this.settings.leaseMs },
        'lease not known to hold at publish time (the process stalled, or Redis renewed nothing): not sent; claiming again',
      );
      for (const entry of fenced) {
        this.leases.drop(entry);
        this.enqueue(entry);
      }
    }
    if (stored.length > 0) await this.commit(stored);
    if (refused.length > 0) await this.release(refused, maybeStored);
    if (lost.length > 0) {
      // Only when stopping gave up waiting for the target: the target may hold these, so keep the
      // claims (they run out as in-doubt, and the next attempt is flagged) and leave the messages
      // unacked for the source to give back.
      for (const entry of lost) {
        this.leases.drop(entry);
        this.counters.returned++;
        this.settle(entry, () => false);
      }
    }
  }

  /** Claims the batch's IDs: acks the duplicates, holds the busy ones, returns those now ours. */
  private async claim(entries: Entry[]): Promise<Entry[]> {
    const keys = entries.map((entry) => entry.key as string);
    const claimStarted = performance.now();
    this.claimsOut++;
    let states: ClaimState[];
    // When the claim that answered was asked for: the lease runs from no earlier than that.
    let askedAt = 0;
    try {
      states = await this.calls.run('claim', () => {
        askedAt = performance.now();
        return this.cache.claim(keys);
      });
    } finally {
      this.claimsOut--;
      if (this.batch.length > 0) this.flush();
    }
    this.onLatency('claim', secondsSince(claimStarted), entries.length);
    const ours: Entry[] = [];
    const busy: Entry[] = [];
    entries.forEach((entry, index) => {
      const claimed = states[index] as ClaimState;
      // Our own claim seen again answers 'new'; a copy of ours may still be out there. An exact
      // target settled what earlier owners of its producer wrote: their left claims have no copy out.
      const state =
        claimed === 'new' && entry.doubt
          ? 'in-doubt'
          : claimed === 'reclaimed'
            ? this.target.exact
              ? 'new'
              : 'in-doubt'
            : claimed;
      entry.state = state;
      if (state === 'dup') {
        this.counters.duplicates++;
        this.progress();
        this.settle(entry, () => this.source.ack(entry.message));
      } else if (state === 'busy') {
        busy.push(entry);
      } else {
        this.leases.grant(entry, askedAt);
        ours.push(entry);
      }
    });
    if (busy.length > 0) {
      this.later(
        BUSY_RECHECK_MS,
        busy,
        (entry) => {
          // Its channel is gone: the broker put it back in the queue, and delivers it again.
          if (!this.source.holds(entry.message)) this.settle(entry, () => false);
          else this.enqueue(entry);
        },
        (entry) => this.giveBack(entry),
      );
    }
    return ours;
  }

  /** Commits what the target stored, then acks it at the source. */
  private async commit(stored: Entry[]): Promise<void> {
    for (const entry of stored) entry.committing = true;
    this.settings.afterConfirm?.();
    const commitStarted = performance.now();
    const keys = stored.map((entry) => entry.key as string);
    const results = await this.commits.submit(keys);
    this.onLatency('commit', secondsSince(commitStarted), stored.length);
    this.target.committed?.(keys);
    stored.forEach((entry, index) => {
      this.leases.drop(entry);
      if (results[index] === 'taken') this.counters.claimTakenOver++;
      this.counters.forwarded++;
      if (entry.state === 'in-doubt') this.counters.inDoubt++;
      this.refusals.forwarded(entry.key as string);
      this.settle(entry, () => this.source.ack(entry.message));
    });
    this.progress();
  }

  /** Gives up the claims of refused messages, then hands them to the refusal policy. */
  private async release(refused: [Entry, Failure, string?][], maybeStored: Set<Entry>): Promise<void> {
    const entries = refused.map(([entry]) => entry);
    // A claim that is in doubt stays so: an earlier copy may be on the target, and the next
    // attempt, by anyone, must flag its copy. So does one the target may have stored anyway.
    const keysOf = (inDoubt: boolean) =>
      entries
        .filter((entry) => (entry.state === 'in-doubt' || maybeStored.has(entry)) === inDoubt)
        .map((entry) => entry.key as string);
    // Not renewed from here on: a renewal between the releases would find these no longer ours.
    for (const entry of entries) this.leases.drop(entry);
    await this.calls.run('release', () => this.cache.release(keysOf(false)));
    await this.calls.run('release', () => this.cache.release(keysOf(true), { keepInDoubt: true }));
    await Promise.all(refused.map(([entry, why, detail]) => this.refusals.refuse(entry, why, detail)));
  }

  /**
   * Publishes a batch until the target answers each message, with one promise for the batch. A
   * publish whose outcome is unknown (lost with its connection) may or may not be on the target:
   * it is sent again, flagged in-doubt, once the target is back.
   */
  private publishBatch(entries: Entry[]): Promise<PublishOutcome[]> {
    const started = performance.now();
    const outcomes = new Array<PublishOutcome>(entries.length);
    let left = entries.length;
    return new Promise((resolve, reject) => {
      const answered = (index: number, outcome: PublishOutcome) => {
        outcomes[index] = outcome;
        (entries[index] as Entry).outstanding = false;
        // Per stored message, at its own answer: the metric is per forwarded message, and a
        // batch's slowest answer (or a returned message) is not every message's confirm.
        if (outcome === 'stored') this.onLatency('confirm', secondsSince(started), 1);
        if (--left > 0) return;
        resolve(outcomes);
      };
      entries.forEach((entry, index) => {
        entry.outstanding = true;
        const first = (outcome: PublishOutcome) => {
          if (outcome === 'unknown' || outcome === 'unsent') {
            this.publishAgain(entry, outcome).then((again) => answered(index, again), reject);
          } else {
            answered(index, outcome);
          }
        };
        try {
          this.send(entry, first);
        } catch (error) {
          reject(error);
        }
      });
    });
  }

  /**
   * The rest of a publish after an attempt whose outcome is unknown, or that surely was not stored
   * (unsent: it goes again as it was, unflagged). Ends 'unknown' only when a stop gave up waiting.
   */
  private async publishAgain(entry: Entry, firstOutcome: PublishOutcome): Promise<PublishOutcome> {
    let outcome = firstOutcome;
    for (let attempt = 1; ; attempt++) {
      if (outcome !== 'unknown' && outcome !== 'unsent') return outcome;
      // A stop gave up waiting, or the target failed for good: the message stays unacked.
      if (this.calls.abandoned || this.target.ended) return 'unknown';
      if (outcome === 'unknown') {
        // Written and not answered: from here on a copy of ours may be on the target.
        entry.doubt = true;
        if (entry.state !== 'in-doubt') {
          entry.state = 'in-doubt';
          this.counters.resentInDoubt++;
        }
      }
      // A publish lost at once again (a channel that is gone but not yet replaced) must not spin:
      // back off, which also lets the event loop run the reconnect, signals and health checks.
      await sleep(backoffDelay(attempt, 10, 1000));
      outcome = await new Promise<PublishOutcome>((resolve) => this.send(entry, resolve));
    }
  }

  /** Publishes the message with the header a forwarded copy gets (see ForwardedHeader). */
  private send(entry: Entry, answered: (outcome: PublishOutcome) => void): void {
    entry.properties = this.forwarded.of(entry.header as ContentHeader, {
      marks: entry.marks,
      idField: entry.idField,
      inDoubt: entry.state === 'in-doubt',
    });
    this.target.send(entry, answered);
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
    this.settle(entry, () => this.source.requeue(entry.message));
  }

  /** Ends our hold on a message: ack/nack it, then let a waiting copy of its ID go on. */
  private settle(entry: Entry, respond: () => boolean): void {
    respond();
    this.held--;
    this.refusals.retrying.delete(entry);
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
    this.refusals.sinceProgress = 0;
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
}
