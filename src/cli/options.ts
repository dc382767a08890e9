import { type Command, Option } from 'commander';
import { MIGRATE_DEFAULTS } from '../config/migrate-settings.js';
import { DEFAULTS } from '../config/settings.js';

function sourceQueueOption(mode: 'run' | 'migrate'): Option {
  if (mode === 'run')
    return new Option('--source-queue <name>', 'queue to consume').env('DEDUP_BRIDGE_SOURCE_QUEUE');
  // Repeatable; the variable may list several, comma-separated.
  return new Option('--source-queue <name>', 'queue to migrate (repeatable)')
    .env('DEDUP_BRIDGE_SOURCE_QUEUE')
    .argParser((value: string, previous: string[] | undefined) => [
      ...(previous ?? []),
      ...value
        .split(',')
        .map((item) => item.trim())
        .filter((item) => item.length > 0),
    ]);
}

function collect(value: string, previous: string[] | undefined): string[] {
  return [...(previous ?? []), value];
}

/** The options only `migrate` has. */
export function addMigrateOptions(command: Command): Command {
  return command
    .option(
      '--map <source=target>',
      'send a source queue to a target queue of another name (repeatable)',
      collect,
    )
    .option('--job-file <file>', 'YAML file listing the queues (and optionally source, target, redis)')
    .option('--job-name <name>', 'name of the job lock (default: derived from the brokers and queues)')
    .option(
      '--job-lock-lease <duration>',
      `how long the job lock outlives a crashed run (default ${MIGRATE_DEFAULTS.jobLockLease})`,
    )
    .option('--parallel <n>', `queues migrated at once (default ${MIGRATE_DEFAULTS.parallel})`)
    .option(
      '--idle-timeout <duration>',
      `drained = source empty and nothing in flight this long (default ${DEFAULTS.idleTimeout})`,
    )
    .option('--max-messages <n>', 'stop after n source messages (exit 4 if any are left)')
    .option('--max-duration <duration>', 'stop after this long (exit 4 if any are left)')
    .option('--max-rate <msg/s>', 'cap the forwarding rate of the whole job')
    .option('--delete-source-when-empty', 'delete each drained source queue, only if it is still empty')
    .option(
      '--declare-target',
      'create missing target queues like their source queues (needs --source-management)',
    )
    .option('--dry-run', 'count what would be forwarded or skipped; move, ack and claim nothing')
    .option(
      '--progress-interval <duration>',
      `off a terminal, a progress line this often (default ${MIGRATE_DEFAULTS.progressInterval})`,
    )
    .option('--quiet', 'no progress and no summary table (errors still print)')
    .option('--report <file>', 'write the report as JSON to this file');
}

/** The options `run` and `migrate` share; defaults are filled in by config/settings, not here. */
export function addBridgeOptions(command: Command, mode: 'run' | 'migrate'): Command {
  const retryDefault = mode === 'run' ? 'retry forever' : DEFAULTS.migrateRetryFor;
  return command
    .addOption(
      new Option('--source <url>', 'source broker, amqp://user:password@host:5672/vhost').env(
        'DEDUP_BRIDGE_SOURCE',
      ),
    )
    .addOption(sourceQueueOption(mode))
    .addOption(new Option('--target <url>', 'target broker URL').env('DEDUP_BRIDGE_TARGET'))
    .option('--target-queue <name>', 'publish through the default exchange to this queue')
    .option('--target-exchange <name>', 'publish to this exchange instead')
    .option('--target-routing-key <key>', "routing key with --target-exchange (default: the message's own)")
    .addOption(
      new Option('--redis <url>', `dedup cache (default ${DEFAULTS.redis})`).env('DEDUP_BRIDGE_REDIS'),
    )
    .option('--redis-prefix <prefix>', `prefix of the cache keys (default ${DEFAULTS.redisPrefix})`)
    .option('--scope <name>', 'dedup scope (default queue:<target-queue> or exchange:<target-exchange>)')
    .option('--id-from <list>', `where IDs come from, first match wins (default ${DEFAULTS.idFrom})`)
    .option(
      '--dedup-window <duration>',
      `how long a forwarded ID is remembered (default ${DEFAULTS.dedupWindow})`,
    )
    .option('--prefetch <n>', `unacked source messages in flight (default ${DEFAULTS.prefetch})`)
    .option('--batch-size <n>', `IDs per cache call (default ${DEFAULTS.batchSize})`)
    .option('--lease <duration>', `claim lease, renewed while in flight (default ${DEFAULTS.lease})`)
    .option('--on-unroutable <policy>', 'requeue (default), dead-letter, or park (with --park-queue)')
    .option('--park-queue <name>', 'move unroutable messages to this queue on the source broker')
    .option('--retry-for <duration>', `give up reaching a server after this long (default ${retryDefault})`)
    .option(
      '--shutdown-timeout <duration>',
      `time to finish in-flight work on stop (default ${DEFAULTS.shutdownTimeout})`,
    )
    .addOption(
      new Option('--log-level <level>', `log level (default ${DEFAULTS.logLevel})`).env(
        'DEDUP_BRIDGE_LOG_LEVEL',
      ),
    )
    .addOption(
      new Option(
        '--source-management <url>',
        'source management API, http://user:password@host:15672 (queue TTL check; migrate --declare-target)',
      ).env('DEDUP_BRIDGE_SOURCE_MANAGEMENT'),
    )
    .option(
      '--strict',
      'refuse to start on a Redis that keeps nothing on disk or may evict keys, or a source queue whose messages can outlive --dedup-window',
    );
}
