import { ConfigError } from '../errors.js';

const UNIT_MS: Record<string, number> = {
  ms: 1,
  s: 1000,
  m: 60_000,
  h: 3_600_000,
  d: 86_400_000,
  w: 604_800_000,
};

/**
 * Parses "500ms", "2s", "1h30m", "7d" (or a bare number of milliseconds) into milliseconds.
 * `what` names the option in the error, e.g. "--dedup-window".
 */
export function parseDuration(text: string, what: string): number {
  const trimmed = text.trim();
  if (/^\d+$/.test(trimmed)) return Number(trimmed);
  const part = /(\d+(?:\.\d+)?)(ms|s|m|h|d|w)/gy;
  let total = 0;
  let consumed = 0;
  for (let match = part.exec(trimmed); match; match = part.exec(trimmed)) {
    total += Number(match[1]) * (UNIT_MS[match[2] as string] as number);
    consumed = part.lastIndex;
  }
  if (trimmed === '' || consumed !== trimmed.length) {
    throw new ConfigError(
      `${what}: "${text}" is not a duration; use a number with a unit, e.g. 500ms, 2s, 5m, 1h30m, 7d`,
    );
  }
  return Math.round(total);
}

// Node's timers hold at most 2^31-1 ms (24.8 days); a longer one fires after 1 ms, with a warning.
const MAX_TIMER_MS = 2 ** 31 - 1;

/** A duration the bridge waits for with a timer (a lease, a timeout, a limit): at most 24 days. */
export function parseTimerDuration(text: string, what: string, beyond = ''): number {
  const ms = parseDuration(text, what);
  if (ms > MAX_TIMER_MS) {
    throw new ConfigError(
      `${what}: "${text}" is longer than a timer can wait (24.8 days); give at most 24d${beyond}`,
    );
  }
  return ms;
}

export function formatDuration(ms: number): string {
  if (ms === 0) return '0s';
  if (ms % 86_400_000 === 0) return `${ms / 86_400_000}d`;
  if (ms % 3_600_000 === 0) return `${ms / 3_600_000}h`;
  if (ms % 60_000 === 0) return `${ms / 60_000}m`;
  if (ms % 1000 === 0) return `${ms / 1000}s`;
  return `${ms}ms`;
}

/** What --retry-for and a file's retryFor take besides a duration: retry until stopped. */
export const FOREVER = 'forever';

/**
 * Parses --retry-for (or a file's retryFor): a duration, or `forever` (0 in the settings). A bare
 * 0 is refused: it reads as "do not retry", which the bridge does not offer (a connect that fails
 * once is retried at least for the budget given), and it used to mean "forever" silently.
 */
export function parseRetryFor(text: string, what: string): number {
  if (text.trim().toLowerCase() === FOREVER) return 0;
  const ms = parseTimerDuration(text, what, `, or ${FOREVER}`);
  if (ms === 0) {
    throw new ConfigError(
      `${what}: 0 is not accepted (it would not mean "no retry"); give how long to keep trying a server, e.g. 1s or 60s, or ${FOREVER}`,
    );
  }
  return ms;
}

/** A retry budget as --retry-for and a file's retryFor accept it back. */
export function formatRetryFor(ms: number): string {
  return ms === 0 ? FOREVER : formatDuration(ms);
}
