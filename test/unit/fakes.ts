/**
 * In-memory fakes of the pipeline's three ports (src/ports.ts: Source, Target, Claims), for the
 * protocol's unit tests (pipeline-protocol.test.ts) only: everywhere else the bridge is tested
 * against real brokers and a real Redis. A fake that disagrees with what it stands for makes those
 * tests lie, so each one keeps to its original's semantics and says where they come from:
 *
 * - FakeSource: src/amqp/source.ts (AmqpSource). Deliveries carry amqplib-like properties with the
 *   raw content header attached (propertiesFor), and headerOf reads it back (contentHeaderOf), as
 *   the real source does. A delivery is held until settled, or until the test drops the connection.
 * - FakeTarget: src/amqp/target.ts (AmqpTarget). The lease is checked at the write itself, after
 *   any wait for the connection ('fenced', never written); a write is `written` until answered;
 *   reset() makes every written, unanswered publish end 'unknown'. Answers come when the test's
 *   script says: at once (a microtask later, as a confirm would), or when the test gives them.
 * - FakeClaims over a ClaimStore: src/dedup/lua/{claim,commit,release,renew}.lua, one method each,
 *   on an in-memory store whose clock the test injects. Two FakeClaims on one store, with two
 *   owner tokens, are two replicas sharing one Redis.
 *
 * Each fake also checks the contract the pipeline owes its port (a delivery settled once, one
 * publish per ID in flight, `id` the wire value of `_HQ_DUPL_ID`) and notes breaches in
 * `contractErrors`, which a test asserts empty.
 */
import type { MessageProperties } from 'amqplib';
import { DUPLICATE_ID_HEADER, IN_DOUBT_HEADER } from '../../src/headers.js';
import type {
  ClaimState,
  Claims,
  CommitResult,
  Delivery,
  Publish,
  PublishOutcome,
  Source,
  Target,
} from '../../src/ports.js';
import { ContentHeader, contentHeaderOf, propertiesFor } from '../../src/wire/properties.js';
import { basicProperties, field, longString, table } from '../wire.js';

// ---- the order things happened in ------------------------------------------------------------

/** One thing a fake saw: what (a call, its answer, a settlement), for which IDs, with what result. */
export interface Event {
  readonly what: string;
  /** The IDs (or delivery labels, for a settlement) it concerns. */
  readonly ids: readonly string[];
  readonly detail: string;
}

/** Every fake's events in one sequence, so that a test can assert their order across ports. */
export class Timeline {
  readonly events: Event[] = [];

  note(what: string, ids: readonly string[], detail = ''): void {
    this.events.push({ what, ids, detail });
  }

  /** Index of the first event `what` for `id` (any, when undefined) at or after `from` (-1: none). */
  index(what: string, id: string | undefined, from = 0): number {
    for (let i = from; i < this.events.length; i++) {
      const event = this.events[i] as Event;
      if (event.what === what && (id === undefined || event.ids.includes(id))) return i;
    }
    return -1;
  }

  /** Every event for `id`, as `what` or `what:detail`, in order (for a readable assertion). */
  of(id: string): string[] {
    return this.events
      .filter((event) => event.ids.includes(id))
      .map((event) => (event.detail ? `${event.what}:${event.detail}` : event.what));
  }
}

// ---- source -----------------------------------------------------------------------------------

/** A delivery with a label the test names it by (its ID, or e.g. `a-1#2` for a second copy). */
export interface FakeDelivery extends Delivery {
  readonly label: string;
}

export interface MessageOptions {
  /** Default: the ID; give copies of one ID different labels. */
  label?: string;
  body?: string | Buffer;
  /** More header fields (from test/wire.ts `field`), after `_HQ_DUPL_ID`. */
  headers?: Buffer[];
  messageId?: string;
  redelivered?: boolean;
  routingKey?: string;
}

/**
 * A source message whose ID is the header `_HQ_DUPL_ID` (a long string), as the default --id-from
 * takes it; `id` undefined: no such header (the ID comes from message_id or the content).
 */
