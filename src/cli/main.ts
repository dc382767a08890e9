import { readFileSync } from 'node:fs';
import { access, constants } from 'node:fs/promises';
import { dirname, resolve } from 'node:path';
import { Command, CommanderError, Option } from 'commander';
import type { Bridge } from '../bridge/bridge.js';
import { startRoutes, superviseRoutes } from '../bridge/routes.js';
import { sourceTtlWarnings } from '../bridge/source-ttl.js';
import { loadConfigRoutes } from '../config/file.js';
import {
  checkManagementCa,
  checkManagementUrl,
  type MigrateRawOptions,
  resolveMigrateSettings,
} from '../config/migrate-settings.js';
import { describeRedis, parseRedisUrl } from '../config/redis-url.js';
import { FILE_VARIABLES, readSecretFile, withoutValue } from '../config/secret-source.js';
import { type BridgeSettings, type RawOptions, resolveBridgeSettings } from '../config/settings.js';
import { closeRedis, connectRedis, redisSafetyWarnings } from '../dedup/redis.js';
import { BridgeError, ConfigError, ExitCode, FatalConnectError, StopRequested } from '../errors.js';
import type { Logger } from '../log.js';
import { formatJobReport } from '../migrate/report.js';
import { type JobContext, runMigration, stoppedJobReport, writeReport } from '../migrate/runner.js';
import { createLogger } from '../observe/log.js';
import { type ObserveServer, resolveMetricsEndpoint, startObserveServer } from '../observe/server.js';
import { addCacheCommands } from './cache.js';
import { addConfigCommands } from './config.js';
import { addBridgeOptions, addConfigOption, addMigrateOptions } from './options.js';
import { onStopSignal } from './signals.js';

/** Runs the CLI and returns the exit code; it prints at most one line per error on stderr. */
export async function main(argv: string[]): Promise<number> {
  const program = buildProgram();
  let active: Command | undefined;
  program.hook('preAction', (_program, actionCommand) => {
    active = actionCommand;
    readFileVariables(actionCommand);
    readSwitchVariables(actionCommand);
  });
  try {
    await program.parseAsync(argv);
    return exitCode;
  } catch (error) {
    if (error instanceof CommanderError && error.code === 'commander.excessArguments') {
      return reportError(strayArgument(program, argv));
    }
    return reportError(active ? namingVariable(active, error) : error);
  }
}

/** The deepest command that took operands: the one a stray argument was given to. */
function parsedCommand(command: Command): Command | undefined {
  for (const sub of command.commands) {
    const found = parsedCommand(sub);
    if (found) return found;
  }
  return command.parent && command.args.length > 0 ? command : undefined;
}

const UNIT = /^(ms|s|m|h|d|w)$/;

/** A word no option took (commander says only "too many arguments"): name it, and the likely slip. */
function strayArgument(program: Command, argv: string[]): ConfigError {
  const command = parsedCommand(program);
  const stray = command?.args[command.registeredArguments.length] ?? '';
  const path: string[] = [];
  for (let at = command; at?.parent; at = at.parent) path.unshift(at.name());
  const name = path.join(' ') || 'dedup-bridge';
  const index = argv.lastIndexOf(stray);
  const value = argv[index - 1] ?? '';
  const option = argv[index - 2] ?? '';
  // `--idle-timeout 2 s`: the unit went apart from its number.
  if (index >= 2 && option.startsWith('--') && !value.startsWith('-') && UNIT.test(stray)) {
    return new ConfigError(
      `unexpected argument "${stray}" after ${option} ${value}: a duration is one word; write ${option} ${value}${stray}`,
    );
  }
  const previous = argv[index - 1]?.startsWith('-')
    ? argv[index - 1]
    : argv.slice(Math.max(0, index - 2), index).join(' ');
  const after = index >= 1 && previous?.startsWith('-') ? ` (after ${previous})` : '';
  const takes = command?.registeredArguments.length
    ? `takes ${command.registeredArguments.map((argument) => `<${argument.name()}>`).join(' ')} only`
    : 'takes no arguments, only options, each with one value';
  return new ConfigError(
    `unexpected argument "${stray}"${after}: ${name} ${takes}; remove it, or quote a value that has spaces`,
  );
}

