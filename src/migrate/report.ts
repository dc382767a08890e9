import type { RouteCounters } from '../bridge/counters.js';

export type MigrateOutcome = 'drained' | 'limit' | 'interrupted' | 'stalled' | 'failed';

/** The `--report` JSON: counts of source messages by outcome, and how the job ended. */
export interface MigrateReport {
  outcome: MigrateOutcome;
  sourceQueue: string;
  scope: string;
  forwarded: number;
  duplicates: number;
  inDoubt: number;
  unroutable: number;
  nacked: number;
  parked: number;
  deadLettered: number;
  requeued: number;
  noId: number;
  consumed: number;
  /** Messages left in the source queue at the end; null when it could not be read. */
  remaining: number | null;
  seconds: number;
  /**
   * Source messages handled (forwarded, duplicates, parked, dead-lettered) per second, from the
   * start of the job to its last handled message (the idle wait that proves the drain not counted).
   */
  ratePerSecond: number;
}

export function buildReport(
  outcome: MigrateOutcome,
  sourceQueue: string,
  scope: string,
  counters: RouteCounters,
  remaining: number | undefined,
  elapsedMs: number,
  activeMs: number,
): MigrateReport {
  const seconds = Math.max(elapsedMs, 1) / 1000;
  const handled = counters.forwarded + counters.duplicates + counters.parked + counters.deadLettered;
  const activeSeconds = Math.max(activeMs, 1) / 1000;
  return {
    outcome,
    sourceQueue,
    scope,
    forwarded: counters.forwarded,
    duplicates: counters.duplicates,
    inDoubt: counters.inDoubt,
    unroutable: counters.unroutable,
    nacked: counters.nacked,
    parked: counters.parked,
    deadLettered: counters.deadLettered,
    requeued: counters.requeued,
    noId: counters.noId,
    consumed: counters.consumed,
    remaining: remaining ?? null,
    seconds: Math.round(seconds * 1000) / 1000,
    ratePerSecond: Math.round(handled / activeSeconds),
  };
}

const OUTCOME_TEXT: Record<MigrateOutcome, string> = {
  drained: 'drained',
  limit: 'stopped at --max-messages',
  interrupted: 'interrupted by a signal',
  stalled: 'stopped: the remaining messages cannot be forwarded',
  failed: 'failed',
};

/** The human summary printed on stderr at the end of a migration. */
export function formatReport(report: MigrateReport): string {
  const remaining = report.remaining === null ? 'unknown' : String(report.remaining);
  return [
    `migrate ${report.sourceQueue} → ${report.scope}: ${OUTCOME_TEXT[report.outcome]} after ${report.seconds.toFixed(1)}s`,
    `  forwarded ${report.forwarded} (in-doubt ${report.inDoubt}) · duplicates ${report.duplicates} · ` +
      `unroutable ${report.unroutable} · nacked ${report.nacked} · parked ${report.parked} · ` +
      `dead-lettered ${report.deadLettered} · requeued ${report.requeued} · no ID ${report.noId}`,
    `  remaining in source ${remaining} · ${report.ratePerSecond} msg/s`,
    '',
  ].join('\n');
}
