import { pino } from 'pino';
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { MessageBudget } from '../../src/bridge/limits.js';
import { Pipeline, type RouteSettings } from '../../src/bridge/pipeline.js';
import { DEFAULT_ID_FROM, parseIdFrom } from '../../src/config/id-from.js';
import { IN_DOUBT_HEADER } from '../../src/headers.js';
import type { PublishOutcome } from '../../src/ports.js';
import { bool, field } from '../wire.js';
import { ClaimStore, FakeClaims, FakeSource, FakeTarget, message, Timeline, type Write } from './fakes.js';

// The forwarding protocol (docs/guarantee.md: claim → publish → commit → ack) of one Pipeline,
// over in-memory fakes of its ports (./fakes.ts). Every test asserts what reached the target and
// what the source was told. Time is vitest's fake clock (timers, Date and performance.now), which
// the fake Redis reads too: nothing here waits on the wall clock. setImmediate stays real: it
// orders turns of the event loop, not time (and a fake one set inside a timer would run 1 ms late,
// as @sinonjs/fake-timers schedules a 0 ms timer made during a tick).
//
// No broker and no Redis are needed, but vitest.config.ts's globalSetup starts the harness's own
// servers unless all three URLs are set; any values will do, nothing connects to them:
//   SOURCE_URL=amqp://unused TARGET_URL=amqp://unused REDIS_URL=redis://unused \
//     npx vitest run test/unit/pipeline-protocol.test.ts

const LEASE_MS = 3000; // renewals every 1000 ms, the fence check every 300 ms, writeBy 2000 ms in
const WINDOW_MS = 60_000;
// pipeline.ts: a busy ID is claimed again after 250 ms.
const BUSY_RECHECK_MS = 250;

function routeSettings(overrides: Partial<RouteSettings>): RouteSettings {
  return {
    targetUser: 'bridge',
    idFrom: parseIdFrom(DEFAULT_ID_FROM),
    batchSize: 10,
    leaseMs: LEASE_MS,
    onUnforwardable: 'retry',
    parkQueue: undefined,
    requeueDelay: { initialMs: 100, maxMs: 400 },
    routeMark: 'rabbit@source/%2F/orders',
    budget: new MessageBudget(undefined),
    throttle: undefined,
    stripCc: false,
    afterConfirm: undefined,
    ...overrides,
  };
}

interface Harness {
  timeline: Timeline;
  store: ClaimStore;
  source: FakeSource;
  target: FakeTarget;
  /** This process's cache, and another replica's on the same Redis. */
  claims: FakeClaims;
  other: FakeClaims;
  pipeline: Pipeline;
  lines: { level: number; msg: string }[];
  fatal: Error[];
  /** Redis's clock runs this much ahead of the process's (an NTP step, say). */
  skew: { ms: number };
}

let current: Harness | undefined;

async function start(overrides: Partial<RouteSettings> = {}): Promise<Harness> {
  const timeline = new Timeline();
  const skew = { ms: 0 };
  const store = new ClaimStore(() => Date.now() + skew.ms, WINDOW_MS);
  const source = new FakeSource(timeline);
  const target = new FakeTarget(timeline);
  const claims = new FakeClaims(store, 'ours', LEASE_MS, timeline);
  const other = new FakeClaims(store, 'other', LEASE_MS, timeline);
  const lines: { level: number; msg: string }[] = [];
  const log = pino({ level: 'info' }, { write: (line: string) => lines.push(JSON.parse(line)) });
  const pipeline = new Pipeline(routeSettings(overrides), source, target, claims, log);
  const fatal: Error[] = [];
  await pipeline.start((error) => fatal.push(error));
  current = { timeline, store, source, target, claims, other, pipeline, lines, fatal, skew };
  return current;
}

beforeEach(() => {
  vi.useFakeTimers({
    toFake: ['setTimeout', 'clearTimeout', 'setInterval', 'clearInterval', 'Date', 'performance'],
  });
});

