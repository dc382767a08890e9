import { describe } from '../errors.js';
import type { Logger } from '../log.js';
import type { Claims, Target } from '../ports.js';
import type { RouteCounters } from './counters.js';
import type { Entry } from './entry.js';

// A message is written to the target only while at least this share of its lease is left, so
// that a process that stalled (paused, starved of CPU, cut off from Redis) after its claim does
// not publish under a lease another owner may already have taken over.
const LEASE_WRITE_SHARE = 1 / 3;
// A publish that is out and unconfirmed when its lease is down to this share (Redis renewed
// nothing meanwhile) makes the bridge reset the target connection: what has not left this host is
// then never sent, so it cannot land after another owner's copy as an unflagged second copy.
const LEASE_RESET_SHARE = 1 / 5;

/**
 * The leases of the claims a route holds: granted at claim, renewed every third of the lease,
 * timed on this process's monotonic clock from when the claim (or renewal) was asked for, and
 * fenced: a message whose lease is not known to hold is not written (see Publish.writeBy), and
 * publishes still unconfirmed when theirs runs low reset the target connection.
 */
export class Leases {
  /** Entries holding a claim that is not yet committed or released. */
  private readonly held = new Set<Entry>();
  private renewTimer: NodeJS.Timeout | undefined;
  private fenceTimer: NodeJS.Timeout | undefined;
  private renewing = false;

  constructor(
    private readonly leaseMs: number,
    private readonly cache: Claims,
    private readonly target: Target,
    private readonly counters: RouteCounters,
    private readonly log: Logger,
  ) {
    // The target's own fence at the write (a stall between a publish and its write) counts too.
    target.onStaleWrites = () => this.counters.fenceResets++;
  }

  start(): void {
    const renewEvery = Math.max(100, Math.floor(this.leaseMs / 3));
    this.renewTimer = setInterval(() => this.renew(), renewEvery);
    const fenceEvery = Math.max(50, Math.floor(this.leaseMs / 10));
    this.fenceTimer = setInterval(() => this.fence(), fenceEvery);
  }

  stop(): void {
    if (this.renewTimer) clearInterval(this.renewTimer);
    if (this.fenceTimer) clearInterval(this.fenceTimer);
  }

  /** The claim of `entry`, asked for at `askedAt` (performance.now()), is ours. */
  grant(entry: Entry, askedAt: number): void {
    entry.claimedAt = askedAt;
    this.extend(entry, askedAt);
    this.held.add(entry);
  }

  /** Its claim is committed, released, or no longer ours: not renewed any more. */
  drop(entry: Entry): void {
    this.held.delete(entry);
  }

  /**
   * Renews these entries' leases at once, for a target about to fence them after a wait; those
   * renewed may be written until a third of the lease before its new end, the others stay fenced.
   */
  async renewNow(entries: readonly Entry[]): Promise<void> {
    const mine = entries.filter((entry) => this.held.has(entry));
    if (mine.length === 0) return;
    const askedAt = performance.now();
    const renewed = await this.cache.renewEach(mine.map((entry) => entry.key as string));
    mine.forEach((entry, index) => {
      // Settled or claimed anew meanwhile: not this renewal's answer.
      if (renewed[index] && this.held.has(entry) && entry.claimedAt <= askedAt) this.extend(entry, askedAt);
    });
  }

  private extend(entry: Entry, askedAt: number): void {
    entry.leaseUntil = Math.max(entry.leaseUntil, askedAt + this.leaseMs);
    entry.writeBy = entry.leaseUntil - this.leaseMs * LEASE_WRITE_SHARE;
  }

  private renew(): void {
    // While Redis is away a renewal waits; do not queue another behind it.
    if (this.held.size === 0 || this.renewing) return;
    const entries = [...this.held];
    const keys = entries.map((entry) => entry.key as string);
    this.renewing = true;
    const askedAt = performance.now();
    this.cache
      .renewEach(keys)
      .then((renewed) => {
        let lost = 0;
        let lostOut = 0;
        entries.forEach((entry, index) => {
          // Settled meanwhile, or claimed anew after this renewal was asked for: not its answer.
          if (!this.held.has(entry) || entry.claimedAt > askedAt) return;
          // Its commit (on its way) deletes the claim: "no longer ours" may only mean committed.
          if (!renewed[index] && entry.committing) return;
          if (renewed[index]) {
            this.extend(entry, askedAt);
            return;
          }
          // No longer ours (taken over after ours ran out, or released): never written again
          // without a new claim. A publish already out may land beside the new owner's copy.
          lost++;
          if (entry.outstanding && entry.written) lostOut++;
          entry.leaseUntil = 0;
          entry.writeBy = 0;
          // Not renewed again (each round would find it lost anew): a new claim adds it back.
          this.held.delete(entry);
        });
        if (lost === 0) return;
        this.counters.leaseLost += lost;
        this.log.warn(
          { lost, unconfirmed: lostOut },
          'leases no longer ours (they ran out and another owner took the IDs over): not published again without a new claim',
        );
        if (lostOut > 0) this.resetTarget(`${lostOut} unconfirmed publish(es) lost their lease`);
      })
      .catch((error: unknown) => {
        this.log.warn({ error: describe(error) }, 'lease renewal failed; will retry');
      })
      .finally(() => {
        this.renewing = false;
      });
  }

  /**
   * Resets the target connection when a publish that is out and unconfirmed is about to outlive
   * its lease (Redis renewed nothing for most of it): bytes still queued on this host are then
   * dropped, not delivered after another owner took the ID over and sent its flagged copy.
   */
  private fence(): void {
    const resetAt = performance.now() + this.leaseMs * LEASE_RESET_SHARE;
    let expiring = 0;
    for (const entry of this.held) {
      // Written, not just waiting for the connection or a trial ahead of it: only those bytes can
      // sit in a buffer and land late.
      if (entry.outstanding && entry.written && entry.leaseUntil < resetAt) expiring++;
    }
    if (expiring > 0) {
      this.resetTarget(
        `the leases of ${expiring} unconfirmed publish(es) run out and Redis has not renewed them`,
      );
    }
  }

  private resetTarget(reason: string): void {
    this.counters.fenceResets++;
    this.target.reset(reason);
  }
}
