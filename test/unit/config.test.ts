import { Command } from 'commander';
import { describe, expect, it } from 'vitest';
import { addBridgeOptions } from '../../src/cli/options.js';
import { formatDuration, parseDuration } from '../../src/config/duration.js';
import { resolveMigrateSettings } from '../../src/config/migrate-settings.js';
import { passwordOf, redactSecrets, redactUrl, secretsOf } from '../../src/config/redact.js';
import { DEFAULTS, type RawOptions, resolveBridgeSettings } from '../../src/config/settings.js';
import { ConfigError } from '../../src/errors.js';
import { catchError } from '../helpers.js';

const SECRET = 'hunter2-Sup3rSecret';

/** The ConfigError that fn throws; fails the test when it throws anything else or nothing. */
function configError(fn: () => unknown): ConfigError {
  const error = catchError(fn);
  expect(error).toBeInstanceOf(ConfigError);
  const configError = error as ConfigError;
  expect(configError.exitCode).toBe(2);
  return configError;
}

describe('parseDuration', () => {
  it.each([
    ['500ms', 500],
    ['2s', 2000],
    ['5m', 300_000],
    ['1h', 3_600_000],
    ['1h30m', 5_400_000],
    ['7d', 604_800_000],
    ['1w', 604_800_000],
    ['1d2h3m4s5ms', 86_400_000 + 7_200_000 + 180_000 + 4000 + 5],
    ['1.5s', 1500],
    ['0.5ms', 1],
    ['0s', 0],
    ['1500', 1500],
    ['0', 0],
    ['  2s  ', 2000],
    [' 250 ', 250],
  ])('parses %j as %d ms', (text, ms) => {
    expect(parseDuration(text, '--x')).toBe(ms);
  });

  it.each([
    ['5 parsecs'],
    [''],
    ['   '],
    ['1x'],
    ['s'],
    ['ms'],
    ['2s5'],
    ['-1s'],
    ['1h 30m'],
    ['1.5'],
    ['1S'],
    ['abc'],
    ['5s!'],
  ])('rejects %j with a ConfigError naming the option', (text) => {
    const error = configError(() => parseDuration(text, '--dedup-window'));
    expect(error.message.startsWith('--dedup-window: ')).toBe(true);
    expect(error.message).toContain(`"${text}"`);
  });

  it('names whatever option it is given', () => {
    expect(configError(() => parseDuration('soon', '--lease')).message).toMatch(/^--lease: /);
    expect(configError(() => parseDuration('soon', '--idle-timeout')).message).toMatch(/^--idle-timeout: /);
  });
});

describe('formatDuration', () => {
  it.each([
    [604_800_000, '7d'],
    [86_400_000, '1d'],
    [3_600_000, '1h'],
    [5_400_000, '90m'],
    [60_000, '1m'],
    [2000, '2s'],
    [90_000, '90s'],
    [1500, '1500ms'],
    [1, '1ms'],
  ])('formats %d ms as %j', (ms, text) => {
    expect(formatDuration(ms)).toBe(text);
  });

  it('round-trips through parseDuration', () => {
    for (const ms of [1, 999, 1000, 61_000, 3_600_000, 5_400_000, 604_800_000, 123_456_789]) {
      expect(parseDuration(formatDuration(ms), '--x')).toBe(ms);
    }
  });
});

