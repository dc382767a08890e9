import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { freePort } from '../harness/servers.js';
import {
  type CliResult,
  depthOf,
  migrateArgs,
  publishAll,
  queuePair,
  runCli,
  servers,
  uniqueName,
  withOption,
} from '../helpers.js';

const SECRET = 's3cr3t-Pa55';

function withPassword(url: string, password: string): string {
  const parsed = new URL(url);
  parsed.password = password;
  return parsed.toString();
}

/** One line on stderr, no stack trace, the password nowhere. */
function expectOneLine(result: CliResult, code: number, pattern: RegExp): void {
  const lines = result.stderr.trim().split('\n');
  expect(lines, result.stderr).toHaveLength(1);
  expect(lines[0]).toMatch(/^dedup-bridge: /);
  expect(lines[0]).toMatch(pattern);
  expect(result.stderr).not.toMatch(/\n\s+at /);
  expect(result.stdout + result.stderr).not.toContain(SECRET);
  expect(result.code).toBe(code);
}

function args(overrides: Record<string, string>, ...extra: string[]): string[] {
  const { sourceUrl, targetUrl, redisUrl } = servers();
  const options: Record<string, string> = {
    '--source': sourceUrl,
    '--source-queue': 'x',
    '--target': targetUrl,
    '--target-queue': 'y',
    '--redis': redisUrl,
    ...overrides,
  };
  return ['migrate', ...Object.entries(options).flat(), ...extra];
}

