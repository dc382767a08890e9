import { writeFile } from 'node:fs/promises';
import { sleep } from '../amqp/backoff.js';
import { startBridge } from '../bridge/bridge.js';
import type { MigrateSettings } from '../config/settings.js';
import { type BridgeError, ExitCode, RuntimeFailure } from '../errors.js';
import type { Logger } from '../observe/log.js';
import { buildReport, type MigrateOutcome, type MigrateReport } from './report.js';

const POLL_MS = 100;

export interface MigrateResult {
  report: MigrateReport;
  exitCode: number;
  /** One line for stderr when the job did not finish cleanly. */
  problem: string | undefined;
}

/**
 * Forwards until the source queue is drained: empty, nothing of ours in flight, and both for
 * `idleTimeoutMs`. Also ends on --max-messages, on a signal (`interrupt`), when only messages that
 * cannot be forwarded are left for `retryForMs`, or on a failure; never acks what is not forwarded.
 */
export async function migrate(
  settings: MigrateSettings,
  log: Logger,
  interrupt: Promise<unknown>,
): Promise<MigrateResult> {
  const started = Date.now();
  const bridge = await startBridge(settings, log);
  const { pipeline, source } = bridge;
  let interrupted = false;
  void interrupt.then(() => {
    interrupted = true;
  });
  let failure: BridgeError | undefined;
  let failureCode: number = ExitCode.runtime;
  void bridge.failure.then((error) => {
    failure = error;
  });

  let outcome: MigrateOutcome | undefined;
  let problem: string | undefined;
  let idleSince: number | undefined;
  while (outcome === undefined) {
    await sleep(POLL_MS);
    const outage = bridge.outage();
    if (failure) {
      outcome = 'failed';
      problem = failure.message;
      failureCode = failure.exitCode;
    } else if (outage && settings.retryForMs > 0 && outage.ms >= settings.retryForMs) {
      outcome = 'failed';
      problem = `${outage.what} unreachable for ${Math.round(outage.ms / 1000)}s (--retry-for); nothing unforwarded was acked: run again when it is back`;
    } else if (interrupted) {
      outcome = 'interrupted';
    } else if (pipeline.limitReached && pipeline.heldCount === 0) {
      outcome = 'limit';
    } else if (
      pipeline.onlyFailuresHeld &&
      settings.retryForMs > 0 &&
      pipeline.msSinceProgress >= settings.retryForMs
    ) {
      outcome = 'stalled';
      problem =
        `${pipeline.heldCount} message(s) could not be forwarded for ${Math.round(pipeline.msSinceProgress / 1000)}s ` +
        `(${pipeline.counters.unroutable} unroutable, ${pipeline.counters.nacked} refused, ${pipeline.counters.noId} without an ID); ` +
        'they stay in the source queue: fix the target binding, or use --park-queue or --on-unroutable dead-letter';
    } else {
      const depth = pipeline.heldCount === 0 ? await source.depth() : undefined;
      if (depth === 0 && pipeline.heldCount === 0) {
        idleSince ??= Date.now();
        if (Date.now() - idleSince >= settings.idleTimeoutMs) outcome = 'drained';
      } else {
        idleSince = undefined;
      }
    }
  }

  const unfinished = await bridge.stop(outcome === 'failed' ? 0 : settings.shutdownTimeoutMs);
  if (unfinished > 0)
    log.warn({ unfinished }, 'stopped with messages still unconfirmed; they stay in the source');
  await source.closeConsumer();
  const remaining = await source.depth();
  await bridge.close();
  const report = buildReport(
    outcome,
    settings.sourceQueue,
    settings.scope,
    pipeline.counters,
    remaining,
    Date.now() - started,
    pipeline.counters.consumed > 0 ? pipeline.lastProgress - started : Date.now() - started,
  );
  if (settings.reportPath) await writeReport(settings.reportPath, report);
  return { report, exitCode: outcome === 'failed' ? failureCode : exitCodeOf(outcome, report), problem };
}

function exitCodeOf(outcome: MigrateOutcome, report: MigrateReport): number {
  switch (outcome) {
    case 'drained':
      return ExitCode.ok;
    case 'limit':
    case 'interrupted':
      return report.remaining === 0 ? ExitCode.ok : ExitCode.limit;
    default:
      return ExitCode.runtime;
  }
}

async function writeReport(path: string, report: MigrateReport): Promise<void> {
  try {
    await writeFile(path, `${JSON.stringify(report, null, 2)}\n`);
  } catch (error) {
    const reason = (error as NodeJS.ErrnoException).code ?? String(error);
    throw new RuntimeFailure(`--report: cannot write "${path}" (${reason}); the migration itself finished`);
  }
}