export function message(id: string | undefined, options: MessageOptions = {}): FakeDelivery {
  const fields = [...(id === undefined ? [] : [field(DUPLICATE_ID_HEADER, longString(id))])];
  fields.push(...(options.headers ?? []));
  const bytes = basicProperties({
    deliveryMode: 2,
    ...(options.messageId === undefined ? {} : { messageId: options.messageId }),
    ...(fields.length > 0 ? { headers: table(...fields) } : {}),
  });
  const body = options.body ?? `body of ${id ?? options.label ?? '?'}`;
  return {
    label: options.label ?? id ?? '?',
    content: Buffer.isBuffer(body) ? body : Buffer.from(body, 'utf8'),
    fields: {
      routingKey: options.routingKey ?? 'orders',
      exchange: '',
      redelivered: options.redelivered ?? false,
    },
    // As the real source's deliveries: amqplib's properties, the raw content header attached.
    properties: propertiesFor(bytes),
  };
}

export type Settlement = 'ack' | 'requeue' | 'deadLetter' | 'park';

/** What the pipeline told the source about one delivery; `held`: whether the source still had it. */
export interface Settled {
  readonly label: string;
  readonly how: Settlement;
  readonly held: boolean;
  readonly reason?: string;
}

/** Mirrors AmqpSource (src/amqp/source.ts) as the pipeline sees it. */
export class FakeSource implements Source {
  readonly settlements: Settled[] = [];
  readonly contractErrors: string[] = [];
  consuming = false;
  stopCalls = 0;
  /** What park() answers (false: the park queue refused it). */
  parkAnswer = true;
  private onDelivery: ((delivery: Delivery) => void) | undefined;
  private readonly delivered = new Set<Delivery>();
  private readonly done = new Set<Delivery>();
  /** Deliveries the source took back (its connection dropped before they were settled). */
  private readonly takenBack = new Set<Delivery>();

  constructor(private readonly timeline: Timeline) {}

  async consume(onDelivery: (delivery: Delivery) => void): Promise<void> {
    this.onDelivery = onDelivery;
    this.consuming = true;
  }

  async stopConsuming(): Promise<void> {
    this.consuming = false;
    this.stopCalls++;
  }

  /** Delivers the messages now, one after another in this turn (as one read from the socket). */
  deliver(...deliveries: FakeDelivery[]): void {
    const onDelivery = this.onDelivery;
    if (!onDelivery) throw new Error('FakeSource: deliver before consume');
    for (const delivery of deliveries) {
      this.delivered.add(delivery);
      this.timeline.note('delivered', [delivery.label]);
      onDelivery(delivery);
    }
  }

  /**
   * The connection drops: the broker takes back every delivery not settled yet (it will deliver
   * them again); from now on they are not held, and settling them does nothing (false).
   */
  drop(): void {
    for (const delivery of this.delivered) {
      if (!this.done.has(delivery)) this.takenBack.add(delivery);
    }
    this.timeline.note('source-dropped', []);
  }

  headerOf(delivery: Delivery): ContentHeader {
    // As AmqpSource.headerOf: the raw header the lossless reader attached to the properties.
    return contentHeaderOf(delivery.properties as MessageProperties);
  }

  routingOf(delivery: Delivery): { exchange: string | Buffer; routingKey: string | Buffer } {
    return { exchange: delivery.fields.exchange, routingKey: delivery.fields.routingKey };
  }

  ack(delivery: Delivery): boolean {
    return this.settle(delivery, 'ack');
  }

  requeue(delivery: Delivery): boolean {
    return this.settle(delivery, 'requeue');
  }

  deadLetter(delivery: Delivery): boolean {
    return this.settle(delivery, 'deadLetter');
  }

  async park(delivery: Delivery, reason: string): Promise<boolean> {
    // AmqpSource.park publishes a copy to the park queue; the pipeline then acks the delivery.
    this.timeline.note('park', [labelOf(delivery)], reason);
    return this.parkAnswer && this.holds(delivery);
  }

  holds(delivery: Delivery): boolean {
    return this.delivered.has(delivery) && !this.done.has(delivery) && !this.takenBack.has(delivery);
  }

  /** How each delivery with this label was settled, in order (one entry each, if all is well). */
  of(label: string): Settlement[] {
    return this.settlements.filter((s) => s.label === label).map((s) => s.how);
  }

  private settle(delivery: Delivery, how: Settlement): boolean {
    const label = labelOf(delivery);
    if (!this.delivered.has(delivery)) this.contractErrors.push(`${how} of ${label}: never delivered`);
    if (this.done.has(delivery)) this.contractErrors.push(`${how} of ${label}: settled twice`);
    const held = this.holds(delivery);
    this.done.add(delivery);
    this.settlements.push({ label, how, held });
    this.timeline.note(how, [label], held ? '' : 'not held');
    return held;
  }
}