describe('redactUrl', () => {
  it('masks the password and keeps user, host, port and vhost', () => {
    const out = redactUrl(`amqp://alice:${SECRET}@broker.example:5672/prod`);
    expect(out).not.toContain(SECRET);
    expect(out).toContain('alice');
    expect(out).toContain('broker.example:5672');
    expect(out).toContain('/prod');
    expect(out).toBe('amqp://alice:***@broker.example:5672/prod');
  });

  it('masks a password with characters that need encoding', () => {
    const raw = 'p@ss:w/rd';
    const out = redactUrl(`amqps://bob:${encodeURIComponent(raw)}@h.example/`);
    expect(out).not.toContain(encodeURIComponent(raw));
    expect(out).not.toContain('ss');
    expect(out).toContain('bob');
    expect(out).toContain('h.example');
  });

  it('masks a password that contains an unencoded @ in a parseable URL', () => {
    const out = redactUrl(`redis://carol:${SECRET}@x@redis.example:6379`);
    expect(out).not.toContain(SECRET);
    expect(out).toContain('carol');
    expect(out).toContain('redis.example:6379');
  });

  it('masks an unencoded password that a URL parser reads as a port and a path', () => {
    // new URL() reads "bob:123" as host and port and "/x@host" as the path: no password at all.
    const out = redactUrl('amqp://bob:123/x@broker.example:5672/prod');
    expect(out).not.toContain('123/x');
    expect(out).toBe('amqp://bob:***@broker.example:5672/prod');
    // The same password is what gets scrubbed from error texts that echo the URL.
    expect(passwordOf('amqp://bob:123/x@broker.example:5672/prod')).toBe('123/x');
    expect(passwordOf('amqp://bob:s3cret@broker.example/')).toBe('s3cret');
    expect(passwordOf('amqp://broker.example:5672/')).toBe('');
  });

  it('leaves a URL without a password as it is', () => {
    expect(redactUrl('redis://127.0.0.1:6379')).toBe('redis://127.0.0.1:6379');
    expect(redactUrl('amqp://guest@host/')).toBe('amqp://guest@host/');
    // An @ after an IPv6 host is not the end of a password.
    expect(redactUrl('amqp://[::1]:5672/a@b')).toBe('amqp://[::1]:5672/a@b');
    expect(passwordOf('amqp://[::1]:5672/a@b')).toBe('');
    expect(redactUrl('redis://h:6379/0?db=1&family=6')).toBe('redis://h:6379/0?db=1&family=6');
  });

  it('masks an @ in a query too: it cannot be told from the end of a password', () => {
    // The same text is user "h" with password "6379/0?x=a" to a reader that splits at the last @.
    expect(redactUrl('redis://h:6379/0?x=a@b')).toBe('redis://h:***@b');
  });

  it.each([
    ['?', 'amqp://bob:12?Zq9-secret@broker.example:5672/prod'],
    ['#', 'amqp://bob:12#Zq9-secret@broker.example:5672/prod'],
    ['/ and ?', 'amqp://bob:12/Zq9?-secret@broker.example/prod'],
    ['@', 'amqps://bob:12@Zq9-secret@broker.example/'],
    ['? (not parseable)', 'amqp://bob:ab?Zq9-secret@broker.example:5672/prod'],
  ])('masks an unencoded %s in an AMQP password', (_what, url) => {
    // amqp://bob:12?x@host is host "bob", port 12 and a query to a URL parser: no password at all.
    const out = redactUrl(url);
    expect(out).not.toMatch(/Zq9|secret/);
    expect(out).toMatch(/^amqps?:\/\/bob:\*\*\*@broker\.example/);
    expect(passwordOf(url)).toMatch(/^(12|ab).Zq9.?-secret$|^12@Zq9-secret$/);
  });

  it('masks a password given as a query parameter (ioredis takes ?password=), and keeps the rest', () => {
    expect(redactUrl(`redis://10.0.0.5:6379/2?password=${SECRET}&db=2`)).toBe(
      'redis://10.0.0.5:6379/2?password=***&db=2',
    );
    expect(redactUrl(`rediss://app@h:6380?family=4&password=${SECRET}`)).toBe(
      'rediss://app@h:6380?family=4&password=***',
    );
    // The multi-host forms are no WHATWG URLs; their query is masked all the same.
    expect(
      redactUrl(`redis-sentinel://:${SECRET}@s1:26379,s2/m?sentinelUsername=w&sentinelPassword=${SECRET}`),
    ).toBe('redis-sentinel://:***@s1:26379,s2/m?sentinelUsername=w&sentinelPassword=***');
    expect(redactUrl(`redis://h?PASS=${SECRET}#x`)).toBe('redis://h?PASS=***#x');
  });

  it('lists every secret of a URL, typed and decoded, for scrubbing texts of other libraries', () => {
    const secrets = secretsOf('redis://u:p%2Fw@h:1?password=a%20b&sentinelPassword=c+d&db=3');
    expect(secrets).toEqual(expect.arrayContaining(['p/w', 'p%2Fw', 'a%20b', 'a b', 'c+d', 'c d']));
    expect(secrets).not.toContain('3');
    expect(redactSecrets('auth p/w failed near p%2Fw; c d', secrets)).toBe('auth *** failed near ***; ***');
    // A secret that contains another is removed whole.
    expect(redactSecrets('xabcx', ['b', 'abc'])).toBe('x***x');
  });

  it('masks the password in a string that is not a valid URL', () => {
    const out = redactUrl(`amqp://alice:${SECRET}@host:notaport/`);
    expect(out).not.toContain(SECRET);
    expect(out).toBe('amqp://alice:***@host:notaport/');
  });

  it('masks the whole password of an unparseable URL, even one containing @', () => {
    // The WHATWG parser takes the last @ as the end of the credentials; a fallback that stops at
    // the first @ leaves the rest of the password in the output.
    const password = 'tr0ub4dor@3-horse';
    const out = redactUrl(`amqp://alice:${password}@host:99999/`);
    expect(out).not.toContain('3-horse');
    expect(out).toContain('alice');
    expect(out).toContain('host');
  });

  it('returns a string that is not a URL unchanged and never throws', () => {
    expect(redactUrl('not a url')).toBe('not a url');
    expect(redactUrl('')).toBe('');
    expect(redactUrl('://')).toBe('://');
  });
});

