import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { SecureClusterSet, SecureSentinelSet } from '../harness/redis-secure.js';
import { SENTINEL_MASTER } from '../harness/redis-topologies.js';
import { makeCertificates, type TestCertificates } from '../harness/tls.js';
import {
  delivered,
  depthOf,
  expectNoSecret,
  migrateArgs,
  migrateWithReport,
  numbered,
  publishAll,
  queuePair,
  runCli,
} from '../helpers.js';
import { onRedis } from './topo-helpers.js';

// Sentinel and Cluster over TLS, with passwords: the master's (with a / in it, which the URL
// takes unencoded) and the sentinels' own. Each forwards end to end, counted on the target.

const piece = () => randomBytes(4).toString('hex');
/** A password with / ? and @ between random pieces; each piece must never be printed. */
function password(): { text: string; pieces: string[] } {
  const pieces = [piece(), piece(), piece(), piece()];
  return { text: `${pieces[0]}/${pieces[1]}?${pieces[2]}@${pieces[3]}`, pieces };
}

let certs: TestCertificates;
let certDir: string;
beforeAll(() => {
  certDir = mkdtempSync(join(tmpdir(), 'dedup-redis-tls-'));
  certs = makeCertificates(certDir);
});
afterAll(() => {
  if (certDir) rmSync(certDir, { recursive: true, force: true });
});

describe('Redis Sentinel over TLS, with a master password and a sentinel password', () => {
  let set: SecureSentinelSet;
  const master = password();
  const sentinel = password();
  const wrong = password();
  beforeAll(async () => {
    set = await SecureSentinelSet.start({
      certs,
      password: master.text,
      sentinelPassword: sentinel.text,
    });
  });
  afterAll(async () => {
    await set?.stop();
  });

  const url = (sentinelPassword: string | undefined) =>
    `rediss-sentinel://:${master.text}@${set.hosts}/${SENTINEL_MASTER}${
      sentinelPassword === undefined ? '' : `?sentinelPassword=${encodeURIComponent(sentinelPassword)}`
    }`;

  it('migrate forwards every message once through the master Sentinel names, over TLS', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const { ids, messages } = numbered(source, 300);
    await publishAll(sourceUrl, source, messages);
    const args = onRedis(
      migrateArgs(source, ['--target-queue', target], '--redis-ca', certs.ca, '--log-level', 'debug'),
      url(sentinel.text),
    );
    const run = await migrateWithReport(args);
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 300, duplicates: 0 });
    expect(await depthOf(sourceUrl, source)).toBe(0);
    expect((await delivered('sentinel over TLS', targetUrl, target, ids)).count).toMatchObject({
      lost: 0,
      duplicated: 0,
      unexpected: 0,
    });
    // The IDs are in the master's keys: the same messages again are all duplicates.
    await publishAll(sourceUrl, source, messages);
    const again = await migrateWithReport(args);
    expect(again.code, again.stderr).toBe(0);
    expect(again.report).toMatchObject({ forwarded: 0, duplicates: 300 });
    expect(await depthOf(targetUrl, target)).toBe(0);
    // The cache tools reach it the same way.
    const stats = await runCli([
      ...['cache', 'stats', '--redis', url(sentinel.text), '--redis-ca', certs.ca],
      ...['--scope', `queue:${target}`],
    ]);
    expect(stats.code, stats.stderr).toBe(0);
    expect(stats.stdout).toContain(`scope queue:${target}: 300 committed IDs`);
    const output = [run, again, stats].map((result) => result.stdout + result.stderr).join('\n');
    expectNoSecret(output, [master, sentinel]);
  });

  it('a wrong or missing sentinel password, or an untrusted CA: one line that names what to fix, exit 2', async () => {
    const { sourceUrl, source, target } = await queuePair();
    await publishAll(sourceUrl, source, numbered(source, 10).messages);
    for (const given of [wrong.text, undefined]) {
      const result = await runCli(
        onRedis(
          migrateArgs(source, ['--target-queue', target], '--redis-ca', certs.ca, '--log-level', 'debug'),
          url(given),
        ),
      );
      expect(result.code, result.stderr).toBe(2);
      expect(result.stderr).toMatch(
        new RegExp(
          `^dedup-bridge: Redis master "${SENTINEL_MASTER}" via Sentinel [0-9.:,]+ over TLS: (WRONGPASS|NOAUTH) from the sentinels — they refused their credentials; check sentinelUsername and sentinelPassword in the URL's query`,
        ),
      );
      expect(result.stderr.trim().split('\n')).toHaveLength(1);
      expectNoSecret(result.stdout + result.stderr, [master, sentinel, wrong]);
    }
    expect(await depthOf(sourceUrl, source)).toBe(10);
    // A CA that did not sign the servers: named at once, not retried for --retry-for.
    const untrusted = await runCli(
      onRedis(
        migrateArgs(source, ['--target-queue', target], '--redis-ca', certs.wrongCa),
        url(sentinel.text),
      ),
    );
    expect(untrusted.code, untrusted.stderr).toBe(2);
    expect(untrusted.stderr).toMatch(
      new RegExp(
        `^dedup-bridge: Redis master "${SENTINEL_MASTER}" via Sentinel [0-9.:,]+ over TLS: TLS certificate not trusted \\([A-Z_]+\\); check --redis-ca\n$`,
      ),
    );
    expect(await depthOf(sourceUrl, source)).toBe(10);
  });
});

describe('Redis Cluster over TLS, with a password', () => {
  let cluster: SecureClusterSet;
  const secret = password();
  beforeAll(async () => {
    cluster = await SecureClusterSet.start({ certs, password: secret.text });
  });
  afterAll(async () => {
    await cluster?.stop();
  });

  const url = () => `rediss-cluster://:${secret.text}@${cluster.hosts}`;

  it('migrate forwards every message once, with its IDs in the Cluster, over TLS', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const { ids, messages } = numbered(source, 500);
    await publishAll(sourceUrl, source, messages);
    const args = onRedis(
      migrateArgs(source, ['--target-queue', target], '--redis-ca', certs.ca, '--log-level', 'debug'),
      url(),
    );
    const run = await migrateWithReport(args);
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 500, duplicates: 0 });
    expect(await depthOf(sourceUrl, source)).toBe(0);
    expect((await delivered('cluster over TLS', targetUrl, target, ids)).count).toMatchObject({
      lost: 0,
      duplicated: 0,
      unexpected: 0,
    });
    const stats = await runCli([
      ...['cache', 'stats', '--redis', url(), '--redis-ca', certs.ca],
      ...['--scope', `queue:${target}`],
    ]);
    expect(stats.code, stats.stderr).toBe(0);
    expect(stats.stdout).toContain(`scope queue:${target}: 500 committed IDs`);
    expectNoSecret(run.stdout + run.stderr + stats.stdout + stats.stderr, [secret]);
  });

  it('without the CA that signed the nodes: one line naming --redis-ca, exit 2', async () => {
    const { source, target } = await queuePair();
    const result = await runCli(
      onRedis(migrateArgs(source, ['--target-queue', target], '--redis-ca', certs.wrongCa), url()),
    );
    expect(result.code, result.stderr).toBe(2);
    expect(result.stderr).toMatch(
      /^dedup-bridge: Redis Cluster [0-9.:,]+ over TLS: TLS certificate not trusted \([A-Z_]+\); check --redis-ca\n$/,
    );
    expectNoSecret(result.stdout + result.stderr, [secret]);
  });
});
