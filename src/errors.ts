// Every error a user can cause or meet has a class here, so the CLI maps it to one line and an exit
// code without matching on message text.

export const ExitCode = {
  ok: 0,
  runtime: 1,
  usage: 2,
  locked: 3,
  limit: 4,
  aborted: 130,
} as const;

/** An error whose message is meant for the operator: one line, what is wrong and what to do. */
export class BridgeError extends Error {
  readonly exitCode: number;
  constructor(message: string, exitCode: number, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
    this.exitCode = exitCode;
  }
}

/** Bad flags, a bad URL, a bad duration, a malformed config: exit 2. */
export class ConfigError extends BridgeError {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, ExitCode.usage, options);
  }
}

/**
 * A broker or Redis refused us for a reason retrying cannot fix (wrong credentials, a missing
 * queue, no permission): exit 2, since the fix is in the configuration.
 */
export class FatalConnectError extends BridgeError {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, ExitCode.usage, options);
  }
}

/** A server could not be reached within the retry budget, or failed while we ran: exit 1. */
export class UnavailableError extends BridgeError {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, ExitCode.runtime, options);
  }
}

/** A run-time failure that is not the user's input: exit 1. */
export class RuntimeFailure extends BridgeError {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, ExitCode.runtime, options);
  }
}

/**
 * A stop signal came while a server was still being waited for: nothing was taken yet, and the
 * work is left for the next run (exit 4 for migrate; `run` ends with 0).
 */
export class StopRequested extends BridgeError {
  constructor(what: string) {
    super(`stopped by a signal while waiting for ${what}; nothing was moved`, ExitCode.limit);
  }
}

/** An error's first line (or the value as text), for a log line or a message about it. */
export function describe(error: unknown): string {
  if (error instanceof Error) return error.message.split('\n')[0] ?? error.name;
  return String(error);
}
