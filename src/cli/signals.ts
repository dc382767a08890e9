import { ExitCode } from '../errors.js';

/**
 * The first SIGINT/SIGTERM resolves `first` (a graceful stop); a second one exits at once, leaving
 * every unconfirmed message unacked, so the broker gives it back to the source queue.
 */
export function onStopSignal(): { first: Promise<NodeJS.Signals>; stop: AbortSignal } {
  let seen = false;
  // Aborted by the first signal: waits for a server end at once (StopRequested).
  const controller = new AbortController();
  let resolveFirst: (signal: NodeJS.Signals) => void = () => {};
  const first = new Promise<NodeJS.Signals>((resolve) => {
    resolveFirst = resolve;
  });
  const handler = (signal: NodeJS.Signals) => {
    if (seen) {
      process.stderr.write(
        `dedup-bridge: second ${signal}: exiting now; unconfirmed messages stay in the source\n`,
      );
      process.exit(ExitCode.aborted);
    }
    seen = true;
    resolveFirst(signal);
    controller.abort();
  };
  process.on('SIGINT', handler);
  process.on('SIGTERM', handler);
  return { first, stop: controller.signal };
}