afterEach(async () => {
  const h = current;
  current = undefined;
  try {
    if (h) {
      // Clears the pipeline's timers; work the test left unanswered is abandoned.
      const stopped = h.pipeline.stop(0);
      await vi.advanceTimersByTimeAsync(1);
      await stopped;
      expect(h.fatal).toEqual([]);
      expect(h.source.contractErrors).toEqual([]);
      expect(h.target.contractErrors).toEqual([]);
      expect(h.claims.contractErrors).toEqual([]);
    }
  } finally {
    vi.useRealTimers();
  }
});

/** Runs what is due now (setImmediate, answers, their promise chains) until `condition` holds. */
async function until(condition: () => boolean, what: string): Promise<void> {
  for (let turn = 0; turn < 200; turn++) {
    if (condition()) return;
    await vi.advanceTimersByTimeAsync(0);
  }
  throw new Error(`did not happen: ${what}`);
}

/** Runs what is due now until nothing more can happen without time passing. */
async function quiesce(): Promise<void> {
  for (let turn = 0; turn < 50; turn++) await vi.advanceTimersByTimeAsync(0);
}

/** Lets `ms` of (fake) time pass, running every timer due meanwhile. */
async function elapse(ms: number): Promise<void> {
  await vi.advanceTimersByTimeAsync(ms);
  await quiesce();
}

function idsOf(writes: readonly Write[]): string[] {
  return writes.map((write) => write.id);
}

/** A script that answers the first write of each ID in `first` so, and every other 'stored'. */
function firstAnswers(
  first: Record<string, PublishOutcome | 'hold'>,
): (write: Write) => PublishOutcome | 'hold' {
  const seen = new Set<string>();
  return (write) => {
    const outcome = first[write.id];
    if (outcome === undefined || seen.has(write.id)) return 'stored';
    seen.add(write.id);
    return outcome;
  };
}

describe('the happy path', () => {
  it('publishes N distinct IDs once each, and acks each only after its publish was stored and its commit answered', async () => {
    const h = await start();
    const ids = ['a-1', 'a-2', 'a-3', 'a-4', 'a-5'];
    h.target.script = () => 'hold';
    h.claims.hold('commit');
    h.source.deliver(...ids.map((id) => message(id)));

    await until(() => h.target.writes.length === 5, 'five writes');
    expect(idsOf(h.target.writes)).toEqual(ids);
    expect(h.target.writes.map((w) => w.inDoubt)).toEqual([false, false, false, false, false]);
    expect(h.target.writes.map((w) => w.content.toString())).toEqual(ids.map((id) => `body of ${id}`));
    // Claimed first, in one call, before anything was written.
    expect(h.claims.callsOf('claim').map((call) => call.ids)).toEqual([ids]);

    // Four of five stored: the batch is not committed yet, and nothing is acked.
    for (const write of h.target.writes.slice(0, 4)) write.answer('stored');
    await quiesce();
    expect(h.claims.callsOf('commit')).toEqual([]);
    expect(h.source.settlements).toEqual([]);

    // All stored: the commit goes out; while it is unanswered nothing is acked.
    h.target.writes[4]?.answer('stored');
    await until(() => h.claims.pending('commit').length === 1, 'the commit call');
    const [commit] = h.claims.pending('commit');
    expect(commit?.ids).toEqual(ids);
    await elapse(1000);
    expect(h.source.settlements).toEqual([]);

    h.claims.letGoAll('commit');
    await until(() => h.source.settlements.length === 5, 'five acks');
    expect(h.source.settlements).toEqual(ids.map((label) => ({ label, how: 'ack', held: true })));
    for (const id of ids) {
      const t = h.timeline;
      const events = t.of(id);
      expect(t.index('claim-answered', id), events.join(' ')).toBeLessThan(t.index('write', id));
      expect(t.index('answer', id), events.join(' ')).toBeLessThan(t.index('commit', id));
      expect(t.index('commit-answered', id), events.join(' ')).toBeLessThan(t.index('ack', id));
      expect(h.store.lookup(h.claims.keyOf(id))).toEqual({ state: 'committed' });
    }
    expect(h.target.writes).toHaveLength(5);
    expect(h.pipeline.heldCount).toBe(0);
  });

  it('sets _HQ_DUPL_ID to the message_id when the message has no ID header, and removes an x-dedup-in-doubt it came with', async () => {
    const h = await start();
    const forged = field(IN_DOUBT_HEADER, bool(true));
    h.source.deliver(message(undefined, { label: 'm', messageId: 'mid-7', headers: [forged] }));
    await until(() => h.source.of('m').length === 1, 'the ack');
    expect(h.source.of('m')).toEqual(['ack']);
    expect(idsOf(h.target.writes)).toEqual(['mid-7']);
    expect(h.target.writes[0]?.inDoubtFields).toBe(0);
  });
});

