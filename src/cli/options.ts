import { type Command, Option } from 'commander';
import { MIGRATE_DEFAULTS } from '../config/migrate-settings.js';
import { DEFAULTS } from '../config/settings.js';
import { DEFAULT_METRICS_HOST } from '../observe/server.js';

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

// Spelled out, not built from the side's name: the docs test finds the flags by reading this file.
const TLS_FLAGS = {
  source: ['--source-ca <file>', '--source-cert <file>', '--source-key <file>'],
  target: ['--target-ca <file>', '--target-cert <file>', '--target-key <file>'],
  redis: ['--redis-ca <file>', '--redis-cert <file>', '--redis-key <file>'],
} as const;

const TLS_HELP = [
  'CA certificate(s) to trust, PEM (default: the system CAs)',
  'client certificate, PEM',
  'private key of the client certificate, PEM (unencrypted)',
];

/** The CA, client certificate and key files for each server's TLS URL, e.g. --target-ca. */
export function addTlsOptions(command: Command, sides: (keyof typeof TLS_FLAGS)[]): Command {
  for (const side of sides) {
    const scheme = side === 'redis' ? 'rediss' : side === 'target' ? 'amqps or rabbitmq-stream+tls' : 'amqps';
    TLS_FLAGS[side].forEach((flags, index) => {
      // --target-ca <file> is also DEDUP_BRIDGE_TARGET_CA
      const env = `DEDUP_BRIDGE_${flags.split(' ')[0]?.slice(2).replace(/-/g, '_').toUpperCase()}`;
      command.addOption(new Option(flags, `${scheme}: ${TLS_HELP[index]}`).env(env));
    });
  }
  return command;
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
      'create missing target queues like their source queues (needs --source-management); with --target-stream, create the stream if missing',
    )
    .option(
      '--declare-target-force',
      'with --declare-target, copy also arguments that make the target drop messages (x-max-length, x-max-length-bytes, x-message-ttl, x-expires, x-max-age)',
    )
    .option('--dry-run', 'count what would be forwarded or skipped; move, ack and claim nothing')
    .option(
      '--progress-interval <duration>',
      `off a terminal, a progress line this often (default ${MIGRATE_DEFAULTS.progressInterval})`,
    )
    .option('--quiet', 'no progress and no summary table (errors still print)')
    .option('--report <file>', 'write the report as JSON to this file');
}

/** `run --config`: the routes come from a file. */
export function addConfigOption(command: Command): Command {
  return command.addOption(
    new Option('--config <file>', 'YAML file of brokers and routes, all run in this process').env(
      'DEDUP_BRIDGE_CONFIG',
    ),
  );
}

