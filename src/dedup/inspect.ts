import { BridgeError, ConfigError, ExitCode } from '../errors.js';
import { DedupCache } from './cache.js';
import { keyOfBytes, keyOfValue } from './id.js';
import { masterNodes, type RedisClient } from './redis.js';

/**
 * An ID as the cache tools take it, with the key the bridge files it under (see dedup/id): the
 * same key the bridge computes for the header value on the wire.
 */
export interface ToolId {
  /** How the operator gave it: the text, `--hex 0aff`, `--int 42`. */
  label: string;
  /** Its key form (dedup/id): text as itself, `num:<exact>`, `bytes:<hex>`, `sha256:…`. */
  key: string;
}

/** A text ID: an `S` or `x` field holding these UTF-8 bytes. */
export function textId(text: string): ToolId {
  const key = keyOfValue(text);
  if (key === undefined) throw new ConfigError('the ID: an empty text is not an ID');
  return { label: text, key };
}

/**
 * A byte ID given in hex (HornetQ's byte[] `_HQ_DUPL_ID`, an `x` or `S` field): `0a1bff`, with or
 * without `0x`, spaces or colons between the bytes. Bytes that are valid UTF-8 are the same ID as
 * that text; others are keyed `bytes:<hex>`.
 */
export function hexId(text: string): ToolId {
  const digits = text.replace(/^0x/i, '').replace(/[\s:]/g, '');
  if (digits.length === 0 || digits.length % 2 !== 0 || !/^[0-9a-f]+$/i.test(digits)) {
    throw new ConfigError(
      `--hex: "${text}" is not bytes in hex; give two hex digits per byte, e.g. --hex 0a1bff`,
    );
  }
  return { label: `--hex ${digits.toLowerCase()}`, key: keyOfBytes(Buffer.from(digits, 'hex')) };
}

const INT64_MIN = -(2n ** 63n);
const INT64_MAX = 2n ** 63n - 1n;

/**
 * An integer ID of any AMQP width (`b` … `l`, 64-bit included, or an integral `d`), keyed by its
 * exact value as `num:<n>`: `I 42`, `l 42` and `d 42.0` are one ID.
 */
export function intId(text: string): ToolId {
  if (!/^[+-]?\d+$/.test(text.trim())) {
    throw new ConfigError(`--int: "${text}" is not a whole number, e.g. --int 42 or --int -9007199254740993`);
  }
  const value = BigInt(text.trim());
  const label = `--int ${value}`;
  if (value >= INT64_MIN && value <= INT64_MAX) return { label, key: `num:${value}` };
  // Past 64 bits only a double can carry it, and only when it holds it exactly.
  const double = Number(value);
  if (Number.isFinite(double) && BigInt(double) === value) {
    return { label, key: keyOfValue(double) as string };
  }
  throw new ConfigError(
    `--int: ${value} is wider than 64 bits and no double holds it exactly, so no message can carry it as an ID`,
  );
}

