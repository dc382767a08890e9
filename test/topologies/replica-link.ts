import { rmSync } from 'node:fs';
import { FaultProxy } from '../harness/proxy.js';
import { cli, type RedisClusterSet, RedisProcess, SENTINEL_MASTER } from '../harness/redis-topologies.js';
import { cleanLeftovers, freeRedisPort, newRunDir } from '../harness/servers.js';
import { waitFor } from '../helpers.js';

const DATA = ['appendonly yes', 'save ""'];

/**
 * A Sentinel set (master, replica, three sentinels) whose replica reaches its master through a
 * TCP fault proxy, so that a test can stop replication at a moment of its choosing: with the proxy
 * blackholed the master keeps taking writes and its replica receives none of them, and when the
 * master then dies those writes die with it. The bridge and the sentinels talk to both servers
 * directly.
 */
export class ProxiedSentinelSet {
  master!: RedisProcess;
  replica!: RedisProcess;
  /** Carries the replication link only. */
  link!: FaultProxy;
  readonly sentinels: RedisProcess[] = [];

  private constructor(private readonly runDir: string) {}

  static async start(): Promise<ProxiedSentinelSet> {
    cleanLeftovers();
    const set = new ProxiedSentinelSet(newRunDir());
    try {
      set.master = new RedisProcess(set.runDir, 'master', await freeRedisPort(), DATA);
      await set.master.start();
      set.link = new FaultProxy('127.0.0.1', set.master.port);
      await set.link.start();
      set.replica = new RedisProcess(set.runDir, 'replica', await freeRedisPort(), [
        ...DATA,
        `replicaof 127.0.0.1 ${set.link.port}`,
      ]);
      await set.replica.start();
      await until('the replica in sync through the proxy', async () =>
        (await cli(set.replica.port, 'info', 'replication')).includes('master_link_status:up'),
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
              // Long: Sentinel points a replica that names another master address (here: the
              // proxy's) straight at the master once this long has passed without a failover.
              `sentinel failover-timeout ${SENTINEL_MASTER} 180000`,
              `sentinel parallel-syncs ${SENTINEL_MASTER} 1`,
            ],
            true,
          ),
        );
      }
      await Promise.all(set.sentinels.map((sentinel) => sentinel.start()));
      await until('every sentinel to know the replica and the other sentinels', async () => {
        for (const sentinel of set.sentinels) {
          const lines = (await cli(sentinel.port, 'sentinel', 'master', SENTINEL_MASTER)).split('\n');
          const value = (name: string) => lines[lines.indexOf(name) + 1];
          if (value('num-slaves') !== '1' || value('num-other-sentinels') !== '2') return false;
        }
        return true;
      });
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

  /** The replica's replication offset as its master last heard it acknowledged (-1: none). */
  async ackedOffset(masterPort: number): Promise<number> {
    const info = await cli(masterPort, 'info', 'replication');
    return Number(/^slave0:.*,offset=(\d+),/m.exec(info)?.[1] ?? -1);
  }

  /**
   * Starts the killed old master again, as a replica of the promoted one (directly, no proxy).
   * Without an append-only file: a replica that keeps one rewrites it right after its first sync,
   * and finishing that rewrite (renames and fsyncs on the main thread) can hold its answer to the
   * master's GETACK past a WAIT's timeout on a busy disk, a second hold of acks just after the
   * first has ended, which is not what the test is about.
   */
  async restartOldMasterUnder(newMaster: RedisProcess): Promise<void> {
    this.master = new RedisProcess(this.runDir, 'master', this.master.port, [
      'appendonly no',
      'save ""',
      `replicaof 127.0.0.1 ${newMaster.port}`,
    ]);
    await this.master.start();
    await until('the old master in sync as a replica of the new one', async () =>
      (await cli(this.master.port, 'info', 'replication')).includes('master_link_status:up'),
    );
  }

  async stop(): Promise<void> {
    await this.link?.stop();
    await Promise.allSettled(
      [...this.sentinels, this.master, this.replica].filter(Boolean).map((server) => server.stop(true)),
    );
    rmSync(this.runDir, { recursive: true, force: true });
  }
}

async function until(what: string, check: () => Promise<boolean>, timeoutMs = 20_000): Promise<void> {
  if (!(await waitFor(() => check().catch(() => false), timeoutMs))) {
    throw new Error(`harness: ${what} did not happen within ${timeoutMs / 1000}s`);
  }
}

/** The port of the replica of a Cluster master, as a live node sees it. */
export async function replicaOf(cluster: RedisClusterSet, masterPort: number): Promise<number> {
  const lines = (await cli(masterPort, 'cluster', 'nodes')).split('\n');
  const id = lines.find((line) => line.includes(`:${masterPort}@`))?.split(' ')[0];
  const replica = lines.find((line) => /\bslave\b/.test(line) && line.split(' ')[3] === id);
  const port = Number(/:(\d+)@/.exec(replica ?? '')?.[1]);
  if (!port) throw new Error(`harness: no replica of the Cluster master on port ${masterPort}`);
  return cluster.node(port).port;
}

/** Waits until every replica of a Cluster has its link to its master up (a new set syncs first). */
export async function clusterInSync(cluster: RedisClusterSet): Promise<void> {
  await until('every Cluster replica in sync with its master', async () => {
    for (const node of cluster.nodes) {
      const info = await cli(node.port, 'info', 'replication');
      if (info.includes('role:slave') && !info.includes('master_link_status:up')) return false;
    }
    return true;
  });
}

/** How many of the bridge's JSON log lines carry this message. */
export function logCount(output: string, message: string): number {
  return output.split('\n').filter((line) => line.includes(`"msg":"${message}"`)).length;
}