/** The options `run` and `migrate` share; defaults are filled in by config/settings, not here. */
export function addBridgeOptions(command: Command, mode: 'run' | 'migrate'): Command {
  const retryDefault = mode === 'run' ? DEFAULTS.runRetryFor : DEFAULTS.migrateRetryFor;
  command
    .addOption(
      new Option(
        '--source <url>',
        'source broker, amqp://user:password@host:5672/vhost (cluster nodes: comma-separated URLs), or one stream endpoint, rabbitmq-stream://user:password@host:5552/vhost (with --source-stream)',
      ).env('DEDUP_BRIDGE_SOURCE'),
    )
    .addOption(sourceQueueOption(mode))
    .addOption(
      new Option(
        '--source-stream <name>',
        'with a rabbitmq-stream:// --source: the stream to read (a stream source, read over the stream protocol)',
      ).env('DEDUP_BRIDGE_SOURCE_STREAM'),
    )
    .addOption(
      new Option(
        '--source-start <where>',
        'with --source-stream, where a route with no stored position starts: first, last, next, an offset, or a time (2026-12-01T00:00:00Z) (default first)',
      ).env('DEDUP_BRIDGE_SOURCE_START'),
    )
    .addOption(
      new Option(
        '--target <url>',
        'target broker URL (cluster nodes: comma-separated URLs), or one stream endpoint, rabbitmq-stream://user:password@host:5552/vhost (with --target-stream)',
      ).env('DEDUP_BRIDGE_TARGET'),
    )
    .option('--target-queue <name>', 'publish through the default exchange to this queue')
    .option('--target-exchange <name>', 'publish to this exchange instead')
    .option('--target-routing-key <key>', "routing key with --target-exchange (default: the message's own)")
    .addOption(
      new Option('--target-stream <name>', 'with a rabbitmq-stream:// --target: the stream to write to').env(
        'DEDUP_BRIDGE_TARGET_STREAM',
      ),
    )
    .addOption(
      new Option(
        '--target-producer <name>',
        "with --target-stream: the stream producer's name, at most 255 bytes (default: derived from the route)",
      ).env('DEDUP_BRIDGE_TARGET_PRODUCER'),
    )
    .addOption(
      new Option('--redis <url>', `dedup cache (default ${DEFAULTS.redis})`).env('DEDUP_BRIDGE_REDIS'),
    )
    .option('--redis-prefix <prefix>', `prefix of the cache keys (default ${DEFAULTS.redisPrefix})`)
    .addOption(
      new Option(
        '--redis-wait-replicas <n>',
        'ack a message only once n Redis replicas hold its commit (WAIT); while fewer do, acks are held (default 0: ack when the master answers)',
      ).env('DEDUP_BRIDGE_REDIS_WAIT_REPLICAS'),
    )
    .option(
      '--scope <name>',
      'dedup scope (default queue:<target-queue>, exchange:<target-exchange> or stream:<target-stream>)',
    )
    .option('--id-from <list>', `where IDs come from, first match wins (default ${DEFAULTS.idFrom})`)
    .option(
      '--dedup-window <duration>',
      `how long a forwarded ID is remembered (default ${DEFAULTS.dedupWindow})`,
    )
    .option('--prefetch <n>', `unacked source messages in flight (default ${DEFAULTS.prefetch})`)
    .addOption(
      new Option(
        '--max-in-flight-bytes <size>',
        `bytes of source message bodies held at once, e.g. 64MiB; past it the consumer pauses (default ${DEFAULTS.maxInFlightBytes})`,
      ).env('DEDUP_BRIDGE_MAX_IN_FLIGHT_BYTES'),
    )
    .option('--batch-size <n>', `IDs per cache call (default ${DEFAULTS.batchSize})`)
    .option(
      '--cache-shards <n>',
      'Redis Cluster slots a new scope is spread over (default auto: 16 on a Cluster, else 1)',
    )
    .option('--lease <duration>', `claim lease, renewed while in flight (default ${DEFAULTS.lease})`)
    .option(
      '--on-unforwardable <policy>',
      'what to do with a message that cannot be forwarded (unroutable, refused, too large, no ID, a loop): retry (default: hold it and retry after a backoff), dead-letter, or park (with --park-queue)',
    )
    // Its old name, still taken; not in --help (docs/cli.md names it once).
    .addOption(new Option('--on-unroutable <policy>', 'old name of --on-unforwardable').hideHelp())
    .option(
      '--park-queue <name>',
      'move messages that cannot be forwarded to this queue on the source broker',
    )
    .addOption(
      new Option(
        '--strip-cc',
        'remove the CC and BCC headers on forward, so that the target routes no extra copies by them (default: keep them, as Shovel does)',
      ).env('DEDUP_BRIDGE_STRIP_CC'),
    )
    .option(
      '--retry-for <duration>',
      `give up reaching a server after this long, or forever; not 0 (default ${retryDefault})`,
    )
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
    .addOption(
      new Option(
        '--source-management-ca <file>',
        'https management API: CA certificate(s) to trust, PEM (default: the system CAs)',
      ).env('DEDUP_BRIDGE_SOURCE_MANAGEMENT_CA'),
    )
    .option(
      '--strict',
      'exit 2 instead of warning at start when a Redis master (each one of a Cluster) has no append-only file, or may evict keys (a maxmemory with a policy other than noeviction), or (Sentinel) has no replica connected; or, with --source-management, a source queue keeps messages longer than --dedup-window (or forever, with a window under 7d), or its management API does not answer. Accepted: any appendfsync, replication lag, fewer replicas than --redis-wait-replicas',
    )
    .addOption(
      new Option('--metrics-port <port>', 'serve /metrics, /healthz and /readyz on this port').env(
        'DEDUP_BRIDGE_METRICS_PORT',
      ),
    )
    .addOption(
      new Option(
        '--metrics-host <address>',
        `address the metrics port listens on (default ${DEFAULT_METRICS_HOST})`,
      ).env('DEDUP_BRIDGE_METRICS_HOST'),
    );
  return addTlsOptions(command, ['source', 'target', 'redis']);
}