/**
 * A switch (`--strip-cc`) set by its variable: commander turns it on whatever the value, so that
 * DEDUP_BRIDGE_STRIP_CC=false would strip. The value is read here: true or 1 turn it on, false, 0
 * or nothing leave it off, anything else is refused.
 */
function readSwitchVariables(command: Command): void {
  for (const option of command.options) {
    const variable = option.envVar;
    if (!variable || !option.isBoolean()) continue;
    const name = option.attributeName();
    if (command.getOptionValueSource(name) !== 'env') continue;
    const value = (process.env[variable] ?? '').trim().toLowerCase();
    if (value === 'true' || value === '1') continue;
    if (value === 'false' || value === '0' || value === '') {
      command.setOptionValueWithSource(name, undefined, 'env');
      continue;
    }
    throw new ConfigError(`${variable} (${option.long}): must be true or false`);
  }
}

/** Options whose value came from a `<VARIABLE>_FILE`, so that errors name that variable. */
const fromFile = new Set<string>();

/**
 * `DEDUP_BRIDGE_SOURCE_FILE=/run/secrets/source` is DEDUP_BRIDGE_SOURCE with the file's text (one
 * trailing newline dropped): the way to pass a URL with its password without putting it in a
 * flag, which `ps` shows, or in the environment. A flag still wins; the variable and its _FILE
 * together are an error, since one of them would be ignored.
 */
function readFileVariables(command: Command): void {
  for (const option of command.options) {
    const variable = option.envVar;
    if (!variable || !(FILE_VARIABLES as readonly string[]).includes(variable)) continue;
    const fileVariable = `${variable}_FILE`;
    const path = process.env[fileVariable];
    if (path === undefined) continue;
    const name = option.attributeName();
    const source = command.getOptionValueSource(name);
    if (source === 'cli') continue;
    if (source === 'env') {
      throw new ConfigError(
        `${fileVariable}: ${variable} is set too; set one of them (the URL, or the file that holds it)`,
      );
    }
    command.setOptionValueWithSource(name, readSecretFile(path, `${fileVariable} (${option.long})`), 'env');
    fromFile.add(name);
  }
}

/**
 * A refused value that came from an environment variable: the line names the variable first
 * ("DEDUP_BRIDGE_LOG_LEVEL (--log-level): …"), since no flag was typed.
 */
function namingVariable(command: Command, error: unknown): unknown {
  if (!(error instanceof ConfigError)) return error;
  for (const option of command.options) {
    if (!option.envVar || !option.long) continue;
    if (command.getOptionValueSource(option.attributeName()) !== 'env') continue;
    const prefix = new RegExp(`^${option.long}( \\(or ${option.envVar}\\))?: `);
    if (prefix.test(error.message)) {
      const name = option.attributeName();
      const variable = fromFile.has(name) ? `${option.envVar}_FILE` : option.envVar;
      let message = error.message.replace(prefix, `${variable} (${option.long}): `);
      // A file that holds a bare password instead of a URL: its text is not repeated.
      if (fromFile.has(name))
        message = withoutValue(message, String(command.getOptionValue(name)), 'its text');
      return new ConfigError(message, { cause: error });
    }
  }
  return error;
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

  addConfigOption(
    addBridgeOptions(
      program
        .command('run')
        .description('forward until stopped (SIGINT/SIGTERM: finish in-flight, then exit 0)'),
      'run',
    ),
  )
    .addOption(new Option('--fault-crash-after-confirm', 'test hook').hideHelp())
    .action(async (raw: RunRawOptions) => {
      exitCode = await runCommand(raw);
    });

  addMigrateOptions(
    addBridgeOptions(
      program.command('migrate').description('forward until the source queues are drained, then exit'),
      'migrate',
    ),
  ).action(async (raw: MigrateRawOptions) => {
    exitCode = await migrateCommand(raw);
  });
  addCacheCommands(program, (code) => {
    exitCode = code;
  });
  addConfigCommands(program, (code) => {
    exitCode = code;
  });
  return program;
}

