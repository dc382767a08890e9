import { ConfigError } from '../errors.js';

const UNIT_BYTES: Record<string, number> = {
  '': 1,
  b: 1,
  kib: 1024,
  ki: 1024,
  mib: 1024 ** 2,
  mi: 1024 ** 2,
  gib: 1024 ** 3,
  gi: 1024 ** 3,
};

/**
 * Parses a size in bytes: "64MiB", "512KiB", "1GiB" (also Kubernetes' "64Mi"), or a bare number
 * of bytes. `what` names the option in the error.
 */
export function parseSize(text: string, what: string): number {
  const match = /^(\d+)\s*([a-z]*)$/i.exec(text.trim());
  const unit = UNIT_BYTES[match?.[2]?.toLowerCase() ?? 'none'];
  if (!match || unit === undefined) {
    throw new ConfigError(
      `${what}: "${text}" is not a size; use a whole number with a unit, e.g. 512KiB, 64MiB, 1GiB (or a number of bytes)`,
    );
  }
  return Number(match[1]) * unit;
}

export function formatSize(bytes: number): string {
  for (const [unit, size] of [
    ['GiB', 1024 ** 3],
    ['MiB', 1024 ** 2],
    ['KiB', 1024],
  ] as const) {
    if (bytes >= size && bytes % size === 0) return `${bytes / size}${unit}`;
  }
  return `${bytes}B`;
}