function labelOf(delivery: Delivery): string {
  return (delivery as FakeDelivery).label ?? '?';
}

// ---- target -----------------------------------------------------------------------------------

/** What the script answers a write: an outcome (given at once), or 'hold' (the test answers it). */
export type Script = (write: Write) => PublishOutcome | 'hold';

/** One message written to the target, as the target received it. */
export interface Write {
  /** Its `_HQ_DUPL_ID` as text ('' when it has none). */
  readonly id: string;
  /** Whether its headers end with `x-dedup-in-doubt: t true` (the field the bridge appends). */
  readonly inDoubt: boolean;
  /** How many `x-dedup-in-doubt` fields its headers have (one at most). */
  readonly inDoubtFields: number;
  readonly header: ContentHeader;
  readonly content: Buffer;
  readonly routingKey: string | Buffer;
  /** performance.now() at the write, and the publish's writeBy then. */
  readonly at: number;
  readonly writeBy: number;
  /** Its outcome, once answered. */
  readonly outcome: PublishOutcome | undefined;
  /** Answers it (a held write), once. */
  answer(outcome: PublishOutcome): void;
}

/** Mirrors AmqpTarget (src/amqp/target.ts) as the pipeline sees it. */
export class FakeTarget implements Target {
  readonly writes: Write[] = [];
  /** Publishes answered 'fenced' at the write: their writeBy had passed (nothing was written). */
  readonly fenced: { id: string; at: number; writeBy: number }[] = [];
  readonly resets: string[] = [];
  readonly contractErrors: string[] = [];
  /** The default answers every write 'stored' at once. */
  script: Script = () => 'stored';
  readonly sizeLimit: number | undefined = undefined;
  private connected = true;
  /** Sends waiting for the connection: not written yet. */
  private readonly waiting: (() => void)[] = [];
  /** Written and unanswered, by the publish's `id` (the real target's pending map is keyed so). */
  private readonly unanswered = new Map<string, WriteRecord>();

  constructor(private readonly timeline: Timeline) {}

  send(publish: Publish, answered: (outcome: PublishOutcome) => void): void {
    if (!this.connected) {
      // AmqpTarget waits for ready(); the lease is checked once it is written, not now.
      this.waiting.push(() => this.write(publish, answered));
      return;
    }
    this.write(publish, answered);
  }

  /** Sends that wait for the connection. */
  get waitingCount(): number {
    return this.waiting.length;
  }

  /** Written and not answered yet. */
  get unansweredWrites(): Write[] {
    return [...this.unanswered.values()];
  }

  /** The connection goes: what is written and unanswered ends 'unknown'; new sends wait. */
  disconnect(): void {
    this.connected = false;
    this.timeline.note('target-disconnected', []);
    this.loseUnanswered();
  }

  /** The connection is back: the waiting sends are written now (each checks its lease now). */
  connect(): void {
    this.connected = true;
    this.timeline.note('target-connected', []);
    for (const write of this.waiting.splice(0)) write();
  }

  reset(reason: string): void {
    // AmqpTarget.reset: a TCP reset of the connection; its channel closes, and every unconfirmed
    // publish on it fails as 'unknown'. Sends waiting for the connection keep waiting (then
    // reconnect; the fake's connection is back at once).
    this.resets.push(reason);
    this.timeline.note('target-reset', [], reason);
    this.loseUnanswered();
  }

  /** The writes with this `_HQ_DUPL_ID`, in order. */
  of(id: string): Write[] {
    return this.writes.filter((write) => write.id === id);
  }

  private loseUnanswered(): void {
    for (const record of [...this.unanswered.values()]) record.answer('unknown');
  }