type RunRawOptions = RawOptions & {
  faultCrashAfterConfirm?: boolean;
  strict?: boolean;
  config?: string;
  sourceManagement?: string;
  sourceManagementCa?: string;
};

async function runCommand(raw: RunRawOptions): Promise<number> {
  // One route from the flags, or every route of a config file (flags override a single route).
  const routes = raw.config ? loadConfigRoutes(raw.config, raw, 'run') : [resolveBridgeSettings(raw, 'run')];
  const first = routes[0] as BridgeSettings;
  const management = raw.sourceManagement ? checkManagementUrl(raw.sourceManagement) : undefined;
  const managementCa = checkManagementCa(management, raw.sourceManagementCa);
  // The flag stands in for routes whose broker names no management API of its own.
  const byFlag = routes.filter((route) => route.sourceManagementUrl === undefined);
  if (management && new Set(byFlag.map((route) => new URL(route.sourceUrl).host)).size > 1) {
    throw new ConfigError(
      '--source-management: the routes read from more than one source broker, and the flag names the management API of one; give each broker its own management: in the config file',
    );
  }
  const metricsEndpoint = resolveMetricsEndpoint(raw);
  const log = createLogger(first.logLevel, process.stdout.isTTY === true);
  // Listening first: a taken port fails at once, and /healthz answers while the servers are sought.
  const observer = metricsEndpoint ? await startObserveServer(metricsEndpoint, log) : undefined;
  try {
    warnOrRefuse(await sourceTtlWarnings(routes, management, log, managementCa), raw.strict === true, log);
    return await forwardUntilStopped(raw, routes, log, observer);
  } finally {
    await observer?.close();
  }
}

async function forwardUntilStopped(
  raw: RunRawOptions,
  routes: BridgeSettings[],
  log: Logger,
  observer: ObserveServer | undefined,
): Promise<number> {
  const first = routes[0] as BridgeSettings;
  // Signals from here on: a stop while a server is still awaited ends the run at once, exit 0.
  const signal = onStopSignal();
  try {
    await checkRedis(first, raw.strict === true, log, signal.stop);
  } catch (error) {
    if (!(error instanceof StopRequested)) throw error;
    log.info({ waitingFor: error.message }, 'stopped while starting');
    return ExitCode.ok;
  }
  // Hidden test hook: die like a crash between a batch's confirms and its commit.
  const crash = raw.faultCrashAfterConfirm
    ? { afterConfirm: () => process.kill(process.pid, 'SIGKILL') }
    : {};
  const started: Bridge[] = [];
  const starting = startRoutes(routes, log, { ...crash, stop: signal.stop }, (bridge) => {
    started.push(bridge);
    observer?.add(bridge);
  });
  // A stop signal while routes are still starting (a broker not reachable yet): the routes already
  // forwarding finish their in-flight messages; the one still connecting holds no message yet, and
  // exiting ends its retries.
  const early = await Promise.race([
    starting.then(() => 'started' as const),
    signal.first.then(() => 'signal' as const),
  ]);
  if (early === 'signal') {
    starting.catch(() => {});
    log.info({ running: started.length, routes: routes.length }, 'stopping while starting');
    await Promise.allSettled(
      started.map(async (bridge) => {
        await bridge.stop(first.shutdownTimeoutMs);
        await bridge.close();
      }),
    );
    return ExitCode.ok;
  }
  return superviseRoutes(await starting, routes, signal.first, log);
}

