import { describe, expect, it } from 'vitest';
import { clip, PerMessageLog } from '../../src/bridge/per-message.js';
import type { Logger } from '../../src/log.js';

/** A logger that keeps its lines (a fake is fine here: PerMessageLog only counts and forwards). */
function recorder(): {
  log: Logger;
  lines: { level: string; text: string; fields: Record<string, unknown> }[];
} {
  const lines: { level: string; text: string; fields: Record<string, unknown> }[] = [];
  const at =
    (level: string) =>
    (fields: Record<string, unknown>, text: string): void => {
      lines.push({ level, text, fields });
    };
  return { log: { warn: at('warn'), error: at('error') } as unknown as Logger, lines };
}

describe('per-message log lines', () => {
  it('writes ten lines of a kind per minute, then says how many it left out', () => {
    const { log, lines } = recorder();
    let now = 1_000_000;
    const perMessage = new PerMessageLog(log, () => now);
    for (let i = 0; i < 25; i++) perMessage.warn({ i }, 'message has no ID');
    perMessage.warn({}, 'message parked');
    expect(lines.filter((line) => line.text === 'message has no ID')).toHaveLength(10);
    expect(lines.filter((line) => line.text === 'message parked')).toHaveLength(1);
    // A minute later: the left-out count of the last interval, then ten more.
    now += 60_000;
    for (let i = 0; i < 12; i++) perMessage.warn({ i }, 'message has no ID');
    expect(
      lines.filter((line) => line.text.startsWith('15 more lines like this were left out')),
    ).toHaveLength(1);
    expect(lines.filter((line) => line.text === 'message has no ID')).toHaveLength(20);
    perMessage.flush();
    expect(lines.at(-1)?.text).toBe('2 more lines like this were left out: message has no ID');
    perMessage.flush();
    expect(lines.at(-1)?.text).toBe('2 more lines like this were left out: message has no ID');
  });

  it('groups lines of one kind whose text varies', () => {
    const { log, lines } = recorder();
    const perMessage = new PerMessageLog(log, () => 0);
    for (let i = 0; i < 30; i++) perMessage.warn({}, `message refused: header of ${i} bytes`, 'refused');
    expect(lines).toHaveLength(10);
  });

  it('clips text that came from a message', () => {
    expect(clip('short')).toBe('short');
    const long = 'x'.repeat(131_072);
    expect(clip(long)).toBe(`${'x'.repeat(200)}… (131072 characters)`);
  });
});