const VALID: RawOptions = {
  source: 'amqp://src-user:src-pass@source.example:5672/in',
  sourceQueue: 'orders',
  target: 'amqp://tgt-user:tgt-pass@target.example:5672/out',
  targetQueue: 'orders-copy',
};

function resolve(overrides: Partial<Record<keyof RawOptions, string | boolean | undefined>>) {
  return resolveBridgeSettings({ ...VALID, ...overrides } as RawOptions, 'run');
}

function resolveError(overrides: Partial<Record<keyof RawOptions, string | boolean | undefined>>): string {
  return configError(() => resolve(overrides)).message;
}

describe('resolveBridgeSettings: defaults', () => {
  it('fills in the documented defaults', () => {
    const settings = resolve({});
    expect(settings.prefetch).toBe(500);
    expect(settings.dedupWindowMs).toBe(604_800_000);
    expect(settings.batchSize).toBe(200);
    expect(settings.leaseMs).toBe(15_000);
    expect(settings.redisUrl).toBe('redis://127.0.0.1:6379');
    expect(settings.redisPrefix).toBe('dedup');
    expect(settings.onUnforwardable).toBe('retry');
    expect(settings.parkQueue).toBeUndefined();
    expect(settings.logLevel).toBe('info');
    expect(settings.retryForMs).toBe(0);
    expect(settings.shutdownTimeoutMs).toBe(30_000);
    expect(settings.requeueDelay).toEqual({ initialMs: 1000, maxMs: 30_000 });
    expect(settings.idFrom).toEqual([
      { kind: 'header', name: '_HQ_DUPL_ID' },
      { kind: 'header', name: '_AMQ_DUPL_ID' },
      { kind: 'message-id' },
      { kind: 'content' },
    ]);
    expect(DEFAULTS.prefetch).toBe(500);
    expect(settings.maxInFlightBytes).toBe(32 * 1024 * 1024);
  });

  it('takes --max-in-flight-bytes with a binary unit or as bytes, and names the flag and variable when it is not a size', () => {
    expect(resolve({ maxInFlightBytes: '64MiB' }).maxInFlightBytes).toBe(64 * 1024 * 1024);
    expect(resolve({ maxInFlightBytes: '512Ki' }).maxInFlightBytes).toBe(512 * 1024);
    expect(resolve({ maxInFlightBytes: '1048576' }).maxInFlightBytes).toBe(1024 * 1024);
    expect(resolveError({ maxInFlightBytes: '64 megs' })).toBe(
      '--max-in-flight-bytes (or DEDUP_BRIDGE_MAX_IN_FLIGHT_BYTES): "64 megs" is not a size; use a whole number with a unit, e.g. 512KiB, 64MiB, 1GiB (or a number of bytes)',
    );
    expect(resolveError({ maxInFlightBytes: '0' })).toMatch(
      /^--max-in-flight-bytes .*: must be at least 1 byte/,
    );
  });

  it('targets a queue through the default exchange, scoped to the queue', () => {
    const settings = resolve({});
    expect(settings.scope).toBe('queue:orders-copy');
    expect(settings.targetExchange).toBe('');
    expect(settings.targetQueue).toBe('orders-copy');
    expect(settings.targetRoutingKey).toBe('orders-copy');
  });

  it('scopes an exchange target to the exchange and keeps each message its own key', () => {
    const settings = resolve({ targetQueue: undefined, targetExchange: 'events' });
    expect(settings.scope).toBe('exchange:events');
    expect(settings.targetExchange).toBe('events');
    expect(settings.targetQueue).toBeUndefined();
    expect(settings.targetRoutingKey).toBeUndefined();
  });

  it('uses a fixed routing key with --target-exchange and --target-routing-key', () => {
    const settings = resolve({ targetQueue: undefined, targetExchange: 'events', targetRoutingKey: 'k.1' });
    expect(settings.targetRoutingKey).toBe('k.1');
    expect(settings.scope).toBe('exchange:events');
  });

  it('lets --scope override the derived scope', () => {
    expect(resolve({ scope: 'shared-target' }).scope).toBe('shared-target');
  });

  it('passes URLs, names and the target user through', () => {
    const settings = resolve({});
    expect(settings.sourceUrl).toBe(VALID.source);
    expect(settings.targetUrl).toBe(VALID.target);
    expect(settings.sourceQueue).toBe('orders');
    expect(settings.targetUser).toBe('tgt-user');
    expect(resolve({ target: 'amqp://target.example/' }).targetUser).toBe('guest');
    expect(resolve({ target: 'amqp://j%C3%BCrgen:pw@target.example/' }).targetUser).toBe('jürgen');
  });

  it('parses the given options', () => {
    const settings = resolve({
      prefetch: '10',
      batchSize: '50',
      dedupWindow: '1h30m',
      lease: '2s',
      idFrom: 'message-id,content',
      redis: 'rediss://cache.example:6380',
      redisPrefix: 'bridge1',
      logLevel: 'debug',
      retryFor: '5m',
      shutdownTimeout: '500ms',
    });
    expect(settings.prefetch).toBe(10);
    expect(settings.batchSize).toBe(50);
    expect(settings.dedupWindowMs).toBe(5_400_000);
    expect(settings.leaseMs).toBe(2000);
    expect(settings.idFrom).toEqual([{ kind: 'message-id' }, { kind: 'content' }]);
    expect(settings.redisUrl).toBe('rediss://cache.example:6380');
    expect(settings.redisPrefix).toBe('bridge1');
    expect(settings.logLevel).toBe('debug');
    expect(settings.retryForMs).toBe(300_000);
    expect(settings.shutdownTimeoutMs).toBe(500);
  });

  it('accepts amqps and the bounds of --prefetch', () => {
    expect(resolve({ source: 'amqps://u:p@h.example:5671/' }).sourceUrl).toBe('amqps://u:p@h.example:5671/');
    expect(resolve({ prefetch: '1' }).prefetch).toBe(1);
    expect(resolve({ prefetch: '65535' }).prefetch).toBe(65535);
  });

  it('implies the park policy from --park-queue', () => {
    const settings = resolve({ parkQueue: 'parked' });
    expect(settings.onUnforwardable).toBe('park');
    expect(settings.parkQueue).toBe('parked');
    expect(resolve({ parkQueue: 'parked', onUnforwardable: 'park' }).onUnforwardable).toBe('park');
  });

  it('accepts the other unforwardable policies without a park queue', () => {
    expect(resolve({ onUnforwardable: 'dead-letter' }).onUnforwardable).toBe('dead-letter');
    expect(resolve({ onUnforwardable: 'retry' }).onUnforwardable).toBe('retry');
  });
});