describe('bad input: one clear line, a documented exit code, no secrets', () => {
  it('a malformed URL exits 2 and names the option', async () => {
    const result = await runCli(args({ '--source': `amqp//guest:${SECRET}@host` }));
    expectOneLine(result, 2, /--source .*not a URL/);
  });

  it('a Redis URL whose path is not a database number exits 2 with one line, before connecting', async () => {
    const result = await runCli(args({ '--redis': `redis://:${SECRET}@127.0.0.1:6390/abc` }));
    expectOneLine(result, 2, /--redis .*the path "\/abc", which is not a database number/);
  });

  it('a virtual host that does not exist exits 2 naming it, without retrying', async () => {
    const { sourceUrl } = servers();
    const url = new URL(sourceUrl);
    url.pathname = '/novhost';
    const started = Date.now();
    const result = await runCli(['run', ...args({ '--source': url.toString() }).slice(1)]);
    expectOneLine(result, 2, /the virtual host "novhost" does not exist or the user may not use it/);
    expect(Date.now() - started).toBeLessThan(30_000);
  });

  it('--on-unforwardable dead-letter on a source queue without a dead-letter exchange exits 2, before consuming', async () => {
    const { sourceUrl, sourceManagementUrl } = servers();
    const { source, target } = await queuePair();
    await publishAll(sourceUrl, source, [{ body: 'kept', options: { headers: { _HQ_DUPL_ID: 'dl-1' } } }]);
    const result = await runCli(
      args(
        { '--source-queue': source, '--target-queue': target },
        '--on-unforwardable',
        'dead-letter',
        '--source-management',
        sourceManagementUrl,
      ),
    );
    expectOneLine(
      result,
      2,
      /source queue "t-src-[0-9a-f]+" has no dead-letter exchange .* RabbitMQ would drop/,
    );
    expect(await depthOf(sourceUrl, source)).toBe(1);
  });

  it('--on-unforwardable and its old name --on-unroutable with different policies exit 2 with one line', async () => {
    const result = await runCli(args({}, '--on-unforwardable', 'retry', '--on-unroutable', 'dead-letter'));
    expectOneLine(
      result,
      2,
      /--on-unforwardable: is retry, but --on-unroutable \(its old name\) is dead-letter; give only --on-unforwardable$/,
    );
  });

  it('a URL of the wrong scheme exits 2 without printing its password', async () => {
    const result = await runCli(args({ '--redis': `http://user:${SECRET}@localhost:6379` }));
    expectOneLine(result, 2, /--redis .*scheme http; use redis or rediss/);
  });

  it('a % that is not percent-encoding in a URL exits 2 with one line, not a stack trace', async () => {
    const cases: [Record<string, string>, RegExp][] = [
      [{ '--source': `amqp://guest:${SECRET}%zz@host/vhost` }, /--source .*not percent-encoding/],
      [{ '--source': `amqp://guest:${SECRET}@host/%zz` }, /--source .*not percent-encoding/],
      [{ '--redis': `redis://:${SECRET}%zz@host:6379` }, /--redis .*not percent-encoding/],
      [
        { '--source-management': `http://guest:${SECRET}%zz@host:15672` },
        /--source-management: .*not percent-encoding/,
      ],
    ];
    for (const [overrides, pattern] of cases) expectOneLine(await runCli(args(overrides)), 2, pattern);
  });

  it('TLS options with a plain Redis Sentinel or Cluster URL name the TLS form of that URL', async () => {
    const result = await runCli(
      args({ '--redis': 'redis-sentinel://127.0.0.1:26379/main', '--redis-ca': 'ca.pem' }),
    );
    expectOneLine(
      result,
      2,
      /^dedup-bridge: --redis-ca: needs --redis to be rediss-sentinel:\/\/, not redis-sentinel:\/\/; use rediss-sentinel:\/\//,
    );
  });

  it('wrong credentials exit 2 and say the login was refused', async () => {
    const { source, target } = await queuePair();
    const result = await runCli(
      args({
        '--source': withPassword(servers().sourceUrl, SECRET),
        '--source-queue': source,
        '--target-queue': target,
      }),
    );
    expectOneLine(result, 2, /source broker at amqp:\/\/guest:\*\*\*@.*login refused/);
  });

  it('Redis refusing the credentials or the database exits 2 and says which', async () => {
    const { redisUrl } = servers();
    const user = new URL(redisUrl);
    user.username = 'nobody';
    user.password = SECRET;
    expectOneLine(
      await runCli(args({ '--redis': user.toString() })),
      2,
      /Redis at redis:\/\/nobody:\*\*\*@.*: WRONGPASS — authentication or database refused; check the user, password and database in the URL$/,
    );
    const database = new URL(redisUrl);
    database.pathname = '/99';
    expectOneLine(
      await runCli(args({ '--redis': database.toString() })),
      2,
      /\/99: ERR DB index is out of range — authentication or database refused/,
    );
  });

  it('an unreachable broker exits 1 after the bounded retry', async () => {
    const { source } = await queuePair();
    const port = await freePort();
    const started = Date.now();
    const result = await runCli(
      args({
        '--target': `amqp://guest:${SECRET}@127.0.0.1:${port}`,
        '--source-queue': source,
        '--retry-for': '1s',
      }),
    );
    expectOneLine(result, 1, /target broker at .* is unreachable \(ECONNREFUSED\) after retrying/);
    expect(Date.now() - started).toBeLessThan(30_000);
  });

  it('an unreachable Redis exits 1 after the bounded retry', async () => {
    const port = await freePort();
    const result = await runCli(
      args({ '--redis': `redis://:${SECRET}@127.0.0.1:${port}`, '--retry-for': '1s' }),
    );
    expectOneLine(result, 1, /Redis at redis:\/\/:\*\*\*@127\.0\.0\.1:\d+\/? is unreachable/);
  });

  it('a missing source queue exits 2 and names it', async () => {
    const { target } = await queuePair();
    const missing = uniqueName('missing');
    const result = await runCli(args({ '--source-queue': missing, '--target-queue': target }));
    expectOneLine(
      result,
      2,
      new RegExp(`--source-queue: queue "${missing}" does not exist on the source broker`),
    );
  });

  it('a missing target queue or exchange exits 2 and names it', async () => {
    const { source } = await queuePair();
    const missing = uniqueName('missing');
    const queue = await runCli(args({ '--source-queue': source, '--target-queue': missing }));
    expectOneLine(
      queue,
      2,
      new RegExp(`--target-queue: queue "${missing}" does not exist on the target broker`),
    );
    const { sourceUrl, targetUrl, redisUrl } = servers();
    const exchange = await runCli([
      'migrate',
      '--source',
      sourceUrl,
      '--source-queue',
      source,
      '--target',
      targetUrl,
      '--target-exchange',
      missing,
      '--redis',
      redisUrl,
    ]);
    expectOneLine(exchange, 2, new RegExp(`--target-exchange: exchange "${missing}" does not exist`));
  });

  it('an unknown option, a bad duration, a missing option, a bad number: exit 2', async () => {
    expectOneLine(await runCli(args({}, '--frobnicate')), 2, /unknown option '--frobnicate'/);
    expectOneLine(
      await runCli(args({ '--dedup-window': '7 parsecs' })),
      2,
      /--dedup-window: "7 parsecs" is not a duration/,
    );
    expectOneLine(
      await runCli(['migrate', '--source-queue', 'q']),
      2,
      /--source \(or DEDUP_BRIDGE_SOURCE\): is required/,
    );
    expectOneLine(
      await runCli(args({ '--prefetch': 'many' })),
      2,
      /--prefetch: must be a whole number from 1 to 65535$/,
    );
    expectOneLine(await runCli(['bogus-command']), 2, /unknown command 'bogus-command'/);
  });

  // Found by a hunt: Node's timers fire after 1 ms past 2^31-1 ms, so --retry-for 25d gave up on a
  // running Redis at once, --max-duration 25d stopped at once (exit 4), with a multi-line warning.
  it.each([
    ['--retry-for', '25d', ', or forever'],
    ['--max-duration', '25d', ''],
    ['--shutdown-timeout', '30d', ''],
    ['--lease', '40d', ''],
    ['--idle-timeout', '600h', ''],
  ])('%s %s, longer than a timer can wait: one line, exit 2', async (option, value, beyond) => {
    const result = await runCli(args({ [option]: value }));
    expectOneLine(
      result,
      2,
      new RegExp(
        `^dedup-bridge: ${option}: "${value}" is longer than a timer can wait \\(24\\.8 days\\); give at most 24d${beyond}$`,
      ),
    );
    expect(result.stderr).not.toMatch(/TimeoutOverflowWarning/);
  });

  // Found by a hunt: amqplib sent these as they were, and the connection failed as if the broker
  // were down (exit 1 after the whole --retry-for, "unreachable").
  it.each([
    ['heartbeat=abc', 'URL parameter heartbeat must be a whole number from 0 to 65535'],
    ['frameMax=100', 'URL parameter frameMax must be a whole number from 4096 to 4294967295'],
    ['channelMax=70000', 'URL parameter channelMax must be a whole number from 0 to 65535'],
    [
      'connection_attempts=3',
      'unknown URL parameter connection_attempts; an amqp URL takes heartbeat, channelMax, frameMax, maxFrameSize, locale',
    ],
  ])('a source URL with ?%s: one line naming the parameter, exit 2, no retry', async (query, problem) => {
    const { sourceUrl } = servers();
    const url = new URL(sourceUrl);
    url.password = SECRET;
    const result = await runCli(
      args({ '--source': `${url.href.replace(/\/?$/, '/')}?${query}`, '--retry-for': '60s' }),
    );
    expectOneLine(
      result,
      2,
      new RegExp(`^dedup-bridge: --source \\(or DEDUP_BRIDGE_SOURCE\\): ".*": ${problem}$`),
    );
  });

  it('a source URL with ?heartbeat=5 and ?frameMax=4096 is taken', async () => {
    const { source, target } = await queuePair();
    const { sourceUrl } = servers();
    const result = await runCli(
      withOption(
        migrateArgs(source, ['--target-queue', target]),
        '--source',
        `${sourceUrl.replace(/\/?$/, '/')}?heartbeat=5&frameMax=4096`,
      ),
    );
    expect(result.code, result.stderr).toBe(0);
  });

  it('a --dedup-window of 90 days is not a timer: accepted', async () => {
    const { source, target } = await queuePair();
    const result = await runCli(migrateArgs(source, ['--target-queue', target], '--dedup-window', '90d'));
    expect(result.code, result.stderr).toBe(0);
  });

  it('the environment variables configure a run, and nothing is left behind on an empty queue', async () => {
    const { sourceUrl, targetUrl, redisUrl } = servers();
    const { source, target } = await queuePair();
    const result = await runCli(['migrate', '--target-queue', target, '--idle-timeout', '200ms'], {
      env: {
        DEDUP_BRIDGE_SOURCE: sourceUrl,
        DEDUP_BRIDGE_SOURCE_QUEUE: source,
        DEDUP_BRIDGE_TARGET: targetUrl,
        DEDUP_BRIDGE_REDIS: redisUrl,
      },
    });
    expect(result.code).toBe(0);
    expect(result.stderr).toContain('drained');
  });
});

