import { connectAmqp } from '../amqp/connect.js';
import { replyCodeOf } from '../amqp/errors.js';
import { sleep } from '../backoff.js';
import { type Bridge, outageLine, startBridge } from '../bridge/bridge.js';
import type { RouteCounters } from '../bridge/counters.js';
import type { MessageBudget } from '../bridge/limits.js';
import type { BridgeSettings } from '../config/settings.js';
import type { BridgeError } from '../errors.js';
import type { Logger } from '../log.js';
import type { RouteWatch } from '../observe/server.js';
import {
  type ActiveSpan,
  buildQueueReport,
  handledOf,
  type QueueOutcome,
  type QueueReport,
} from './report.js';

const POLL_MS = 100;
/** While messages are in flight, the source depth (for progress and the ETA) is read this often. */
const DEPTH_EVERY_MS = 1000;

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
  /** A stop signal: a queue still waiting for a server gives up at once. */
  stop?: AbortSignal;
}

/** What progress displays (and a report of a job cut short) read while a queue migrates. */
export interface QueueProgress {
  sourceQueue: string;
  counters: RouteCounters;
  /** Ready messages last seen in the source queue: read every second while messages are in flight. */
  depth: number | undefined;
  /** Messages taken from the source and not yet acked or given back. */
  inFlight: number;
  /**
   * Handled, in flight and ready in the source at the last depth read: the queue's whole, for the
   * bar's total and what is left (it grows only when producers add messages).
   */
  total: number | undefined;
  startedAt: number;
  /** When its bridge began consuming (0 before): its active time starts here. */
  activeFrom: number;
  /** When it last handled a message (forwarded, duplicate, parked, dead-lettered); 0 before. */
  lastHandledAt: number;
  done: boolean;
}