  private write(publish: Publish, answered: (outcome: PublishOutcome) => void): void {
    const header = new ContentHeader(Buffer.from(publish.properties));
    const span = header.field(DUPLICATE_ID_HEADER);
    const idValue = span ? header.valueOf(span) : undefined;
    const id =
      idValue && (idValue.type === 'S' || idValue.type === 'x') ? idValue.value.toString('utf8') : '';
    const now = performance.now();
    // AmqpTarget.publishOn: checked right before the write, after any wait; nothing is written.
    if (now > publish.writeBy) {
      this.fenced.push({ id, at: now, writeBy: publish.writeBy });
      this.timeline.note('fenced', [id]);
      answered('fenced');
      return;
    }
    if (!span || header.valueBytes(span).toString('latin1') !== publish.id) {
      this.contractErrors.push(`publish ${id}: its id is not the wire value of its ${DUPLICATE_ID_HEADER}`);
    }
    if (this.unanswered.has(publish.id)) {
      this.contractErrors.push(`publish ${id}: sent while another publish of its ID is unanswered`);
    }
    const flags = (header.fields ?? []).filter((f) => f.name === IN_DOUBT_HEADER);
    const last = header.field(IN_DOUBT_HEADER);
    const lastValue = last ? header.valueOf(last) : undefined;
    publish.written = true;
    const record = new WriteRecord(
      {
        id,
        inDoubt: lastValue?.type === 't' && lastValue.value === true,
        inDoubtFields: flags.length,
        header,
        content: Buffer.from(publish.content),
        routingKey: publish.routingKey,
        at: now,
        writeBy: publish.writeBy,
      },
      (outcome) => {
        if (this.unanswered.get(publish.id) === record) this.unanswered.delete(publish.id);
        // Answered: nothing of it is on its way any more.
        publish.written = false;
        if (outcome === 'rejected' || outcome === 'too-large' || outcome === 'unpublishable') {
          publish.refusal = `the fake target refused it (${outcome})`;
        }
        this.timeline.note('answer', [id], outcome);
        answered(outcome);
      },
    );
    this.unanswered.set(publish.id, record);
    this.writes.push(record);
    this.timeline.note('write', [id], record.inDoubt ? 'in-doubt' : '');
    const scripted = this.script(record);
    // A confirm comes later than the write: never inside send().
    if (scripted !== 'hold') queueMicrotask(() => record.answer(scripted));
  }
}

class WriteRecord implements Write {
  readonly id: string;
  readonly inDoubt: boolean;
  readonly inDoubtFields: number;
  readonly header: ContentHeader;
  readonly content: Buffer;
  readonly routingKey: string | Buffer;
  readonly at: number;
  readonly writeBy: number;
  outcome: PublishOutcome | undefined;

  constructor(
    what: Omit<Write, 'answer' | 'outcome'>,
    private readonly onAnswer: (outcome: PublishOutcome) => void,
  ) {
    this.id = what.id;
    this.inDoubt = what.inDoubt;
    this.inDoubtFields = what.inDoubtFields;
    this.header = what.header;
    this.content = what.content;
    this.routingKey = what.routingKey;
    this.at = what.at;
    this.writeBy = what.writeBy;
  }

  answer(outcome: PublishOutcome): void {
    if (this.outcome !== undefined) return; // answered once (a reset after the answer: no-op)
    this.outcome = outcome;
    this.onAnswer(outcome);
  }
}

// ---- the dedup cache --------------------------------------------------------------------------

/** A claim as claim.lua stores it: `c:<owner>:<lease expiry ms>:<1 if in-doubt else 0>`. */
interface ClaimValue {
  owner: string;
  /** Lease expiry (store clock, ms); 0: released in doubt (release.lua), never re-armed. */
  expiry: number;
  inDoubt: boolean;
  /** When the key itself expires (its PX): the lease plus the window from the last write. */
  keyUntil: number;
}

/** What the store holds for one claim key, as lookup.lua reports it (for assertions). */
export type KeyRecord =
  | { state: 'unknown' }
  | { state: 'committed' }
  | { state: 'claimed'; owner: string; expiry: number; inDoubt: boolean };

/**
 * The claim keys and committed IDs of one scope, as Redis holds them (one shard). The clock is the
 * test's (Redis's TIME, in ms); a key expires as Redis's do, once the clock is past its PX.
 * Committed IDs are kept for the window from their commit (Redis keeps them a slice longer at
 * most, see committed.lua: no test here comes near a window).
 */
export class ClaimStore {
  private readonly claims = new Map<string, ClaimValue>();
  private readonly committed = new Map<string, number>();

  constructor(
    readonly now: () => number,
    readonly windowMs: number,
  ) {}

  /** GET of a claim key (undefined once expired, as Redis would have dropped it). */
  getClaim(key: string): ClaimValue | undefined {
    const value = this.claims.get(key);
    if (value && this.now() > value.keyUntil) {
      this.claims.delete(key);
      return undefined;
    }
    return value;
  }

  /** SET key value PX keepMs. */
  setClaim(key: string, value: Omit<ClaimValue, 'keyUntil'>, keepMs: number): void {
    this.claims.set(key, { ...value, keyUntil: this.now() + keepMs });
  }

