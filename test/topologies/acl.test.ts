import { Cluster, Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { documentedAcl, forTest, notRefused, refusalsOf } from '../documented-grants.js';
import { cli, RedisClusterSet, RedisSentinelSet } from '../harness/redis-topologies.js';
import {
  delivered,
  depthOf,
  migrateArgs,
  numbered,
  publishAll,
  queuePair,
  runCli,
  startCli,
  waitFor,
} from '../helpers.js';
import { onRedis } from './topo-helpers.js';

// The users of README's "Redis ACL" lines, with the default --redis-prefix (dedup) they are written for.
const PASSWORD = 'acl-topology';
const ADMIN = ['--user', 'acl-admin', '--pass', 'acl-admin-pw', '--no-auth-warning'];
const bridgeLines = () => documentedAcl('the bridge: run');

/** Runs the documented lines on one server, for `user` in place of the docs' name. */
async function createUser(port: number, user: string, lines: { rules: string[] }[]): Promise<void> {
  for (const { rules } of lines) {
    const reply = await cli(port, 'ACL', 'SETUSER', user, ...forTest(rules, { password: PASSWORD }));
    expect(reply).toBe('OK');
  }
}

/** A URL's scheme with the user and password put in front of its hosts. */
const withUser = (url: string, user: string) => url.replace('://', `://${user}:${PASSWORD}@`);

describe('the documented Redis ACL on a Sentinel set, sentinels restricted too', () => {
  let set: RedisSentinelSet;
  const user = 'dedup-bridge-sentinel-test';
  beforeAll(async () => {
    set = await RedisSentinelSet.start();
    // The bridge's user on both data nodes (ACLs are not replicated).
    for (const node of [set.master, set.replica]) await createUser(node.port, user, bridgeLines());
    // Each sentinel: an administrator for this test, then the docs' line for the user the bridge
    // reaches sentinels as.
    const [sentinelLine] = documentedAcl('on each sentinel');
    for (const sentinel of set.sentinels) {
      await cli(sentinel.port, 'ACL', 'SETUSER', 'acl-admin', 'on', '>acl-admin-pw', '+@all', '~*', '&*');
      const rules = sentinelLine?.rules ?? [];
      expect(await cli(sentinel.port, ...ADMIN, 'ACL', 'SETUSER', sentinelLine?.user ?? '', ...rules)).toBe(
        'OK',
      );
    }
  });
  afterAll(async () => {
    await set?.stop();
  });

  it('run with --redis-wait-replicas 1 forwards each message once, listening on every sentinel for failovers; the users are refused the rest', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const { ids, messages } = numbered(source, 200);
    await publishAll(sourceUrl, source, messages);
    const run = startCli([
      'run',
      '--source',
      sourceUrl,
      '--source-queue',
      source,
      '--target',
      targetUrl,
      '--target-queue',
      target,
      '--redis',
      withUser(set.url, user),
      '--redis-wait-replicas',
      '1',
    ]);
    let subscribers: string[] = [];
    try {
      const done = await waitFor(async () => (await depthOf(targetUrl, target)) === 200, 30_000);
      expect(done, run.output().slice(-3000)).toBe(true);
      // ioredis's failover detector subscribed to +switch-master on each sentinel.
      // (Sentinel has no PUBSUB: look for clients of its default user subscribed to one channel; each of the bridge's
      // Redis connections has its own.)
      subscribers = await Promise.all(
        set.sentinels.map(async (sentinel) => {
          const clients = (await cli(sentinel.port, ...ADMIN, 'CLIENT', 'LIST')).split('\n');
          const subscribed = clients.filter((line) => / user=default /.test(line) && / sub=1 /.test(line));
          return subscribed.length > 0 ? 'subscribed' : 'not subscribed';
        }),
      );
    } finally {
      run.signal('SIGTERM');
    }
    const stopped = await run.done;
    expect(stopped.code, stopped.stderr).toBe(0);
    expect(stopped.stderr).toBe('');
    expect(subscribers).toEqual(set.sentinels.map(() => 'subscribed'));
    const { count } = await delivered('acl sentinel', targetUrl, target, ids);
    expect(count).toMatchObject({ received: 200, lost: 0, duplicated: 0, unexpected: 0 });
    expect(await depthOf(sourceUrl, source)).toBe(0);

    // Nothing the bridge sent to the data nodes was refused.
    for (const node of [set.master, set.replica]) {
      expect(refusalsOf(await onNode(node.port, ['ACL', 'LOG', '1000']), user)).toEqual([]);
    }
    // The data nodes' user is refused the rest.
    const master = new Redis({
      port: set.master.port,
      host: '127.0.0.1',
      username: user,
      password: PASSWORD,
    });
    try {
      expect(await notRefused((command, ...args) => master.call(command, ...args))).toEqual([]);
    } finally {
      master.disconnect();
    }
    // And the sentinels' default user may not steer Sentinel.
    const sentinelPort = set.sentinels[0]?.port ?? 0;
    for (const command of [
      ['SENTINEL', 'FAILOVER', 'dedup-test'],
      ['SENTINEL', 'SET', 'dedup-test', 'quorum', '1'],
      ['SENTINEL', 'REMOVE', 'dedup-test'],
      ['ACL', 'SETUSER', 'intruder', 'on', '+@all'],
    ]) {
      expect(await cli(sentinelPort, ...command)).toMatch(/^NOPERM/);
    }
  });
});