/**
 * `migrate`; with --report, a report is written on every exit (0 to 4), with the outcome, the exit
 * code and the error's line: also when the options are refused after --report was read, another
 * run holds the job, or a server cannot be reached, so that a scheduled run always leaves one.
 */
async function migrateCommand(raw: MigrateRawOptions & { strict?: boolean }): Promise<number> {
  const started = Date.now();
  const context: JobContext = { name: raw.jobName, dryRun: raw.dryRun === true };
  let result: Awaited<ReturnType<typeof migrate>>;
  try {
    result = await migrate(raw, context);
  } catch (error) {
    if (raw.report !== undefined) {
      const { code, text } = describeFailure(error);
      const report = stoppedJobReport(context, { exitCode: code, line: text }, Date.now() - started);
      // The error's own line is what matters here; a report that cannot be written adds nothing.
      await writeReport(raw.report, report).catch(() => {});
    }
    throw error;
  }
  const { settings, outcome } = result;
  if (settings.reportPath) await writeReport(settings.reportPath, outcome.report);
  if (!settings.quiet) process.stderr.write(formatJobReport(outcome.report));
  for (const problem of outcome.problems) process.stderr.write(`dedup-bridge: ${problem}\n`);
  return outcome.exitCode;
}

async function migrate(raw: MigrateRawOptions & { strict?: boolean }, context: JobContext) {
  const settings = resolveMigrateSettings(raw);
  const metricsEndpoint = resolveMetricsEndpoint(raw);
  if (settings.reportPath) await checkWritable(settings.reportPath);
  const first = settings.routes[0] as BridgeSettings;
  const log = createLogger(first.logLevel, process.stdout.isTTY === true);
  const observer = metricsEndpoint ? await startObserveServer(metricsEndpoint, log) : undefined;
  try {
    context.name = settings.jobName;
    const ttlWarnings = await sourceTtlWarnings(
      settings.routes,
      settings.sourceManagementUrl,
      log,
      settings.sourceManagementCa,
    );
    warnOrRefuse(ttlWarnings, raw.strict === true, log);
    const signal = onStopSignal();
    await checkRedis(first, raw.strict === true, log, signal.stop);
    const outcome = await runMigration(
      settings,
      log,
      signal.first,
      process.stderr.isTTY === true,
      observer,
      context,
      signal.stop,
    );
    return { settings, outcome };
  } finally {
    await observer?.close();
  }
}

/** Warns (or with --strict refuses) when the Redis cannot be trusted to remember IDs. */
async function checkRedis(
  settings: BridgeSettings,
  strict: boolean,
  log: Logger,
  stop: AbortSignal,
): Promise<void> {
  const redis = await connectRedis(settings.redisUrl, settings.retryForMs, log, settings.tls.redis, stop);
  try {
    warnOrRefuse(await redisSafetyWarnings(redis), strict, log);
  } catch (error) {
    if (!/^NOPERM/.test((error as Error).message)) throw error;
    throw new FatalConnectError(
      `${describeRedis(parseRedisUrl(settings.redisUrl))}: the user may not run INFO, which the start-up checks need; grant it +info (see docs/security.md, Least privilege)`,
    );
  } finally {
    closeRedis(redis);
  }
}

/** A start-up check's findings: logged as warnings, or with --strict the first one refuses to start. */
function warnOrRefuse(warnings: string[], strict: boolean, log: Logger): void {
  for (const warning of warnings) {
    if (strict) throw new ConfigError(`--strict: ${warning}`);
    log.warn(warning);
  }
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

/** The exit code an error ends the CLI with, and its line (without the "dedup-bridge: "). */
function describeFailure(error: unknown): { code: number; text: string } {
  if (error instanceof BridgeError) return { code: error.exitCode, text: error.message };
  const message = error instanceof Error ? error.message : String(error);
  return { code: ExitCode.runtime, text: `internal error (please report it): ${message.split('\n')[0]}` };
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
