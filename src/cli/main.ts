import { readFileSync } from 'node:fs';
import { access, constants } from 'node:fs/promises';
import { dirname, resolve } from 'node:path';
import { Command, CommanderError } from 'commander';
import { startBridge } from '../bridge/bridge.js';
import { type RawOptions, resolveBridgeSettings, resolveMigrateSettings } from '../config/settings.js';
import { BridgeError, ConfigError, ExitCode } from '../errors.js';
import { migrate } from '../migrate/job.js';
import { formatReport } from '../migrate/report.js';
import { createLogger } from '../observe/log.js';
import { addBridgeOptions } from './options.js';
import { onStopSignal } from './signals.js';

/** Runs the CLI and returns the exit code; it prints at most one line per error on stderr. */
export async function main(argv: string[]): Promise<number> {
  const program = buildProgram();
  try {
    await program.parseAsync(argv);
    return exitCode;
  } catch (error) {
    return reportError(error);
  }
}

let exitCode: number = ExitCode.ok;

const VERSION = (
  JSON.parse(readFileSync(new URL('../../package.json', import.meta.url), 'utf8')) as { version: string }
).version;

function buildProgram(): Command {
  const program = new Command('dedup-bridge')
    .description('Forward RabbitMQ messages from a source queue to a target once and only once')
    .version(VERSION)
    .exitOverride()
    .showSuggestionAfterError(false)
    .configureOutput({ outputError: () => {} });

  addBridgeOptions(
    program
      .command('run')
      .description('forward until stopped (SIGINT/SIGTERM: finish in-flight, then exit 0)'),
    'run',
  ).action(async (raw: RawOptions) => {
    exitCode = await runCommand(raw);
  });

  addBridgeOptions(
    program.command('migrate').description('forward until the source queue is drained, then exit'),
    'migrate',
  )
    .option(
      '--idle-timeout <duration>',
      'drained = source empty and nothing in flight this long (default 2s)',
    )
    .option('--max-messages <n>', 'stop after n source messages handled (exit 4 if any are left)')
    .option('--report <file>', 'write the counts as JSON to this file')
    .action(async (raw: RawOptions) => {
      exitCode = await migrateCommand(raw);
    });
  return program;
}

async function runCommand(raw: RawOptions): Promise<number> {
  const settings = resolveBridgeSettings(raw, 'run');
  const log = createLogger(settings.logLevel);
  const signal = onStopSignal();
  const bridge = await startBridge(settings, log);
  const first = await Promise.race([signal.first.then(() => 'signal' as const), bridge.failure]);
  if (first === 'signal') {
    log.info({ timeoutMs: settings.shutdownTimeoutMs }, 'stopping: finishing in-flight messages');
    const unfinished = await bridge.stop(settings.shutdownTimeoutMs);
    await bridge.close();
    log.info({ unfinished, counters: bridge.pipeline.counters }, 'stopped');
    return ExitCode.ok;
  }
  // Retrying cannot fix this (a queue deleted, credentials revoked): release and report.
  await bridge.stop(settings.shutdownTimeoutMs);
  await bridge.close();
  throw first;
}

async function migrateCommand(raw: RawOptions): Promise<number> {
  const settings = resolveMigrateSettings(raw);
  if (settings.reportPath) await checkWritable(settings.reportPath);
  const log = createLogger(settings.logLevel);
  const signal = onStopSignal();
  const result = await migrate(settings, log, signal.first);
  process.stderr.write(formatReport(result.report));
  if (result.problem) process.stderr.write(`dedup-bridge: ${result.problem}\n`);
  return result.exitCode;
}

async function checkWritable(path: string): Promise<void> {
  try {
    await access(dirname(resolve(path)), constants.W_OK);
  } catch {
    throw new ConfigError(
      `--report: cannot write to the folder of "${path}"; give a path in a writable folder`,
    );
  }
}

function reportError(error: unknown): number {
  if (error instanceof CommanderError) {
    if (error.code === 'commander.helpDisplayed' || error.code === 'commander.version') return ExitCode.ok;
    if (error.code === 'commander.help') return ExitCode.usage;
    const text = error.message.replace(/^error: /, '');
    process.stderr.write(`dedup-bridge: ${text}; see dedup-bridge --help\n`);
    return ExitCode.usage;
  }
  if (error instanceof BridgeError) {
    process.stderr.write(`dedup-bridge: ${error.message}\n`);
    return error.exitCode;
  }
  const text = error instanceof Error ? (error.stack ?? error.message) : String(error);
  process.stderr.write(`dedup-bridge: internal error (please report it): ${text}\n`);
  return ExitCode.runtime;
}
