import { sleep } from '../backoff.js';

/** How many source messages a job may still take (migrate --max-messages); shared by its routes. */
export class MessageBudget {
  private taken = 0;
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
