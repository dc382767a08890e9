import { createRequire } from 'node:module';
import type { Logger } from '../log.js';
import { activeSpanOf, type QueueProgress } from './job.js';
import { handledOf, rateOf as rateOver } from './report.js';

interface ProgressOptions {
  /** A live bar per queue on a terminal; otherwise one log line per interval. */
  terminal: boolean;
  quiet: boolean;
  intervalMs: number;
  log: Logger;
}

function handled(item: QueueProgress): number {
  return handledOf(item.counters);
}

/** Messages handled per active second, as the report counts them (the idle wait not included). */
function rateOf(item: QueueProgress): number {
  const span = activeSpanOf(item);
  return span ? rateOver(handled(item), span.to - span.from) : 0;
}

/** What is left to move, in flight included: the whole as last read, less what was handled since. */
function remainingOf(item: QueueProgress): number | undefined {
  return item.total === undefined ? undefined : Math.max(0, item.total - handled(item));
}

/** Time left at the current rate, from what is left: "42s", "3m", or "?" before any rate. */
function etaOf(item: QueueProgress): string {
  const remaining = remainingOf(item);
  if (item.done || remaining === 0) return '0s';
  const rate = rateOf(item);
  if (!rate || remaining === undefined) return '?';
  const seconds = Math.ceil(remaining / rate);
  return seconds < 120 ? `${seconds}s` : `${Math.ceil(seconds / 60)}m`;
}

/** Shows the job's progress until stopped: bars on a terminal, log lines off it, nothing if quiet. */
export function showProgress(items: QueueProgress[], options: ProgressOptions): { stop(): void } {
  if (options.quiet) return { stop: () => {} };
  if (!options.terminal) {
    const timer = setInterval(() => {
      for (const item of items) {
        // Not before the source queue's depth is known: a line while the route still connects
        // would say nothing of what is left.
        if (item.done || item.startedAt === 0 || item.total === undefined) continue;
        const c = item.counters;
        options.log.info(
          {
            queue: item.sourceQueue,
            forwarded: c.forwarded,
            duplicates: c.duplicates,
            inDoubt: c.inDoubt,
            remaining: remainingOf(item),
            ratePerSecond: rateOf(item),
          },
          'progress',
        );
      }
    }, options.intervalMs);
    return { stop: () => clearInterval(timer) };
  }
  // Loaded only when bars are drawn (a terminal): a job's start does not wait for it otherwise.
  const cliProgress = createRequire(import.meta.url)('cli-progress') as typeof import('cli-progress');
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
      // The total is what we moved plus what is left (the source may grow while we run).
      bar.get(item)?.setTotal(Math.max(1, item.total ?? done, done));
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
