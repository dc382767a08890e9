import { backoffDelay, sleep } from '../backoff.js';
import { ConfigError, describe, FatalConnectError } from '../errors.js';
import type { Logger } from '../log.js';

/** Thrown inside work that a stop abandoned when its time ran out. */
export class Abandoned extends Error {}

// An ACL refusal, of the call itself or of a command inside a script.
const REDIS_NO_PERMISSION = /NOPERM|can't run this command/;

/**
 * Runs the pipeline's cache calls until they succeed (a message never moves on without its claim
 * or commit), and keeps the streak of failures, which the bridge counts as an outage.
 */
export class CacheCalls {
  /** Set once a stop gave up waiting: calls still retrying throw Abandoned. */
  abandoned = false;
  /** Set while calls fail, so that an outage is logged once, not once per batch. */
  private failing = false;
  /** When the current streak of failed calls began (Date.now()); undefined once one succeeds. */
  private failingSince: number | undefined;
  /** The first line of the streak's last error (an error reply such as OOM). */
  private lastError: string | undefined;

  constructor(private readonly log: Logger) {}

  /**
   * Since when every call has failed (an error reply such as OOM or READONLY; while the connection
   * is down calls wait instead), with the last error's first line; undefined while calls succeed.
   */
  get failingStreak(): { since: number; error: string } | undefined {
    if (this.failingSince === undefined) return undefined;
    return { since: this.failingSince, error: this.lastError ?? 'no answer' };
  }

  async run<T>(what: string, call: () => Promise<T>): Promise<T> {
    for (let attempt = 1; ; attempt++) {
      if (this.abandoned) throw new Abandoned();
      try {
        const result = await call();
        this.failingSince = undefined;
        if (this.failing) {
          this.failing = false;
          this.log.info({ what }, 'Redis answers again');
        }
        return result;
      } catch (error) {
        // A cache layout this process cannot follow (see DedupCache): retrying cannot fix that.
        if (error instanceof ConfigError) throw error;
        // The Redis user lacks a command the bridge needs: retrying cannot fix that.
        if (REDIS_NO_PERMISSION.test(describe(error))) {
          throw new FatalConnectError(
            `Redis refused the ${what} call (${describe(error)}); give the user the ACL that docs/security.md, Least privilege, lists`,
          );
        }
        // A streak of failures is an outage from its first (see failingStreak).
        this.failingSince ??= Date.now();
        this.lastError = describe(error).split('\n')[0];
        // One line per outage, not one per batch in flight.
        if (!this.failing) {
          this.failing = true;
          this.log.warn(
            { what, error: describe(error) },
            'Redis call failed; holding the messages unacked and retrying',
          );
        }
        await sleep(backoffDelay(attempt, 100, 5000));
      }
    }
  }
}