/** One command on one server as its default user (the data nodes' administrator here). */
async function onNode(port: number, command: string[]): Promise<unknown> {
  const redis = new Redis({ port, host: '127.0.0.1', lazyConnect: true });
  try {
    await redis.connect();
    return await redis.call(command[0] as string, ...command.slice(1));
  } finally {
    redis.disconnect();
  }
}

describe('the documented Redis ACL on a Redis Cluster', () => {
  let cluster: RedisClusterSet;
  const user = 'dedup-bridge-cluster-test';
  const withoutClusterLine = 'dedup-bridge-no-cluster-test';
  const tools = 'dedup-tools-cluster-test';
  beforeAll(async () => {
    cluster = await RedisClusterSet.start();
    const clusterLines = documentedAcl('on a Redis Cluster');
    const toolLines = documentedAcl('cache stats and cache reset-scope');
    for (const node of cluster.nodes) {
      await createUser(node.port, user, [...bridgeLines(), ...clusterLines]);
      await createUser(node.port, withoutClusterLine, bridgeLines());
      await createUser(node.port, tools, [...bridgeLines(), ...clusterLines, ...toolLines]);
    }
  });
  afterAll(async () => {
    await cluster?.stop();
  });

  it('migrate forwards each message once and the tools read the scope; without the Cluster line it stops at once naming the refusal; the user is refused the rest', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const { ids, messages } = numbered(source, 300);
    await publishAll(sourceUrl, source, messages);
    const args = (as: string) =>
      onRedis(migrateArgs(source, ['--target-queue', target], '--quiet'), withUser(cluster.url, as));

    const refused = await runCli(args(withoutClusterLine));
    expect(refused.code).toBe(2);
    expect(refused.stderr).toMatch(/^dedup-bridge: [^\n]*NOPERM[^\n]*'cluster\|slots'[^\n]*\n$/);
    expect(refused.stderr).not.toContain(PASSWORD);
    expect(await depthOf(targetUrl, target)).toBe(0);

    const migrate = await runCli(args(user));
    expect(migrate.stderr).toBe('');
    expect(migrate.code).toBe(0);
    const { count } = await delivered('acl cluster', targetUrl, target, ids);
    expect(count).toMatchObject({ received: 300, lost: 0, duplicated: 0, unexpected: 0 });

    const stats = await runCli([
      'cache',
      'stats',
      '--redis',
      withUser(cluster.url, tools),
      '--scope',
      `queue:${target}`,
    ]);
    expect(stats.stderr).toBe('');
    expect(stats.stdout).toMatch(/: 300 committed IDs/);

    for (const node of cluster.nodes) {
      const log = await onNode(node.port, ['ACL', 'LOG', '1000']);
      expect(refusalsOf(log, user), `node ${node.port}`).toEqual([]);
      expect(refusalsOf(log, tools), `node ${node.port}`).toEqual([]);
    }
    const asUser = new Cluster([{ host: '127.0.0.1', port: cluster.nodes[0]?.port ?? 0 }], {
      redisOptions: { username: user, password: PASSWORD },
    });
    try {
      expect(await notRefused((command, ...rest) => asUser.call(command, ...rest))).toEqual([]);
    } finally {
      asUser.disconnect();
    }
  });
});