  /** PTTL of a claim key (-2: none). */
  pttl(key: string): number {
    const value = this.getClaim(key);
    return value ? value.keyUntil - this.now() : -2;
  }

  deleteClaim(key: string): void {
    this.claims.delete(key);
  }

  /** find_committed in committed.lua: committed within the window. */
  isCommitted(key: string): boolean {
    const at = this.committed.get(key);
    return at !== undefined && this.now() - at <= this.windowMs;
  }

  /** writer.add in committed.lua. */
  addCommitted(key: string): void {
    this.committed.set(key, this.now());
  }

  /** What lookup.lua would answer for the key. */
  lookup(key: string): KeyRecord {
    const claim = this.getClaim(key);
    if (claim) return { state: 'claimed', owner: claim.owner, expiry: claim.expiry, inDoubt: claim.inDoubt };
    return this.isCommitted(key) ? { state: 'committed' } : { state: 'unknown' };
  }
}

export type ClaimsOp = 'claim' | 'commit' | 'release' | 'renew';

/** One call the pipeline made of the cache (one Redis script call: the fake's store is one shard). */
export interface ClaimsCall {
  readonly op: ClaimsOp;
  readonly keys: readonly string[];
  readonly ids: readonly string[];
  readonly keepInDoubt: boolean;
  /** Whether its script ran in Redis yet, and its reply reached the caller. */
  ran: boolean;
  answered: boolean;
  result: readonly unknown[] | undefined;
}

/**
 * Where a held call waits: 'request' (on its way to Redis: its script runs when let go) or 'reply'
 * (its script ran at once; its reply is on its way back).
 */
export type HoldAt = 'request' | 'reply';

/**
 * The Claims port over a ClaimStore, as DedupCache (src/dedup/cache.ts) implements it over Redis:
 * each method is the script of the same name in src/dedup/lua. Calls answer on a later microtask;
 * the test can hold the calls of an operation (see hold) and let them go one by one.
 */
export class FakeClaims implements Claims {
  readonly calls: ClaimsCall[] = [];
  readonly contractErrors: string[] = [];
  private readonly holds = new Map<ClaimsOp, { at: HoldAt; when: (call: ClaimsCall) => boolean }>();
  private readonly held = new Map<ClaimsCall, () => void>();

  constructor(
    readonly store: ClaimStore,
    readonly token: string,
    readonly leaseMs: number,
    private readonly timeline: Timeline,
    readonly prefix = 'dd:{queue:target}:c:',
  ) {}

  /** As DedupCache.keyOf on one shard: `<prefix>:{<scope>}:c:<id key>`. */
  keyOf(idKey: string): string {
    return `${this.prefix}${idKey}`;
  }

  /** Holds the later calls of `op` (those `when` picks) until the test lets them go. */
  hold(op: ClaimsOp, at: HoldAt = 'request', when: (call: ClaimsCall) => boolean = () => true): void {
    this.holds.set(op, { at, when });
  }

  /** Later calls of `op` answer at once again (calls held already stay held until let go). */
  unhold(op: ClaimsOp): void {
    this.holds.delete(op);
  }

  /** Calls of `op` held and not let go yet, oldest first. */
  pending(op: ClaimsOp): ClaimsCall[] {
    return [...this.held.keys()].filter((call) => call.op === op);
  }

  /** Lets a held call go on: its script runs now (held at its request), and its reply arrives. */
  letGo(call: ClaimsCall): void {
    const go = this.held.get(call);
    if (!go) throw new Error(`FakeClaims: that ${call.op} call is not held`);
    this.held.delete(call);
    go();
  }

  letGoAll(op: ClaimsOp): void {
    for (const call of this.pending(op)) this.letGo(call);
  }

  /** The calls of `op` (with keys: an empty list makes no Redis call, see perShard). */
  callsOf(op: ClaimsOp): ClaimsCall[] {
    return this.calls.filter((call) => call.op === op);
  }