describe('--redis-wait-replicas', () => {
  /** What `run` collects from these flags and environment, as the CLI defines its options. */
  function collected(argv: string[], env: Record<string, string> = {}): RawOptions {
    const saved = { ...process.env };
    Object.assign(process.env, env);
    try {
      const command = addBridgeOptions(new Command('run').exitOverride(), 'run');
      command.parse(argv, { from: 'user' });
      return command.opts() as RawOptions;
    } finally {
      for (const name of Object.keys(env)) {
        if (saved[name] === undefined) delete process.env[name];
        else process.env[name] = saved[name];
      }
    }
  }

  it('is 0 by default: acks go out when the master answers', () => {
    expect(resolve({}).redisWaitReplicas).toBe(0);
    expect(DEFAULTS.redisWaitReplicas).toBe(0);
  });

  it('comes from the flag, else from DEDUP_BRIDGE_REDIS_WAIT_REPLICAS', () => {
    const base = ['--source-queue', 'q', '--target-queue', 'q2'];
    const fromFlag = collected([...base, '--redis-wait-replicas', '2']);
    expect(resolve({ ...fromFlag }).redisWaitReplicas).toBe(2);
    const fromEnv = collected(base, { DEDUP_BRIDGE_REDIS_WAIT_REPLICAS: '1' });
    expect(resolve({ ...fromEnv }).redisWaitReplicas).toBe(1);
    const both = collected([...base, '--redis-wait-replicas', '3'], {
      DEDUP_BRIDGE_REDIS_WAIT_REPLICAS: '1',
    });
    expect(resolve({ ...both }).redisWaitReplicas).toBe(3);
  });

  it('reaches every route of a migration', () => {
    const settings = resolveMigrateSettings({
      ...MIGRATE,
      sourceQueue: ['a', 'b'],
      targetQueue: undefined,
      redisWaitReplicas: '1',
    });
    expect(settings.routes.map((route) => route.redisWaitReplicas)).toEqual([1, 1]);
  });

  it.each(['-1', 'one', '1.5', '65', ''])('refuses %j, naming the flag and its variable', (value) => {
    expect(resolveError({ redisWaitReplicas: value })).toMatch(
      /^--redis-wait-replicas \(or DEDUP_BRIDGE_REDIS_WAIT_REPLICAS\): must be/,
    );
  });

  it('takes 0 (off) up to 64', () => {
    expect(resolve({ redisWaitReplicas: '0' }).redisWaitReplicas).toBe(0);
    expect(resolve({ redisWaitReplicas: '64' }).redisWaitReplicas).toBe(64);
  });
});

