import { writeFile } from 'node:fs/promises';
import { connectAmqp } from '../amqp/connect.js';
import { checkExchangeExists, checkQueueExists, sourceQueueTypeOf } from '../amqp/source.js';
import { newCounters } from '../bridge/counters.js';
import { MessageBudget, TokenBucket } from '../bridge/limits.js';
import type { MigrateSettings } from '../config/migrate-settings.js';
import { redactUrl } from '../config/redact.js';
import { describeRedis, parseRedisUrl } from '../config/redis-url.js';
import type { BridgeSettings } from '../config/settings.js';
import { newOwnerToken } from '../dedup/cache.js';
import { closeRedis, connectRedis, untilRedisAnswers } from '../dedup/redis.js';
import { BridgeError, ExitCode, RuntimeFailure, StopRequested } from '../errors.js';
import type { Logger } from '../log.js';
import type { RouteWatch } from '../observe/server.js';
import { dryRunQueue } from './dry-run.js';
import { activeSpanOf, type JobControl, migrateQueue, type QueueProgress, type QueueResult } from './job.js';
import { JobLock } from './lock.js';
import { showProgress } from './progress.js';
import {
  type ActiveSpan,
  buildJobReport,
  buildQueueReport,
  type JobReport,
  type QueueReport,
} from './report.js';
import { checkTargetStream, declareTargetQueues, declareTargetStream } from './topology.js';

interface JobResult {
  report: JobReport;
  exitCode: number;
  /** Lines for stderr, one per queue that did not finish cleanly. */
  problems: string[];
}

/**
 * What a job shows of itself as it goes, so that a run ended by an error (outside any one queue)
 * still gets a report of what its queues did until then: see stoppedJobReport.
 */
export interface JobContext {
  /** The job's name, once the options are resolved. */
  name?: string;
  dryRun: boolean;
  routes?: BridgeSettings[];
  /** Each queue's progress, once the queues started moving. */
  progress?: QueueProgress[];
  /** Each queue's report, once it finished. */
  finished?: (QueueReport | undefined)[];
}

/**
 * The scheduled migration job: takes the job lock, checks (or declares) the topology before
 * anything moves, migrates up to --parallel queues at once under the job's limits, and reports.
 */
