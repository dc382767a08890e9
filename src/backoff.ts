/** Exponential backoff with ±20% jitter, capped; attempt starts at 1. */
export function backoffDelay(attempt: number, initialMs = 100, maxMs = 5000): number {
  const base = Math.min(maxMs, initialMs * 2 ** Math.max(0, attempt - 1));
  const jitter = base * 0.2 * (Math.random() * 2 - 1);
  return Math.max(0, Math.round(Math.min(maxMs, base + jitter)));
}

export function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    timer.unref?.();
  });
}

/** Sleeps `ms`, or less when `stop` is aborted first. */
export function sleepUnlessStopped(ms: number, stop: AbortSignal | undefined): Promise<void> {
  if (!stop) return sleep(ms);
  if (stop.aborted) return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      stop.removeEventListener('abort', done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    timer.unref?.();
    stop.addEventListener('abort', done);
  });
}