const MIGRATE = { ...VALID, sourceQueue: ['orders'] };

describe('resolveMigrateSettings', () => {
  it('adds the migrate defaults', () => {
    const settings = resolveMigrateSettings({ ...MIGRATE });
    const route = settings.routes[0];
    expect(settings.idleTimeoutMs).toBe(2000);
    expect(settings.reportPath).toBeUndefined();
    expect(settings.parallel).toBe(4);
    expect(settings.jobName).toMatch(/^migrate-[0-9a-f]{12}$/);
    expect(route?.retryForMs).toBe(60_000);
    expect(route?.prefetch).toBe(500);
    expect(route?.dedupWindowMs).toBe(604_800_000);
    expect(route?.scope).toBe('queue:orders-copy');
  });

  it('parses its own options', () => {
    const settings = resolveMigrateSettings({
      ...MIGRATE,
      idleTimeout: '10s',
      report: '/tmp/report.json',
      retryFor: 'forever',
      maxMessages: '5',
      maxDuration: '1h',
      maxRate: '200',
      parallel: '2',
    });
    expect(settings.idleTimeoutMs).toBe(10_000);
    expect(settings.reportPath).toBe('/tmp/report.json');
    expect(settings.routes[0]?.retryForMs).toBe(0);
    expect(settings.maxMessages).toBe(5);
    expect(settings.maxDurationMs).toBe(3_600_000);
    expect(settings.maxRate).toBe(200);
    expect(settings.parallel).toBe(2);
  });

  it('sends several queues each to the queue of its own name, unless mapped', () => {
    const settings = resolveMigrateSettings({
      ...MIGRATE,
      targetQueue: undefined,
      sourceQueue: ['a', 'b', 'c'],
      map: ['b=b-new'],
    });
    expect(settings.routes.map((route) => [route.sourceQueue, route.targetQueue, route.scope])).toEqual([
      ['a', 'a', 'queue:a'],
      ['b', 'b-new', 'queue:b-new'],
      ['c', 'c', 'queue:c'],
    ]);
  });

  it('the same routes give the same job name; other routes another', () => {
    const one = resolveMigrateSettings({ ...MIGRATE, targetQueue: undefined, sourceQueue: ['a', 'b'] });
    const again = resolveMigrateSettings({ ...MIGRATE, targetQueue: undefined, sourceQueue: ['b', 'a'] });
    const other = resolveMigrateSettings({ ...MIGRATE, targetQueue: undefined, sourceQueue: ['a'] });
    expect(again.jobName).toBe(one.jobName);
    expect(other.jobName).not.toBe(one.jobName);
  });

  it.each([
    [{ sourceQueue: ['a', 'b'] }, /^--target-queue: names the target of a single source queue/],
    [{ sourceQueue: ['a', 'a'], targetQueue: undefined }, /^--source-queue: "a" is listed twice/],
    [{ map: ['x=y'] }, /^--map: "x" is not one of the source queues/],
    [{ map: ['nonsense'] }, /^--map: "nonsense" is not source=target/],
    [{ sourceQueue: [] }, /^--source-queue \(or DEDUP_BRIDGE_SOURCE_QUEUE\): is required/],
    [{ declareTarget: true }, /^--declare-target: needs --source-management/],
    [{ maxMessages: '0' }, /^--max-messages: /],
    [{ maxMessages: 'many' }, /^--max-messages: /],
    [{ parallel: '0' }, /^--parallel: /],
    [{ maxDuration: 'soon' }, /^--max-duration: /],
  ])('rejects %j', (overrides, pattern) => {
    expect(configError(() => resolveMigrateSettings({ ...MIGRATE, ...overrides })).message).toMatch(pattern);
  });

  it('scopes an exchange target to the exchange', () => {
    const settings = resolveMigrateSettings({ ...MIGRATE, targetQueue: undefined, targetExchange: 'ex' });
    expect(settings.routes[0]?.scope).toBe('exchange:ex');
  });

  it('rejects a bad --idle-timeout naming the flag', () => {
    const error = configError(() => resolveMigrateSettings({ ...MIGRATE, idleTimeout: 'forever' }));
    expect(error.message).toMatch(/^--idle-timeout: /);
  });

  it('applies the same validation as run', () => {
    const error = configError(() => resolveMigrateSettings({ ...MIGRATE, source: undefined }));
    expect(error.message).toMatch(/^--source\b.*: is required$/);
  });
});