/** A time span as an operator reads it: the largest unit and the one below it, "8d 0h", "42s". */
export function humanDuration(ms: number | undefined): string {
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

/** The scope the cache tools were given does not exist: they say so, with the ones that do. */
class NoSuchScopeError extends ConfigError {}

/** Reset-scope refused: a bridge or job is forwarding on the scope right now (exit 3). */
class ScopeInUseError extends BridgeError {
  constructor(message: string) {
    super(message, ExitCode.locked);
  }
}

interface IdState {
  id: string;
  /** The ID's key form (see ToolId). */
  idKey: string;
  /** Its claim key in Redis. */
  key: string;
  state: 'committed' | 'claimed' | 'in-doubt' | 'unknown';
  /** The claim's owner token (claimed and in-doubt only). */
  owner: string | undefined;
  /** Time left before the record expires, in ms; undefined when there is no record. */
  ttlMs: number | undefined;
  /** For a live claim: time left on its lease, in ms. */
  leaseMs: number | undefined;
}

// The tools look at every slice still stored, whatever window wrote it.
const ANY_WINDOW = Number.MAX_SAFE_INTEGER;

/**
 * The scope as stored under the prefix; a scope that was never written is an error that lists the
 * scopes that were, so that a wrong --scope or --redis-prefix is not read as "unknown, 0".
 */
async function openScope(redis: RedisClient, prefix: string, scope: string): Promise<DedupCache> {
  const cache = await DedupCache.existing(redis, { prefix, scope, windowMs: ANY_WINDOW });
  if (cache) return cache;
  // Listing the scopes takes SCAN, which the bridge's minimal ACL leaves out (it would show every
  // key name in the database): without it the error names the scope only.
  const scopes = await listScopes(redis, prefix).catch((error: Error) => {
    if (/NOPERM/.test(error.message)) return undefined;
    throw error;
  });
  if (scopes === undefined) {
    throw new NoSuchScopeError(
      `--scope: no such scope "${scope}" under --redis-prefix "${prefix}" (this Redis user may not SCAN, so the stored scopes are not listed); check --scope, --redis and --redis-prefix`,
    );
  }
  const shown = scopes.slice(0, 20).join(', ');
  const more = scopes.length > 20 ? ` and ${scopes.length - 20} more` : '';
  throw new NoSuchScopeError(
    scopes.length === 0
      ? `--scope: no such scope "${scope}": no scope is stored under --redis-prefix "${prefix}" on this Redis; check --redis and --redis-prefix`
      : `--scope: no such scope "${scope}" under --redis-prefix "${prefix}"; the scopes there are ${shown}${more}`,
  );
}

function glob(text: string): string {
  return text.replace(/[*?[\]\\]/g, '\\$&');
}

/**
 * The scopes stored under a prefix, sorted: one SCAN per server (each master of a Cluster) for the
 * scopes' layout keys `<prefix>:{<scope>}:layout` (a slot shard's `{<scope> <n>}` is skipped).
 */
async function listScopes(redis: RedisClient, prefix: string): Promise<string[]> {
  const head = `${prefix}:{`;
  const found = new Set<string>();
  for (const node of masterNodes(redis)) {
    let cursor = '0';
    do {
      const [next, keys] = await node.scan(cursor, 'MATCH', `${glob(prefix)}:{*}:layout`, 'COUNT', 1000);
      cursor = next;
      for (const key of keys) {
        const scope = key.slice(head.length, key.length - '}:layout'.length);
        if (key.startsWith(head) && key.endsWith('}:layout') && !/[\s{}]/.test(scope)) found.add(scope);
      }
    } while (cursor !== '0');
  }
  return [...found].sort();
}

/** What the cache holds for each ID. */
export async function inspectIds(
  redis: RedisClient,
  prefix: string,
  scope: string,
  ids: ToolId[],
): Promise<IdState[]> {
  const cache = await openScope(redis, prefix, scope);
  const now = await redisNow(redis);
  const keys = ids.map((id) => cache.keyOf(id.key));
  const records = await cache.lookup(keys);
  return ids.map(({ label: id, key: idKey }, index) => {
    const key = keys[index] as string;
    const record = records[index];
    const none = { id, idKey, key, owner: undefined, ttlMs: undefined, leaseMs: undefined };
    if (!record || record.state === 'unknown') return { ...none, state: 'unknown' };
    if (record.state === 'committed') return { ...none, state: 'committed', ttlMs: record.ttlMs };
    const claim = parseClaim(record.claim, now);
    return {
      ...none,
      state: claim.inDoubt ? 'in-doubt' : 'claimed',
      owner: claim.owner,
      ttlMs: record.ttlMs,
      leaseMs: claim.leaseMs,
    };
  });
}

/** A claim's value `c:<owner>:<lease expiry ms>:<in-doubt flag>`, read at `now`. */
function parseClaim(
  value: string,
  now: number,
): { owner: string | undefined; inDoubt: boolean; leaseMs: number } {
  const match = /^c:([^:]*):(\d+):([01])$/.exec(value);
  const expiry = Number(match?.[2] ?? 0);
  const live = expiry > now;
  return { owner: match?.[1], inDoubt: match?.[3] === '1' || !live, leaseMs: live ? expiry - now : 0 };
}

interface ScopeStats {
  committed: number;
  claimed: number;
  /** Bytes Redis reports for a sample of the keys, scaled to all of them. */
  approxBytes: number;
}

/**
 * Counts a scope's records: committed IDs from the slice totals in each shard's meta hash, claims
 * with SCAN (no KEYS); memory from a sample of the keys, scaled up.
 */
export async function scopeStats(redis: RedisClient, prefix: string, scope: string): Promise<ScopeStats> {
  const cache = await openScope(redis, prefix, scope);
  const now = await redisNow(redis);
  const usage = async (key: string) => Number((await redis.memory('USAGE', key).catch(() => 0)) ?? 0);
  let committed = 0;
  let approxBytes = 0;
  for (const base of cache.bases()) {
    for (const [slice, value] of Object.entries(await redis.hgetall(`${base}:m`))) {
      const [, total, expireAt, list] = value.split(':');
      // A slice past its expiry is gone (its buckets expired); the next commit drops its entry.
      if (Number(expireAt) <= now) continue;
      committed += Number(total);
      // Each generation from a few of its buckets (a bucket not created yet counts as 0 bytes).
      for (const [generation, buckets] of (list ?? '').split(',').map(Number).entries()) {
        const picks = Math.min(3, buckets);
        let bytes = 0;
        for (let bucket = 0; bucket < picks; bucket++) {
          bytes += await usage(`${base}:d:${slice}:${generation}:${bucket}`);
        }
        approxBytes += picks > 0 ? (bytes / picks) * buckets : 0;
      }
    }
  }
  // Claims: one SCAN per server (on a Cluster, each master) that matches every shard of the scope.
  let claimed = 0;
  let claimBytes = 0;
  let sampled = 0;
  await scanScope(redis, cache, prefix, scope, 'c:*', async (node, keys) => {
    claimed += keys.length;
    for (const key of keys.slice(0, 3)) {
      claimBytes += Number((await node.memory('USAGE', key).catch(() => 0)) ?? 0);
      sampled++;
    }
  });
  if (sampled > 0) approxBytes += (claimBytes / sampled) * claimed;
  return { committed, claimed, approxBytes: Math.round(approxBytes) };
}

async function redisNow(redis: RedisClient): Promise<number> {
  const [seconds, micros] = (await redis.time()) as [string | number, string | number];
  return Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
}

/** Calls `each` with every batch of the scope's keys (all its shards) that SCAN finds matching `tail`. */
async function scanScope(
  redis: RedisClient,
  cache: DedupCache,
  prefix: string,
  scope: string,
  tail: string,
  each: (node: ReturnType<typeof masterNodes>[number], keys: string[]) => Promise<void>,
): Promise<void> {
  const tag = cache.layout.shards === 1 ? `{${glob(scope)}}` : `{${glob(scope)} *}`;
  const pattern = `${glob(prefix)}:${tag}:${tail}`;
  for (const node of masterNodes(redis)) {
    let cursor = '0';
    do {
      const [next, keys] = await node.scan(cursor, 'MATCH', pattern, 'COUNT', 1000);
      cursor = next;
      if (keys.length > 0) await each(node, keys);
    } while (cursor !== '0');
  }
}

/** Deletes the records of the given IDs; returns, per ID, whether it had one. */
export async function forgetIds(
  redis: RedisClient,
  prefix: string,
  scope: string,
  ids: ToolId[],
): Promise<boolean[]> {
  const cache = await openScope(redis, prefix, scope);
  // One at a time, so that each ID's own outcome is known (the script counts the batch).
  const removed: boolean[] = [];
  for (const id of ids) removed.push((await cache.forget([cache.keyOf(id.key)])) > 0);
  return removed;
}

interface ResetResult {
  /** Committed IDs the scope held (live slices), now forgotten. */
  committed: number;
  /** Claims left by processes that stopped (in doubt or lapsed), now forgotten. */
  staleClaims: number;
  /** Redis keys deleted. */
  keys: number;
  /** The scope's slice length before, in ms (the window it was first written with set it). */
  sliceMs: number;
}

/**
 * Deletes everything stored for a scope — its layout, committed IDs and claims — so that the next
 * process to open it lays it out for its own --dedup-window (a scope first written with a short
 * trial window keeps short slices, and a long window is refused on it while it holds IDs).
 * Refused while any claim is live (a bridge is forwarding on the scope: exit 3); refused without
 * `force` while the scope holds committed IDs or claims left in doubt, since forgetting them means a
 * message with one of those IDs that comes again is forwarded again.
 */
export async function resetScope(
  redis: RedisClient,
  prefix: string,
  scope: string,
  options: { force: boolean },
): Promise<ResetResult> {
  const cache = await openScope(redis, prefix, scope);
  const now = await redisNow(redis);
  let committed = 0;
  let lastExpiry = now;
  for (const base of cache.bases()) {
    for (const value of Object.values(await redis.hgetall(`${base}:m`))) {
      const [, total, expireAt] = value.split(':');
      if (Number(expireAt) <= now) continue;
      committed += Number(total);
      if (Number(total) > 0) lastExpiry = Math.max(lastExpiry, Number(expireAt));
    }
  }
  let staleClaims = 0;
  const owners = new Set<string>();
  let live = 0;
  await scanScope(redis, cache, prefix, scope, 'c:*', async (node, keys) => {
    const values = await node.mget(...keys);
    for (const value of values) {
      if (value === null) continue;
      const claim = parseClaim(value, now);
      if (claim.inDoubt) staleClaims++;
      else {
        live++;
        if (claim.owner) owners.add(claim.owner);
      }
    }
  });
  if (live > 0) {
    throw new ScopeInUseError(
      `cache reset-scope: scope "${scope}" is in use: ${live} ID(s) are being forwarded now (claims held by ${[...owners].join(', ')}); stop every bridge and migrate job that writes to it, then reset`,
    );
  }
  if ((committed > 0 || staleClaims > 0) && !options.force) {
    const doubt = staleClaims > 0 ? ` and ${staleClaims} claim(s) left in doubt` : '';
    throw new ConfigError(
      `cache reset-scope: scope "${scope}" holds ${committed} committed ID(s)${doubt}; a reset forgets them, so a message with one of those IDs that comes again is forwarded again. If they are from a trial, add --force; or wait until they expire (the last in ${humanDuration(Math.max(0, lastExpiry - now))})`,
    );
  }
  const keys: string[] = [];
  await scanScope(redis, cache, prefix, scope, '*', async (_node, found) => {
    keys.push(...found);
  });
  // The layout keys last: a reset cut short leaves the scope listed, to be reset again.
  const scopeLayout = `${prefix}:{${scope}}:layout`;
  const data = keys.filter((key) => !key.endsWith(':layout'));
  const layouts = [...new Set([...keys.filter((key) => key.endsWith(':layout')), scopeLayout])];
  let deleted = 0;
  for (const group of [data, layouts]) {
    for (let at = 0; at < group.length; at += 500) {
      const counts = await Promise.all(group.slice(at, at + 500).map((key) => redis.unlink(key)));
      deleted += counts.reduce((sum, count) => sum + count, 0);
    }
  }
  return { committed, staleClaims, keys: deleted, sliceMs: cache.layout.sliceMs };
}
