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

export function formatDuration(ms: number): string {
  if (ms === 0) return '0s';
  if (ms % 86_400_000 === 0) return `${ms / 86_400_000}d`;
  if (ms % 3_600_000 === 0) return `${ms / 3_600_000}h`;
  if (ms % 60_000 === 0) return `${ms / 60_000}m`;
  if (ms % 1000 === 0) return `${ms / 1000}s`;
  return `${ms}ms`;
}
