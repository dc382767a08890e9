import { type Command, Option } from 'commander';
import { checkRedisUrl, checkScope, DEFAULTS } from '../config/settings.js';
import { checkTlsFiles, type TlsRawOptions, tlsFilesOf } from '../config/tls.js';
import {
  forgetIds,
  hexId,
  humanDuration,
  inspectIds,
  intId,
  resetScope,
  scopeStats,
  type ToolId,
  textId,
} from '../dedup/inspect.js';
import { closeRedis, connectRedis } from '../dedup/redis.js';
import { ConfigError, ExitCode } from '../errors.js';
import { createLogger } from '../observe/log.js';
import { addTlsOptions } from './options.js';

interface CacheOptions extends Pick<TlsRawOptions, 'redisCa' | 'redisCert' | 'redisKey'> {
  redis?: string;
  redisPrefix?: string;
  scope?: string;
  yes?: boolean;
  force?: boolean;
  hex?: string[];
  int?: string[];
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

/**
 * A command the --redis user may not run is a missing grant, not a bug: one line naming the refused
 * command, exit 2 (cache stats and reset-scope need SCAN, which the bridge's own ACL leaves out).
 */
async function needingGrants<T>(tool: string, work: () => Promise<T>): Promise<T> {
  try {
    return await work();
  } catch (error) {
    const message = error instanceof Error ? error.message : String(error);
    if (!/^NOPERM/.test(message)) throw error;
    throw new ConfigError(
      `${tool}: Redis refused a command it needs (${message}); give the --redis user the grants that docs/security.md, Least privilege, lists for this tool`,
    );
  }
}

function collect(value: string, previous: string[] | undefined): string[] {
  return [...(previous ?? []), value];
}

/** The IDs of `inspect` and `cache forget`: text arguments, and typed ones for what text cannot say. */
function idOptions(command: Command): Command {
  return command
    .argument('[id...]', 'IDs as text (as a string header or message_id carries them)')
    .option(
      '--hex <bytes>',
      'an ID given as bytes in hex, e.g. a HornetQ byte[] _HQ_DUPL_ID: --hex 0a1bff (repeatable)',
      collect,
    )
    .option(
      '--int <n>',
      'an integer ID of any width, 64-bit included (a numeric header), keyed num:<n> (repeatable)',
      collect,
    );
}

/** Every ID given, keyed as the bridge keys the wire value: text first, then --hex, then --int. */
function idsOf(texts: string[], options: CacheOptions, command: string): ToolId[] {
  const ids = [...texts.map(textId), ...(options.hex ?? []).map(hexId), ...(options.int ?? []).map(intId)];
  if (ids.length === 0) {
    throw new ConfigError(
      `${command}: give at least one ID: as text, or --hex <bytes>, or --int <n> (see dedup-bridge ${command} --help)`,
    );
  }
  return ids;
}

/** `inspect` and `cache stats|forget|reset-scope`: look at and correct the dedup cache by hand. */
export function addCacheCommands(program: Command, done: (code: number) => void): void {
  idOptions(
    cacheOptions(
      program
        .command('inspect')
        .description('show what the cache holds for IDs: the key each maps to, state, owner, TTL'),
    ),
  ).action(async (texts: string[], options: CacheOptions) => {
    const ids = idsOf(texts, options, 'inspect');
    const { redis, prefix, scope } = await open(options);
    try {
      for (const row of await needingGrants('inspect', () => inspectIds(redis, prefix, scope, ids))) {
        const owner = row.owner ? ` · owner ${row.owner}` : '';
        const lease = row.state === 'claimed' ? ` · lease ${humanDuration(row.leaseMs)}` : '';
        const expires = row.state === 'unknown' ? '' : ` · expires in ${humanDuration(row.ttlMs)}`;
        process.stdout.write(`${row.id}\tkey ${row.idKey}\t${row.state}${owner}${lease}${expires}\n`);
      }
    } finally {
      closeRedis(redis);
    }
    done(ExitCode.ok);
  });

  const cache = program.command('cache').description('dedup cache tools');
  cacheOptions(cache.command('stats').description('how many IDs a scope holds, and their memory')).action(
    async (options: CacheOptions) => {
      const { redis, prefix, scope } = await open(options);
      try {
        const stats = await needingGrants('cache stats', () => scopeStats(redis, prefix, scope));
        process.stdout.write(
          `scope ${scope}: ${stats.committed} committed IDs, ${stats.claimed} claims, about ${Math.round(stats.approxBytes / 1024)} KiB\n`,
        );
      } finally {
        closeRedis(redis);
      }
      done(ExitCode.ok);
    },
  );
  idOptions(
    cacheOptions(
      cache.command('forget').description('delete IDs from the cache, so they are forwarded again'),
    ),
  )
    .option('--yes', 'really delete (a forgotten ID that comes back is forwarded again)')
    .action(async (texts: string[], options: CacheOptions) => {
      const ids = idsOf(texts, options, 'cache forget');
      if (!options.yes) {
        throw new ConfigError('cache forget: deletes what the bridge knows of these IDs; add --yes to do it');
      }
      const { redis, prefix, scope } = await open(options);
      try {
        const removed = await needingGrants('cache forget', () => forgetIds(redis, prefix, scope, ids));
        ids.forEach((id, index) => {
          const what = removed[index] ? 'forgotten' : 'not held';
          process.stdout.write(`${id.label}\tkey ${id.key}\t${what}\n`);
        });
        const count = removed.filter(Boolean).length;
        process.stdout.write(`forgot ${count} of ${ids.length} ID(s) in scope ${scope}\n`);
      } finally {
        closeRedis(redis);
      }
      done(ExitCode.ok);
    });

  cacheOptions(
    cache
      .command('reset-scope')
      .description(
        'delete everything a scope holds (layout, IDs, claims), e.g. one first written with a short trial --dedup-window, so the next run lays it out for its own window',
      ),
  )
    .option('--yes', 'really delete the scope')
    .option(
      '--force',
      'also when it holds committed IDs or claims left in doubt (their messages, if they come again, are forwarded again); never while a bridge forwards on it',
    )
    .action(async (options: CacheOptions) => {
      if (!options.yes) {
        throw new ConfigError(
          'cache reset-scope: deletes everything the cache holds for the scope (its layout, committed IDs and claims); add --yes to do it',
        );
      }
      const { redis, prefix, scope } = await open(options);
      try {
        const result = await needingGrants('cache reset-scope', () =>
          resetScope(redis, prefix, scope, { force: options.force === true }),
        );
        const forgotten =
          result.committed + result.staleClaims > 0
            ? `; forgot ${result.committed} committed ID(s) and ${result.staleClaims} claim(s) left in doubt`
            : '';
        process.stdout.write(
          `reset scope ${scope}: deleted ${result.keys} key(s) (it kept IDs in slices of ${humanDuration(result.sliceMs)})${forgotten}; the next bridge or job on it lays it out for its own --dedup-window\n`,
        );
      } finally {
        closeRedis(redis);
      }
      done(ExitCode.ok);
    });
}
