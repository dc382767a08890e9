import { backoffDelay } from '../backoff.js';
import { BoundedMap } from '../bounded-map.js';
import type { UnforwardablePolicy } from '../config/settings.js';
import type { Source } from '../ports.js';
import type { RouteCounters } from './counters.js';
import type { Entry, Failure } from './entry.js';
import { namedOf, type PerMessageLog } from './per-message.js';

// Remembered retry counts of failing IDs, for their backoff; bounded, oldest forgotten first.
const MAX_RETRY_MEMORY = 10_000;

export interface RefusalSettings {
  policy: UnforwardablePolicy;
  parkQueue: string | undefined;
  /** Backoff before the bridge retries a message it could not forward (it holds it meanwhile). */
  retryDelay: { initialMs: number; maxMs: number };
}

/** What the policy needs of the pipeline that holds the message. */
export interface RefusalHost {
  /** Ends the hold on a message with `respond` (an ack, a nack …). */
  settle(entry: Entry, respond: () => boolean): void;
  /** A message left the route for good (parked, dead-lettered): the route moves. */
  progress(): void;
  /** Runs `then` after `ms`, or `onStop` at once if the route stops first. */
  later(ms: number, entries: Entry[], then: (entry: Entry) => void, onStop: (entry: Entry) => void): void;
  /** Gives a held message back to the source (at a stop). */
  giveBack(entry: Entry): void;
  /** Sends a held message through claim → publish again. */
  forward(entry: Entry): void;
}

/**
 * What happens to a message the bridge cannot forward: refused by the target (unroutable,
 * rejected, too large, unpublishable), without an ID, unreadable, or looped back. It is parked,
 * dead-lettered, or held and retried after a backoff, as --on-unforwardable says.
 */
export class Refusals {
  /**
   * Messages held to be retried after a backoff: from their first failure until they are
   * forwarded or given back.
   */
  readonly retrying = new Set<Entry>();
  /** Failures in a row since the route last moved a message (the stall check reads it). */
  sinceProgress = 0;
  /** Why the last unreadable or unpublishable message could not be forwarded (migrate names it). */
  lastUnforwardable: string | undefined;
  private readonly attempts = new BoundedMap<string, number>(MAX_RETRY_MEMORY);

  constructor(
    private readonly settings: RefusalSettings,
    private readonly source: Source,
    private readonly counters: RouteCounters,
    private readonly perMessage: PerMessageLog,
    private readonly host: RefusalHost,
  ) {}

  /** The ID was forwarded: its next failure, if any, starts the backoff anew. */
  forwarded(key: string): void {
    this.attempts.delete(key);
  }

  async refuse(entry: Entry, why: Failure, detail?: string): Promise<void> {
    if (why === 'unroutable') this.counters.unroutable++;
    if (why === 'nacked') this.counters.nacked++;
    if (why === 'unreadable' || why === 'unpublishable') {
      this.counters.unforwardable++;
      this.lastUnforwardable = detail;
    }
    const named = namedOf(entry.message, entry.idText);
    if (detail !== undefined) {
      this.perMessage.warn({ ...named, reason: why, detail }, `message refused: ${detail}`, `refused ${why}`);
    }
    this.sinceProgress++;
    const { policy, parkQueue } = this.settings;
    const reason = detail === undefined ? why : `${why}: ${detail}`;
    if (policy === 'park' && parkQueue !== undefined) {
      if (await this.source.park(entry.message, reason)) {
        this.counters.parked++;
        this.host.progress();
        this.perMessage.warn({ ...named, reason: why, parkQueue }, 'message parked');
        this.host.settle(entry, () => this.source.ack(entry.message));
        return;
      }
      this.perMessage.warn({ ...named, parkQueue }, 'parking failed; the message goes back to the source');
    } else if (policy === 'dead-letter') {
      this.counters.deadLettered++;
      this.host.progress();
      this.perMessage.warn(
        { ...named, reason: why },
        "message rejected to the source queue's dead-letter exchange (RabbitMQ drops it if the queue has none)",
      );
      this.host.settle(entry, () => this.source.deadLetter(entry.message));
      return;
    }
    const retryKey = entry.key ?? '';
    const attempt = (this.attempts.get(retryKey) ?? 0) + 1;
    this.attempts.set(retryKey, attempt);
    const { initialMs, maxMs } = this.settings.retryDelay;
    const delay = backoffDelay(attempt, initialMs, maxMs);
    // Held, not returned to the source: RabbitMQ puts a returned message back at the head of the
    // queue and delivers it again at once, so a return buys no time, and a quorum queue counts it
    // toward its delivery limit, past which the broker drops the message. A message with an ID goes
    // through claim → publish again after the backoff (it stays the leading copy of its ID; its
    // claim was released); one without (no ID, unreadable, a loop) can never be forwarded and stays
    // held until the route stops, when it is given back once, like every message held then.
    const again = entry.key !== undefined;
    this.perMessage.warn(
      { ...named, reason: why, attempt, delayMs: delay },
      again
        ? 'message not forwarded; the bridge holds it unacked and retries it after a backoff'
        : 'message not forwarded; the bridge holds it unacked until the route stops, then gives it back to the source queue',
    );
    this.retrying.add(entry);
    const retry = (held: Entry) => {
      if (!this.source.holds(held.message)) {
        // Its channel is gone: the broker put it back in the queue, and delivers it again.
        this.host.settle(held, () => false);
      } else if (held.key === undefined) {
        this.host.later(maxMs, [held], retry, (gone) => this.host.giveBack(gone));
      } else {
        this.counters.retried++;
        this.host.forward(held);
      }
    };
    this.host.later(delay, [entry], retry, (held) => this.host.giveBack(held));
  }
}