describe('config and flags agree; each mistake is one line that names it (issue 17, item 6)', () => {
  const tempFile = (name: string, text: string) => {
    const path = join(mkdtempSync(join(tmpdir(), 'cli-errors-')), name);
    writeFileSync(path, text);
    return path;
  };
  const configText = (retryFor: string) => {
    const { sourceUrl, targetUrl } = servers();
    return `brokers:\n  a: { url: "${sourceUrl}" }\n  b: { url: "${targetUrl}" }\n${retryFor}routes:\n  - { name: r, source: { broker: a, queue: q }, target: { broker: b, queue: t }, lease: 20000 }\n`;
  };

  it('a number out of range says the range', async () => {
    expectOneLine(
      await runCli(args({ '--prefetch': '-5' })),
      2,
      /^dedup-bridge: --prefetch: must be a whole number from 1 to 65535$/,
    );
    expectOneLine(
      await runCli(args({ '--batch-size': '0' })),
      2,
      /^dedup-bridge: --batch-size: must be at least 1 \(a whole number from 1 to 5000\)$/,
    );
  });

  it('a URL without a scheme says to add it, password masked', async () => {
    expectOneLine(
      await runCli(args({ '--source': 'localhost:5701' })),
      2,
      /^dedup-bridge: --source \(or DEDUP_BRIDGE_SOURCE\): "localhost:5701" has no scheme; add amqp:\/\/, e.g\. amqp:\/\/localhost:5701$/,
    );
    expectOneLine(
      await runCli(args({ '--redis': `u:${SECRET}@localhost:6379` })),
      2,
      /--redis \(or DEDUP_BRIDGE_REDIS\): ".*" has no scheme; add redis:\/\//,
    );
  });

  it('--retry-for 0 is refused (it would not mean "no retry"); forever is taken', async () => {
    for (const command of ['run', 'migrate']) {
      expectOneLine(
        await runCli([command, ...args({ '--retry-for': '0' }).slice(1)]),
        2,
        /^dedup-bridge: --retry-for: 0 is not accepted \(it would not mean "no retry"\); give how long to keep trying a server, e\.g\. 1s or 60s, or forever$/,
      );
    }
    const { source, target } = await queuePair();
    const forever = await runCli(
      args({
        '--source-queue': source,
        '--target-queue': target,
        '--retry-for': 'forever',
        '--idle-timeout': '200ms',
      }),
    );
    expect(forever.code, forever.stderr).toBe(0);
  });

  it('config check prints a retryFor the file accepts back; the file takes the flag forms and refuses 0', async () => {
    const checked = await runCli(['config', 'check', tempFile('c.yaml', configText(''))]);
    expect(checked.code, checked.stderr).toBe(0);
    expect(checked.stdout).toMatch(/^retryFor: forever$/m);
    expect(checked.stdout).toMatch(/^ {4}lease: 20s$/m);
    for (const retryFor of ['forever', '90000', '90s']) {
      const again = await runCli([
        'config',
        'check',
        tempFile('c.yaml', configText(`retryFor: ${retryFor}\n`)),
      ]);
      expect(again.code, again.stderr).toBe(0);
      expect(again.stdout).toMatch(
        new RegExp(`^retryFor: ${retryFor === 'forever' ? 'forever' : '90s'}$`, 'm'),
      );
    }
    expectOneLine(
      await runCli(['config', 'check', tempFile('c.yaml', configText('retryFor: 0\n'))]),
      2,
      /c\.yaml: retryFor: 0 is not accepted \(it would not mean "no retry"\)/,
    );
  });

  it('a stray argument is named; a duration split by a space says to write it as one word', async () => {
    expectOneLine(
      await runCli(args({}, 'extra')),
      2,
      /^dedup-bridge: unexpected argument "extra" \(after --redis \S+\): migrate takes no arguments, only options, each with one value; remove it, or quote a value that has spaces$/,
    );
    expectOneLine(
      await runCli(args({ '--idle-timeout': '2' }, 's')),
      2,
      /^dedup-bridge: unexpected argument "s" after --idle-timeout 2: a duration is one word; write --idle-timeout 2s$/,
    );
    expectOneLine(
      await runCli(['config', 'check', 'a.yaml', 'b.yaml']),
      2,
      /^dedup-bridge: unexpected argument "b\.yaml": config check takes <file> only/,
    );
  });

  it('a value from an environment variable is refused naming the variable', async () => {
    const { sourceUrl, targetUrl } = servers();
    const base = [
      'run',
      '--source',
      sourceUrl,
      '--target',
      targetUrl,
      '--source-queue',
      'q',
      '--target-queue',
      't',
    ];
    expectOneLine(
      await runCli(base, { env: { DEDUP_BRIDGE_LOG_LEVEL: 'loud' } }),
      2,
      /^dedup-bridge: DEDUP_BRIDGE_LOG_LEVEL \(--log-level\): must be one of /,
    );
    expectOneLine(
      await runCli(['run', '--target', targetUrl, '--source-queue', 'q', '--target-queue', 't'], {
        env: { DEDUP_BRIDGE_SOURCE: 'localhost:5701' },
      }),
      2,
      /^dedup-bridge: DEDUP_BRIDGE_SOURCE \(--source\): "localhost:5701" has no scheme/,
    );
    expectOneLine(
      await runCli(base, { env: { DEDUP_BRIDGE_REDIS_WAIT_REPLICAS: 'all' } }),
      2,
      /^dedup-bridge: DEDUP_BRIDGE_REDIS_WAIT_REPLICAS \(--redis-wait-replicas\): must be a whole number from 0 to 64$/,
    );
  });

  it('--job-file with --source-queue (flag or variable) is refused', async () => {
    const { sourceUrl, targetUrl } = servers();
    const job = tempFile('job.yaml', 'queues:\n  - a\n');
    const base = ['migrate', '--job-file', job, '--source', sourceUrl, '--target', targetUrl];
    expectOneLine(
      await runCli([...base, '--source-queue', 'b']),
      2,
      /^dedup-bridge: --source-queue: does not go with --job-file, which lists the queues/,
    );
    expectOneLine(
      await runCli(base, { env: { DEDUP_BRIDGE_SOURCE_QUEUE: 'b' } }),
      2,
      /^dedup-bridge: DEDUP_BRIDGE_SOURCE_QUEUE \(--source-queue\): does not go with --job-file/,
    );
  });
});

describe('the README matches (issue 17, item 8)', () => {
  it('an empty --redis-prefix is refused, as the README now says', async () => {
    expectOneLine(
      await runCli(args({ '--redis-prefix': '' })),
      2,
      /^dedup-bridge: --redis-prefix: must be non-empty, without braces, colons or spaces$/,
    );
  });
});
