import type { RouteCounters } from '../bridge/counters.js';
import type { BridgeSettings } from '../config/settings.js';

export type QueueOutcome = 'drained' | 'limit' | 'interrupted' | 'stalled' | 'failed' | 'dry-run';
export type JobOutcome = QueueOutcome | 'partial';

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
  requeued: number;
  returned: number;
  noId: number;
  /** Messages that cannot be forwarded as they are (an unreadable header table, say). */
  unforwardable: number;
  /** Messages that came back to this route: the target routes into the source queue (a loop). */
  looped: number;
  /** Deliveries taken from the source queue. */
  consumed: number;
  /** True when every consumed delivery is accounted for by one of the outcomes above. */
  accounted: boolean;
  /** Ready messages left in the source queue at the end; null when it could not be read. */
  remaining: number | null;
  deleted: boolean;
  seconds: number;
  /** Messages handled per second, until the last one (not the idle wait that proves the drain). */
  ratePerSecond: number;
}

const COUNTS = [
  'forwarded',
  'duplicates',
  'inDoubt',
  'unroutable',
  'nacked',
  'parked',
  'deadLettered',
  'requeued',
  'returned',
  'noId',
  'unforwardable',
  'looped',
  'consumed',
] as const;

/** The `--report` JSON: the job's totals at the top level, and a row per queue. */
export interface JobReport
  extends Omit<QueueReport, 'sourceQueue' | 'targetQueue' | 'scope' | 'outcome' | 'deleted'> {
  job: string;
  outcome: JobOutcome;
  dryRun: boolean;
  queues: QueueReport[];
}

export function buildQueueReport(input: {
  outcome: QueueOutcome;
  settings: BridgeSettings;
  counters: RouteCounters;
  remaining: number | undefined;
  deleted: boolean;
  elapsedMs: number;
  activeMs: number;
}): QueueReport {
  const { counters } = input;
  const seconds = Math.max(input.elapsedMs, 1) / 1000;
  const handled = counters.forwarded + counters.duplicates + counters.parked + counters.deadLettered;
  const settled = handled + counters.requeued + counters.returned;
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
    requeued: counters.requeued,
    returned: counters.returned,
    noId: counters.noId,
    unforwardable: counters.unforwardable,
    looped: counters.looped,
    consumed: counters.consumed,
    accounted: settled === counters.consumed,
    remaining: input.remaining ?? null,
    deleted: input.deleted,
    seconds: round(seconds),
    ratePerSecond: Math.round(handled / (Math.max(input.activeMs, 1) / 1000)),
  };
}

function round(seconds: number): number {
  return Math.round(seconds * 1000) / 1000;
}

export function buildJobReport(
  job: string,
  dryRun: boolean,
  queues: QueueReport[],
  elapsedMs: number,
): JobReport {
  const totals = Object.fromEntries(
    COUNTS.map((name) => [name, queues.reduce((sum, queue) => sum + queue[name], 0)]),
  ) as Record<(typeof COUNTS)[number], number>;
  const outcomes = new Set(queues.map((queue) => queue.outcome));
  const outcome: JobOutcome =
    outcomes.size === 1 ? (queues[0]?.outcome ?? 'drained') : outcomes.has('failed') ? 'failed' : 'partial';
  const remaining = queues.some((queue) => queue.remaining === null)
    ? null
    : queues.reduce((sum, queue) => sum + (queue.remaining ?? 0), 0);
  const seconds = Math.max(elapsedMs, 1) / 1000;
  const handled = totals.forwarded + totals.duplicates + totals.parked + totals.deadLettered;
  return {
    job,
    outcome,
    dryRun,
    ...totals,
    accounted: queues.every((queue) => queue.accounted),
    remaining,
    seconds: round(seconds),
    ratePerSecond: Math.round(handled / seconds),
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
  if (report.queues.length > 1) rows.push(row('total', report, report.outcome));
  const widths = head.map((cell, i) => Math.max(cell.length, ...rows.map((r) => (r[i] as string).length)));
  const line = (cells: string[]) => cells.map((cell, i) => cell.padEnd(widths[i] as number)).join('  ');
  const title = `migrate ${report.job}: ${OUTCOME_TEXT[report.outcome]} after ${report.seconds.toFixed(1)}s${
    report.accounted ? '' : ' (some deliveries were returned by the broker when a connection dropped)'
  }`;
  return `${[title, line(head), ...rows.map(line)].join('\n')}\n`;
}
