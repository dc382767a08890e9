import { pino } from 'pino';
import type { Logger, LogLevel } from '../log.js';
import { readableLine } from './readable.js';

/**
 * Logs on stdout, written synchronously so that nothing is lost when the process exits: JSON lines
 * with the level as a word (for log collectors), or, when `readable` (stdout is a terminal), one
 * short coloured line per entry for a person.
 */
export function createLogger(level: LogLevel, readable = false): Logger {
  const out = pino.destination({ dest: 1, sync: true });
  const options: pino.LoggerOptions = {
    level,
    base: { pid: process.pid },
    timestamp: pino.stdTimeFunctions.isoTime,
    formatters: { level: (label) => ({ level: label }) },
  };
  if (!readable) return pino(options, out);
  return pino(options, {
    write(line: string) {
      out.write(readableLine(line));
    },
  });
}
