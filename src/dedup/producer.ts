import { readFileSync } from 'node:fs';
import type { RedisClient } from './redis.js';

/**
 * What Redis keeps of a stream producer (a route's named publisher on its target stream): who owns
 * it and since which epoch, the last publishing ID given out, and the ledger of claims whose
 * messages were given an ID and are not yet known committed. The stream target (src/stream/
 * target.ts) is the one user; the keys share one hash slot, `<prefix>:{<scope>}:producer:<name>`.
 */

/** The caller no longer owns the producer: another bridge took it over. */
class ProducerFencedError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'ProducerFencedError';
  }
}

type TakeReply =
  | { ours: true; epoch: string }
  | { ours: false; waitMs: number }
  | { ours: false; over: true };

type ScriptName = 'producer-take' | 'producer-reserve' | 'producer-settle' | 'producer-leave';
type ScriptCall = (...args: (string | number)[]) => Promise<unknown>;

/** A Lua script of src/dedup/lua, defined once per connection and called by its SHA. */
function script(redis: RedisClient, name: ScriptName): ScriptCall {
  const command = `dedupBridge_${name.replace('-', '_')}`;
  if (!(command in redis)) {
    redis.defineCommand(command, {
      lua: readFileSync(new URL(`./lua/${name}.lua`, import.meta.url), 'utf8'),
    });
  }
  return ((redis as unknown as Record<string, ScriptCall>)[command] as ScriptCall).bind(redis);
}

function fenced(error: unknown): unknown {
  if (error instanceof Error && /^DEDUPFENCED/.test(error.message)) {
    return new ProducerFencedError(error.message.replace(/^DEDUPFENCED /, ''));
  }
  return error;
}

export class ProducerStore {
  private readonly owner: string;
  private readonly epochKey: string;
  private readonly seq: string;
  private readonly ledgerKey: string;
  /** "<token>:<epoch>" while we own the producer. */
  private held = '';

  constructor(
    private readonly redis: RedisClient,
    base: string,
    private readonly token: string,
    private readonly leaseMs: number,
  ) {
    this.owner = `${base}:owner`;
    this.epochKey = `${base}:epoch`;
    this.seq = `${base}:seq`;
    this.ledgerKey = `${base}:ledger`;
  }

  /** The producer's keys' common part, in one hash slot. */
  static baseOf(prefix: string, scope: string, producer: string): string {
    return `${prefix}:{${scope}}:producer:${producer}`;
  }

  get epoch(): string {
    return this.held.slice(this.held.indexOf(':') + 1);
  }

  /**
   * Takes the producer anew (ours: a new epoch), or keeps it (renewal; also after our lease lapsed
   * while nobody took it). `over`: another owner took it since ours.
   */
  async take(): Promise<TakeReply> {
    const keeping = this.held !== '';
    const [code, value] = (await script(this.redis, 'producer-take')(
      2,
      this.owner,
      this.epochKey,
      this.token,
      this.leaseMs,
      keeping ? this.epoch : '',
    )) as [number, number | string];
    if (code === 1) {
      this.held = `${this.token}:${value}`;
      return { ours: true, epoch: String(value) };
    }
    if (code === 0) return { ours: false, waitMs: Math.max(0, Number(value)) };
    this.held = '';
    return { ours: false, over: true };
  }

  /** The ledger: claim key → publishing ID. */
  async ledger(): Promise<Map<string, bigint>> {
    const entries = await this.redis.hgetall(this.ledgerKey);
    return new Map(Object.entries(entries).map(([key, id]) => [key, BigInt(id)]));
  }

  /**
   * Gives `keys` the next publishing IDs, in order, above `floor`; forgets the ledger entries of
   * `committed`. Returns the first ID. Throws ProducerFencedError when the producer is not ours.
   */
  async reserve(keys: readonly string[], committed: readonly string[], floor: bigint): Promise<bigint> {
    try {
      const first = await script(this.redis, 'producer-reserve')(
        3,
        this.owner,
        this.seq,
        this.ledgerKey,
        this.held,
        floor.toString(),
        committed.length,
        ...committed,
        ...keys,
      );
      return BigInt(first as number);
    } catch (error) {
      throw fenced(error);
    }
  }

  /** Forgets ledger entries (while each still holds its ID) and raises the sequence to `floor`. */
  async settle(entries: readonly (readonly [string, bigint])[], floor: bigint): Promise<void> {
    try {
      await script(this.redis, 'producer-settle')(
        3,
        this.owner,
        this.seq,
        this.ledgerKey,
        this.held,
        floor.toString(),
        ...entries.flatMap(([key, id]) => [key, id.toString()]),
      );
    } catch (error) {
      throw fenced(error);
    }
  }

  /** Gives the producer up (a clean stop): a standby takes it at once. */
  async leave(): Promise<void> {
    if (this.held === '') return;
    const held = this.held;
    this.held = '';
    await script(this.redis, 'producer-leave')(1, this.owner, held);
  }
}
