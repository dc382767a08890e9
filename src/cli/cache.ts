import { type Command, Option } from 'commander';
import { checkRedisUrl, checkScope, DEFAULTS } from '../config/settings.js';
import { checkTlsFiles, type TlsRawOptions, tlsFilesOf } from '../config/tls.js';
import { forgetIds, inspectIds, scopeStats } from '../dedup/inspect.js';
import { connectRedis } from '../dedup/redis.js';
import { ConfigError, ExitCode } from '../errors.js';
import { createLogger } from '../observe/log.js';
import { addTlsOptions } from './options.js';

interface CacheOptions extends Pick<TlsRawOptions, 'redisCa' | 'redisCert' | 'redisKey'> {
  redis?: string;
  redisPrefix?: string;
  scope?: string;
  yes?: boolean;
}

function cacheOptions(command: Command): Command {
  command
    .addOption(
      new Option('--redis <url>', `the dedup cache (default ${DEFAULTS.redis})`).env('DEDUP_BRIDGE_REDIS'),
    )
    .option('--redis-prefix <prefix>', `prefix of the cache keys (default ${DEFAULTS.redisPrefix})`)
    .option('--scope <name>', 'the dedup scope, e.g. queue:orders (required)');
  return addTlsOptions(command, ['redis']);
}

async function open(options: CacheOptions) {
  const url = checkRedisUrl(options.redis ?? DEFAULTS.redis);
  if (!options.scope)
    throw new ConfigError('--scope: is required (e.g. queue:orders, the target queue the bridge writes to)');
  const scope = checkScope(options.scope);
  const tls = checkTlsFiles('redis', url, tlsFilesOf(options, 'redis'));
  const redis = await connectRedis(url, 10_000, createLogger('silent'), tls);
  return { redis, prefix: options.redisPrefix ?? DEFAULTS.redisPrefix, scope };
}

function human(ms: number | undefined): string {
  if (ms === undefined || ms < 0) return '-';
  const units: [number, string][] = [
    [86_400_000, 'd'],
    [3_600_000, 'h'],
    [60_000, 'm'],
    [1000, 's'],
  ];
  // The largest unit and the one below it, zero included: "8d 0h", never "8d 51m".
  const first = units.findIndex(([size]) => ms >= size);
  if (first < 0) return `${ms}ms`;
  const [size, unit] = units[first] as [number, string];
  const next = units[first + 1];
  const head = `${Math.floor(ms / size)}${unit}`;
  return next ? `${head} ${Math.floor((ms % size) / next[0])}${next[1]}` : head;
}

/** `inspect` and `cache stats|forget`: look at and correct the dedup cache by hand. */
export function addCacheCommands(program: Command, done: (code: number) => void): void {
  cacheOptions(program.command('inspect').description('show what the cache holds for IDs: state, owner, TTL'))
    .argument('<id...>', 'the IDs, as text')
    .action(async (ids: string[], options: CacheOptions) => {
      const { redis, prefix, scope } = await open(options);
      try {
        for (const row of await inspectIds(redis, prefix, scope, ids)) {
          const owner = row.owner ? ` · owner ${row.owner}` : '';
          const lease = row.state === 'claimed' ? ` · lease ${human(row.leaseMs)}` : '';
          process.stdout.write(`${row.id}\t${row.state}${owner}${lease} · expires in ${human(row.ttlMs)}\n`);
        }
      } finally {
        redis.disconnect();
      }
      done(ExitCode.ok);
    });

  const cache = program.command('cache').description('dedup cache tools');
  cacheOptions(cache.command('stats').description('how many IDs a scope holds, and their memory')).action(
    async (options: CacheOptions) => {
      const { redis, prefix, scope } = await open(options);
      try {
        const stats = await scopeStats(redis, prefix, scope);
        process.stdout.write(
          `scope ${scope}: ${stats.committed} committed IDs, ${stats.claimed} claims, about ${Math.round(stats.approxBytes / 1024)} KiB\n`,
        );
      } finally {
        redis.disconnect();
      }
      done(ExitCode.ok);
    },
  );
  cacheOptions(cache.command('forget').description('delete IDs from the cache, so they are forwarded again'))
    .argument('<id...>', 'the IDs, as text')
    .option('--yes', 'really delete (a forgotten ID that comes back is forwarded again)')
    .action(async (ids: string[], options: CacheOptions) => {
      if (!options.yes) {
        throw new ConfigError('cache forget: deletes what the bridge knows of these IDs; add --yes to do it');
      }
      const { redis, prefix, scope } = await open(options);
      try {
        const removed = await forgetIds(redis, prefix, scope, ids);
        process.stdout.write(`forgot ${removed} of ${ids.length} ID(s) in scope ${scope}\n`);
      } finally {
        redis.disconnect();
      }
      done(ExitCode.ok);
    });
}