describe('an ID another owner holds (busy)', () => {
  it('is not published while the other owner holds it, and is published once it releases it', async () => {
    const h = await start();
    expect(await h.other.claim([h.claims.keyOf('b-1')])).toEqual(['new']);
    h.source.deliver(message('b-1'), message('b-2'));
    await until(() => h.source.of('b-2').length === 1, 'b-2 acked');

    await elapse(3 * BUSY_RECHECK_MS); // well inside the other's lease
    expect(h.target.of('b-1')).toEqual([]);
    expect(h.source.of('b-1')).toEqual([]); // held: neither acked nor given back
    const busy = h.claims.callsOf('claim').filter((call) => call.ids.includes('b-1'));
    expect(busy.length).toBeGreaterThanOrEqual(3); // claimed again after each recheck
    expect(busy.map((call) => call.result?.[call.ids.indexOf('b-1')])).toEqual(busy.map(() => 'busy'));

    expect(await h.other.release([h.claims.keyOf('b-1')])).toBe(1);
    await elapse(BUSY_RECHECK_MS);
    await until(() => h.source.of('b-1').length === 1, 'b-1 acked');
    expect(h.source.of('b-1')).toEqual(['ack']);
    expect(h.target.of('b-1').map((w) => w.inDoubt)).toEqual([false]);
    expect(h.claims.callsOf('commit').flatMap((call) => call.result)).toEqual(['committed', 'committed']);
  });

  it('is acked as a duplicate, never published, once the other owner commits it', async () => {
    const h = await start();
    await h.other.claim([h.claims.keyOf('b-1')]);
    h.source.deliver(message('b-1'));
    await elapse(2 * BUSY_RECHECK_MS);
    expect(h.source.of('b-1')).toEqual([]);

    expect(await h.other.commit([h.claims.keyOf('b-1')])).toEqual(['committed']);
    await elapse(BUSY_RECHECK_MS);
    await until(() => h.source.of('b-1').length === 1, 'b-1 acked');
    expect(h.source.of('b-1')).toEqual(['ack']);
    expect(h.target.writes).toEqual([]);
    expect(h.claims.callsOf('claim').at(-1)?.result).toEqual(['dup']);
    expect(h.claims.callsOf('commit')).toEqual([]);
  });
});

describe('an in-doubt takeover', () => {
  it.each([
    ['whose lease ran out unconfirmed', 'expired'],
    ['that released it in doubt', 'released'],
  ] as const)('an ID of a previous owner %s goes out flagged x-dedup-in-doubt', async (_, how) => {
    const h = await start();
    const key = h.claims.keyOf('d-1');
    await h.other.claim([key]);
    if (how === 'expired')
      await elapse(LEASE_MS + 1); // it never renewed: crashed
    else expect(await h.other.release([key], { keepInDoubt: true })).toBe(1);

    // Both came with a forged in-doubt flag: the bridge removes it, and sets its own where due.
    const forged = field(IN_DOUBT_HEADER, bool(true));
    h.source.deliver(message('d-1', { headers: [forged] }), message('d-2', { headers: [forged] }));
    await until(() => h.source.settlements.length === 2, 'both acked');
    expect(h.claims.callsOf('claim')[0]?.result).toEqual(['in-doubt', 'new']);
    expect(h.target.of('d-1').map((w) => [w.inDoubt, w.inDoubtFields])).toEqual([[true, 1]]);
    expect(h.target.of('d-2').map((w) => [w.inDoubt, w.inDoubtFields])).toEqual([[false, 0]]);
    expect(h.source.settlements.map((s) => [s.label, s.how])).toEqual([
      ['d-1', 'ack'],
      ['d-2', 'ack'],
    ]);
  });
});

