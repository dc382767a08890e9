import { execFile } from 'node:child_process';
import { existsSync, rmSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { promisify } from 'node:util';
import { RedisProcess, SENTINEL_MASTER, until } from './redis-topologies.js';
import { cleanLeftovers, freeRedisPort, newRunDir } from './servers.js';
import { makeLeaf, type TestCertificates } from './tls.js';

const exec = promisify(execFile);

/**
 * The servers' own certificate: for IP 127.0.0.1, good for both ends of a connection, since the
 * cluster bus and replication present it as a client certificate too (and the bus always checks
 * it). Made once beside the CA.
 */
function nodeCertificate(certs: TestCertificates): { cert: string; key: string } {
  const dir = dirname(certs.ca);
  if (!existsSync(join(dir, 'redis-node.pem'))) {
    makeLeaf(dir, 'redis-node', 'serverAuth,clientAuth', 'IP:127.0.0.1');
  }
  return { cert: join(dir, 'redis-node.pem'), key: join(dir, 'redis-node.key') };
}

/**
 * A TLS port on a Redis server (or sentinel), beside its plain port, which only the harness's own
 * redis-cli calls use. Replication, the cluster bus and sentinels' links go over TLS as well. The
 * servers ask clients for no certificate: these tests are about the bridge trusting the servers.
 */
function tlsLines(certs: TestCertificates, tlsPort: number): string[] {
  const node = nodeCertificate(certs);
  return [
    `tls-port ${tlsPort}`,
    `tls-cert-file ${node.cert}`,
    `tls-key-file ${node.key}`,
    `tls-ca-cert-file ${certs.ca}`,
    'tls-auth-clients no',
    'tls-replication yes',
  ];
}

/** A server's TLS port, kept beside the process. */
interface Secured {
  server: RedisProcess;
  tlsPort: number;
}

async function secured(
  runDir: string,
  label: string,
  certs: TestCertificates,
  config: string[],
  options: { sentinel?: boolean; password?: string } = {},
): Promise<Secured> {
  const tlsPort = await freeRedisPort();
  const server = new RedisProcess(
    runDir,
    label,
    await freeRedisPort(),
    [...config, ...tlsLines(certs, tlsPort)],
    options.sentinel,
    options.password,
  );
  return { server, tlsPort };
}

/**
 * A master with a password, its replica and three sentinels with a password of their own, all
 * over TLS: what `rediss-sentinel://…?sentinelPassword=…` connects to.
 */
export class SecureSentinelSet {
  readonly servers: Secured[] = [];
  sentinels: Secured[] = [];

  private constructor(private readonly runDir: string) {}

  static async start(options: {
    certs: TestCertificates;
    password: string;
    sentinelPassword: string;
  }): Promise<SecureSentinelSet> {
    cleanLeftovers();
    const set = new SecureSentinelSet(newRunDir());
    const { certs, password, sentinelPassword } = options;
    try {
      const data = ['appendonly yes', 'save ""', `requirepass ${password}`, `masterauth ${password}`];
      const master = await secured(set.runDir, 'secure-master', certs, data, { password });
      set.servers.push(master);
      await master.server.start();
      const replica = await secured(
        set.runDir,
        'secure-replica',
        certs,
        [...data, `replicaof 127.0.0.1 ${master.tlsPort}`],
        { password },
      );
      set.servers.push(replica);
      await replica.server.start();
      await until(
        'the replica in sync with the master over TLS',
        async () => (await replica.server.cli('info', 'replication')).includes('master_link_status:up'),
        15_000,
      );
      for (let index = 0; index < 3; index++) {
        set.sentinels.push(
          await secured(
            set.runDir,
            `secure-sentinel-${index}`,
            certs,
            [
              `sentinel monitor ${SENTINEL_MASTER} 127.0.0.1 ${master.tlsPort} 2`,
              `sentinel auth-pass ${SENTINEL_MASTER} ${password}`,
              `sentinel down-after-milliseconds ${SENTINEL_MASTER} 1000`,
              `sentinel failover-timeout ${SENTINEL_MASTER} 5000`,
              `requirepass ${sentinelPassword}`,
              `sentinel sentinel-pass ${sentinelPassword}`,
            ],
            { sentinel: true, password: sentinelPassword },
          ),
        );
      }
      await Promise.all(set.sentinels.map((sentinel) => sentinel.server.start()));
      await until(
        'every sentinel to know the replica and the other sentinels',
        async () => {
          for (const sentinel of set.sentinels) {
            const lines = (await sentinel.server.cli('sentinel', 'master', SENTINEL_MASTER)).split('\n');
            const value = (name: string) => lines[lines.indexOf(name) + 1];
            if (value('num-slaves') !== '1' || value('num-other-sentinels') !== '2') return false;
          }
          return true;
        },
        30_000,
      );
    } catch (error) {
      await set.stop();
      throw error;
    }
    return set;
  }

  /** The sentinels' TLS ports, as a --redis URL lists them. */
  get hosts(): string {
    return this.sentinels.map((sentinel) => `127.0.0.1:${sentinel.tlsPort}`).join(',');
  }

  async stop(): Promise<void> {
    await Promise.allSettled([...this.sentinels, ...this.servers].map((server) => server.server.stop(true)));
    rmSync(this.runDir, { recursive: true, force: true });
  }
}

/** A Cluster of three masters and three replicas with a password, over TLS (bus included). */
export class SecureClusterSet {
  readonly nodes: Secured[] = [];

  private constructor(private readonly runDir: string) {}

  static async start(options: { certs: TestCertificates; password: string }): Promise<SecureClusterSet> {
    cleanLeftovers();
    const set = new SecureClusterSet(newRunDir());
    const { certs, password } = options;
    try {
      for (let index = 0; index < 6; index++) {
        set.nodes.push(
          await secured(
            set.runDir,
            `secure-cluster-${index}`,
            certs,
            [
              'cluster-enabled yes',
              `cluster-port ${await freeRedisPort()}`,
              'cluster-config-file nodes.conf',
              'cluster-node-timeout 1500',
              'tls-cluster yes',
              'appendonly yes',
              'save ""',
              `requirepass ${password}`,
              `masterauth ${password}`,
            ],
            { password },
          ),
        );
      }
      await Promise.all(set.nodes.map((node) => node.server.start()));
      await exec(
        'redis-cli',
        [
          ...['-a', password, '--no-auth-warning'],
          '--cluster',
          'create',
          // By the plain ports, as the other harness does; the nodes then meet over the TLS bus.
          ...set.nodes.map((node) => `127.0.0.1:${node.server.port}`),
          ...['--cluster-replicas', '1', '--cluster-yes'],
        ],
        { timeout: 30_000 },
      ).catch((error: { stdout?: string; stderr?: string }) => {
        throw new Error(`harness: redis-cli --cluster create failed: ${error.stderr || error.stdout}`);
      });
      await until(
        'cluster_state:ok on every node',
        async () => {
          for (const node of set.nodes) {
            if (!(await node.server.cli('cluster', 'info')).includes('cluster_state:ok')) return false;
          }
          return true;
        },
        30_000,
      );
    } catch (error) {
      await set.stop();
      throw error;
    }
    return set;
  }

  /** The nodes' TLS ports, as a --redis URL lists them. */
  get hosts(): string {
    return this.nodes.map((node) => `127.0.0.1:${node.tlsPort}`).join(',');
  }

  async stop(): Promise<void> {
    await Promise.allSettled(this.nodes.map((node) => node.server.stop(true)));
    rmSync(this.runDir, { recursive: true, force: true });
  }
}
