import { type Command, Option } from 'commander';
import { DEFAULTS } from '../config/settings.js';

/** The options `run` and `migrate` share; defaults are filled in by config/settings, not here. */
export function addBridgeOptions(command: Command, mode: 'run' | 'migrate'): Command {
  const retryDefault = mode === 'run' ? 'retry forever' : DEFAULTS.migrateRetryFor;
  return command
    .addOption(
      new Option('--source <url>', 'source broker, amqp://user:password@host:5672/vhost').env(
        'DEDUP_BRIDGE_SOURCE',
      ),
    )
    .addOption(new Option('--source-queue <name>', 'queue to consume').env('DEDUP_BRIDGE_SOURCE_QUEUE'))
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
    );
}
