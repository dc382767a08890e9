import cliProgress from 'cli-progress';
import type { Logger } from '../observe/log.js';
import type { QueueProgress } from './job.js';

export interface ProgressOptions {
  /** A live bar per queue on a terminal; otherwise one log line per interval. */
  terminal: boolean;
  quiet: boolean;
  intervalMs: number;
  log: Logger;
}

function handled(item: QueueProgress): number {
  const c = item.counters;
  return c.forwarded + c.duplicates + c.parked + c.deadLettered;
}

function rateOf(item: QueueProgress): number {
  const seconds = Math.max(1, Date.now() - item.startedAt) / 1000;
  return Math.round(handled(item) / seconds);
}

/** Time left at the current rate, from the source depth: "42s", "3m", or "?" before any rate. */
function etaOf(item: QueueProgress): string {
  if (item.done || item.depth === 0) return '0s';
  const rate = rateOf(item);
  if (!rate || item.depth === undefined) return '?';
  const seconds = Math.ceil(item.depth / rate);
  return seconds < 120 ? `${seconds}s` : `${Math.ceil(seconds / 60)}m`;
}

/** Shows the job's progress until stopped: bars on a terminal, log lines off it, nothing if quiet. */
export function showProgress(items: QueueProgress[], options: ProgressOptions): { stop(): void } {
  if (options.quiet) return { stop: () => {} };
  if (!options.terminal) {
    const timer = setInterval(() => {
      for (const item of items) {
        if (item.done || item.startedAt === 0) continue;
        const c = item.counters;
        options.log.info(
          {
            queue: item.sourceQueue,
            forwarded: c.forwarded,
            duplicates: c.duplicates,
            inDoubt: c.inDoubt,
            remaining: item.depth,
            ratePerSecond: rateOf(item),
          },
          'progress',
        );
      }
    }, options.intervalMs);
    return { stop: () => clearInterval(timer) };
  }
  const bars = new cliProgress.MultiBar(
    {
      format: ' {queue} |{bar}| {value}/{total} moved · {dups} dups · {rate} msg/s · ETA {etaText}',
      hideCursor: true,
      clearOnComplete: false,
      stream: process.stderr,
    },
    cliProgress.Presets.shades_classic,
  );
  const width = Math.max(...items.map((item) => item.sourceQueue.length));
  const bar = new Map(
    items.map((item) => [
      item,
      bars.create(1, 0, { queue: item.sourceQueue.padEnd(width), dups: 0, rate: 0, etaText: '?' }),
    ]),
  );
  const refresh = () => {
    for (const item of items) {
      const done = handled(item);
      // The total is what we moved plus what the source still holds (it may grow while we run).
      bar.get(item)?.setTotal(Math.max(1, done + (item.depth ?? 0)));
      const payload = { dups: item.counters.duplicates, rate: rateOf(item), etaText: etaOf(item) };
      bar.get(item)?.update(done, payload);
    }
  };
  const timer = setInterval(refresh, 200);
  return {
    stop: () => {
      clearInterval(timer);
      refresh();
      bars.stop();
    },
  };
}
