import { randomBytes } from 'node:crypto';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { newRunDir, RedisServer } from '../harness/servers.js';
import {
  declareQueue,
  depthOf,
  expectNoSecret,
  numbered,
  publishAll,
  runCli,
  startCli,
  takeAll,
  uniqueName,
  waitFor,
} from '../helpers.js';
import { type AdminServers, adminServers, asUser, redisAdmin } from './privilege-admin.js';

// Every way a password can reach the bridge, at debug level, through the CLI: none of it may
// appear in what the bridge prints. A password is five random pieces joined by ? # @ /, the
// characters URL readers split at; the test looks for each piece alone, so that a password cut
// in two (`has a bad host "admin:Top"`) is caught as well as a whole one.

interface Secret {
  text: string;
  pieces: string[];
}

function newSecret(): Secret {
  const pieces = Array.from({ length: 5 }, () => randomBytes(4).toString('hex'));
  const [a, b, c, d, e] = pieces;
  return { text: `${a}?${b}#${c}@${d}/${e}`, pieces };
}

const MESSAGES = 20;

describe('passwords are never printed, however they are given', () => {
  let admin: AdminServers;
  let redis: RedisServer;
  let runDir: string;
  let files: string;
  const amqpSecret = newSecret();
  const redisSecret = newSecret();
  const wrongSecret = newSecret();
  const all = [amqpSecret, redisSecret, wrongSecret];
  const user = uniqueName('secret-user');
  let source: string;
  let target: string;
  let management: string;
  let redisUrl: string;

  beforeAll(async () => {
    admin = await adminServers();
    const permissions = { configure: '.*', write: '.*', read: '.*' };
    await admin.addUsers('source', [
      { name: user, password: amqpSecret.text, permissions, tags: 'management' },
    ]);
    await admin.addUsers('target', [{ name: user, password: amqpSecret.text, permissions }]);
    runDir = newRunDir();
    redis = new RedisServer(runDir, 'secrets-redis');
    await redis.start();
    // Set once it answers (the harness waits for a PONG, which a password would refuse).
    await redisAdmin(redis.url, 'CONFIG', 'SET', 'requirepass', redisSecret.text);
    // asUser percent-encodes the password, as it must be for the broker to get it whole.
    source = asUser(admin.sourceUrl, user, amqpSecret.text);
    target = asUser(admin.targetUrl, user, amqpSecret.text);
    management = asUser(admin.sourceManagementUrl, user, amqpSecret.text);
    // ioredis takes a password from the query too.
    redisUrl = `redis://127.0.0.1:${redis.port}/0?password=${encodeURIComponent(redisSecret.text)}`;
    files = mkdtempSync(join(tmpdir(), 'dedup-secrets-'));
  });

  afterAll(async () => {
    await admin?.deleteUsers('source', [user]).catch(() => {});
    await admin?.deleteUsers('target', [user]).catch(() => {});
    await admin?.stop();
    await redis?.stop();
    if (runDir) rmSync(runDir, { recursive: true, force: true });
    if (files) rmSync(files, { recursive: true, force: true });
  });

  async function pair(): Promise<{ from: string; to: string }> {
    const from = uniqueName('sec-src');
    const to = uniqueName('sec-dst');
    await declareQueue(admin.sourceUrl, from);
    await declareQueue(admin.targetUrl, to);
    await publishAll(admin.sourceUrl, from, numbered(from, MESSAGES).messages);
    return { from, to };
  }

  /** A file holding `text` and the newline an editor or `echo` adds. */
  function secretFile(name: string, text: string): string {
    const path = join(files, name);
    writeFileSync(path, `${text}\n`);
    return path;
  }

  it('run at trace level: the forwarding line shows the URLs with *** for the password and ?password=', async () => {
    const { from, to } = await pair();
    const bridge = startCli([
      'run',
      ...['--source', source, '--source-queue', from, '--target', target, '--target-queue', to],
      ...['--redis', redisUrl, '--source-management', management, '--log-level', 'trace'],
    ]);
    expect(await waitFor(async () => (await depthOf(admin.targetUrl, to)) === MESSAGES)).toBe(true);
    bridge.signal('SIGTERM');
    const ended = await bridge.done;
    expect(ended.code, ended.stderr).toBe(0);
    const forwarding = ended.stdout.split('\n').find((line) => line.includes('"msg":"forwarding"'));
    expect(forwarding).toContain('"redis":"redis://127.0.0.1:');
    expect(forwarding).toContain('?password=***"');
    expect(forwarding).toContain(`"source":"amqp://${user}:***@`);
    expectNoSecret(ended.stdout + ended.stderr, all);
    expect(await depthOf(admin.sourceUrl, from)).toBe(0);
  });

  it('migrate with every URL from a *_FILE variable: forwards, and prints no password', async () => {
    const { from, to } = await pair();
    const report = join(files, 'report.json');
    const result = await runCli(
      [
        'migrate',
        ...['--source-queue', from, '--target-queue', to, '--idle-timeout', '300ms'],
        ...['--log-level', 'debug', '--report', report],
      ],
      {
        env: {
          DEDUP_BRIDGE_SOURCE_FILE: secretFile('source', source),
          DEDUP_BRIDGE_TARGET_FILE: secretFile('target', target),
          DEDUP_BRIDGE_REDIS_FILE: secretFile('redis', redisUrl),
          DEDUP_BRIDGE_SOURCE_MANAGEMENT_FILE: secretFile('management', management),
        },
      },
    );
    expect(result.code, result.stderr).toBe(0);
    expect(await depthOf(admin.sourceUrl, from)).toBe(0);
    expect((await takeAll(admin.targetUrl, to)).map((m) => m.content.toString()).sort()).toEqual(
      [...numbered(from, MESSAGES).ids].sort(),
    );
    expectNoSecret(result.stdout + result.stderr + readFileSync(report, 'utf8'), all);
  });

  it('a job file with { file } and { env } in place of URLs: migrate forwards, and prints no password', async () => {
    const { from, to } = await pair();
    const job = join(files, 'job.yaml');
    writeFileSync(
      job,
      [
        `source: { file: ${secretFile('job-source', source)} }`,
        'target: { env: SECRET_JOB_TARGET }',
        `redis: { file: ${secretFile('job-redis', redisUrl)} }`,
        `queues: [{ source: ${from}, target: ${to} }]`,
        '',
      ].join('\n'),
    );
    const result = await runCli(
      ['migrate', '--job-file', job, '--idle-timeout', '300ms', '--log-level', 'debug'],
      { env: { SECRET_JOB_TARGET: target } },
    );
    expect(result.code, result.stderr).toBe(0);
    expect(await depthOf(admin.sourceUrl, from)).toBe(0);
    expect(await depthOf(admin.targetUrl, to)).toBe(MESSAGES);
    expectNoSecret(result.stdout + result.stderr, all);

    writeFileSync(job, `source: { file: /nope/source }\nqueues: [${from}]\n`);
    const missing = await runCli(['migrate', '--job-file', job]);
    expect(missing.code).toBe(2);
    expect(missing.stderr).toBe(
      `dedup-bridge: --job-file ${job}: source.file: cannot read "/nope/source" (ENOENT); give a readable file that holds the URL\n`,
    );
  });

  it('a config file with { file } and { env } in place of URLs: config check masks them, run --config forwards', async () => {
    const { from, to } = await pair();
    const config = join(files, 'bridge.yaml');
    writeFileSync(
      config,
      [
        'brokers:',
        `  src: { url: { file: ${secretFile('cfg-source', source)} }, management: { env: SECRET_MGMT } }`,
        '  dst: { urls: [{ env: SECRET_TARGET }] }',
        `redis: { url: { file: ${secretFile('cfg-redis', redisUrl)} } }`,
        'logLevel: debug',
        'routes:',
        `  - { name: r1, source: { broker: src, queue: ${from} }, target: { broker: dst, queue: ${to} } }`,
        '',
      ].join('\n'),
    );
    const env = { SECRET_MGMT: management, SECRET_TARGET: target };
    const check = await runCli(['config', 'check', config], { env });
    expect(check.code, check.stderr).toBe(0);
    expect(check.stdout).toContain(`- amqp://${user}:***@127.0.0.1:`);
    expect(check.stdout).toContain('?password=***');
    expectNoSecret(check.stdout + check.stderr, all);

    const bridge = startCli(['run', '--config', config], env);
    expect(await waitFor(async () => (await depthOf(admin.targetUrl, to)) === MESSAGES)).toBe(true);
    bridge.signal('SIGTERM');
    const ended = await bridge.done;
    expect(ended.code, ended.stderr).toBe(0);
    expect(await depthOf(admin.sourceUrl, from)).toBe(0);
    expectNoSecret(ended.stdout + ended.stderr, all);
  });

  it('a missing or unreadable secret file: one line naming the variable or field and the path, exit 2', async () => {
    const folder = join(files, 'a-folder');
    mkdirSync(folder, { recursive: true });
    const base = ['migrate', '--source-queue', 'q', '--target-queue', 'q', '--log-level', 'debug'];
    const missing = await runCli(base, {
      env: { DEDUP_BRIDGE_SOURCE: source, DEDUP_BRIDGE_TARGET: target, DEDUP_BRIDGE_REDIS_FILE: '/nope/x' },
    });
    expect(missing.code).toBe(2);
    expect(missing.stderr).toBe(
      'dedup-bridge: DEDUP_BRIDGE_REDIS_FILE (--redis): cannot read "/nope/x" (ENOENT); give a readable file that holds the URL\n',
    );
    const directory = await runCli(base, {
      env: { DEDUP_BRIDGE_SOURCE_FILE: folder, DEDUP_BRIDGE_TARGET: target },
    });
    expect(directory.code).toBe(2);
    expect(directory.stderr).toMatch(
      /^dedup-bridge: DEDUP_BRIDGE_SOURCE_FILE \(--source\): cannot read ".*a-folder" \(EISDIR\)/,
    );
    const both = await runCli(base, {
      env: { DEDUP_BRIDGE_TARGET: target, DEDUP_BRIDGE_TARGET_FILE: secretFile('t2', target) },
    });
    expect(both.code).toBe(2);
    expect(both.stderr).toBe(
      'dedup-bridge: DEDUP_BRIDGE_TARGET_FILE: DEDUP_BRIDGE_TARGET is set too; set one of them (the URL, or the file that holds it)\n',
    );
    // A file whose URL is refused: the line names the _FILE variable, and masks the password.
    const refused = await runCli(base, {
      env: {
        DEDUP_BRIDGE_SOURCE_FILE: secretFile('bad-source', `ftp://${user}:${amqpSecret.text}@h/`),
        DEDUP_BRIDGE_TARGET: target,
      },
    });
    expect(refused.code).toBe(2);
    expect(refused.stderr).toMatch(
      /^dedup-bridge: DEDUP_BRIDGE_SOURCE_FILE \(--source\): "ftp:\/\/.*:\*\*\*@h\/" is not a URL/,
    );

    const config = join(files, 'missing.yaml');
    writeFileSync(
      config,
      [
        'brokers:',
        `  src: { url: ${JSON.stringify(source)} }`,
        '  dst: { url: { file: /nope/target-url } }',
        'routes:',
        '  - { name: r1, source: { broker: src, queue: q }, target: { broker: dst, queue: q } }',
        '',
      ].join('\n'),
    );
    for (const args of [
      ['config', 'check', config],
      ['run', '--config', config],
    ]) {
      const result = await runCli(args);
      expect(result.code).toBe(2);
      expect(result.stderr).toBe(
        `dedup-bridge: ${config}: brokers.dst.url.file: cannot read "/nope/target-url" (ENOENT); give a readable file that holds the URL\n`,
      );
    }
    const unset = join(files, 'unset.yaml');
    writeFileSync(
      unset,
      [
        'brokers:',
        '  a: { url: { env: NO_SUCH_VAR_SET } }',
        'routes:',
        '  - { name: r1, source: { broker: a, queue: q }, target: { broker: a, queue: t } }',
        '',
      ].join('\n'),
    );
    const noVariable = await runCli(['config', 'check', unset]);
    expect(noVariable.code).toBe(2);
    expect(noVariable.stderr).toBe(
      `dedup-bridge: ${unset}: brokers.a.url.env: the variable NO_SUCH_VAR_SET is not set (or empty); set it to the URL\n`,
    );
    // A file (or variable) holding the bare password instead of the URL: refused without quoting it.
    const bare = await runCli(base, {
      env: { DEDUP_BRIDGE_SOURCE: source, DEDUP_BRIDGE_TARGET_FILE: secretFile('bare', amqpSecret.text) },
    });
    expect(bare.code).toBe(2);
    expect(bare.stderr).toMatch(/^dedup-bridge: DEDUP_BRIDGE_TARGET_FILE \(--target\): "its text" /);
    const bareConfig = join(files, 'bare.yaml');
    writeFileSync(
      bareConfig,
      [
        'brokers:',
        `  a: { url: { file: ${secretFile('bare-config', amqpSecret.text)} } }`,
        '  b: { url: { env: BARE_PASSWORD } }',
        'routes:',
        '  - { name: r1, source: { broker: a, queue: q }, target: { broker: b, queue: t } }',
        '',
      ].join('\n'),
    );
    const bareFile = await runCli(['config', 'check', bareConfig]);
    expect(bareFile.code).toBe(2);
    expect(bareFile.stderr).toMatch(/brokers\.a\.url: "the URL in .*bare-config" /);
    writeFileSync(bareConfig, readFileSync(bareConfig, 'utf8').replace(/\{ file: [^}]+\}/, `"${source}"`));
    const bareVariable = await runCli(['config', 'check', bareConfig], {
      env: { BARE_PASSWORD: redisSecret.text },
    });
    expect(bareVariable.code).toBe(2);
    expect(bareVariable.stderr).toMatch(/brokers\.b\.url: "the URL in \$BARE_PASSWORD" /);
    const job = join(files, 'bare-job.yaml');
    writeFileSync(job, 'source: { env: BARE_PASSWORD }\nqueues: [q]\n');
    const bareJob = await runCli(['migrate', '--job-file', job, '--target', target], {
      env: { BARE_PASSWORD: redisSecret.text },
    });
    expect(bareJob.code).toBe(2);
    expect(bareJob.stderr).toMatch(/^dedup-bridge: --job-file .*: source: "the URL in \$BARE_PASSWORD" /);
    expectNoSecret(
      [missing, directory, both, refused, bare, bareFile, bareVariable, bareJob]
        .map((r) => r.stdout + r.stderr)
        .join('\n'),
      all,
    );
  });

  it('refusals and unreachable servers: one line each, no part of any password', async () => {
    const from = uniqueName('sec-src');
    await declareQueue(admin.sourceUrl, from);
    await publishAll(admin.sourceUrl, from, numbered(from, MESSAGES).messages);
    const port = Number(new URL(admin.sourceUrl).port);
    const wrong = wrongSecret.text;
    const enc = encodeURIComponent;
    const redisPort = redis.port;
    const migrate = (over: { source?: string; target?: string; redis?: string }, ...extra: string[]) =>
      runCli([
        'migrate',
        ...['--source', over.source ?? source, '--source-queue', from, '--target', over.target ?? target],
        ...['--target-queue', from, '--redis', over.redis ?? redisUrl, '--idle-timeout', '300ms'],
        ...['--retry-for', '1s', '--log-level', 'debug', ...extra],
      ]);
    const cases: [string, () => ReturnType<typeof runCli>, number, RegExp][] = [
      [
        'a wrong ?password= for Redis',
        () => migrate({ redis: `redis://127.0.0.1:${redisPort}/0?password=${enc(wrong)}` }),
        2,
        /^dedup-bridge: Redis at redis:\/\/127\.0\.0\.1:\d+\/0\?password=\*\*\*: WRONGPASS/,
      ],
      [
        'a wrong AMQP password with ? # @ / (encoded)',
        () => migrate({ source: asUser(admin.sourceUrl, user, wrong) }),
        2,
        /^dedup-bridge: source broker at amqp:\/\/.*:\*\*\*@127\.0\.0\.1:\d+.*(ACCESS_REFUSED|refused)/,
      ],
      [
        'an unencoded ? in an AMQP password that reads as a port',
        () => migrate({ source: `amqp://${user}:12?${wrong}@127.0.0.1:${port}` }),
        2,
        /^dedup-bridge: --source \(or DEDUP_BRIDGE_SOURCE\): "amqp:\/\/.*:\*\*\*@127\.0\.0\.1:\d+" has an @ after its host.*percent-encode/,
      ],
      [
        'an unencoded # and / in an AMQP password',
        () => migrate({ target: `amqp://${user}:x${wrong}@127.0.0.1:${port}` }),
        2,
        /^dedup-bridge: --target \(or DEDUP_BRIDGE_TARGET\): "amqp:\/\/.*:\*\*\*@127\.0\.0\.1:\d+" is not a URL/,
      ],
      [
        'an unencoded # in a Redis password',
        () => migrate({ redis: `redis://app:12#${wrong}@127.0.0.1:${redisPort}` }),
        2,
        /^dedup-bridge: --redis \(or DEDUP_BRIDGE_REDIS\): "redis:\/\/app:\*\*\*@127\.0\.0\.1:\d+" has an @ after its host/,
      ],
      [
        'a Sentinel URL with / in its password and a bad host',
        () => migrate({ redis: `redis-sentinel://admin:${wrong}@127.0.0.1:1,:2/m` }),
        2,
        /^dedup-bridge: --redis \(or DEDUP_BRIDGE_REDIS\): "redis-sentinel:\/\/admin:\*\*\*@127\.0\.0\.1:1,:2\/m" has a bad host \(number 2 of its host list\)/,
      ],
      [
        'a Sentinel URL with / in its password, and a sentinel password, not answering',
        () =>
          migrate({
            redis: `redis-sentinel://admin:${wrong}@127.0.0.1:1/m?sentinelPassword=${enc(wrong)}`,
          }),
        1,
        /^dedup-bridge: Redis master "m" via Sentinel 127\.0\.0\.1:1 is unreachable/,
      ],
      [
        'a Cluster URL with / in its password, not answering',
        () => migrate({ redis: `rediss-cluster://admin:${wrong}@127.0.0.1:1` }),
        1,
        /^dedup-bridge: Redis Cluster 127\.0\.0\.1:1 over TLS is unreachable/,
      ],
      [
        'a wrong management API password',
        () => migrate({}, '--source-management', asUser(admin.sourceManagementUrl, user, wrong)),
        2,
        /^dedup-bridge: --source-management: login refused by http:\/\/.*:\*\*\*@127\.0\.0\.1:\d+/,
      ],
    ];
    for (const [what, running, code, line] of cases) {
      const result = await running();
      expect(result.code, `${what}: ${result.stderr}`).toBe(code);
      expect(result.stderr, what).toMatch(line);
      expect(result.stderr.trim().split('\n'), what).toHaveLength(1);
      expectNoSecret(result.stdout + result.stderr, all);
    }
    // Nothing moved by any of them.
    expect(await depthOf(admin.sourceUrl, from)).toBe(MESSAGES);
  });
});