export async function runMigration(
  settings: MigrateSettings,
  log: Logger,
  interrupt: Promise<unknown>,
  terminal: boolean,
  watch?: RouteWatch,
  context: JobContext = { dryRun: settings.dryRun },
  stop?: AbortSignal,
): Promise<JobResult> {
  const started = Date.now();
  const first = settings.routes[0] as BridgeSettings;
  context.name = settings.jobName;
  context.routes = settings.routes;
  const redis = await connectRedis(first.redisUrl, first.retryForMs, log, first.tls.redis, stop);
  let lock: JobLock | undefined;
  try {
    // A full Redis (OOM) refuses the lock's write: waited for as for an unreachable one.
    lock = await untilRedisAnswers(
      describeRedis(parseRedisUrl(first.redisUrl)),
      'when taking the job lock',
      first.retryForMs,
      log,
      () =>
        JobLock.acquire(
          redis,
          first.redisPrefix,
          settings.jobName,
          newOwnerToken(),
          settings.jobLockLeaseMs,
          log,
        ),
      stop,
    );
    // A stream target is one route (resolveMigrateSettings): its stream, over the stream protocol.
    if (settings.declareTarget && first.targetStream !== undefined) {
      await declareTargetStream(
        first,
        settings.sourceManagementUrl,
        log,
        settings.declareTargetForce,
        settings.sourceManagementCa,
      );
    } else if (settings.declareTarget) {
      await declareTargetQueues(
        settings.routes,
        settings.sourceManagementUrl as string,
        log,
        settings.declareTargetForce,
        settings.sourceManagementCa,
      );
    }
    await checkTopology(settings.routes, log, stop);

    if (settings.dryRun) {
      const queues: QueueReport[] = [];
      const active: ActiveSpan[] = [];
      for (const route of settings.routes) {
        const from = Date.now();
        queues.push(await dryRunQueue(route, redis, settings.maxMessages, log));
        active.push({ from, to: Date.now() });
      }
      return {
        report: buildJobReport({
          job: settings.jobName,
          dryRun: true,
          queues,
          elapsedMs: Date.now() - started,
          active,
          exitCode: ExitCode.ok,
        }),
        exitCode: ExitCode.ok,
        problems: queues.flatMap((queue) => (queue.problem === null ? [] : [queue.problem])),
      };
    }

    const control: JobControl = {
      stopReason: undefined,
      budget: new MessageBudget(settings.maxMessages),
      throttle: settings.maxRate ? bucketOf(settings.maxRate) : undefined,
      idleTimeoutMs: settings.idleTimeoutMs,
      deleteSourceWhenEmpty: settings.deleteSourceWhenEmpty,
      log,
      watch,
      stop,
    };
    void interrupt.then(() => {
      control.stopReason ??= 'interrupted';
    });
    const deadline =
      settings.maxDurationMs === undefined
        ? undefined
        : setTimeout(() => {
            control.stopReason ??= 'limit';
          }, settings.maxDurationMs);

    const progress: QueueProgress[] = settings.routes.map((route) => ({
      sourceQueue: route.sourceQueue,
      counters: newCounters(),
      depth: undefined,
      inFlight: 0,
      total: undefined,
      startedAt: 0,
      activeFrom: 0,
      lastHandledAt: 0,
      done: false,
    }));
    context.progress = progress;
    context.finished = progress.map(() => undefined);
    const display = showProgress(progress, {
      terminal,
      quiet: settings.quiet,
      intervalMs: settings.progressIntervalMs,
      log,
    });
    let results: QueueResult[];
    try {
      results = await inParallel(settings.routes, settings.parallel, async (route, index) => {
        const item = progress[index] as QueueProgress;
        item.startedAt = Date.now();
        let result: QueueResult;
        try {
          result = await migrateQueue(route, control, item);
        } catch (error) {
          // This queue could not start (e.g. a server unreachable for --retry-for); the others go on.
          item.done = true;
          result = failedToStart(route, error, Date.now() - item.startedAt);
        }
        if (context.finished) context.finished[index] = result.report;
        return result;
      });
    } finally {
      display.stop();
      clearTimeout(deadline);
    }
    const exitCode = exitCodeOf(results);
    const report = buildJobReport({
      job: settings.jobName,
      dryRun: false,
      queues: results.map((result) => result.report),
      elapsedMs: Date.now() - started,
      active: progress.flatMap((item) => activeSpanOf(item) ?? []),
      exitCode,
    });
    return {
      report,
      exitCode,
      problems: results.flatMap((result) => (result.problem ? [result.problem] : [])),
    };
  } finally {
    await lock?.release();
    closeRedis(redis);
  }
}

function failedToStart(route: BridgeSettings, error: unknown, elapsedMs: number): QueueResult {
  if (error instanceof StopRequested) {
    // Stopped by a signal before this queue could start: nothing moved, the queue is left as it was.
    const report = buildQueueReport({
      outcome: 'interrupted',
      settings: route,
      counters: newCounters(),
      remaining: undefined,
      deleted: false,
      elapsedMs,
      active: undefined,
    });
    return { report, problem: undefined, failureCode: undefined };
  }
  const report = buildQueueReport({
    outcome: 'failed',
    settings: route,
    counters: newCounters(),
    remaining: undefined,
    deleted: false,
    problem: `${route.sourceQueue}: ${error instanceof Error ? error.message : String(error)}`,
    elapsedMs,
    active: undefined,
  });
  return {
    report,
    problem: report.problem ?? undefined,
    failureCode: error instanceof BridgeError ? error.exitCode : ExitCode.runtime,
  };
}

function bucketOf(rate: number): (count: number) => Promise<void> {
  const bucket = new TokenBucket(rate);
  return (count) => bucket.take(count);
}

