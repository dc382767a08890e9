import type { RouteCounters } from '../bridge/counters.js';
import type { BridgeSettings } from '../config/settings.js';

export type QueueOutcome = 'drained' | 'limit' | 'interrupted' | 'stalled' | 'failed' | 'dry-run';
/**
 * A job's outcome: its queues' when they agree, else `partial` (or `failed` when one failed); a job
 * stopped before it moved anything is `refused` (exit 2: options, configuration, credentials, a
 * missing queue), `locked` (exit 3: another run holds the job) or `failed` (exit 1).
 */
type JobOutcome = QueueOutcome | 'partial' | 'refused' | 'locked';

/** Counts of one queue's source messages by outcome. */
export interface QueueReport {
  sourceQueue: string;
  targetQueue: string | null;
  scope: string;
  outcome: QueueOutcome;
  /** Published and confirmed by the target, then acked (in-doubt ones included). */
  forwarded: number;
  /** Acked without publishing: the target already held the ID. */
  duplicates: number;
  inDoubt: number;
  unroutable: number;
  nacked: number;
  parked: number;
  deadLettered: number;
  /** Retries the bridge made itself of refused or unroutable messages (held, never returned). */
  retried: number;
  returned: number;
  noId: number;
  /**
   * Messages with an ID header of a type that cannot be an ID (a table, a float…): skipped, and the
   * next --id-from strategy decided. Not an outcome: each is also counted as what became of it.
   */
  badIdHeader: number;
  /** Messages that cannot be forwarded as they are (an unreadable header table, say). */
  unforwardable: number;
  /** Messages that came back to this route: the target routes into the source queue (a loop). */
  looped: number;
  /**
   * Commits that found no record of their claim: Redis lost it (FLUSHDB, a restart or a failover
   * without persistence). Not an outcome: each is also forwarded. Duplicates are possible for them.
   */
  claimsLost: number;
  /** Commits that found the ID committed already: another process forwarded it first, or a re-sent commit. */
  alreadyCommitted: number;
  /** Deliveries taken from the source queue. */
  consumed: number;
  /** True when every consumed delivery is accounted for by one of the outcomes above. */
  accounted: boolean;
  /** Ready messages left in the source queue at the end; null when it could not be read. */
  remaining: number | null;
  deleted: boolean;
  /** Why the queue did not finish cleanly, or why a drained queue was not deleted; one line. */
  problem: string | null;
  seconds: number;
  /**
   * Time spent moving messages: from when consuming began to the last message handled, without
   * the connecting before it or the idle wait that proves the drain after it.
   */
  activeSeconds: number;
  /** Messages handled (forwarded, duplicates, parked, dead-lettered) per active second. */
  ratePerSecond: number;
}

/** When a queue was moving messages: from when it began consuming to its last message handled. */
export interface ActiveSpan {
  from: number;
  to: number;
}

const COUNTS = [
  'forwarded',
  'duplicates',
  'inDoubt',
  'unroutable',
  'nacked',
  'parked',
  'deadLettered',
  'retried',
  'returned',
  'noId',
  'badIdHeader',
  'unforwardable',
  'looped',
  'claimsLost',
  'alreadyCommitted',
  'consumed',
] as const;

/**
 * The `--report` JSON, written on every exit: the job's totals at the top level, and a row per queue.
 * The job's activeSeconds is the time any of its queues was active (their spans joined), so that a
 * job of one queue has that queue's rate, and queues migrated one after another do not count the
 * idle waits between them.
 */
export interface JobReport
  extends Omit<QueueReport, 'sourceQueue' | 'targetQueue' | 'scope' | 'outcome' | 'deleted' | 'problem'> {
  /** The job's name (its lock); null when the options were refused before it could be named. */
  job: string | null;
  outcome: JobOutcome;
  /** The process's exit code. */
  exitCode: number;
  /** The line printed on stderr when the job did not finish cleanly (its queues' lines joined), else null. */
  problem: string | null;
  dryRun: boolean;
  queues: QueueReport[];
}

export function buildQueueReport(input: {
  outcome: QueueOutcome;
  settings: BridgeSettings;
  counters: RouteCounters;
  remaining: number | undefined;
  deleted: boolean;
  problem?: string | undefined;
  elapsedMs: number;
  /** When it was moving messages; undefined when it handled none. */
  active: ActiveSpan | undefined;
}): QueueReport {
  const { counters } = input;
  const seconds = Math.max(input.elapsedMs, 1) / 1000;
  const handled = handledOf(counters);
  // A retried message is still held by the bridge: it ends forwarded (or another outcome) or returned.
  const settled = handled + counters.returned;
  const activeMs = spanLength(input.active === undefined ? [] : [input.active]);
  return {
    sourceQueue: input.settings.sourceQueue,
    targetQueue: input.settings.targetQueue ?? null,
    scope: input.settings.scope,
    outcome: input.outcome,
    forwarded: counters.forwarded,
    duplicates: counters.duplicates,
    inDoubt: counters.inDoubt,
    unroutable: counters.unroutable,
    nacked: counters.nacked,
    parked: counters.parked,
    deadLettered: counters.deadLettered,
    retried: counters.retried,
    returned: counters.returned,
    noId: counters.noId,
    badIdHeader: counters.badIdHeader,
    unforwardable: counters.unforwardable,
    looped: counters.looped,
    claimsLost: counters.claimsLost,
    alreadyCommitted: counters.alreadyCommitted,
    consumed: counters.consumed,
    accounted: settled === counters.consumed,
    remaining: input.remaining ?? null,
    deleted: input.deleted,
    problem: input.problem ?? null,
    seconds: round(seconds),
    activeSeconds: round(activeMs / 1000),
    ratePerSecond: rateOf(handled, activeMs),
  };
}