/** When the queue was moving messages, or undefined while it has handled none. */
export function activeSpanOf(item: QueueProgress, now = Date.now()): ActiveSpan | undefined {
  if (item.activeFrom === 0 || handledOf(item.counters) === 0) return undefined;
  // While it runs, the span reaches the last message handled; never before it began.
  return { from: item.activeFrom, to: Math.min(now, Math.max(item.activeFrom, item.lastHandledAt)) };
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
    stop: control.stop,
    toEnd: true,
  });
  const { pipeline, source } = bridge;
  control.watch?.add(bridge);
  progress.counters = pipeline.counters;
  progress.activeFrom = Date.now();
  let failure: BridgeError | undefined;
  void bridge.failure.then((error) => {
    failure = error;
  });

  let outcome: QueueOutcome | undefined;
  let problem: string | undefined;
  let idleSince: number | undefined;
  let depthReadAt = 0;
  const follow = () => {
    progress.inFlight = pipeline.heldCount;
    if (handledOf(pipeline.counters) > 0) progress.lastHandledAt = pipeline.lastProgress;
  };
  const readDepth = async () => {
    const depth = await source.depth();
    depthReadAt = Date.now();
    if (depth === undefined) return undefined;
    progress.depth = depth;
    progress.total = handledOf(pipeline.counters) + pipeline.heldCount + depth;
    return depth;
  };
  // What is left, known from the first progress line on (see showProgress).
  await readDepth();
  while (outcome === undefined) {
    await sleep(POLL_MS);
    follow();
    const outage = bridge.outage();
    if (failure) {
      outcome = 'failed';
      problem = failure.message;
    } else if (outage && settings.retryForMs > 0 && outage.ms >= settings.retryForMs) {
      outcome = 'failed';
      problem = `${outageLine(outage)}: run again when it is back`;
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
        (settings.sourceStream === undefined
          ? `they stay in the source queue: ${stallAdvice(pipeline.targetSizeLimit, pipeline.counters.unroutable, pipeline.counters.nacked)}`
          : `the route's position keeps them as holes, and the next run reads them again: ${streamStallAdvice(pipeline.targetSizeLimit, pipeline.counters.unroutable, pipeline.lastUnforwardable)}`);
    } else if (pipeline.heldCount === 0) {
      // Drained: the source is empty, nothing is in flight, and both stay so for the idle timeout.
      const depth = await readDepth();
      if (depth === 0 && pipeline.heldCount === 0) {
        idleSince ??= Date.now();
        if (Date.now() - idleSince >= control.idleTimeoutMs) outcome = 'drained';
      } else {
        idleSince = undefined;
      }
    } else {
      idleSince = undefined;
      // In flight: the depth only for progress and the ETA, on a timer (it cannot mean drained).
      if (Date.now() - depthReadAt >= DEPTH_EVERY_MS) await readDepth();
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
  follow();
  const remaining = await settledDepth(bridge);
  progress.depth = remaining;
  if (remaining !== undefined) progress.total = handledOf(pipeline.counters) + remaining;
  control.watch?.remove(bridge);
  await bridge.close().catch(() => {});
  let deleted = false;
  // A stream is read, not emptied: it is never deleted.
  if (outcome === 'drained' && control.deleteSourceWhenEmpty && settings.sourceStream === undefined) {
    const deletion = await deleteIfEmpty(settings, control.log);
    deleted = deletion.deleted;
    if (deletion.kept !== undefined)
      problem = `${settings.sourceQueue}: drained, but not deleted: ${deletion.kept}`;
  }
  progress.done = true;
  const report = buildQueueReport({
    outcome,
    settings,
    counters: pipeline.counters,
    remaining,
    deleted,
    problem,
    elapsedMs: Date.now() - started,
    active: activeSpanOf(progress),
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
 * One queue.delete on a connection of its own; the AMQP reply code it was refused with, if any. A
 * refusal the broker sends as a connection error (540 NOT_IMPLEMENTED) is read from the connection.
 */
async function deleteOnce(
  settings: BridgeSettings,
  log: Logger,
  options: { ifEmpty: boolean; ifUnused?: boolean },
): Promise<{ code: number | undefined; error: unknown } | undefined> {
  const connection = await connectAmqp(settings.sourceUrl, {
    side: 'source',
    retryForMs: settings.retryForMs || 30_000,
    log,
    tls: settings.tls.source,
  });
  // A connection error's reason: amqplib rejects the pending call with "Channel ended" only.
  let closedWith: unknown;
  connection.on('error', (error: unknown) => {
    closedWith = error;
  });
  try {
    const channel = await connection.createChannel();
    channel.on('error', () => {});
    await channel.deleteQueue(settings.sourceQueue, options);
    return undefined;
  } catch (error) {
    return { code: replyCodeOf(error) ?? replyCodeOf(closedWith), error };
  } finally {
    await connection.close().catch(() => {});
  }
}

/** Ready messages and consumers of the source queue (a passive declare). */
async function sourceQueueState(
  settings: BridgeSettings,
  log: Logger,
): Promise<{ messageCount: number; consumerCount: number }> {
  const connection = await connectAmqp(settings.sourceUrl, {
    side: 'source',
    retryForMs: settings.retryForMs || 30_000,
    log,
    tls: settings.tls.source,
  });
  try {
    const channel = await connection.createChannel();
    channel.on('error', () => {});
    return await channel.checkQueue(settings.sourceQueue);
  } finally {
    await connection.close().catch(() => {});
  }
}

const NOT_IMPLEMENTED = 540;

/**
 * Deletes the drained source queue, only if it is still empty (`if-empty`: RabbitMQ refuses with
 * PRECONDITION_FAILED when a producer added a message meanwhile) and unused (`if-unused`: another
 * consumer's unacked messages are not counted as "not empty"). RabbitMQ does not do `if-unused` on
 * a quorum queue (it closes the connection with NOT_IMPLEMENTED): there, with no other consumer
 * attached and nothing ready, `if-empty` alone; where the broker does neither on a quorum queue (3.x),
 * the queue is kept, since deleting it unconditionally could drop a message published meanwhile.
 * Returns whether it was deleted and, if not, why, in words.
 */
async function deleteIfEmpty(
  settings: BridgeSettings,
  log: Logger,
): Promise<{ deleted: boolean; kept: string | undefined }> {
  const queue = settings.sourceQueue;
  const kept = (reason: string) => {
    log.warn({ queue, reason }, 'source queue not deleted');
    return { deleted: false, kept: reason };
  };
  const deleted = () => {
    log.info({ queue }, 'source queue drained and deleted');
    return { deleted: true, kept: undefined };
  };
  try {
    const first = await deleteOnce(settings, log, { ifEmpty: true, ifUnused: true });
    if (first === undefined) return deleted();
    if (first.code === 406)
      return kept('it is no longer empty, or another consumer uses it; the next run moves what is left');
    if (first.code !== NOT_IMPLEMENTED) return kept(describeError(first.error));
    // A quorum queue: no if-unused. Look first: another consumer could hold messages unacked.
    const state = await sourceQueueState(settings, log);
    if (state.consumerCount > 0) {
      return kept(
        `it is a quorum queue with ${state.consumerCount} other consumer(s) attached, which may hold messages unacked; stop them and run again`,
      );
    }
    if (state.messageCount > 0) return kept('it is no longer empty; the next run moves what is left');
    const second = await deleteOnce(settings, log, { ifEmpty: true });
    if (second === undefined) return deleted();
    if (second.code === 406) return kept('it is no longer empty; the next run moves what is left');
    if (second.code !== NOT_IMPLEMENTED) return kept(describeError(second.error));
    return kept(
      'it is a quorum queue, and this RabbitMQ deletes quorum queues neither if-empty nor if-unused, so it cannot be deleted only while empty; it is drained: delete it yourself once no producer publishes to it',
    );
  } catch (error) {
    return kept(describeError(error));
  }
}

function describeError(error: unknown): string {
  return error instanceof Error ? (error.message.split('\n')[0] ?? String(error)) : String(error);
}

/** What to do about messages that stay in the source queue: a size limit is the target's to raise. */
function stallAdvice(sizeLimit: number | undefined, unroutable: number, nacked = 0): string {
  const setAside = 'or use --park-queue or --on-unforwardable dead-letter';
  if (sizeLimit === undefined && unroutable === 0 && nacked > 0) {
    return `the target refuses them (a queue at its length limit with overflow reject-publish, say): make room on the target, ${setAside}`;
  }
  if (sizeLimit === undefined) return `fix the target binding, ${setAside}`;
  const binding = unroutable > 0 ? ' (and fix the target binding for the unroutable ones)' : '';
  return `the target refuses messages larger than its max_message_size (${sizeLimit} bytes): raise that limit on the target${binding}, ${setAside} to set them aside`;
}

/** The same for a stream source, which keeps its messages and has nowhere to set one aside. */
function streamStallAdvice(
  sizeLimit: number | undefined,
  unroutable: number,
  unforwardable?: string,
): string {
  const advice: string[] = [];
  if (sizeLimit !== undefined)
    advice.push(
      `the target refuses messages larger than its max_message_size (${sizeLimit} bytes): raise that limit`,
    );
  else if (unroutable > 0) advice.push('fix the target binding');
  // An entry the target can never take as it is stored: its reason says what would.
  if (unforwardable !== undefined)
    advice.push(`the last one that has no form the target takes: ${unforwardable}`);
  if (advice.length === 0)
    advice.push('make the target take them (room on a queue at its length limit, say)');
  return advice.join('; ');
}
