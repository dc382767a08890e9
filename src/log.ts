// The logger every module is handed: only its type and the level names live here, so that amqp,
// dedup, config and the rest need nothing from observe; observe/log.ts creates the pino logger.
import type { pino } from 'pino';

export type Logger = pino.Logger;
export type LogLevel = 'fatal' | 'error' | 'warn' | 'info' | 'debug' | 'trace' | 'silent';
export const LOG_LEVELS: readonly LogLevel[] = ['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent'];
