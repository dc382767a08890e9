import type { Logger } from '../log.js';
import type { Delivery } from '../ports.js';

/** How many lines of one kind are written per interval; the rest are counted and summed up. */
const LINES_PER_INTERVAL = 10;
const INTERVAL_MS = 60_000;
/** Text from a message (an ID, a routing key) is cut to this many characters in a log line. */
const MAX_TEXT = 200;

/** Cuts text that came from a message, so that one message cannot write a 128 KiB log line. */
export function clip(text: string): string {
  return text.length <= MAX_TEXT ? text : `${text.slice(0, MAX_TEXT)}… (${text.length} characters)`;
}

/** What names a message in a log line: its ID (or message_id) and routing key, clipped. */
export function namedOf(message: Delivery, id?: string): Record<string, string> {
  const named: Record<string, string> = { routingKey: clip(message.fields.routingKey) };
  const shown = id ?? message.properties.messageId;
  if (shown !== undefined) named.id = clip(String(shown));
  return named;
}

/**
 * Warnings about single messages: a flood of bad messages must not flood the log. Each kind of
 * line (its text) is written at most LINES_PER_INTERVAL times an interval; after that, one line per
 * interval says how many were left out, and `flush()` (at a stop) says it for the last one.
 */
export class PerMessageLog {
  private readonly kinds = new Map<string, { since: number; written: number; skipped: number }>();

  constructor(
    private readonly log: Logger,
    private readonly now: () => number = Date.now,
  ) {}

  /** `kind` groups lines whose text varies (default: the text itself). */
  warn(fields: Record<string, unknown>, text: string, kindOf = text): void {
    this.write('warn', fields, text, kindOf);
  }

  error(fields: Record<string, unknown>, text: string, kindOf = text): void {
    this.write('error', fields, text, kindOf);
  }

  private write(
    level: 'warn' | 'error',
    fields: Record<string, unknown>,
    text: string,
    kindOf: string,
  ): void {
    const now = this.now();
    let kind = this.kinds.get(kindOf);
    if (!kind || now - kind.since >= INTERVAL_MS) {
      if (kind) this.sayLeftOut(kindOf, kind.skipped);
      kind = { since: now, written: 0, skipped: 0 };
      this.kinds.set(kindOf, kind);
    }
    if (kind.written >= LINES_PER_INTERVAL) {
      kind.skipped++;
      return;
    }
    kind.written++;
    this.log[level](fields, text);
  }

  /** Says how many lines of each kind were left out since their last summary. */
  flush(): void {
    for (const [text, kind] of this.kinds) {
      this.sayLeftOut(text, kind.skipped);
      kind.skipped = 0;
    }
  }

  private sayLeftOut(text: string, skipped: number): void {
    if (skipped > 0) {
      this.log.warn(
        { leftOut: skipped, line: text },
        `${skipped} more lines like this were left out: ${text}`,
      );
    }
  }
}
