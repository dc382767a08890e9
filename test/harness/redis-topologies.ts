import { execFile } from 'node:child_process';
import { mkdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { cleanLeftovers, freeRedisPort, isAlive, newRunDir } from './servers.js';

const exec = promisify(execFile);
const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

/** redis-cli against one of our servers; its trimmed stdout. */
export async function cli(port: number, ...args: string[]): Promise<string> {
  const { stdout } = await exec('redis-cli', ['-h', '127.0.0.1', '-p', String(port), ...args], {
    timeout: 10_000,
  });
  return stdout.trim();
}

export async function until(what: string, check: () => Promise<boolean>, timeoutMs: number): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    if (await check().catch(() => false)) return;
    await sleep(100);
  }
  throw new Error(`harness: ${what} did not happen within ${timeoutMs / 1000}s`);
}

/**
 * One redis-server (or sentinel) daemon in `<runDir>/<label>`, with its pid in server.pid there,
 * so cleanLeftovers() finds and kills it if this test run dies before stopping it.
 */
export class RedisProcess {
  readonly dir: string;

  constructor(
    runDir: string,
    readonly label: string,
    readonly port: number,
    private readonly config: string[],
    private readonly sentinel = false,
    /** The server's requirepass, for the harness's own redis-cli calls. */
    readonly password?: string,
  ) {
    this.dir = join(runDir, label);
  }

  async start(): Promise<void> {
    mkdirSync(this.dir, { recursive: true });
    const lines = [
      `port ${this.port}`,
      'bind 127.0.0.1',
      `dir ${this.dir}`,
      'daemonize yes',
      `pidfile ${join(this.dir, 'server.pid')}`,
      `logfile ${join(this.dir, 'redis.log')}`,
      ...this.config,
    ];
    // Sentinel rewrites its config file, so it gets one of its own.
    const file = join(this.dir, this.sentinel ? 'sentinel.conf' : 'redis.conf');
    writeFileSync(file, `${lines.join('\n')}\n`);
    await exec('redis-server', this.sentinel ? [file, '--sentinel'] : [file], { timeout: 10_000 });
    await until(
      `Redis on port ${this.port} answering`,
      async () => (await this.cli('ping')) === 'PONG',
      10_000,
    );
  }

  /** redis-cli against this server, with its password when it has one. */
  cli(...args: string[]): Promise<string> {
    const auth = this.password ? ['-a', this.password, '--no-auth-warning'] : [];
    return cli(this.port, ...auth, ...args);
  }

  pid(): number {
    try {
      return Number(readFileSync(join(this.dir, 'server.pid'), 'utf8').trim());
    } catch {
      return 0;
    }
  }

  /** SIGTERM (or SIGKILL with `kill`), then waits until the process is gone. */
  async stop(kill = false): Promise<void> {
    const pid = this.pid();
    if (!pid || !isAlive(pid)) return;
    process.kill(pid, kill ? 'SIGKILL' : 'SIGTERM');
    const deadline = Date.now() + 10_000;
    while (isAlive(pid) && Date.now() < deadline) await sleep(50);
    if (isAlive(pid)) process.kill(pid, 'SIGKILL');
  }
}

async function newRun(): Promise<string> {
  cleanLeftovers();
  return newRunDir();
}

/** A Redis Cluster of three masters, each with one replica, on free loopback ports. */
export class RedisClusterSet {
  readonly nodes: RedisProcess[] = [];

  private constructor(private readonly runDir: string) {}

  static async start(): Promise<RedisClusterSet> {
    const set = new RedisClusterSet(await newRun());
    try {
      for (let index = 0; index < 6; index++) {
        const [port, busPort] = [await freeRedisPort(), await freeRedisPort()];
        set.nodes.push(
          new RedisProcess(set.runDir, `cluster-${index}`, port, [
            'cluster-enabled yes',
            `cluster-port ${busPort}`,
            'cluster-config-file nodes.conf',
            // Short, so a dead master's replica takes over within a few seconds.
            'cluster-node-timeout 1500',
            'appendonly yes',
            'save ""',
          ]),
        );
      }
      await Promise.all(set.nodes.map((node) => node.start()));
      // The first three become masters, the others their replicas.
      await exec(
        'redis-cli',
        [
          '--cluster',
          'create',
          ...set.nodes.map((node) => `127.0.0.1:${node.port}`),
          '--cluster-replicas',
          '1',
          '--cluster-yes',
        ],
        { timeout: 30_000 },
      );
      await until(
        'cluster_state:ok on every node, with three masters',
        async () => {
          for (const node of set.nodes) {
            if (!(await cli(node.port, 'cluster', 'info')).includes('cluster_state:ok')) return false;
          }
          return (await set.masterPorts()).length === 3 && (await set.replicaCount()) === 3;
        },
        30_000,
      );
    } catch (error) {
      await set.stop();
      throw error;
    }
    return set;
  }