/** A missing source or target queue is an error before anything moves, for every route. */
async function checkTopology(routes: BridgeSettings[], log: Logger, stop?: AbortSignal): Promise<void> {
  const first = routes[0] as BridgeSettings;
  for (const side of ['source', 'target'] as const) {
    if (side === 'target' && first.targetStream !== undefined) {
      for (const route of routes) await checkTargetStream(route, log, stop);
      continue;
    }
    // A stream source is checked as its reader starts (the stream exists, the user may read it).
    if (side === 'source' && first.sourceStream !== undefined) continue;
    const url = side === 'source' ? first.sourceUrl : first.targetUrl;
    const connection = await connectAmqp(url, {
      side,
      retryForMs: first.retryForMs,
      log,
      tls: first.tls[side],
      stop,
    });
    try {
      const where = `${side} broker at ${redactUrl(url)}`;
      for (const route of routes) {
        const queue = side === 'source' ? route.sourceQueue : route.targetQueue;
        const channel = await connection.createChannel();
        channel.on('error', () => {});
        if (queue !== undefined) await checkQueueExists(channel, queue, where, `--${side}-queue`);
        // A stream is refused before anything moves (see sourceQueueTypeOf).
        if (side === 'source') await sourceQueueTypeOf(connection, route.sourceQueue, where, log);
        else if (route.targetExchange !== '') await checkExchangeExists(channel, route.targetExchange, where);
        await channel.close().catch(() => {});
      }
    } finally {
      await connection.close().catch(() => {});
    }
  }
}

/** Runs `work` over the items with at most `limit` at a time, keeping the results in order. */
async function inParallel<T, R>(
  items: T[],
  limit: number,
  work: (item: T, index: number) => Promise<R>,
): Promise<R[]> {
  const results: R[] = new Array(items.length);
  let next = 0;
  const worker = async () => {
    while (next < items.length) {
      const index = next++;
      results[index] = await work(items[index] as T, index);
    }
  };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, worker));
  return results;
}

function exitCodeOf(results: QueueResult[]): number {
  const failed = results.find((result) => result.failureCode !== undefined);
  if (failed) return failed.failureCode as number;
  if (results.some((result) => result.report.outcome === 'stalled')) return ExitCode.runtime;
  const left = results.some((result) => result.report.remaining !== 0);
  if (results.some((result) => ['limit', 'interrupted'].includes(result.report.outcome)) && left)
    return ExitCode.limit;
  return ExitCode.ok;
}

/**
 * The report of a run ended by an error outside its queues (bad options, the job lock held, a
 * server unreachable at start, an internal error): the outcome the exit code means, the error's
 * line, and what each queue did until then (its counters so far, marked failed), if any moved.
 */
export function stoppedJobReport(
  context: JobContext,
  error: { exitCode: number; line: string },
  elapsedMs: number,
): JobReport {
  // Exit 4 (or 0) from an error is a stop signal that came while a server was still awaited.
  const outcome =
    error.exitCode === ExitCode.usage
      ? 'refused'
      : error.exitCode === ExitCode.locked
        ? 'locked'
        : error.exitCode === ExitCode.limit || error.exitCode === ExitCode.ok
          ? 'interrupted'
          : 'failed';
  const progress = context.progress ?? [];
  const queues = progress.map(
    (item, index) =>
      context.finished?.[index] ??
      buildQueueReport({
        outcome: 'failed',
        settings: context.routes?.[index] as BridgeSettings,
        counters: item.counters,
        remaining: item.depth,
        deleted: false,
        problem: `${item.sourceQueue}: ${item.startedAt === 0 ? 'not started' : 'cut short'}: ${error.line}`,
        elapsedMs: item.startedAt === 0 ? 0 : Date.now() - item.startedAt,
        active: activeSpanOf(item),
      }),
  );
  return buildJobReport({
    job: context.name ?? null,
    dryRun: context.dryRun,
    queues,
    elapsedMs,
    active: progress.flatMap((item) => activeSpanOf(item) ?? []),
    exitCode: error.exitCode,
    outcome,
    problem: error.line,
  });
}

export async function writeReport(path: string, report: JobReport): Promise<void> {
  try {
    await writeFile(path, `${JSON.stringify(report, null, 2)}\n`);
  } catch (error) {
    const reason = (error as NodeJS.ErrnoException).code ?? String(error);
    throw new RuntimeFailure(`--report: cannot write "${path}" (${reason}); the migration itself finished`);
  }
}