describe('a message the target refuses', () => {
  it.each([
    ['rejected', true],
    ['unroutable', false],
    ['too-large', false],
  ] as const)(
    '(%s) is held unacked and retried after the backoff; its retry flagged: %s',
    async (refusal, flagged) => {
      const h = await start({ requeueDelay: { initialMs: 100, maxMs: 400 } });
      h.target.script = firstAnswers({ 'r-1': refusal });
      h.source.deliver(message('r-1'), message('r-2'));
      await until(() => h.source.of('r-2').length === 1, 'r-2 acked');
      await until(() => h.claims.callsOf('release').length === 1, 'the release');
      const answeredAt = performance.now();
      // 'rejected' may have left a copy stored: the ID stays in doubt. The others stored none.
      expect(h.claims.callsOf('release').map((call) => [call.ids, call.keepInDoubt])).toEqual([
        [['r-1'], flagged],
      ]);
      expect(h.store.lookup(h.claims.keyOf('r-1'))).toEqual(
        flagged ? { state: 'claimed', owner: 'ours', expiry: 0, inDoubt: true } : { state: 'unknown' },
      );

      // The backoff is 100 ms ± 20%: nothing before 80 ms, and the message is held meanwhile.
      await elapse(79);
      expect(h.target.of('r-1')).toHaveLength(1);
      expect(h.source.of('r-1')).toEqual([]);
      await elapse(42);
      await until(() => h.source.of('r-1').length === 1, 'r-1 acked');
      const [first, retry] = h.target.of('r-1');
      expect(h.target.of('r-1')).toHaveLength(2);
      expect(first?.inDoubt).toBe(false);
      expect(retry?.inDoubt).toBe(flagged);
      expect((retry?.at ?? 0) - answeredAt).toBeGreaterThanOrEqual(80);
      // Claimed again before the retry was written, and acked only after its commit.
      const t = h.timeline;
      const reclaimed = t.index('claim-answered', 'r-1', t.index('release-answered', 'r-1'));
      expect(reclaimed).toBeGreaterThan(0);
      expect(t.index('write', 'r-1', reclaimed)).toBeGreaterThan(reclaimed);
      expect(t.index('ack', 'r-1')).toBeGreaterThan(t.index('commit-answered', 'r-1'));
      expect(h.source.of('r-1')).toEqual(['ack']);
    },
  );

  it('is let go, not retried, once the source took it back (its connection dropped during the backoff)', async () => {
    const h = await start({ requeueDelay: { initialMs: 100, maxMs: 400 } });
    h.target.script = () => 'unroutable';
    h.source.deliver(message('r-1'));
    await until(() => h.claims.callsOf('release').length === 1, 'the release');
    h.source.drop();
    await elapse(200);
    expect(h.target.of('r-1')).toHaveLength(1);
    expect(h.claims.callsOf('claim')).toHaveLength(1);
    expect(h.source.settlements).toEqual([]); // nothing to tell a source that took it back
    expect(h.pipeline.heldCount).toBe(0);
  });
});