describe('resolveBridgeSettings: validation', () => {
  it.each([
    ['source', '--source'],
    ['sourceQueue', '--source-queue'],
    ['target', '--target'],
  ] as const)('says %s is required, naming %s', (field, flag) => {
    const message = resolveError({ [field]: undefined });
    expect(message.startsWith(`${flag} `) || message.startsWith(`${flag}:`)).toBe(true);
    expect(message).toContain('is required');
  });

  it('names the environment variable of a required option', () => {
    expect(resolveError({ source: undefined })).toBe('--source (or DEDUP_BRIDGE_SOURCE): is required');
  });

  it('asks for a target queue or exchange when neither is given', () => {
    const message = resolveError({ targetQueue: undefined });
    expect(message).toMatch(/^--target-queue: /);
    expect(message).toContain('--target-exchange');
  });

  it('rejects both --target-queue and --target-exchange', () => {
    const message = resolveError({ targetExchange: 'events' });
    expect(message).toMatch(/^--target-queue: /);
    expect(message).toContain('not both');
  });

  it('rejects --target-routing-key without --target-exchange', () => {
    const message = resolveError({ targetRoutingKey: 'rk' });
    expect(message).toMatch(/^--target-routing-key: /);
    expect(message).toContain('--target-exchange');
  });

  it('rejects --on-unforwardable park without --park-queue', () => {
    const message = resolveError({ onUnforwardable: 'park' });
    expect(message).toMatch(/^--park-queue: /);
    expect(message).toContain('--on-unforwardable park');
  });

  it('rejects --park-queue with another policy', () => {
    const message = resolveError({ parkQueue: 'parked', onUnforwardable: 'dead-letter' });
    expect(message).toMatch(/^--park-queue: /);
    expect(message).toContain('dead-letter');
  });

  it('rejects an unknown --on-unforwardable policy', () => {
    expect(resolveError({ onUnforwardable: 'drop' })).toMatch(
      /^--on-unforwardable: .*retry, dead-letter or park/,
    );
  });

  it.each([
    ['0', 'at least 1'],
    ['abc', 'whole number'],
    ['-5', 'whole number'],
    ['1.5', 'whole number'],
    ['', 'whole number'],
    ['65536', 'at most 65535'],
  ])('rejects --prefetch %j', (value, why) => {
    const message = resolveError({ prefetch: value });
    expect(message).toMatch(/^--prefetch: /);
    expect(message).toContain(why);
  });

  it.each([['0'], ['5001'], ['x']])('rejects --batch-size %j', (value) => {
    expect(resolveError({ batchSize: value })).toMatch(/^--batch-size: /);
  });

  it.each([
    ['source', '--source', 'http://u:p@h.example/'],
    ['source', '--source', 'redis://h.example:6379'],
    ['target', '--target', 'https://h.example/'],
    ['target', '--target', 'mqtt://h.example/'],
    ['redis', '--redis', 'amqp://h.example/'],
    ['redis', '--redis', 'http://h.example:6379'],
  ] as const)('rejects %s with a wrong scheme (%s %s)', (field, flag, url) => {
    const message = resolveError({ [field]: url });
    expect(message.startsWith(`${flag} `)).toBe(true);
    expect(message).toContain('scheme');
  });

  it.each([
    ['source', '--source', 'amqp//localhost'],
    ['target', '--target', 'amqp://h.example:notaport/'],
    ['redis', '--redis', 'redis//missing-colon'],
  ] as const)('rejects %s that is not a URL (%s %j)', (field, flag, url) => {
    const message = resolveError({ [field]: url });
    expect(message.startsWith(`${flag} `)).toBe(true);
    expect(message).toContain('not a URL');
  });

  it.each([
    ['sourceQueue', '--source-queue', ''],
    ['targetQueue', '--target-queue', ''],
    ['targetQueue', '--target-queue', 'q'.repeat(256)],
    ['parkQueue', '--park-queue', ''],
  ] as const)('rejects a bad queue name for %s (%s) %j', (field, flag, value) => {
    expect(resolveError({ [field]: value }).startsWith(`${flag}`)).toBe(true);
  });

  it.each([
    ['redisPrefix', '--redis-prefix', 'a:b'],
    ['redisPrefix', '--redis-prefix', ''],
    ['redisPrefix', '--redis-prefix', '{x}'],
    ['scope', '--scope', 'has space'],
    ['scope', '--scope', 'a{b}'],
    ['logLevel', '--log-level', 'loud'],
  ] as const)('rejects %s (%s) %j', (field, flag, value) => {
    expect(resolveError({ [field]: value }).startsWith(`${flag}`)).toBe(true);
  });

  it('rejects a target queue name that cannot be part of a scope', () => {
    expect(resolveError({ targetQueue: 'my queue' })).toMatch(/^--scope: /);
    expect(resolve({ targetQueue: 'my queue', scope: 'my-queue' }).scope).toBe('my-queue');
  });

  it.each([
    ['dedupWindow', '--dedup-window', '5 parsecs'],
    ['lease', '--lease', '1x'],
    ['retryFor', '--retry-for', 'a while'],
    ['shutdownTimeout', '--shutdown-timeout', ''],
  ] as const)('rejects a bad duration for %s (%s) %j', (field, flag, value) => {
    expect(resolveError({ [field]: value })).toMatch(new RegExp(`^${flag}: `));
  });

  it('rejects a --lease under 1s and a --dedup-window shorter than the lease', () => {
    expect(resolveError({ lease: '999ms' })).toMatch(/^--lease: /);
    expect(resolveError({ lease: '1m', dedupWindow: '30s' })).toMatch(/^--dedup-window: /);
  });

  it('rejects a bad --id-from', () => {
    expect(resolveError({ idFrom: 'header:' })).toMatch(/^--id-from: /);
  });

  it('reports a malformed target user name as a ConfigError', () => {
    // "%E0%A4%A" is not valid percent-encoding: decoding it must not escape as a URIError.
    const message = resolveError({ target: 'amqp://%E0%A4%A:pw@target.example/' });
    expect(message).toMatch(/^--target\b/);
  });

  describe('never echoes a password', () => {
    it.each([
      ['source', `http://user:${SECRET}@h.example/`],
      ['source', `amqp://user:${SECRET}@h.example:notaport/`],
      ['source', `amqp://user:${SECRET}@/vhost`],
      ['target', `ftp://user:${SECRET}@h.example/`],
      ['target', `amqp://user:${SECRET}@h ost/`],
      ['redis', `http://:${SECRET}@h.example:6379`],
      ['redis', `redis://:${SECRET}@h.example:99999999`],
    ] as const)('in the error for a bad %s %j', (field, url) => {
      const message = resolveError({ [field]: url });
      expect(message).not.toContain(SECRET);
      expect(message).toContain('***');
    });

    it('in the error for a URL without its scheme', () => {
      // A common slip: user:password@host without amqp://. It parses as a URL with scheme "user".
      const message = resolveError({ source: `user:${SECRET}@h.example:5672/vhost` });
      expect(message).toMatch(/^--source\b/);
      expect(message).not.toContain(SECRET);
    });
  });
});