/** Messages that left the source with an outcome: forwarded, duplicates, parked, dead-lettered. */
export function handledOf(
  counters: Pick<RouteCounters, 'forwarded' | 'duplicates' | 'parked' | 'deadLettered'>,
): number {
  return counters.forwarded + counters.duplicates + counters.parked + counters.deadLettered;
}

/** Messages per second over `activeMs`; 0 when nothing was handled. */
export function rateOf(handled: number, activeMs: number): number {
  return handled === 0 ? 0 : Math.round(handled / (Math.max(activeMs, 1) / 1000));
}

/** The time covered by the spans together, overlaps counted once. */
function spanLength(spans: readonly ActiveSpan[]): number {
  let total = 0;
  let end = Number.NEGATIVE_INFINITY;
  for (const span of [...spans].sort((a, b) => a.from - b.from)) {
    const from = Math.max(span.from, end);
    if (span.to > from) total += span.to - from;
    end = Math.max(end, span.to);
  }
  return total;
}

function round(seconds: number): number {
  return Math.round(seconds * 1000) / 1000;
}

export function buildJobReport(input: {
  job: string | null;
  dryRun: boolean;
  queues: QueueReport[];
  elapsedMs: number;
  /** When each queue was moving messages (those that handled any). */
  active: ActiveSpan[];
  exitCode: number;
  /** Overrides the outcome the queues give (a job stopped before or outside its queues). */
  outcome?: JobOutcome;
  /** The job's own problem; default: its queues' joined. */
  problem?: string;
}): JobReport {
  const { job, dryRun, queues, elapsedMs } = input;
  const totals = Object.fromEntries(
    COUNTS.map((name) => [name, queues.reduce((sum, queue) => sum + queue[name], 0)]),
  ) as Record<(typeof COUNTS)[number], number>;
  const outcomes = new Set(queues.map((queue) => queue.outcome));
  const outcome: JobOutcome =
    input.outcome ??
    (outcomes.size === 1 ? (queues[0]?.outcome ?? 'drained') : outcomes.has('failed') ? 'failed' : 'partial');
  const remaining =
    queues.length === 0 || queues.some((queue) => queue.remaining === null)
      ? null
      : queues.reduce((sum, queue) => sum + (queue.remaining ?? 0), 0);
  const seconds = Math.max(elapsedMs, 1) / 1000;
  const activeMs = spanLength(input.active);
  const problems = queues.flatMap((queue) => (queue.problem === null ? [] : [queue.problem]));
  return {
    job,
    outcome,
    exitCode: input.exitCode,
    problem: input.problem ?? (problems.length > 0 ? problems.join('; ') : null),
    dryRun,
    ...totals,
    accounted: queues.every((queue) => queue.accounted),
    remaining,
    seconds: round(seconds),
    activeSeconds: round(activeMs / 1000),
    ratePerSecond: rateOf(handledOf(totals), activeMs),
    queues,
  };
}

const OUTCOME_TEXT: Record<JobOutcome, string> = {
  drained: 'drained',
  limit: 'stopped at a limit',
  interrupted: 'interrupted by a signal',
  stalled: 'stopped: messages that cannot be forwarded are left',
  failed: 'failed',
  'dry-run': 'dry run (nothing moved)',
  partial: 'partly done',
  refused: 'refused',
  locked: 'another run holds the job',
};

/** The table printed on stderr at the end of a migration. */
export function formatJobReport(report: JobReport): string {
  const head = [
    'queue',
    'outcome',
    'forwarded',
    'dups',
    'in-doubt',
    'unroutable',
    'parked',
    'dead-l.',
    'remaining',
    'msg/s',
    's',
  ];
  const row = (name: string, r: QueueReport | JobReport, outcome: string) => [
    name,
    outcome,
    String(r.forwarded),
    String(r.duplicates),
    String(r.inDoubt),
    String(r.unroutable),
    String(r.parked),
    String(r.deadLettered),
    r.remaining === null ? '?' : String(r.remaining),
    String(r.ratePerSecond),
    r.seconds.toFixed(1),
  ];
  const rows = report.queues.map((queue) =>
    row(`${queue.sourceQueue}${queue.deleted ? ' (deleted)' : ''}`, queue, queue.outcome),
  );
  // msg/s is per active second (from consuming to the last message), for the rows and the total.
  if (report.queues.length > 1) rows.push(row('total', report, report.outcome));
  const widths = head.map((cell, i) => Math.max(cell.length, ...rows.map((r) => (r[i] as string).length)));
  const line = (cells: string[]) => cells.map((cell, i) => cell.padEnd(widths[i] as number)).join('  ');
  const title = `migrate ${report.job}: ${OUTCOME_TEXT[report.outcome]} after ${report.seconds.toFixed(1)}s${
    report.accounted ? '' : ' (some deliveries were returned by the broker when a connection dropped)'
  }`;
  return `${[title, line(head), ...rows.map(line)].join('\n')}\n`;
}
