import { sleep } from '../amqp/backoff.js';
import { connectAmqp } from '../amqp/connect.js';
import { replyCodeOf } from '../amqp/errors.js';
import { type Bridge, startBridge } from '../bridge/bridge.js';
import type { RouteCounters } from '../bridge/counters.js';
import type { MessageBudget } from '../bridge/limits.js';
import type { BridgeSettings } from '../config/settings.js';
import type { BridgeError } from '../errors.js';
import type { Logger } from '../observe/log.js';
import type { RouteWatch } from '../observe/server.js';
import { buildQueueReport, type QueueOutcome, type QueueReport } from './report.js';

const POLL_MS = 100;

/** Shared by the queues of one job: why the job as a whole stops early, if it does. */
export interface JobControl {
  stopReason: 'interrupted' | 'limit' | undefined;
  budget: MessageBudget;
  throttle: ((count: number) => Promise<void>) | undefined;
  idleTimeoutMs: number;
  deleteSourceWhenEmpty: boolean;
  log: Logger;
  /** Told of each queue's bridge while it runs (--metrics-port). */
  watch?: RouteWatch;
}

/** What progress displays read while a queue migrates. */
export interface QueueProgress {
  sourceQueue: string;
  counters: RouteCounters;
  /** Ready messages last seen in the source queue. */
  depth: number | undefined;
  startedAt: number;
  done: boolean;
}

export interface QueueResult {
  report: QueueReport;
  /** One line for stderr when the queue did not finish cleanly. */
  problem: string | undefined;
  /** The exit code a failure asks for (2 for a configuration error found late, else 1). */
  failureCode: number | undefined;
}

/**
 * Migrates one queue: forwards until it is drained — the source reports it empty, nothing of ours
 * is in flight, and both stay so for the idle timeout. Also ends when the job stops (a signal, a
 * limit), when only messages that cannot be forwarded are left for --retry-for, when a server stays
 * unreachable for --retry-for, or on a failure that retrying cannot fix. Never acks what is not
 * forwarded.
 */
export async function migrateQueue(
  settings: BridgeSettings,
  control: JobControl,
  progress: QueueProgress,
): Promise<QueueResult> {
  const started = Date.now();
  const bridge = await startBridge(settings, control.log, {
    budget: control.budget,
    throttle: control.throttle,
  });
  const { pipeline, source } = bridge;
  control.watch?.add(bridge);
  progress.counters = pipeline.counters;
  let failure: BridgeError | undefined;
  void bridge.failure.then((error) => {
    failure = error;
  });

  let outcome: QueueOutcome | undefined;
  let problem: string | undefined;
  let idleSince: number | undefined;
  while (outcome === undefined) {
    await sleep(POLL_MS);
    const outage = bridge.outage();
    if (failure) {
      outcome = 'failed';
      problem = failure.message;
    } else if (outage && settings.retryForMs > 0 && outage.ms >= settings.retryForMs) {
      outcome = 'failed';
      problem = `${outage.what} unreachable for ${Math.round(outage.ms / 1000)}s (--retry-for); nothing unforwarded was acked: run again when it is back`;
    } else if (control.stopReason) {
      outcome = control.stopReason;
    } else if (pipeline.limitReached && pipeline.heldCount === 0) {
      outcome = 'limit';
    } else if (
      pipeline.onlyFailuresHeld &&
      settings.retryForMs > 0 &&
      pipeline.msSinceProgress >= settings.retryForMs
    ) {
      outcome = 'stalled';
      problem =
        `${settings.sourceQueue}: ${pipeline.heldCount} message(s) could not be forwarded for ${Math.round(pipeline.msSinceProgress / 1000)}s ` +
        `(${pipeline.counters.unroutable} unroutable, ${pipeline.counters.nacked} refused, ${pipeline.counters.noId} without an ID, ${pipeline.counters.unforwardable} unforwardable); ` +
        'they stay in the source queue: fix the target binding, or use --park-queue or --on-unroutable dead-letter';
    } else {
      const depth = pipeline.heldCount === 0 ? await source.depth() : undefined;
      if (depth !== undefined) progress.depth = depth;
      if (depth === 0 && pipeline.heldCount === 0) {
        idleSince ??= Date.now();
        if (Date.now() - idleSince >= control.idleTimeoutMs) outcome = 'drained';
      } else {
        idleSince = undefined;
      }
    }
  }

  const unfinished = await bridge.stop(outcome === 'failed' ? 0 : settings.shutdownTimeoutMs);
  if (unfinished > 0) {
    control.log.warn(
      { queue: settings.sourceQueue, unfinished },
      'stopped with messages unconfirmed; they stay in the source',
    );
  }
  await source.closeConsumer();
  const remaining = await settledDepth(bridge);
  progress.depth = remaining;
  control.watch?.remove(bridge);
  await bridge.close().catch(() => {});
  let deleted = false;
  if (outcome === 'drained' && control.deleteSourceWhenEmpty) {
    deleted = await deleteIfEmpty(settings, control.log);
  }
  progress.done = true;
  const report = buildQueueReport({
    outcome,
    settings,
    counters: pipeline.counters,
    remaining,
    deleted,
    elapsedMs: Date.now() - started,
    activeMs: pipeline.counters.consumed > 0 ? pipeline.lastProgress - started : Date.now() - started,
  });
  return { report, problem, failureCode: outcome === 'failed' ? (failure?.exitCode ?? 1) : undefined };
}

/**
 * The source depth once the broker has put back what we returned: it requeues a closed channel's
 * deliveries in the background, so read until two reads agree.
 */
async function settledDepth(bridge: Bridge): Promise<number | undefined> {
  let last = await bridge.source.depth();
  for (let i = 0; i < 20; i++) {
    await sleep(100);
    const now = await bridge.source.depth();
    if (now === last) return now;
    last = now;
  }
  return last;
}

/**
 * Deletes the drained source queue, only if it is still empty (`if-empty`: RabbitMQ refuses with
 * PRECONDITION_FAILED when a producer added a message meanwhile). Returns whether it was deleted.
 */
async function deleteIfEmpty(settings: BridgeSettings, log: Logger): Promise<boolean> {
  const connection = await connectAmqp(settings.sourceUrl, {
    side: 'source',
    retryForMs: settings.retryForMs || 30_000,
    log,
    tls: settings.tls.source,
  });
  try {
    const channel = await connection.createChannel();
    channel.on('error', () => {});
    // if-unused too: another consumer's unacked messages are not counted as "not empty".
    await channel.deleteQueue(settings.sourceQueue, { ifEmpty: true, ifUnused: true });
    log.info({ queue: settings.sourceQueue }, 'source queue drained and deleted');
    return true;
  } catch (error) {
    const reason =
      replyCodeOf(error) === 406
        ? 'it is no longer empty, or another consumer uses it'
        : String((error as Error).message);
    log.warn({ queue: settings.sourceQueue, reason }, 'source queue not deleted');
    return false;
  } finally {
    await connection.close().catch(() => {});
  }
}
