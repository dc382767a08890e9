/**
 * Coalesces calls that take a list of keys: one call is out at a time, and the lists submitted
 * meanwhile go together in the next (up to `maxKeys` keys, and at least one list), so a busy
 * caller makes one call for several. Each submitter gets the answers for its own keys.
 */
export class Coalescer<R> {
  private readonly waiting: {
    keys: readonly string[];
    resolve: (results: R[]) => void;
    reject: (error: unknown) => void;
  }[] = [];
  private busy = false;

  constructor(
    private readonly maxKeys: number,
    private readonly call: (keys: string[]) => Promise<R[]>,
  ) {}

  submit(keys: readonly string[]): Promise<R[]> {
    return new Promise((resolve, reject) => {
      this.waiting.push({ keys, resolve, reject });
      if (!this.busy) void this.drain();
    });
  }

  private async drain(): Promise<void> {
    this.busy = true;
    try {
      while (this.waiting.length > 0) {
        let count = 1;
        let size = this.waiting[0]?.keys.length ?? 0;
        for (const next of this.waiting.slice(1)) {
          if (size + next.keys.length > this.maxKeys) break;
          size += next.keys.length;
          count++;
        }
        const group = this.waiting.splice(0, count);
        try {
          const results = await this.call(group.flatMap((item) => item.keys));
          let at = 0;
          for (const item of group) {
            item.resolve(results.slice(at, at + item.keys.length));
            at += item.keys.length;
          }
        } catch (error) {
          for (const item of group) item.reject(error);
        }
      }
    } finally {
      this.busy = false;
    }
  }
}