  /** Seed URL with every node, as a user would give it. */
  get url(): string {
    return `redis-cluster://${this.nodes.map((node) => `127.0.0.1:${node.port}`).join(',')}`;
  }

  /** Ports of the nodes that currently serve slots as masters (as a live node sees it). */
  async masterPorts(): Promise<number[]> {
    const alive = this.nodes.find((node) => isAlive(node.pid()));
    if (!alive) return [];
    return (await cli(alive.port, 'cluster', 'nodes'))
      .split('\n')
      .filter((line) => /\bmaster\b/.test(line) && !/\bfail\b/.test(line) && / \d+-\d+/.test(line))
      .map((line) => Number(/:(\d+)@/.exec(line)?.[1]));
  }

  private async replicaCount(): Promise<number> {
    return (await cli(this.nodes[0]?.port ?? 0, 'cluster', 'nodes'))
      .split('\n')
      .filter((line) => /\bslave\b/.test(line)).length;
  }

  node(port: number): RedisProcess {
    const node = this.nodes.find((candidate) => candidate.port === port);
    if (!node) throw new Error(`harness: no cluster node on port ${port}`);
    return node;
  }

  /** The live master holding the most keys that match a SCAN pattern. */
  async busiestMaster(pattern: string): Promise<number> {
    let best = { port: 0, keys: -1 };
    for (const port of await this.masterPorts()) {
      const found = await cli(port, '--scan', '--pattern', pattern);
      const keys = found === '' ? 0 : found.split('\n').length;
      if (keys > best.keys) best = { port, keys };
    }
    return best.port;
  }

  async stop(): Promise<void> {
    await Promise.allSettled(this.nodes.map((node) => node.stop(true)));
    rmSync(this.runDir, { recursive: true, force: true });
  }
}

export const SENTINEL_MASTER = 'dedup-test';

/**
 * One master, one replica and three sentinels (quorum 2). Sentinel calls the master down after
 * 1 s without answers, so after a SIGKILL the replica is promoted within a few seconds.
 */
export class RedisSentinelSet {
  master!: RedisProcess;
  replica!: RedisProcess;
  readonly sentinels: RedisProcess[] = [];

  private constructor(private readonly runDir: string) {}

  static async start(): Promise<RedisSentinelSet> {
    const set = new RedisSentinelSet(await newRun());
    try {
      const data = ['appendonly yes', 'save ""'];
      set.master = new RedisProcess(set.runDir, 'sentinel-master', await freeRedisPort(), data);
      set.replica = new RedisProcess(set.runDir, 'sentinel-replica', await freeRedisPort(), [
        ...data,
        `replicaof 127.0.0.1 ${set.master.port}`,
      ]);
      await set.master.start();
      await set.replica.start();
      await until(
        'the replica in sync with the master',
        async () => (await cli(set.replica.port, 'info', 'replication')).includes('master_link_status:up'),
        15_000,
      );
      for (let index = 0; index < 3; index++) {
        set.sentinels.push(
          new RedisProcess(
            set.runDir,
            `sentinel-${index}`,
            await freeRedisPort(),
            [
              `sentinel monitor ${SENTINEL_MASTER} 127.0.0.1 ${set.master.port} 2`,
              `sentinel down-after-milliseconds ${SENTINEL_MASTER} 1000`,
              `sentinel failover-timeout ${SENTINEL_MASTER} 5000`,
              `sentinel parallel-syncs ${SENTINEL_MASTER} 1`,
            ],
            true,
          ),
        );
      }
      await Promise.all(set.sentinels.map((sentinel) => sentinel.start()));
      await until(
        'every sentinel to know the replica and the other sentinels',
        async () => {
          for (const sentinel of set.sentinels) {
            const info = await cli(sentinel.port, 'sentinel', 'master', SENTINEL_MASTER);
            const value = (name: string) => {
              const lines = info.split('\n');
              return lines[lines.indexOf(name) + 1];
            };
            if (value('num-slaves') !== '1' || value('num-other-sentinels') !== '2') return false;
          }
          return true;
        },
        20_000,
      );
    } catch (error) {
      await set.stop();
      throw error;
    }
    return set;
  }

  get url(): string {
    return `redis-sentinel://${this.sentinels.map((sentinel) => `127.0.0.1:${sentinel.port}`).join(',')}/${SENTINEL_MASTER}`;
  }

  /** The master's port as the first sentinel reports it. */
  async masterPort(): Promise<number> {
    const reply = await cli(
      this.sentinels[0]?.port ?? 0,
      'sentinel',
      'get-master-addr-by-name',
      SENTINEL_MASTER,
    );
    return Number(reply.split('\n')[1]);
  }

  async stop(): Promise<void> {
    await Promise.allSettled(
      [...this.sentinels, this.master, this.replica].filter(Boolean).map((server) => server.stop(true)),
    );
    rmSync(this.runDir, { recursive: true, force: true });
  }
}