describe('a publish whose outcome is not known', () => {
  it.each([
    ['unknown', true],
    ['unsent', false],
  ] as const)('(%s) is sent again; the copy flagged: %s', async (outcome, flagged) => {
    const h = await start();
    h.target.script = firstAnswers({ 'u-1': outcome });
    h.source.deliver(message('u-1'));
    await elapse(1100); // the resend's backoff is 10 ms at first
    await until(() => h.source.of('u-1').length === 1, 'u-1 acked');
    expect(h.target.of('u-1').map((w) => [w.inDoubt, w.outcome])).toEqual([
      [false, outcome],
      [flagged, 'stored'],
    ]);
    expect(h.source.of('u-1')).toEqual(['ack']);
    expect(h.claims.callsOf('commit').map((call) => call.ids)).toEqual([['u-1']]);
    expect(h.timeline.index('ack', 'u-1')).toBeGreaterThan(h.timeline.index('commit-answered', 'u-1'));
  });
});

describe('commits', () => {
  it('coalesce: the batches confirmed while a commit call is out go together in the next call', async () => {
    const h = await start({ batchSize: 2 });
    const ids = ['c-1', 'c-2', 'c-3', 'c-4', 'c-5', 'c-6'];
    h.target.script = () => 'hold';
    h.claims.hold('commit');
    h.source.deliver(...ids.map((id) => message(id)));
    await until(() => h.target.writes.length === 6, 'six writes');
    expect(h.claims.callsOf('claim').map((call) => call.ids)).toEqual([
      ['c-1', 'c-2'],
      ['c-3', 'c-4'],
      ['c-5', 'c-6'],
    ]);
    const answer = (...which: string[]) => {
      for (const id of which) h.target.of(id)[0]?.answer('stored');
    };

    answer('c-1', 'c-2');
    await until(() => h.claims.pending('commit').length === 1, 'the first commit');
    answer('c-3', 'c-4');
    await quiesce();
    answer('c-5', 'c-6');
    await quiesce();
    // One commit call out at a time: the other two batches wait for it.
    expect(h.claims.callsOf('commit').map((call) => call.ids)).toEqual([['c-1', 'c-2']]);
    expect(h.source.settlements).toEqual([]);

    h.claims.letGoAll('commit');
    await until(() => h.claims.pending('commit').length === 1, 'the second commit');
    expect(h.claims.callsOf('commit').map((call) => call.ids)).toEqual([
      ['c-1', 'c-2'],
      ['c-3', 'c-4', 'c-5', 'c-6'],
    ]);
    await quiesce();
    expect(h.source.settlements.map((s) => s.label)).toEqual(['c-1', 'c-2']);

    h.claims.letGoAll('commit');
    await until(() => h.source.settlements.length === 6, 'six acks');
    expect(h.source.settlements.map((s) => [s.label, s.how])).toEqual(ids.map((id) => [id, 'ack']));
    expect(h.claims.callsOf('commit')).toHaveLength(2);
  });
});

describe('stop', () => {
  it('with a publish unanswered: returns the unfinished count, acks nothing uncommitted, and requeues what waited behind', async () => {
    const h = await start();
    h.target.script = () => 'hold';
    await h.other.claim([h.claims.keyOf('s-2')]);
    h.source.deliver(message('s-1'), message('s-2'), message('s-1', { label: 's-1#2' }));
    await until(() => h.target.writes.length === 1, 's-1 written');
    expect(h.claims.callsOf('claim')[0]?.result).toEqual(['new', 'busy']);

    const stopped = h.pipeline.stop(500);
    // The busy one and the copy behind s-1 are given back at once.
    await until(() => h.source.settlements.length === 2, 'two given back');
    expect(h.source.settlements.map((s) => [s.label, s.how])).toEqual([
      ['s-2', 'requeue'],
      ['s-1#2', 'requeue'],
    ]);
    // Delivered while stopping: not ours to handle.
    h.source.deliver(message('s-3'));
    expect(h.source.of('s-3')).toEqual(['requeue']);

    await elapse(501);
    expect(await stopped).toBe(1);
    expect(h.source.of('s-1')).toEqual([]);
    // Answered after the stop gave up: not committed, not acked; its claim left to run out.
    h.target.writes[0]?.answer('stored');
    await quiesce();
    expect(h.claims.callsOf('commit')).toEqual([]);
    expect(h.source.of('s-1')).toEqual([]);
    expect(h.store.lookup(h.claims.keyOf('s-1'))).toMatchObject({ state: 'claimed', owner: 'ours' });
    expect(idsOf(h.target.writes)).toEqual(['s-1']);
  });

  it('lets a publish answered in time finish: committed, acked, and 0 unfinished', async () => {
    const h = await start();
    h.target.script = () => 'hold';
    h.source.deliver(message('s-1'));
    await until(() => h.target.writes.length === 1, 's-1 written');
    const stopped = h.pipeline.stop(1000);
    await elapse(200);
    h.target.writes[0]?.answer('stored');
    await until(() => h.source.of('s-1').length === 1, 's-1 acked');
    expect(await stopped).toBe(0);
    expect(h.source.of('s-1')).toEqual(['ack']);
    expect(h.timeline.index('ack', 's-1')).toBeGreaterThan(h.timeline.index('commit-answered', 's-1'));
  });
});