  /** claim.lua */
  claim(keys: readonly string[]): Promise<ClaimState[]> {
    return this.call('claim', keys, false, () => {
      const { store, token } = this;
      const now = store.now();
      const expiry = now + this.leaseMs;
      const keep = this.leaseMs + store.windowMs;
      return keys.map((key): ClaimState => {
        if (store.isCommitted(key)) return 'dup';
        const value = store.getClaim(key);
        if (!value) {
          // SET key c:<token>:<expiry>:0 PX keep NX
          store.setClaim(key, { owner: token, expiry, inDoubt: false }, keep);
          return 'new';
        }
        if (value.owner === token) {
          // Our own claim seen again: renewed, its flag kept (a claim released in doubt included).
          store.setClaim(key, { owner: token, expiry, inDoubt: value.inDoubt }, keep);
          return value.inDoubt ? 'in-doubt' : 'new';
        }
        if (value.expiry > now) return 'busy';
        // Another owner's lease ran out (or it released the ID in doubt): ours now, in doubt.
        store.setClaim(key, { owner: token, expiry, inDoubt: true }, keep);
        return 'in-doubt';
      });
    });
  }

  /** commit.lua */
  commit(keys: readonly string[]): Promise<CommitResult[]> {
    return this.call('commit', keys, false, () => {
      const { store, token } = this;
      return keys.map((key): CommitResult => {
        // GETDEL: the claim goes in every case.
        const value = store.getClaim(key);
        store.deleteClaim(key);
        if (value) {
          store.addCommitted(key);
          return value.owner === token ? 'committed' : 'taken';
        }
        if (store.isCommitted(key)) return 'already';
        store.addCommitted(key);
        return 'restored';
      });
    });
  }

  /** release.lua; returns how many were ours (DedupCache.release sums the replies). */
  async release(keys: readonly string[], options: { keepInDoubt?: boolean } = {}): Promise<number> {
    const keepInDoubt = options.keepInDoubt === true;
    const replies = await this.call('release', keys, keepInDoubt, () => {
      const { store, token } = this;
      return keys.map((key) => {
        const value = store.getClaim(key);
        if (!value || value.owner !== token) return 0;
        if (keepInDoubt) {
          // Kept expired (expiry 0) and flagged, at least a window from now.
          const keep = Math.max(store.pttl(key), store.windowMs);
          store.setClaim(key, { owner: token, expiry: 0, inDoubt: true }, keep);
        } else {
          store.deleteClaim(key);
        }
        return 1;
      });
    });
    return replies.reduce((sum: number, reply) => sum + reply, 0);
  }

  /** renew.lua */
  renewEach(keys: readonly string[]): Promise<boolean[]> {
    return this.call('renew', keys, false, () => {
      const { store, token } = this;
      const now = store.now();
      return keys.map((key) => {
        const value = store.getClaim(key);
        // A claim released in doubt (expiry 0) is never re-armed; one that ran out unnoticed and
        // nobody took over is (the message is still in flight with us).
        if (!value || value.owner !== token || value.expiry === 0) return false;
        store.setClaim(
          key,
          { owner: token, expiry: now + this.leaseMs, inDoubt: value.inDoubt },
          this.leaseMs + store.windowMs,
        );
        return true;
      });
    });
  }

  private idOf(key: string): string {
    return key.startsWith(this.prefix) ? key.slice(this.prefix.length) : key;
  }

  private call<T>(
    op: ClaimsOp,
    keys: readonly string[],
    keepInDoubt: boolean,
    script: () => T[],
  ): Promise<T[]> {
    // DedupCache.perShard: no keys, no Redis call.
    if (keys.length === 0) return Promise.resolve([]);
    if (new Set(keys).size !== keys.length) this.contractErrors.push(`${op}: a key twice in one call`);
    const call: ClaimsCall = {
      op,
      keys: [...keys],
      ids: keys.map((key) => this.idOf(key)),
      keepInDoubt,
      ran: false,
      answered: false,
      result: undefined,
    };
    this.calls.push(call);
    const who = this.token;
    this.timeline.note(op, call.ids, `${who}${keepInDoubt ? ' keepInDoubt' : ''}`);
    const run = () => {
      const result = script();
      call.result = result;
      call.ran = true;
      return result;
    };
    const reply = (result: T[]) => {
      call.answered = true;
      // One event per ID, with its own answer, for order assertions per ID.
      call.ids.forEach((id, index) => {
        this.timeline.note(`${op}-answered`, [id], `${who} ${String(result[index])}`);
      });
      return result;
    };
    const hold = this.holds.get(op);
    if (hold?.when(call)) {
      const early = hold.at === 'reply' ? run() : undefined;
      return new Promise((resolve) => {
        this.held.set(call, () => resolve(reply(early ?? run())));
      });
    }
    const result = run();
    return Promise.resolve().then(() => reply(result));
  }
}
