import { readFileSync } from 'node:fs';
import { hostname } from 'node:os';
import { Cluster } from 'ioredis';
import { formatDuration } from '../config/duration.js';
import { asMissingGrant, closeRedis, type RedisClient } from '../dedup/redis.js';
import { BridgeError, ExitCode } from '../errors.js';
import type { Logger } from '../log.js';

/** How long the end of a run waits for Redis to drop its job lock; the lease lets it go anyway. */
const RELEASE_WAIT_MS = 5000;
/** How often the spare connection of a release tries Redis again (see JobLock.release). */
const SPARE_RETRY_MS = 200;
const SPARE_CONNECT_TIMEOUT_MS = 1000;

/** Another run of the same job holds the lock: exit 3. */
class JobLockedError extends BridgeError {
  constructor(message: string) {
    super(message, ExitCode.locked);
  }
}

interface Holder {
  owner: string;
  host: string;
  pid: number;
  since: string;
}

type Script = (key: string, value: string, ...args: (string | number)[]) => Promise<number>;

function script(redis: RedisClient, name: string): Script {
  const command = `dedupBridge_${name.replace('-', '_')}`;
  if (!(command in redis)) {
    const lua = readFileSync(new URL(`../dedup/lua/${name}.lua`, import.meta.url), 'utf8');
    redis.defineCommand(command, { lua, numberOfKeys: 1 });
  }
  const call = (redis as unknown as Record<string, Script>)[command] as Script;
  return call.bind(redis);
}

/**
 * One run of a job at a time: a Redis key with a lease, renewed while the job runs. A run that
 * crashed leaves a lock that expires after the lease, and the next run takes over.
 */
export class JobLock {
  private timer: NodeJS.Timeout | undefined;
  private lost = false;

  private constructor(
    private readonly redis: RedisClient,
    private readonly key: string,
    private readonly value: string,
    private readonly leaseMs: number,
    private readonly log: Logger,
  ) {}

  static async acquire(
    redis: RedisClient,
    prefix: string,
    job: string,
    owner: string,
    leaseMs: number,
    log: Logger,
  ): Promise<JobLock> {
    const key = `${prefix}:job:${job}`;
    const holder: Holder = { owner, host: hostname(), pid: process.pid, since: new Date().toISOString() };
    const value = JSON.stringify(holder);
    const taken = await redis.set(key, value, 'PX', leaseMs, 'NX').catch((error: unknown) => {
      throw asMissingGrant(error, 'taking the job lock');
    });
    if (taken !== 'OK') {
      const current = await redis.get(key);
      throw new JobLockedError(
        `job "${job}" is already running (${describeHolder(current)}); this run exits without touching anything`,
      );
    }
    const lock = new JobLock(redis, key, value, leaseMs, log);
    lock.timer = setInterval(() => void lock.renew(), Math.max(250, Math.floor(leaseMs / 3)));
    return lock;
  }

  private async renew(): Promise<void> {
    try {
      const renewed = await script(this.redis, 'lock-renew')(this.key, this.value, this.leaseMs);
      if (renewed === 0 && !this.lost) {
        this.lost = true;
        this.log.error(
          { key: this.key },
          'job lock lost (expired while Redis was unreachable?); another run may start',
        );
      }
    } catch (error) {
      this.log.warn({ error: (error as Error).message }, 'job lock renewal failed; retrying');
    }
  }

  /**
   * Drops the lock, waiting at most RELEASE_WAIT_MS: Redis calls wait through an outage, and a
   * run that ends because Redis stayed down past --retry-for must still end. When the run's client
   * is not connected, the release goes over a spare connection too, which tries every
   * SPARE_RETRY_MS: after a long outage the client waits up to 5 s between attempts, and would
   * miss a Redis back within the wait, leaving the next run refused until the lease ran out.
   */
  async release(): Promise<void> {
    clearInterval(this.timer);
    this.log.debug({ key: this.key }, 'dropping the job lock');
    const release = (redis: RedisClient) => script(redis, 'lock-release')(this.key, this.value);
    const spare = this.redis.status === 'ready' ? undefined : spareOf(this.redis);
    // A refusal (NOPERM, WRONGPASS) over either connection says more than "no answer" at the end.
    const failure = (error: unknown) => `the release failed: ${(error as Error).message.split('\n')[0]}`;
    let refusal: string | undefined;
    const attempt = (redis: RedisClient) =>
      release(redis).catch((error: unknown) => {
        if ((error as Error).name === 'ReplyError') refusal ??= failure(error);
        throw error;
      });
    const attempts = spare ? [attempt(this.redis), attempt(spare)] : [attempt(this.redis)];
    let timer: NodeJS.Timeout | undefined;
    const outcome = await Promise.race([
      // Either one releasing it is enough: the other then finds the lock gone, and changes nothing.
      Promise.any(attempts).then(
        () => undefined,
        (failed: AggregateError) => refusal ?? failure(failed.errors[0]),
      ),
      new Promise<string>((resolve) => {
        timer = setTimeout(
          () => resolve(refusal ?? `Redis did not answer within ${formatDuration(RELEASE_WAIT_MS)}`),
          RELEASE_WAIT_MS,
        );
      }),
    ]);
    clearTimeout(timer);
    if (spare) closeRedis(spare);
    if (outcome) {
      this.log.warn(
        { key: this.key },
        `job lock not released (${outcome}); unless the release still reaches it, the next run of this job is refused until the lock expires, within --job-lock-lease (${formatDuration(this.leaseMs)})`,
      );
    }
  }
}

/**
 * A new connection like `redis`, retrying every SPARE_RETRY_MS, each attempt given at most a
 * second (a host that drops packets would hold the first for the whole wait); no failover
 * watch of its own. Its errors are the release's to report.
 */
function spareOf(redis: RedisClient): RedisClient {
  const retry = () => SPARE_RETRY_MS;
  const spare =
    redis instanceof Cluster
      ? redis.duplicate([], {
          clusterRetryStrategy: retry,
          redisOptions: { ...redis.options.redisOptions, connectTimeout: SPARE_CONNECT_TIMEOUT_MS },
        })
      : redis.duplicate({
          retryStrategy: retry,
          sentinelRetryStrategy: retry,
          connectTimeout: SPARE_CONNECT_TIMEOUT_MS,
          failoverDetector: false,
        });
  spare.on('error', () => {});
  return spare;
}

function describeHolder(value: string | null): string {
  if (!value) return 'the lock was released a moment ago; try again';
  try {
    const holder = JSON.parse(value) as Holder;
    return `held by ${holder.host} pid ${holder.pid} since ${holder.since}`;
  } catch {
    return 'held by another run';
  }
}