describe('leases', () => {
  it('a renewal that finds the claim no longer ours: the ID is not published again without a new claim', async () => {
    const h = await start();
    h.target.disconnect(); // the publish waits for the connection: not written
    const claimedAt = performance.now();
    h.source.deliver(message('l-1'));
    await until(() => h.target.waitingCount === 1, 'the send waiting');
    // Redis's clock jumps past our lease (an NTP step): the other replica takes the ID over,
    // while by our own clock the lease has 2 s to go (writeBy is 1 s ahead).
    h.skew.ms = LEASE_MS + 1;
    expect(await h.other.claim([h.claims.keyOf('l-1')])).toEqual(['in-doubt']);
    await elapse(1000); // the renewal: not ours
    expect(h.claims.callsOf('renew').map((call) => call.result)).toEqual([[false]]);
    expect(h.lines.filter((line) => /leases no longer ours/.test(line.msg))).toHaveLength(1);
    expect(performance.now() - claimedAt).toBeLessThan(LEASE_MS * (2 / 3)); // its writeBy has not passed

    h.target.connect();
    await until(() => h.target.fenced.length === 1, 'fenced at the write');
    await until(() => h.claims.callsOf('claim').length === 2, 'claimed again');
    await quiesce();
    expect(h.claims.callsOf('claim')[1]?.result).toEqual(['busy']);
    expect(h.target.writes).toEqual([]);

    // The other owner forwards and commits it: ours is a duplicate, acked, never published.
    await h.other.commit([h.claims.keyOf('l-1')]);
    await elapse(BUSY_RECHECK_MS);
    await until(() => h.source.of('l-1').length === 1, 'l-1 acked');
    expect(h.source.of('l-1')).toEqual(['ack']);
    expect(h.target.writes).toEqual([]);
  });

  it('a renewal that finds the claim taken while a write is unanswered resets the target; the ID goes no further without a new claim', async () => {
    const h = await start();
    h.target.script = () => 'hold';
    h.source.deliver(message('l-2'));
    await until(() => h.target.writes.length === 1, 'written');
    // Redis's clock jumps past our lease (an NTP step): the other replica takes the ID over.
    h.skew.ms = LEASE_MS + 1;
    expect(await h.other.claim([h.claims.keyOf('l-2')])).toEqual(['in-doubt']);
    await elapse(1000); // the renewal: not ours
    await until(() => h.target.resets.length === 1, 'the reset');
    expect(h.target.resets[0]).toMatch(/lost their lease/);
    expect(h.target.writes[0]?.outcome).toBe('unknown');
    await elapse(1100); // the resend after 'unknown': fenced (writeBy was cleared), claimed again: busy
    expect(h.target.fenced.map((f) => f.id)).toEqual(['l-2']);
    const claimed = h.claims.callsOf('claim').map((call) => call.result?.[0]);
    expect(claimed[0]).toBe('new');
    expect(claimed.length).toBeGreaterThan(1);
    expect(new Set(claimed.slice(1))).toEqual(new Set(['busy']));
    expect(h.timeline.index('claim', 'l-2', h.timeline.index('fenced', 'l-2'))).toBeGreaterThan(0);
    expect(h.target.writes).toHaveLength(1);
    await h.other.commit([h.claims.keyOf('l-2')]);
    await elapse(BUSY_RECHECK_MS);
    await until(() => h.source.of('l-2').length === 1, 'l-2 acked');
    expect(h.source.of('l-2')).toEqual(['ack']);
    expect(h.target.writes).toHaveLength(1);
  });

  it('a publish whose writeBy passed is fenced by the target and claimed again before it is written', async () => {
    const h = await start();
    h.target.disconnect();
    h.claims.hold('renew'); // Redis renews nothing: writeBy stays claim + 2000 ms
    h.source.deliver(message('f-1'));
    await until(() => h.target.waitingCount === 1, 'the send waiting');
    await elapse(2100); // past writeBy; our lease in Redis (3000 ms) still holds
    h.target.connect();
    await until(() => h.source.of('f-1').length === 1, 'f-1 acked');

    expect(h.target.fenced.map((f) => f.id)).toEqual(['f-1']);
    const writes = h.target.of('f-1');
    expect(writes.map((w) => w.inDoubt)).toEqual([false]); // nothing of ours went out before
    expect(writes[0]?.at).toBeLessThanOrEqual(writes[0]?.writeBy ?? 0);
    const t = h.timeline;
    const fenced = t.index('fenced', 'f-1');
    const reclaimed = t.index('claim-answered', 'f-1', fenced);
    expect(reclaimed).toBeGreaterThan(fenced);
    expect(t.index('write', 'f-1')).toBeGreaterThan(reclaimed);
    expect(h.source.of('f-1')).toEqual(['ack']);
    h.claims.letGoAll('renew');
  });

  it('a written publish whose lease runs low resets the target; the copy goes again flagged, after a new claim', async () => {
    const h = await start();
    h.target.script = firstAnswers({ 'g-1': 'hold' });
    h.claims.hold('renew'); // Redis renews nothing
    h.source.deliver(message('g-1'));
    await until(() => h.target.writes.length === 1, 'written');
    await elapse(2300);
    expect(h.target.resets).toEqual([]);
    await elapse(600); // under a fifth of the lease left: reset
    await until(() => h.source.of('g-1').length === 1, 'g-1 acked');
    expect(h.target.resets).toHaveLength(1);
    expect(h.target.of('g-1').map((w) => [w.inDoubt, w.outcome])).toEqual([
      [false, 'unknown'],
      [true, 'stored'],
    ]);
    const t = h.timeline;
    const fenced = t.index('fenced', 'g-1');
    expect(fenced).toBeGreaterThan(t.index('target-reset', undefined));
    const reclaimed = t.index('claim-answered', 'g-1', fenced);
    expect(reclaimed).toBeGreaterThan(fenced);
    expect(t.index('write', 'g-1', reclaimed)).toBeGreaterThan(reclaimed);
    h.claims.letGoAll('renew');
  });
});

