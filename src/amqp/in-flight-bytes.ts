// The byte bound on what the source consumer holds: the consumer keeps it, the bridge sizes it.

/** The most returned body sizes remembered (see InFlightBytes.returnedSizes). */
const MAX_RETURNED_KEPT = 10_000;

/**
 * The bytes of source message bodies the bridge holds (delivered, not yet acked or returned), for
 * --max-in-flight-bytes. RabbitMQ ignores a prefetch size, so the bridge keeps the bound itself: a
 * delivery that would take the held bytes past the bound is returned unread (unless nothing else
 * is held: a body at least as big as the bound passes alone), and the source consumer pauses and
 * comes back with a window of as many messages as fit.
 */
export class InFlightBytes {
  /** Bytes of the bodies held now. */
  held = 0;
  /** Messages held now. */
  count = 0;
  /** The most bytes the process held at once, counting a body that arrived and was returned. */
  peak = 0;
  /** Deliveries returned to the source unread because they did not fit. */
  returned = 0;
  /** The largest body seen since nothing was last held, and the one before that moment. */
  private largest = 0;
  private largestBefore = 0;
  /**
   * The sizes of the bodies returned and not delivered again yet. The broker puts a returned
   * message back at the head of the queue, and it cannot be returned twice (see admit), so the
   * next window must fit them: one sized for the small bodies seen since would take them all at
   * once, past the bound.
   */
  private returnedSizes: number[] = [];
  /** The next delivery is a new consumer's first (see consumerStarted). */
  private firstOfConsumer = false;
  /**
   * Set when nothing can be returned to the source queue (a queue that counts deliveries, see
   * SourceQueue.deliver): what the broker sends is taken, so the window is all that bounds the
   * bytes past the bound. Then it is sized for the largest body the route has seen, not only the
   * largest since nothing was last held, and opens twofold per new consumer, from one (the
   * source consumer starts a new one each time the last one's window was delivered).
   */
  takesAll = false;
  /** The window of the live consumer (for takesAll's growth). */
  private lastWindow = 0;

  constructor(readonly bound: number) {}

  /**
   * Whether a delivery of `size` bytes may be taken: it fits, or nothing else is held, or it may
   * not be returned (`returnable` false: it was returned before, see SourceQueue.deliver).
   */
  admit(size: number, returnable = true): boolean {
    this.peak = Math.max(this.peak, this.held + size);
    // An empty body counts as one byte here, so that it too tells that bodies were seen.
    this.largest = Math.max(this.largest, size, 1);
    if (this.firstOfConsumer) {
      this.firstOfConsumer = false;
      // A new consumer's first delivery is not one we returned: none of those is left at the head
      // of the queue (another consumer took them).
      if (returnable) this.returnedSizes = [];
    }
    if (!returnable) {
      const at = this.returnedSizes.indexOf(size);
      if (at >= 0) this.returnedSizes.splice(at, 1);
    }
    if (returnable && this.count > 0 && this.held + size > this.bound) {
      this.returned++;
      if (this.returnedSizes.length < MAX_RETURNED_KEPT) this.returnedSizes.push(size);
      return false;
    }
    this.held += size;
    this.count++;
    return true;
  }

  release(size: number): void {
    this.held -= size;
    this.count--;
    if (this.count === 0) {
      this.largestBefore = this.takesAll ? Math.max(this.largest, this.largestBefore) : this.largest;
      this.largest = 0;
    }
  }

  get full(): boolean {
    return this.held >= this.bound;
  }

  /** The body size the next deliveries are expected to have (0: none seen yet). */
  private get typical(): number {
    return this.count === 0 || this.takesAll ? Math.max(this.largest, this.largestBefore) : this.largest;
  }

  /**
   * The prefetch for a new consumer: as many bodies of the typical size as fit in what is free
   * of the bound, at least 1 and at most `prefetch` less what is held. Before any body was seen
   * it is 1, not sized: the broker may send a whole window before the bridge can react, and the
   * first body tells the size to open it to.
   */
  windowFor(prefetch: number): { window: number; sized: boolean } {
    const most = Math.max(1, prefetch - this.count);
    if (this.bound === Number.POSITIVE_INFINITY) return { window: most, sized: true };
    if (this.returnedSizes.length > 0) {
      // The returned bodies come first, in the order they were returned: as many as fit.
      let free = this.bound - this.held;
      let fit = 0;
      for (const size of this.returnedSizes) {
        if (size > free) break;
        free -= size;
        fit++;
      }
      return { window: Math.min(most, Math.max(1, fit)), sized: true };
    }
    const typical = this.typical;
    if (typical === 0) return { window: 1, sized: false };
    const fit = Math.floor((this.bound - this.held) / typical);
    const window = Math.min(most, Math.max(1, fit));
    // What the broker sends is taken (takesAll): a window opens twofold at a time, from one.
    return {
      window: this.takesAll ? Math.min(window, Math.max(1, 2 * this.lastWindow)) : window,
      sized: true,
    };
  }

  /** A consumer starts with the window windowFor gave (see admit). */
  consumerStarted(window = 0): void {
    this.firstOfConsumer = true;
    this.lastWindow = window;
  }

  /** Whether a body was seen since the last drain or before it (a window can be sized). */
  get sizeKnown(): boolean {
    return this.typical > 0;
  }

  /** A paused consumer may come back: nothing held, or half the bound free and room for a typical body. */
  get mayResume(): boolean {
    return this.count === 0 || (this.held <= this.bound / 2 && this.held + this.typical <= this.bound);
  }
}
