import { sleep } from '../backoff.js';

/**
 * How many source messages a job may still take (migrate --max-messages); shared by its routes.
 * A consumer reserves the deliveries the broker may still send it (its window, and one per message
 * it settles while it consumes), so that no route is sent more than the budget: each delivery past
 * it would be returned, and a quorum queue counts a return toward its delivery limit.
 */
export class MessageBudget {
  private taken = 0;
  private reserved = 0;
  private waiters: (() => void)[] = [];
  constructor(private readonly max: number | undefined) {}

  /** Takes one message from the budget; false once it is spent. */
  tryTake(): boolean {
    if (this.max !== undefined && this.taken >= this.max) return false;
    this.taken++;
    return true;
  }

  /** Messages still to take (Infinity without a limit). */
  get remaining(): number {
    return this.max === undefined ? Number.POSITIVE_INFINITY : Math.max(0, this.max - this.taken);
  }

  get exhausted(): boolean {
    return this.max !== undefined && this.taken >= this.max;
  }

  /** Whether there is a limit to reserve against. */
  get limited(): boolean {
    return this.max !== undefined;
  }

  /** Neither taken nor reserved by a consumer. */
  get available(): number {
    return Math.max(0, this.remaining - this.reserved);
  }

  /** Reserves up to n deliveries; returns how many it could. */
  reserve(n: number): number {
    const granted = Math.max(0, Math.min(n, this.available));
    this.reserved += granted;
    return granted;
  }

  /** A reserved delivery came: the taking (tryTake) follows at once. */
  delivered(): void {
    this.reserved = Math.max(0, this.reserved - 1);
  }

  /** A consumer ended with `n` deliveries reserved and not made: others may have them. */
  release(n: number): void {
    this.reserved = Math.max(0, this.reserved - n);
    if (n <= 0) return;
    for (const wake of this.waiters.splice(0)) wake();
  }

  /** Calls `wake` once at the next release. */
  whenReleased(wake: () => void): void {
    this.waiters.push(wake);
  }
}

/**
 * A token bucket for migrate --max-rate: forwarding waits for tokens, so the job's publish rate
 * stays at or under `ratePerSecond`, with bursts of at most a tenth of a second's worth.
 */
export class TokenBucket {
  private tokens: number;
  private readonly capacity: number;
  private refilledAt = Date.now();
  private queue: Promise<void> = Promise.resolve();

  constructor(private readonly ratePerSecond: number) {
    this.capacity = Math.max(1, Math.floor(ratePerSecond / 10));
    this.tokens = this.capacity;
  }

  /** Resolves once `count` tokens were taken; callers are served in order. */
  take(count: number): Promise<void> {
    const turn = this.queue.then(() => this.takeNow(count));
    this.queue = turn;
    return turn;
  }

  private async takeNow(count: number): Promise<void> {
    let needed = count;
    while (needed > 0) {
      const now = Date.now();
      // Never more than the burst: tokens saved up while idle (or connecting) are not a second's worth.
      this.tokens = Math.min(
        this.capacity,
        this.tokens + ((now - this.refilledAt) / 1000) * this.ratePerSecond,
      );
      this.refilledAt = now;
      const grant = Math.min(needed, Math.floor(this.tokens));
      this.tokens -= grant;
      needed -= grant;
      // Until the bucket holds what is needed, or is full (it holds no more than a burst).
      if (needed > 0)
        await sleep(Math.max(5, Math.ceil((Math.min(needed, this.capacity) / this.ratePerSecond) * 1000)));
    }
  }
}
