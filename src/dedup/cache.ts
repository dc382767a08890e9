import { hash, randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { type ChainableCommander, Cluster, type Redis } from 'ioredis';
import { Coalescer } from '../coalesce.js';
import { formatDuration } from '../config/duration.js';
import { ConfigError } from '../errors.js';
import type { ClaimState, Claims, CommitResult } from '../ports.js';
import { asMissingGrant, type RedisClient } from './redis.js';

const CLAIM_STATES: readonly ClaimState[] = ['new', 'dup', 'busy', 'in-doubt', 'reclaimed'];
const COMMIT_RESULTS: readonly CommitResult[] = ['committed', 'committed', 'already', 'taken', 'restored'];

// Scripts that read or write committed IDs get the shared committed.lua functions in front.
const SCRIPTS = {
  claim: true,
  commit: true,
  release: false,
  renew: false,
  lookup: true,
  forget: true,
  relayout: false,
} as const;
type ScriptName = keyof typeof SCRIPTS;

function loadScript(name: ScriptName): string {
  const read = (file: string) => readFileSync(new URL(`./lua/${file}.lua`, import.meta.url), 'utf8');
  return SCRIPTS[name] ? `${read('committed')}\n${read(name)}` : read(name);
}

/** The oldest Redis the scripts run on: commit uses GETDEL (6.2). */
const MIN_REDIS: readonly [number, number] = [6, 2];

/**
 * Refuses a Redis older than MIN_REDIS before anything is claimed: there, claims would succeed and
 * every commit fail, so messages would reach the target and never be acked.
 */
async function requireRedisVersion(redis: RedisClient): Promise<void> {
  const problem = redisVersionProblem(await redis.info('server'));
  if (problem) throw new ConfigError(problem);
}

/** What is wrong with the Redis that wrote this INFO server text, or undefined when it will do. */
export function redisVersionProblem(info: string): string | undefined {
  const version = /^redis_version:(\S+)/m.exec(info)?.[1];
  if (version === undefined) return undefined; // a proxy that hides it: the scripts will tell
  const [major = 0, minor = 0] = version.split('.').map(Number);
  const [needMajor, needMinor] = MIN_REDIS;
  if (major > needMajor || (major === needMajor && minor >= needMinor)) return undefined;
  return `Redis ${version} is too old: dedup-bridge needs Redis ${needMajor}.${needMinor} or later (its scripts use GETDEL); upgrade Redis or point --redis at a newer one`;
}

/** A token that names this process as the owner of its claims; never contains ':'. */
export function newOwnerToken(): string {
  return randomBytes(9).toString('base64url').replace(/[-_]/g, 'x');
}

/**
 * How a scope's records are laid out, fixed when the scope is first written (a reader with
 * another layout would not find the IDs): how many Redis Cluster slots they are spread over, and
 * how much commit time one slice of committed IDs covers. Each slot shard stores its layout in its
 * own slot too (`<base>:layout`; with one shard that is the scope's layout key), and the scripts go
 * by that one, not by what the caller read at start: the slice length of a scope with nothing
 * committed may be changed by a process with a longer window (see `open`).
 */
interface CacheLayout {
  shards: number;
  sliceMs: number;
}

/** Slot shards of a new scope on a Redis Cluster: enough to spread a busy scope over the masters. */
const CLUSTER_SHARDS = 16;
const MIN_SLICE_MS = 60_000;
/** Slices a lookup may walk: a window this many times its scope's slice length is refused. */
const MAX_SLICES_PER_WINDOW = 16;

/** A quarter of the window, at least 1 min: IDs are kept up to one slice past the window. */
export function sliceLengthFor(windowMs: number): number {
  return Math.max(MIN_SLICE_MS, Math.round(windowMs / 4));
}

function layoutKey(prefix: string, scope: string): string {
  return `${prefix}:{${scope}}:layout`;
}

function formatLayout(layout: CacheLayout): string {
  return `v1 shards=${layout.shards} slice=${layout.sliceMs}`;
}

function parseLayout(value: string, where: string): CacheLayout {
  const match = /^v1 shards=(\d+) slice=(\d+)$/.exec(value);
  if (!match) {
    throw new ConfigError(
      `${where} holds "${value}", not a layout this version understands; is --redis-prefix shared with something else?`,
    );
  }
  return { shards: Number(match[1]), sliceMs: Number(match[2]) };
}

/**
 * The key tag of one slot shard of a scope. A scope has no spaces, so `{<scope> <n>}` never
 * equals another scope's tag.
 */
function baseOf(prefix: string, scope: string, shard: number, shards: number): string {
  return shards === 1 ? `${prefix}:{${scope}}` : `${prefix}:{${scope} ${shard}}`;
}

/**
 * An ID's SHA-1 digest as a 20-character latin1 string, one character per byte: its first 16 bytes
 * are what the scripts take for the ID (12 that stand for it in the committed hashes, then 4 that
 * pick its bucket within a generation, see digest_at in committed.lua), the last 4 pick the slot
 * shard. A string, not a Buffer: Node makes it five times faster, and it is no ArrayBuffer for the
 * garbage collector to track per message.
 */
type Digest = string;

function digestOf(idKey: string): Digest {
  return hash('sha1', idKey, 'binary');
}

/** The slot shard a digest picks (its last 4 bytes, big-endian). */
function shardOf(digest: Digest): number {
  return (
    ((digest.charCodeAt(16) << 24) |
      (digest.charCodeAt(17) << 16) |
      (digest.charCodeAt(18) << 8) |
      digest.charCodeAt(19)) >>>
    0
  );
}

// Digests of recent claim keys: a key is made once per message and then claimed and committed,
// each needing its digest. Bounded: emptied when full (a miss only costs a hash).
const recentDigests = new Map<string, Digest>();
const RECENT_DIGESTS_MAX = 16_384;

function digestOfKey(key: string): Digest {
  let digest = recentDigests.get(key);
  if (digest === undefined) {
    digest = digestOf(splitKey(key).idKey);
    rememberDigest(key, digest);
  }
  return digest;
}

function rememberDigest(key: string, digest: Digest): void {
  if (recentDigests.size >= RECENT_DIGESTS_MAX) recentDigests.clear();
  recentDigests.set(key, digest);
}

const CLAIM_MARK = ':c:';

/** Splits a claim key `<base>:c:<idKey>` (the base ends at the first '}'). */
function splitKey(key: string): { base: string; idKey: string } {
  const end = key.indexOf('}') + 1;
  return { base: key.slice(0, end), idKey: key.slice(end + CLAIM_MARK.length) };
}

/** The keys' digests as one argument, 16 bytes each, in their order (the scripts split it). */
function packedDigests(keys: readonly string[]): Buffer {
  const packed = Buffer.allocUnsafe(keys.length * 16);
  for (let i = 0; i < keys.length; i++) packed.write(digestOfKey(keys[i] as string), i * 16, 16, 'latin1');
  return packed;
}

/**
 * The key count and keys of a script that reads committed IDs: the shard's meta hash and layout
 * key first.
 */
function withMeta(base: string, keys: readonly string[]): [number, ...string[]] {
  return [keys.length + 2, `${base}:m`, `${base}:layout`, ...keys];
}

/**
 * How long one WAIT may block the commit connection while the replicas are behind. It is then sent
 * again, with the commit, for as long as it takes: the caller acks nothing meanwhile.
 */
const WAIT_TIMEOUT_MS = 500;
/** The most IDs of one shard that go in one commit under --redis-wait-replicas (--batch-size's limit). */
const MAX_GROUP_IDS = 5000;
/** How long a shard's write mark (see commitDurably) outlives the last commit that set it. */
const MARK_TTL_MS = 60_000;

/** The commit script as commitDurably sends it itself: by its SHA1, or whole when Redis lacks it. */
const COMMIT_LUA = loadScript('commit');
const COMMIT_SHA = hash('sha1', COMMIT_LUA, 'hex');

/** Commits waiting on replicas (behind: true), and their end; see DedupCacheOptions.onReplicas. */
interface ReplicaEvent {
  behind: boolean;
  /** --redis-wait-replicas */
  wanted: number;
  /** behind: how many replicas the WAIT that came short counted. */
  acked?: number;
  /** caught up: how long commits waited for the replicas. */
  heldMs?: number;
}

// The scripts' reply when a shard's stored layout spreads the scope over another number of shards
// than the caller's: its keys would be on the wrong shards.
const LAYOUT_ERROR = /^DEDUPLAYOUT /;

export interface DedupCacheOptions {
  token: string;
  leaseMs: number;
  windowMs: number;
  prefix: string;
  scope: string;
  /**
   * Slot shards for a scope not written yet: a number, or 'auto' (default: CLUSTER_SHARDS on a
   * Redis Cluster, else 1). A scope already written keeps its layout; a different number given
   * explicitly is an error.
   */
  shards?: number | 'auto';
  /**
   * The time the scripts go by, in ms since the epoch: which slice a commit lands in, when slices
   * and leases run out. Default: the Redis server's clock (the scripts read TIME), the one clock
   * every process on the scope shares. Tests pass a fixed one, so that nothing they assert
   * depends on where in a slice the wall clock happens to be.
   */
  clock?: () => number;
  /**
   * Replicas that must hold a commit before `commit` returns (Redis WAIT); 0, the default: it
   * returns when the master answers. While fewer replicas acknowledge it, `commit` keeps waiting
   * (and so its caller keeps the messages unacked): see commitDurably.
   */
  waitReplicas?: number;
  /**
   * The connection `commit` uses when it waits for replicas, default `redis`: a client of its own
   * keeps a WAIT that blocks while the replicas are behind from holding up claims and renewals.
   */
  commitRedis?: RedisClient;
  /** Told once when commits start waiting on replicas that are behind, and once when they stop. */
  onReplicas?: (event: ReplicaEvent) => void;
}

interface IdRecord {
  state: 'unknown' | 'committed' | 'claimed';
  /** Time before the record expires, in ms; -2 when there is none. */
  ttlMs: number;
  /** The claim value (claimed only): c:<owner>:<lease expiry ms>:<in-doubt flag>. */
  claim: string;
}

type Arg = string | number | Buffer;

type ScriptCall = (numKeys: number, ...args: Arg[]) => Promise<unknown>;

/**
 * The shared record of which IDs the target holds (committed) and which are being forwarded
 * (claimed), for one scope. Each method takes a batch of claim keys (from `keyOf`) and makes one
 * script call per slot shard among them.
 */
export class DedupCache implements Claims {
  readonly token: string;
  /**
   * How many IDs a new scope's first slice should have room for (the bridge sets the source
   * backlog): sized right, a first migration run keeps one generation, so one lookup per new ID.
   */
  expectedIds = 0;
  private readonly scripts: Record<ScriptName, ScriptCall>;
  /** What the caller passes the scripts; each shard's stored layout counts (see CacheLayout). */
  private current: CacheLayout;
  /** The same as the scripts take it: the default for a shard that stores none. */
  private currentText: string;
  private readonly waitReplicas: number;
  private readonly commitRedis: RedisClient;
  /** Counts the commit connection's reconnects (one server or Sentinel; see commitDurably). */
  private commitEpoch = 0;
  /**
   * Shards whose last WAIT came back short, until one of their commits gets its replicas (a commit
   * whose caller gave up stays counted: the caller retries it); and since when there have been any.
   */
  private readonly behindShards = new Set<string>();
  private behindSince: number | undefined;
  /** Per shard under --redis-wait-replicas: its commits, a group at a time (see commitDurably). */
  private readonly lanes = new Map<string, Coalescer<unknown>>();
  /** Shards whose server has run the commit script sent whole, so that its SHA1 will do. */
  private readonly loadedOn = new Set<string>();

  private constructor(
    readonly redis: RedisClient,
    private readonly options: DedupCacheOptions,
    layout: CacheLayout,
  ) {
    this.token = options.token;
    this.current = layout;
    this.currentText = formatLayout(layout);
    const calls = {} as Record<ScriptName, ScriptCall>;
    for (const name of Object.keys(SCRIPTS) as ScriptName[]) {
      const command = `dedupBridge_${name}`;
      if (!(command in redis)) redis.defineCommand(command, { lua: loadScript(name) });
      const call = (redis as unknown as Record<string, ScriptCall>)[command] as ScriptCall;
      calls[name] = call.bind(redis);
    }
    this.scripts = calls;
    this.waitReplicas = options.waitReplicas ?? 0;
    this.commitRedis = options.commitRedis ?? redis;
    // A Cluster's node connections never reconnect (ioredis drops a lost node's connection and
    // opens another for the slot's new master): only a single connection has reconnects to count.
    if (this.waitReplicas > 0 && !(this.commitRedis instanceof Cluster)) {
      this.commitRedis.on('close', () => {
        this.commitEpoch++;
      });
    }
  }

  /** Reads the scope's layout, or records one for a new scope, and returns the cache. */
  static async open(redis: RedisClient, options: DedupCacheOptions): Promise<DedupCache> {
    try {
      return await DedupCache.openScope(redis, options);
    } catch (error) {
      throw asMissingGrant(error, 'opening the dedup scope');
    }
  }

  private static async openScope(redis: RedisClient, options: DedupCacheOptions): Promise<DedupCache> {
    await requireRedisVersion(redis);
    const key = layoutKey(options.prefix, options.scope);
    const cluster = (redis as unknown as { isCluster?: boolean }).isCluster === true;
    const wanted: CacheLayout = {
      shards:
        options.shards === undefined || options.shards === 'auto'
          ? cluster
            ? CLUSTER_SHARDS
            : 1
          : options.shards,
      sliceMs: sliceLengthFor(options.windowMs),
    };
    await redis.set(key, formatLayout(wanted), 'NX');
    const stored = await redis.get(key);
    const layout = stored === null ? wanted : parseLayout(stored, key);
    if (typeof options.shards === 'number' && options.shards !== layout.shards) {
      throw new ConfigError(
        `--cache-shards: scope "${options.scope}" is stored over ${layout.shards} shard(s); keep that number (with another, the IDs it remembers would not be found)`,
      );
    }
    const cache = new DedupCache(redis, options, layout);
    // The first writer's window set the slice length; a much longer window would make every
    // lookup walk many slices. Nothing committed yet: take a slice length that suits this window.
    if (options.windowMs > layout.sliceMs * MAX_SLICES_PER_WINDOW) {
      await cache.relayout({ ...layout, sliceMs: wanted.sliceMs });
    }
    return cache;
  }

  /**
   * Re-slices a scope with nothing committed for this process's longer window, shard by shard, each
   * in one script (no commit lands between the check and the change); processes already running
   * go by the new layout from their next call. Refused (ConfigError) when IDs are committed.
   */
  private async relayout(wider: CacheLayout): Promise<void> {
    const { prefix, scope } = this.options;
    const refused = () =>
      new ConfigError(
        `--dedup-window: scope "${scope}" keeps its IDs in slices of ${formatDuration(this.current.sliceMs)} (set by the window it was first written with); a window over ${formatDuration(this.current.sliceMs * MAX_SLICES_PER_WINDOW)} would make every lookup walk more than ${MAX_SLICES_PER_WINDOW} slices while it holds IDs: use a shorter window, or another --scope, or, if its IDs are from a trial with a short window, delete them with \`dedup-bridge cache reset-scope --scope ${scope} --yes\` (see --force there)`,
      );
    // Looked at first, so that a scope in use is refused without changing any shard.
    const metas = this.bases().map((base) => this.redis.exists(`${base}:m`));
    if ((await Promise.all(metas)).some((found) => found > 0)) throw refused();
    const text = formatLayout(wider);
    const kept = await Promise.all(
      this.bases().map((base) => this.scripts.relayout(2, `${base}:m`, `${base}:layout`, text)),
    );
    // A commit came first on some shard: it keeps its slices (the scripts read each shard's own).
    if (kept.some((layout) => layout !== text)) throw refused();
    // Over several shards the scope's key is another slot's: new processes start from it.
    if (this.current.shards > 1) await this.redis.set(layoutKey(prefix, scope), text);
    this.current = wider;
    this.currentText = text;
  }

  /** For the cache tools: the scope's layout if it was ever written, without creating one. */
  static async existing(
    redis: RedisClient,
    options: Omit<DedupCacheOptions, 'token' | 'leaseMs'>,
  ): Promise<DedupCache | undefined> {
    const stored = await redis.get(layoutKey(options.prefix, options.scope));
    if (stored === null) return undefined;
    const layout = parseLayout(stored, layoutKey(options.prefix, options.scope));
    return new DedupCache(redis, { ...options, token: 'tools', leaseMs: 1000 }, layout);
  }

  /** The scope's layout as this process read it at start (or set it for its window). */
  get layout(): CacheLayout {
    return this.current;
  }

  /** The claim key of an ID (its key form from dedup/id); it also names the ID to the other methods. */
  keyOf(idKey: string): string {
    const digest = digestOf(idKey);
    const shard = shardOf(digest) % this.layout.shards;
    const key = `${baseOf(this.options.prefix, this.options.scope, shard, this.layout.shards)}${CLAIM_MARK}${idKey}`;
    rememberDigest(key, digest);
    return key;
  }

  /** Every slot shard's base, for tools that walk the whole scope. */
  bases(): string[] {
    return Array.from({ length: this.layout.shards }, (_, shard) =>
      baseOf(this.options.prefix, this.options.scope, shard, this.layout.shards),
    );
  }

  async claim(keys: readonly string[]): Promise<ClaimState[]> {
    const { leaseMs, windowMs } = this.options;
    const codes = await this.perShard(keys, (base, group) =>
      this.scripts.claim(
        ...withMeta(base, group),
        this.token,
        leaseMs,
        windowMs,
        this.currentText,
        packedDigests(group),
        this.now(),
      ),
    );
    return codes.map((code) => CLAIM_STATES[code as number] as ClaimState);
  }

  /**
   * Commits the IDs. With `waitReplicas`, returns only once that many replicas hold the commit (see
   * commitDurably); the replies are those of each shard's first commit.
   */
  async commit(keys: readonly string[]): Promise<CommitResult[]> {
    const codes = await this.perShard(keys, (base, group) =>
      this.waitReplicas > 0
        ? this.commitDurably(base, group)
        : this.scripts.commit(...this.commitArgs(base, group)),
    );
    return codes.map((code) => COMMIT_RESULTS[code as number] as CommitResult);
  }

  /** Since when commits have been waiting on replicas that are behind; undefined when none are. */
  get replicasBehindSince(): number | undefined {
    return this.behindSince;
  }

  /**
   * One shard's commit, returned only once `waitReplicas` replicas hold it. A shard's commits go
   * one group at a time: those that arrive while one is out (or waiting on lagging replicas) go
   * together as the next, one script call and one WAIT, so that a WAIT that blocks delays no
   * other WAIT of the shard and a shard never has more than one in the connection.
   */
  private commitDurably(base: string, keys: string[]): Promise<unknown[]> {
    let lane = this.lanes.get(base);
    if (!lane) {
      lane = new Coalescer(MAX_GROUP_IDS, (group) => this.commitReplicated(base, group));
      this.lanes.set(base, lane);
    }
    return lane.submit(keys);
  }

  /**
   * Commits the keys of one shard and waits until `waitReplicas` replicas hold the commit. Each
   * attempt is one pipeline on one connection, so on a Cluster it reaches the master that holds
   * the shard's slot: the commit script, a write of the shard's mark key, and WAIT. WAIT waits
   * for this connection's last write to reach the replicas; the mark makes that write come after
   * the IDs' records even when the script wrote nothing (every ID already committed, by another
   * process or by an earlier attempt of ours), so whatever WAIT counts holds those records. An
   * attempt whose WAIT comes back short, or whose replies straddle a reconnect (a resent WAIT on
   * another server would not cover a commit made on the old one), is made again whole: the script
   * commits what a failover lost ('restored') and finds the rest committed. Returns the replies
   * of the first attempt that committed; errors go to the caller, which retries.
   */
  private async commitReplicated(base: string, keys: string[]): Promise<unknown[]> {
    const wanted = this.waitReplicas;
    let first: unknown[] | undefined;
    for (;;) {
      const epoch = this.commitEpoch;
      const args = this.commitArgs(base, keys);
      const batch = (this.commitRedis as Redis).pipeline();
      // Whole the first time on a shard (and after a NOSCRIPT), by its SHA1 after that.
      const whole = !this.loadedOn.has(base);
      if (whole) batch.eval(COMMIT_LUA, ...args);
      else batch.evalsha(COMMIT_SHA, ...args);
      batch.set(`${base}:w`, this.token, 'PX', MARK_TTL_MS);
      batch.wait(wanted, WAIT_TIMEOUT_MS);
      const [committed, marked, waited] = ((await batch.exec()) ?? []) as [Error | null, unknown][];
      const commitError = committed?.[0];
      if (commitError) {
        // Not loaded on this server (a new master, a flushed script cache): send it whole.
        if (!whole && /^NOSCRIPT/.test(commitError.message)) {
          this.loadedOn.delete(base);
          continue;
        }
        // The slot moved (a failover, a resharding) and the WAIT went through on the old node, so
        // ioredis did not send the pipeline again: look the slots up, for the caller's retry.
        if (/^(MOVED|ASK) /.test(commitError.message) && this.commitRedis instanceof Cluster) {
          this.commitRedis.refreshSlotsCache();
        }
        throw commitError;
      }
      this.loadedOn.add(base);
      first ??= committed?.[1] as unknown[];
      if (marked?.[0]) throw marked[0];
      const waitError = waited?.[0];
      if (waitError) {
        throw /NOPERM/.test(waitError.message)
          ? new Error(
              `${waitError.message}: --redis-wait-replicas needs the Redis user to be allowed WAIT (+wait)`,
              { cause: waitError },
            )
          : waitError;
      }
      if (this.commitEpoch !== epoch) continue;
      const acked = Number(waited?.[1]);
      if (acked >= wanted) {
        this.replicasCaughtUp(base);
        return first;
      }
      this.replicasBehind(base, acked);
    }
  }

  /** Said once for as long as any shard waits on its replicas, not once per batch or shard. */
  private replicasBehind(base: string, acked: number): void {
    this.behindShards.add(base);
    if (this.behindSince !== undefined) return;
    this.behindSince = Date.now();
    this.options.onReplicas?.({ behind: true, wanted: this.waitReplicas, acked });
  }

  private replicasCaughtUp(base: string): void {
    if (!this.behindShards.delete(base) || this.behindShards.size > 0) return;
    const heldMs = Date.now() - (this.behindSince ?? Date.now());
    this.behindSince = undefined;
    this.options.onReplicas?.({ behind: false, wanted: this.waitReplicas, heldMs });
  }

  /** Queues the commit of `keys` on a MULTI, so it lands with the caller's own writes or not at all. */
  commitIn(transaction: ChainableCommander, keys: readonly string[]): void {
    const queue = transaction as unknown as Record<string, (...args: Arg[]) => unknown>;
    for (const [base, group] of this.groups(keys)) {
      queue.dedupBridge_commit?.(...this.commitArgs(base, group.keys));
    }
  }

  /**
   * Gives up our claims. With `keepInDoubt` the claim stays, expired and flagged, so whoever
   * claims the ID next (we included) forwards it flagged in-doubt.
   */
  async release(keys: readonly string[], options: { keepInDoubt?: boolean } = {}): Promise<number> {
    const mode = options.keepInDoubt ? 'doubt' : 'drop';
    const codes = await this.perShard(keys, (_, group) =>
      this.scripts.release(group.length, ...group, this.token, mode, this.options.windowMs),
    );
    return codes.reduce((sum: number, code) => sum + (code as number), 0);
  }

  /**
   * Drops the claims of these IDs whoever holds them (committed IDs are left alone): an exact
   * target found that no copy of them was stored, so the next claim is a plain 'new'.
   */
  async unclaim(keys: readonly string[]): Promise<number> {
    const codes = await this.perShard(keys, (_, group) =>
      this.scripts.release(group.length, ...group, '*', 'drop', this.options.windowMs),
    );
    return codes.reduce((sum: number, code) => sum + (code as number), 0);
  }

  /** Extends our leases; returns how many were still ours (see renewEach). */
  async renew(keys: readonly string[]): Promise<number> {
    return (await this.renewEach(keys)).filter(Boolean).length;
  }

  /**
   * Extends our leases, one answer per key: true renewed, false no longer ours (committed, taken
   * over by another owner whose turn came when ours ran out, or released).
   */
  async renewEach(keys: readonly string[]): Promise<boolean[]> {
    const codes = await this.perShard(keys, (_, group) =>
      this.scripts.renew(
        group.length,
        ...group,
        this.token,
        this.options.leaseMs,
        this.now(),
        this.options.windowMs,
      ),
    );
    return codes.map((code) => code === 1);
  }

  /** What the cache holds for each key; changes nothing. */
  async lookup(keys: readonly string[]): Promise<IdRecord[]> {
    const replies = await this.perShard(keys, (base, group) =>
      this.scripts.lookup(
        ...withMeta(base, group),
        this.options.windowMs,
        this.currentText,
        packedDigests(group),
        this.now(),
      ),
    );
    return replies.map((reply) => {
      const [state, ttlMs, claim] = reply as [number, number, string];
      return { state: (['unknown', 'committed', 'claimed'] as const)[state] ?? 'unknown', ttlMs, claim };
    });
  }

  /** Deletes every record of the keys; returns how many had one. */
  async forget(keys: readonly string[]): Promise<number> {
    const codes = await this.perShard(keys, (base, group) =>
      this.scripts.forget(...withMeta(base, group), this.currentText, packedDigests(group), this.now()),
    );
    return codes.reduce((sum: number, code) => sum + (code as number), 0);
  }

  private commitArgs(base: string, keys: readonly string[]): [number, ...Arg[]] {
    return [
      ...withMeta(base, keys),
      this.token,
      this.options.windowMs,
      this.currentText,
      packedDigests(keys),
      // Each slot shard holds its share of the IDs.
      Math.ceil(this.expectedIds / this.layout.shards),
      this.now(),
    ];
  }

  /**
   * A script's DEDUPLAYOUT reply as the error it is: a shard's layout key was written again (or
   * spoilt) since this process read the scope's, with another shard count, so its keys would be
   * on the wrong shards. Nothing a retry mends.
   */
  private layoutRefusal(error: unknown): unknown {
    const message = error instanceof Error ? error.message : '';
    if (!LAYOUT_ERROR.test(message)) return error;
    return new ConfigError(
      `scope "${this.options.scope}": ${message.replace(LAYOUT_ERROR, '')}; its layout was written again while this process ran, with another shard count: restart it (with the scope's --cache-shards)`,
      { cause: error },
    );
  }

  /** The scripts' last argument: the injected clock's time, or '' for the Redis server's TIME. */
  private now(): number | '' {
    const clock = this.options.clock;
    return clock ? Math.floor(clock()) : '';
  }

  private groups(keys: readonly string[]): Map<string, { keys: string[]; at: number[] }> {
    const groups = new Map<string, { keys: string[]; at: number[] }>();
    keys.forEach((key, index) => {
      const { base } = splitKey(key);
      let group = groups.get(base);
      if (!group) {
        group = { keys: [], at: [] };
        groups.set(base, group);
      }
      group.keys.push(key);
      group.at.push(index);
    });
    return groups;
  }

  /** One script call per slot shard, in parallel; the replies come back in the order of `keys`. */
  private async perShard(
    keys: readonly string[],
    shardCall: (base: string, group: string[]) => Promise<unknown>,
  ): Promise<unknown[]> {
    if (keys.length === 0) return [];
    const call = (base: string, group: string[]) =>
      shardCall(base, group).catch((error: unknown) => {
        throw this.layoutRefusal(error);
      });
    if (this.current.shards === 1) {
      // One shard: every key has the scope's one base (no need to split each key to find it).
      return (await call(splitKey(keys[0] as string).base, keys as string[])) as unknown[];
    }
    const groups = this.groups(keys);
    if (groups.size === 1) {
      const [base] = groups.keys();
      return (await call(base as string, keys as string[])) as unknown[];
    }
    const out = new Array<unknown>(keys.length);
    await Promise.all(
      [...groups].map(async ([base, group]) => {
        const reply = (await call(base, group.keys)) as unknown[];
        group.at.forEach((index, i) => {
          out[index] = reply[i];
        });
      }),
    );
    return out;
  }
}
