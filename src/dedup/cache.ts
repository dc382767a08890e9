import { randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import type { ChainableCommander } from 'ioredis';
import type { RedisClient } from './redis.js';

export type ClaimState = 'new' | 'dup' | 'busy' | 'in-doubt';
export type CommitResult = 'committed' | 'already' | 'taken' | 'restored';

const CLAIM_STATES: readonly ClaimState[] = ['new', 'dup', 'busy', 'in-doubt'];
const COMMIT_RESULTS: readonly CommitResult[] = ['committed', 'committed', 'already', 'taken', 'restored'];

const SCRIPTS = ['claim', 'commit', 'release', 'renew'] as const;
type ScriptName = (typeof SCRIPTS)[number];

function loadScript(name: ScriptName): string {
  return readFileSync(new URL(`./lua/${name}.lua`, import.meta.url), 'utf8');
}

/** A token that names this process as the owner of its claims; never contains ':'. */
export function newOwnerToken(): string {
  return randomBytes(9).toString('base64url').replace(/[-_]/g, 'x');
}

/** Builds `<prefix>:{<scope>}:<id>`; the braces keep one scope in one Redis Cluster slot. */
export function cacheKey(prefix: string, scope: string, idKey: string): string {
  return `${prefix}:{${scope}}:${idKey}`;
}

export interface DedupCacheOptions {
  token: string;
  leaseMs: number;
  windowMs: number;
}

type ScriptCall = (numKeys: number, ...args: (string | number)[]) => Promise<number[]>;

/**
 * The shared record of which IDs the target holds (committed) and which are being forwarded
 * (claimed). Each method takes a whole batch of keys from one scope in one script call.
 */
export class DedupCache {
  readonly token: string;
  private readonly leaseMs: number;
  private readonly windowMs: number;
  private readonly scripts: Record<ScriptName, ScriptCall>;

  constructor(
    readonly redis: RedisClient,
    options: DedupCacheOptions,
  ) {
    this.token = options.token;
    this.leaseMs = options.leaseMs;
    this.windowMs = options.windowMs;
    const calls = {} as Record<ScriptName, ScriptCall>;
    for (const name of SCRIPTS) {
      const command = `dedupBridge_${name}`;
      if (!(command in redis)) redis.defineCommand(command, { lua: loadScript(name) });
      const call = (redis as unknown as Record<string, ScriptCall>)[command] as ScriptCall;
      calls[name] = call.bind(redis);
    }
    this.scripts = calls;
  }

  async claim(keys: readonly string[]): Promise<ClaimState[]> {
    if (keys.length === 0) return [];
    const reply = await this.scripts.claim(keys.length, ...keys, this.token, this.leaseMs, this.windowMs);
    return reply.map((code) => CLAIM_STATES[code] as ClaimState);
  }

  async commit(keys: readonly string[]): Promise<CommitResult[]> {
    if (keys.length === 0) return [];
    const reply = await this.scripts.commit(keys.length, ...keys, this.token, this.windowMs);
    return reply.map((code) => COMMIT_RESULTS[code] as CommitResult);
  }

  /**
   * Gives up our claims. With `keepInDoubt` the claim stays, expired and flagged, so whoever
   * claims the ID next (we included) forwards it flagged in-doubt.
   */
  /** Queues the commit of `keys` on a MULTI, so it lands with the caller's own writes or not at all. */
  commitIn(transaction: ChainableCommander, keys: readonly string[]): void {
    const queue = transaction as unknown as Record<string, (...args: (string | number)[]) => unknown>;
    queue.dedupBridge_commit?.(keys.length, ...keys, this.token, this.windowMs);
  }

  async release(keys: readonly string[], options: { keepInDoubt?: boolean } = {}): Promise<number> {
    if (keys.length === 0) return 0;
    const mode = options.keepInDoubt ? 'doubt' : 'drop';
    const reply = await this.scripts.release(keys.length, ...keys, this.token, mode);
    return reply.reduce((sum, code) => sum + code, 0);
  }

  async renew(keys: readonly string[]): Promise<number> {
    if (keys.length === 0) return 0;
    const reply = await this.scripts.renew(keys.length, ...keys, this.token, this.leaseMs);
    return reply.reduce((sum, code) => sum + code, 0);
  }
}
