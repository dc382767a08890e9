import { pino } from 'pino';

export type Logger = pino.Logger;
export type LogLevel = 'fatal' | 'error' | 'warn' | 'info' | 'debug' | 'trace' | 'silent';
export const LOG_LEVELS: readonly LogLevel[] = ['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent'];

/** JSON lines on stdout (synchronous, so nothing is lost when the process exits). */
export function createLogger(level: LogLevel): Logger {
  return pino(
    { level, base: { pid: process.pid }, timestamp: pino.stdTimeFunctions.isoTime },
    pino.destination({ dest: 1, sync: true }),
  );
}

export function silentLogger(): Logger {
  return pino({ level: 'silent' });
}