describe('two copies of one ID delivered at once', () => {
  it('make one publish; the second copy is acked as a duplicate after the first commits', async () => {
    const h = await start();
    h.claims.hold('commit');
    h.source.deliver(message('e-1', { label: 'e-1#1' }), message('e-1', { label: 'e-1#2' }));
    await until(() => h.claims.pending('commit').length === 1, 'the commit');
    await quiesce();
    expect(h.claims.callsOf('claim').map((call) => call.ids)).toEqual([['e-1']]);
    expect(h.source.settlements).toEqual([]);

    h.claims.letGoAll('commit');
    await until(() => h.source.settlements.length === 2, 'both acked');
    expect(h.source.settlements.map((s) => [s.label, s.how])).toEqual([
      ['e-1#1', 'ack'],
      ['e-1#2', 'ack'],
    ]);
    expect(h.target.writes).toHaveLength(1);
    expect(h.claims.callsOf('claim').map((call) => call.result)).toEqual([['new'], ['dup']]);
    const t = h.timeline;
    expect(t.index('ack', 'e-1#2')).toBeGreaterThan(t.index('commit-answered', 'e-1'));
    expect(t.index('ack', 'e-1#2')).toBeGreaterThan(
      t.index('claim-answered', 'e-1', t.index('ack', 'e-1#1')),
    );
  });
});