describe('flags that agree with the file (issue 17, item 6)', () => {
  const resolve = (raw: RawOptions) => resolveBridgeSettings({ ...VALID, ...raw } as RawOptions, 'migrate');

  it('--retry-for takes a duration or forever, and refuses 0 saying why', () => {
    expect(resolve({ retryFor: 'forever' }).retryForMs).toBe(0);
    expect(resolve({ retryFor: '1500' }).retryForMs).toBe(1500);
    expect(resolve({}).retryForMs).toBe(60_000);
    expect(resolveBridgeSettings({ ...VALID } as RawOptions, 'run').retryForMs).toBe(0);
    for (const retryFor of ['0', '0s', '0ms']) {
      expect(configError(() => resolve({ retryFor })).message).toBe(
        '--retry-for: 0 is not accepted (it would not mean "no retry"); give how long to keep trying a server, e.g. 1s or 60s, or forever',
      );
    }
  });

  it.each([
    ['prefetch', '-5', '--prefetch: must be a whole number from 1 to 65535'],
    ['prefetch', '0', '--prefetch: must be at least 1 (a whole number from 1 to 65535)'],
    ['batchSize', '9999', '--batch-size: must be at most 5000 (a whole number from 1 to 5000)'],
  ] as const)('a number out of range says the range: %s %s', (field, value, message) => {
    expect(configError(() => resolve({ [field]: value })).message).toBe(message);
  });

  it('a URL without a scheme says to add it, password masked', () => {
    expect(configError(() => resolve({ source: 'localhost:5701' })).message).toBe(
      '--source (or DEDUP_BRIDGE_SOURCE): "localhost:5701" has no scheme; add amqp://, e.g. amqp://localhost:5701',
    );
    const message = configError(() => resolve({ redis: `u:${SECRET}@localhost:6379` })).message;
    expect(message).toMatch(/^--redis \(or DEDUP_BRIDGE_REDIS\): ".*" has no scheme; add redis:\/\//);
    expect(message).not.toContain(SECRET);
  });

  it('--job-file with --source-queue is refused', () => {
    const message = configError(() =>
      resolveMigrateSettings({ ...MIGRATE, jobFile: '/nonexistent/job.yaml' }),
    ).message;
    expect(message).toMatch(/^--source-queue: does not go with --job-file/);
  });
});

describe('--on-unroutable and requeue, the old names of --on-unforwardable and retry', () => {
  /** What `run` collects from these flags, as the CLI defines its options. */
  function parsed(argv: string[]): RawOptions {
    const command = addBridgeOptions(new Command('run').exitOverride(), 'run');
    command.parse(['--source-queue', 'q', '--target-queue', 'q2', ...argv], { from: 'user' });
    return command.opts() as RawOptions;
  }
  const policyOf = (argv: string[]) => resolve({ ...parsed(argv) }).onUnforwardable;

  it('mean the same as the new names', () => {
    expect(policyOf(['--on-unroutable', 'dead-letter'])).toBe('dead-letter');
    expect(policyOf(['--on-unroutable', 'requeue'])).toBe('retry');
    expect(policyOf(['--on-unforwardable', 'requeue'])).toBe('retry');
    expect(policyOf(['--on-unroutable', 'park', '--park-queue', 'parked'])).toBe('park');
    // Both names with values of the same meaning are no conflict.
    expect(policyOf(['--on-unforwardable', 'retry', '--on-unroutable', 'requeue'])).toBe('retry');
    expect(policyOf([])).toBe('retry');
    expect(
      resolveMigrateSettings({
        ...MIGRATE,
        sourceQueue: ['a', 'b'],
        targetQueue: undefined,
        onUnroutable: 'requeue',
      }).routes.map((route) => route.onUnforwardable),
    ).toEqual(['retry', 'retry']);
  });

  it('are refused in one line when the old and the new name say different policies', () => {
    const error = configError(() =>
      resolve({ ...parsed(['--on-unforwardable', 'retry', '--on-unroutable', 'dead-letter']) }),
    );
    expect(error.message).toBe(
      '--on-unforwardable: is retry, but --on-unroutable (its old name) is dead-letter; give only --on-unforwardable',
    );
    expect(error.message).not.toContain('\n');
  });

  it('the old flag takes the same values, and its park needs --park-queue as the new one', () => {
    expect(resolveError({ onUnroutable: 'drop' })).toBe(
      '--on-unroutable: must be retry, dead-letter or park',
    );
    expect(resolveError({ onUnroutable: 'park' })).toBe(
      '--park-queue: --on-unforwardable park needs --park-queue <name>',
    );
    expect(resolveError({ onUnroutable: 'requeue', parkQueue: 'parked' })).toBe(
      '--park-queue: cannot be combined with --on-unforwardable retry',
    );
  });

  it('--help shows the new name only', () => {
    const help = addBridgeOptions(new Command('run'), 'run').helpInformation();
    expect(help).toContain('--on-unforwardable <policy>');
    expect(help).not.toContain('--on-unroutable');
    expect(help).not.toContain('requeue');
  });
});