// Two defects these tests found in the pipeline, fixed since: each test keeps them fixed.
describe('defects found by these tests', () => {
  // The busy recheck did not ask source.holds(), unlike the refused-message retry: a busy message
  // whose delivery the source took back stayed held and was claimed again every 250 ms for as long
  // as the other owner held the ID, and bridge.ts consumes again after a source reconnect only on
  // pipeline.whenIdle(), so the route took nothing meanwhile.
  it('a busy message the source took back (its connection dropped) is let go at its next recheck', async () => {
    const h = await start();
    const key = h.claims.keyOf('k-1');
    await h.other.claim([key]);
    h.source.deliver(message('k-1'));
    await until(() => h.claims.callsOf('claim')[0]?.answered === true, 'the claim');
    expect(h.claims.callsOf('claim')[0]?.result).toEqual(['busy']);
    h.source.drop();
    const claimsAtDrop = h.claims.callsOf('claim').length;
    // bridge.ts: after a source reconnect the route consumes again only once the pipeline is idle.
    let idle = false;
    void h.pipeline.whenIdle().then(() => {
      idle = true;
    });
    await elapse(2 * BUSY_RECHECK_MS);
    expect(h.pipeline.heldCount).toBe(0);
    expect(idle).toBe(true);
    expect(h.claims.callsOf('claim')).toHaveLength(claimsAtDrop);
    // The other owner gives the ID up (its copy was refused): a message we no longer hold is not forwarded.
    await h.other.release([key]);
    await elapse(BUSY_RECHECK_MS);
    expect(h.target.writes).toEqual([]);
    expect(h.source.settlements).toEqual([]);
  });

  // Refused entries left the leases renewed only after both release calls answered, so a renewal
  // between them counted a released ID as a lost lease: dedup_bridge_lease_lost_total went up and
  // the warning said another owner took it over, though nobody did.
  it('a renewal that crosses the release of refused messages is not counted as a lost lease', async () => {
    const h = await start();
    h.target.script = firstAnswers({ 'q-1': 'unroutable', 'q-2': 'rejected' });
    // One Redis connection: what is sent first runs first, and its reply comes first. The release
    // of q-1 runs, its reply on its way; the renewal (sent meanwhile) runs after it; the release of
    // q-2 (kept in doubt) is sent once the first reply is in, so after the renewal.
    h.claims.hold('release', 'reply');
    h.claims.hold('renew', 'reply');
    h.source.deliver(message('q-1'), message('q-2'));
    await until(() => h.claims.pending('release').length === 1, 'the first release');
    h.claims.hold('release', 'request');
    // The renewal at 1 s: as pipeline.ts stands, both are still in `claimed`, so it carries both,
    // and Redis answers q-1 false (released) and q-2 true (not yet). Whatever a fix changes of
    // that, the outcome below must hold.
    await elapse(1000);
    h.claims.letGoAll('release'); // the first release's reply; the second is sent
    await until(() => h.claims.pending('release').length === 1, 'the second release');
    h.claims.letGoAll('renew'); // then the renewal's reply
    await quiesce();
    h.claims.unhold('release');
    h.claims.letGoAll('release');
    await elapse(500); // the retries after their backoff
    await until(() => h.source.settlements.length === 2, 'both acked');
    expect(h.target.of('q-1').map((w) => w.inDoubt)).toEqual([false, false]);
    expect(h.target.of('q-2').map((w) => w.inDoubt)).toEqual([false, true]);
    // Released by us, not run out and taken over: no lease was lost.
    expect(h.lines.filter((line) => /leases no longer ours/.test(line.msg))).toEqual([]);
    expect(h.pipeline.counters.leaseLost).toBe(0);
  });
});
