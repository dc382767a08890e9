import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { stringify } from 'yaml';
import { describeConfig, loadConfigFile, loadConfigRoutes } from '../../src/config/file.js';
import { type RawOptions, resolveBridgeSettings } from '../../src/config/settings.js';
import { ConfigError } from '../../src/errors.js';
import { makeCertificates } from '../harness/tls.js';

const SECRET = 'hunter2-Sup3rSecret';
const folder = mkdtempSync(join(tmpdir(), 'dedup-config-'));
let files = 0;

/** Writes a config file (YAML text, or an object turned into YAML) and returns its path. */
function configFile(content: string | object): string {
  const path = join(folder, `config-${files++}.yaml`);
  writeFileSync(path, typeof content === 'string' ? content : stringify(content));
  return path;
}

/** A valid file with two routes; tests change one part of it. */
function twoRoutes() {
  return {
    brokers: {
      old: { urls: [`amqp://bridge:${SECRET}@old-1:5672`, `amqp://bridge:${SECRET}@old-2:5672`] },
      new: { url: `amqp://bridge:${SECRET}@new:5672/prod` },
    },
    redis: { url: `redis://:${SECRET}@cache:6379`, prefix: 'bridge' },
    defaults: { prefetch: 50, idFrom: ['header:_HQ_DUPL_ID', 'message-id'] },
    routes: [
      {
        name: 'orders',
        source: { broker: 'old', queue: 'orders' },
        target: { broker: 'new', queue: 'orders-v2' },
      } as Record<string, unknown>,
      {
        name: 'audit',
        source: { broker: 'old', queue: 'audit' },
        target: { broker: 'new', exchange: 'events', routingKey: 'audit' },
        dedupWindow: '1d',
        parkQueue: 'audit-parked',
      } as Record<string, unknown>,
    ],
  };
}

/** The one-line message of the ConfigError that loading `path` throws (exit 2). */
function loadError(path: string, flags: RawOptions = {}): string {
  try {
    loadConfigRoutes(path, flags, 'run');
  } catch (error) {
    expect(error).toBeInstanceOf(ConfigError);
    expect((error as ConfigError).exitCode).toBe(2);
    return (error as ConfigError).message;
  }
  throw new Error('expected the config to be refused');
}

describe('config file', () => {
  it('resolves each route to its own settings, defaults filled in and implied', () => {
    const routes = loadConfigRoutes(configFile(twoRoutes()), {}, 'run');
    expect(routes.map((route) => route.route)).toEqual(['orders', 'audit']);
    const [orders, audit] = routes;
    expect(orders).toMatchObject({
      sourceUrls: [`amqp://bridge:${SECRET}@old-1:5672`, `amqp://bridge:${SECRET}@old-2:5672`],
      sourceUrl: `amqp://bridge:${SECRET}@old-1:5672`,
      sourceQueue: 'orders',
      targetUrls: [`amqp://bridge:${SECRET}@new:5672/prod`],
      targetQueue: 'orders-v2',
      targetExchange: '',
      scope: 'queue:orders-v2',
      redisPrefix: 'bridge',
      prefetch: 50,
      batchSize: 200,
      dedupWindowMs: 7 * 86_400_000,
      onUnforwardable: 'retry',
      targetUser: 'bridge',
    });
    expect(orders?.idFrom).toEqual([{ kind: 'header', name: '_HQ_DUPL_ID' }, { kind: 'message-id' }]);
    expect(audit).toMatchObject({
      targetExchange: 'events',
      targetRoutingKey: 'audit',
      targetQueue: undefined,
      scope: 'exchange:events',
      dedupWindowMs: 86_400_000,
      onUnforwardable: 'park',
      parkQueue: 'audit-parked',
    });
  });

  it.each([
    [
      'an unknown key',
      (file: ReturnType<typeof twoRoutes>) => {
        (file.routes[1]?.target as Record<string, unknown>).exchang = 'x';
      },
      'routes[1].target.exchang: is not a known key',
    ],
    [
      'an unknown top-level key',
      (file: ReturnType<typeof twoRoutes>) => {
        Object.assign(file, { route: [] });
      },
      'route: is not a known key',
    ],
    [
      'a bad duration',
      (file: ReturnType<typeof twoRoutes>) => {
        Object.assign(file.routes[1] as object, { dedupWindow: '1 day' });
      },
      'routes[1].dedupWindow: "1 day" is not a duration',
    ],
    [
      'a size that is not one',
      (file: ReturnType<typeof twoRoutes>) => {
        Object.assign(file.routes[0] as object, { maxInFlightBytes: '2 GB' });
      },
      'routes[0].maxInFlightBytes: "2 GB" is not a size',
    ],
    [
      'a bad default',
      (file: ReturnType<typeof twoRoutes>) => {
        Object.assign(file.defaults, { prefetch: 0 });
      },
      'defaults.prefetch: must be at least 1',
    ],
    [
      'a redis.waitReplicas that is not a whole number',
      (file: ReturnType<typeof twoRoutes>) => {
        Object.assign(file.redis, { waitReplicas: 'all' });
      },
      'redis.waitReplicas: must be a whole number',
    ],
    [
      'a redis.waitReplicas under a route',
      (file: ReturnType<typeof twoRoutes>) => {
        Object.assign(file.routes[0] as object, { waitReplicas: 1 });
      },
      'routes[0].waitReplicas: is not a known key',
    ],
    [
      'a dangling broker name',
      (file: ReturnType<typeof twoRoutes>) => {
        Object.assign(file.routes[1]?.target as object, { broker: 'neu' });
      },
      'routes[1].target.broker: no broker "neu" under brokers (there are: old, new)',
    ],
    [
      'a duplicate route name',
      (file: ReturnType<typeof twoRoutes>) => {
        Object.assign(file.routes[1] as object, { name: 'orders' });
      },
      'routes[1].name: "orders" is already the name of routes[0]',
    ],
    [
      'two routes on one source queue',
      (file: ReturnType<typeof twoRoutes>) => {
        Object.assign(file.routes[1]?.source as object, { queue: 'orders' });
      },
      'routes[1].source.queue: routes[0] already consumes queue "orders" on this broker',
    ],
    [
      'two routes on one source queue through two names of one broker',
      (file: ReturnType<typeof twoRoutes>) => {
        // A second name for one node of the cluster.
        Object.assign(file.brokers, { again: { url: file.brokers.old.urls[1] } });
        Object.assign(file.routes[1]?.source as object, { broker: 'again', queue: 'orders' });
      },
      'routes[1].source.queue: routes[0] already consumes queue "orders"',
    ],
    [
      'a target with both queue and exchange',
      (file: ReturnType<typeof twoRoutes>) => {
        Object.assign(file.routes[1]?.target as object, { queue: 'q' });
      },
      'routes[1].target.exchange: give either queue or exchange, not both',
    ],
    [
      'a target with neither',
      (file: ReturnType<typeof twoRoutes>) => {
        Object.assign(file.routes[0] as object, { target: { broker: 'new' } });
      },
      'routes[0].target: give queue, or exchange (with routingKey)',
    ],
    [
      'a park policy without a park queue',
      (file: ReturnType<typeof twoRoutes>) => {
        Object.assign(file.routes[0] as object, { onUnforwardable: 'park' });
      },
      'routes[0].parkQueue: onUnforwardable park needs parkQueue',
    ],
    [
      'a window not longer than the lease',
      (file: ReturnType<typeof twoRoutes>) => {
        Object.assign(file.routes[0] as object, { lease: '1m', dedupWindow: '30s' });
      },
      'routes[0].dedupWindow: must be longer than the lease',
    ],
    [
      'a missing source',
      (file: ReturnType<typeof twoRoutes>) => {
        delete file.routes[0]?.source;
      },
      'routes[0].source: is required',
    ],
    [
      'routes that are not a list',
      (file: ReturnType<typeof twoRoutes>) => {
        Object.assign(file, { routes: 'orders' });
      },
      'routes: must be a list',
    ],
    [
      'a broker with url and urls',
      (file: ReturnType<typeof twoRoutes>) => {
        Object.assign(file.brokers.new, { urls: ['amqp://new-2'] });
      },
      'brokers.new.url: give url (one node) or urls (the nodes of a cluster), not both',
    ],
  ])('refuses %s, naming its path', (_, change, expected) => {
    const file = twoRoutes();
    change(file);
    const path = configFile(file);
    expect(loadError(path)).toContain(`${path}: ${expected}`);
  });

  it('names a bad URL in a list by its index, with the password masked', () => {
    const file = twoRoutes();
    file.brokers.old.urls[1] = `http://bridge:${SECRET}@old-2:5672`;
    const path = configFile(file);
    const message = loadError(path);
    expect(message).toContain(
      `${path}: brokers.old.urls[1]: "http://bridge:***@old-2:5672/" has scheme http`,
    );
    expect(message).not.toContain(SECRET);
  });

  it('refuses a file that is missing or not YAML, saying which', () => {
    expect(loadError(join(folder, 'none.yaml'))).toMatch(/^--config: cannot read ".*none\.yaml" \(ENOENT\)$/);
    const path = configFile('routes: [\n');
    expect(loadError(path)).toMatch(new RegExp(`^${path}: not valid YAML: `));
  });

  it('lets flags override a single route, and refuses route flags with several routes', () => {
    const file = twoRoutes();
    file.routes.pop();
    const one = configFile(file);
    const [route] = loadConfigRoutes(
      one,
      { sourceQueue: 'orders-b', targetExchange: 'x', prefetch: '7' },
      'run',
    );
    expect(route).toMatchObject({
      route: 'orders',
      sourceQueue: 'orders-b',
      targetExchange: 'x',
      targetQueue: undefined,
      scope: 'exchange:x',
      prefetch: 7,
    });

    const two = configFile(twoRoutes());
    expect(loadError(two, { sourceQueue: 'orders-b' })).toBe(
      `--source-queue (or DEDUP_BRIDGE_SOURCE_QUEUE): applies to a single route, but ${two} has 2 routes; set it per route in the file`,
    );
    expect(loadError(two, { dedupWindow: '1h' })).toMatch(/^--dedup-window: applies to a single route/);
    // Process-wide options override the file whatever the number of routes.
    const routes = loadConfigRoutes(two, { redis: 'redis://other:6380', logLevel: 'warn' }, 'run');
    expect(routes.map((r) => [r.redisUrl, r.logLevel])).toEqual([
      ['redis://other:6380', 'warn'],
      ['redis://other:6380', 'warn'],
    ]);
  });

  it("takes a source broker's management API for the TTL check, checked like --source-management", () => {
    const file = twoRoutes() as ReturnType<typeof twoRoutes> & {
      brokers: { old: { management?: string } };
    };
    file.brokers.old.management = `http://monitor:${SECRET}@old-1:15672`;
    const path = configFile(file);
    const routes = loadConfigRoutes(path, {}, 'run');
    expect(routes.map((route) => route.sourceManagementUrl)).toEqual([
      `http://monitor:${SECRET}@old-1:15672`,
      `http://monitor:${SECRET}@old-1:15672`,
    ]);
    const described = describeConfig(loadConfigFile(path), routes);
    expect(JSON.stringify(described)).not.toContain(SECRET);
    expect(described).toMatchObject({
      routes: [{ source: { management: 'http://monitor:***@old-1:15672/' } }, {}],
    });
    file.brokers.old.management = 'amqp://old-1:15672';
    expect(loadError(configFile(file))).toMatch(
      /: brokers\.old\.management: must be an http\(s\) URL, e\.g\. http:\/\/user:password@host:15672$/,
    );
  });

  it("takes the CA of a broker's https management API as managementCa, for https only", () => {
    const dir = mkdtempSync(join(tmpdir(), 'dedup-management-ca-'));
    const { ca } = makeCertificates(dir);
    const file = twoRoutes() as ReturnType<typeof twoRoutes> & {
      brokers: { old: { management?: string; managementCa?: string } };
    };
    file.brokers.old.management = 'https://monitor:pw@old-1:15671';
    file.brokers.old.managementCa = ca;
    const path = configFile(file);
    const routes = loadConfigRoutes(path, {}, 'run');
    expect(routes.map((route) => route.sourceManagementCa)).toEqual([ca, ca]);
    expect(describeConfig(loadConfigFile(path), routes)).toMatchObject({
      routes: [{ source: { management: 'https://monitor:***@old-1:15671/', managementCa: ca } }, {}],
    });
    file.brokers.old.management = 'http://monitor:pw@old-1:15672';
    expect(loadError(configFile(file))).toMatch(
      /: routes\[0\] \(\w+\): brokers\.old\.managementCa: needs brokers\.old\.management to be https:\/\/, not http:\/\//,
    );
    file.brokers.old.management = 'https://monitor:pw@old-1:15671';
    file.brokers.old.managementCa = join(dir, 'missing.pem');
    expect(loadError(configFile(file))).toMatch(
      /brokers\.old\.managementCa: cannot read ".*missing\.pem" \(ENOENT\)/,
    );
    rmSync(dir, { recursive: true, force: true });
  });

  it('describes the effective config with every password masked', () => {
    const path = configFile(twoRoutes());
    const file = loadConfigFile(path);
    const described = describeConfig(file, loadConfigRoutes(path, {}, 'run'));
    const text = JSON.stringify(described);
    expect(text).not.toContain(SECRET);
    expect(described).toMatchObject({
      redis: { url: 'redis://:***@cache:6379', prefix: 'bridge' },
      retryFor: 'forever',
      routes: [
        {
          name: 'orders',
          source: { urls: ['amqp://bridge:***@old-1:5672', 'amqp://bridge:***@old-2:5672'], queue: 'orders' },
          target: { urls: ['amqp://bridge:***@new:5672/prod'], queue: 'orders-v2' },
          scope: 'queue:orders-v2',
          idFrom: ['header:_HQ_DUPL_ID', 'message-id'],
          dedupWindow: '7d',
          prefetch: 50,
          lease: '15s',
        },
        {
          name: 'audit',
          target: { exchange: 'events', routingKey: 'audit' },
          onUnforwardable: 'park',
          parkQueue: 'audit-parked',
        },
      ],
    });
  });
});

describe('redis.waitReplicas (--redis-wait-replicas)', () => {
  it('applies to every route, is overridden by the flag, and config check shows it', () => {
    const file = twoRoutes();
    Object.assign(file.redis, { waitReplicas: 1 });
    const path = configFile(file);
    const routes = loadConfigRoutes(path, {}, 'run');
    expect(routes.map((route) => route.redisWaitReplicas)).toEqual([1, 1]);
    // Process-wide, like --redis: a flag is allowed whatever the number of routes.
    const flagged = loadConfigRoutes(path, { redisWaitReplicas: '2' }, 'run');
    expect(flagged.map((route) => route.redisWaitReplicas)).toEqual([2, 2]);
    expect(describeConfig(loadConfigFile(path), routes)).toMatchObject({
      redis: { url: 'redis://:***@cache:6379', prefix: 'bridge', waitReplicas: 1 },
    });
  });

  it('is 0 when the file leaves it out, and config check says so', () => {
    const path = configFile(twoRoutes());
    const routes = loadConfigRoutes(path, {}, 'run');
    expect(routes.map((route) => route.redisWaitReplicas)).toEqual([0, 0]);
    expect(describeConfig(loadConfigFile(path), routes)).toMatchObject({ redis: { waitReplicas: 0 } });
  });
});

describe('the example in docs/configuration.md', () => {
  it('is a valid config file', () => {
    const page = readFileSync(new URL('../../docs/configuration.md', import.meta.url), 'utf8');
    const example = [...page.matchAll(/```yaml\n([\s\S]*?)```/g)]
      .map((match) => match[1] as string)
      .find((text) => text.includes('routes:'));
    expect(example).toBeDefined();
    // The example reads its URLs from mounted secrets and variables: give it those.
    const secrets = mkdtempSync(join(tmpdir(), 'dedup-secrets-'));
    for (const name of ['old-1', 'old-2', 'new']) {
      writeFileSync(join(secrets, name), `amqp://bridge:secret@${name}:5672/prod\n`);
    }
    process.env.OLD_MANAGEMENT_URL = 'http://monitor:secret@old-1:15672';
    process.env.DEDUP_REDIS_URL = 'redis://:secret@cache:6379';
    process.env.EVENTS_STREAM_URL = 'rabbitmq-stream://bridge:secret@events:5552/prod';
    try {
      const text = (example as string).replaceAll('/run/secrets/', `${secrets}/`);
      const routes = loadConfigRoutes(configFile(text), {}, 'run');
      expect(routes.map((route) => [route.route, route.sourceUrls])).toEqual([
        ['orders', ['amqp://bridge:secret@old-1:5672/prod', 'amqp://bridge:secret@old-2:5672/prod']],
        ['audit', ['amqp://bridge:secret@old-1:5672/prod', 'amqp://bridge:secret@old-2:5672/prod']],
        ['payments', ['amqp://bridge:secret@old-1:5672/prod', 'amqp://bridge:secret@old-2:5672/prod']],
      ]);
      expect(routes[2]).toMatchObject({
        targetUrls: ['rabbitmq-stream://bridge:secret@events:5552/prod'],
        targetStream: 'payments',
        targetProducer: 'payments-bridge',
        scope: 'stream:payments',
      });
      expect(routes[0]?.redisUrl).toBe('redis://:secret@cache:6379');
      expect(routes[0]?.sourceManagementUrl).toBe('http://monitor:secret@old-1:15672');
    } finally {
      delete process.env.OLD_MANAGEMENT_URL;
      delete process.env.DEDUP_REDIS_URL;
      delete process.env.EVENTS_STREAM_URL;
      rmSync(secrets, { recursive: true, force: true });
    }
  });
});

describe('a stream source in a config file', () => {
  const brokers = {
    old: { url: 'rabbitmq-stream://bridge:secret@old:5552/prod' },
    new: { url: 'rabbitmq-stream://bridge:secret@new:5552/prod' },
  };

  it('reads source.stream and source.start on a rabbitmq-stream:// broker', () => {
    const routes = loadConfigRoutes(
      configFile({
        brokers,
        routes: [
          {
            name: 'events',
            source: { broker: 'old', stream: 'events', start: 'next' },
            target: { broker: 'new', stream: 'events' },
          },
        ],
      }),
      {},
      'run',
    );
    expect(routes[0]).toMatchObject({
      sourceStream: 'events',
      sourceQueue: 'events',
      sourceStart: 'next',
      idFrom: [{ kind: 'offset' }],
      targetStream: 'events',
    });
  });

  it('refuses a queue on a stream broker, and a stream on an amqp:// one, naming the place', () => {
    const file = (source: object) =>
      configFile({
        brokers: { ...brokers, amqp: { url: 'amqp://bridge:secret@old:5672/prod' } },
        routes: [{ name: 'events', source, target: { broker: 'new', stream: 'events' } }],
      });
    expect(loadError(file({ broker: 'old', queue: 'events' }))).toMatch(
      /routes\[0\]\.source\.queue: does not go with a stream source; source\.stream names the stream to read/,
    );
    expect(loadError(file({ broker: 'amqp', stream: 'events' }))).toMatch(
      /routes\[0\]\.source\.stream: goes with a broker whose url is rabbitmq-stream:\/\//,
    );
  });
});

describe('several broker URLs on the command line', () => {
  const base: RawOptions = { sourceQueue: 'q', targetQueue: 'q' };

  it('--source and --target take comma-separated URLs, tried in that order', () => {
    const settings = resolveBridgeSettings(
      { ...base, source: 'amqp://a:1, amqp://b:2', target: 'amqp://u:p@c:3,amqp://u:p@d:4' },
      'run',
    );
    expect(settings.sourceUrls).toEqual(['amqp://a:1', 'amqp://b:2']);
    expect(settings.sourceUrl).toBe('amqp://a:1');
    expect(settings.targetUrls).toEqual(['amqp://u:p@c:3', 'amqp://u:p@d:4']);
    expect(settings.targetUser).toBe('u');
  });

  it('refuses a bad URL in the list, and nodes that log in as different users', () => {
    const bad = () => resolveBridgeSettings({ ...base, source: 'amqp://a:1,b:2', target: 'amqp://c' }, 'run');
    expect(bad).toThrow(
      /^--source \(or DEDUP_BRIDGE_SOURCE\): "b:2" has no scheme; add amqp:\/\/, e.g. amqp:\/\/b:2$/,
    );
    const users = () =>
      resolveBridgeSettings(
        { ...base, source: 'amqp://a', target: `amqp://u:${SECRET}@c,amqp://v:${SECRET}@d` },
        'run',
      );
    expect(users).toThrow('--target (or DEDUP_BRIDGE_TARGET): all URLs of a cluster must use the same user');
  });
});

describe('the file takes what the flags take (issue 17, item 6)', () => {
  it('durations as bare milliseconds (a YAML number or digits) or with a unit, as the flags do', () => {
    const file = twoRoutes();
    Object.assign(file, { retryFor: 90000, shutdownTimeout: '5000' });
    Object.assign(file.defaults, { lease: 20000 });
    const routes = loadConfigRoutes(configFile(file), {}, 'run');
    expect(routes.map((route) => [route.retryForMs, route.shutdownTimeoutMs, route.leaseMs])).toEqual([
      [90_000, 5000, 20_000],
      [90_000, 5000, 20_000],
    ]);
  });

  it('retryFor: forever is accepted, and what config check prints is accepted back', () => {
    for (const retryFor of [undefined, 'forever', '2m', 1500]) {
      const file = twoRoutes();
      if (retryFor !== undefined) Object.assign(file, { retryFor });
      const path = configFile(file);
      const printed = describeConfig(loadConfigFile(path), loadConfigRoutes(path, {}, 'run')).retryFor;
      const again = twoRoutes();
      Object.assign(again, { retryFor: printed });
      const back = loadConfigRoutes(configFile(again), {}, 'run');
      expect(back[0]?.retryForMs).toBe(loadConfigRoutes(path, {}, 'run')[0]?.retryForMs);
    }
  });

  it('retryFor: 0 is refused with the reason and the forms allowed, as --retry-for 0 is', () => {
    for (const retryFor of [0, '0', '0s']) {
      const file = twoRoutes();
      Object.assign(file, { retryFor });
      expect(loadError(configFile(file))).toMatch(
        /: retryFor: 0 is not accepted \(it would not mean "no retry"\); give how long to keep trying a server, e\.g\. 1s or 60s, or forever$/,
      );
    }
  });

  it('a number out of range says the range', () => {
    const file = twoRoutes();
    Object.assign(file.defaults, { prefetch: -5 });
    expect(loadError(configFile(file))).toMatch(
      /defaults\.prefetch: must be a whole number from 1 to 65535$/,
    );
  });

  it('a broker URL without a scheme says to add amqp://', () => {
    const file = twoRoutes();
    Object.assign(file.brokers, { new: { url: 'localhost:5701' } });
    expect(loadError(configFile(file))).toMatch(
      /brokers\.new\.url: "localhost:5701" has no scheme; add amqp:\/\//,
    );
  });
});

describe('stripCc (--strip-cc)', () => {
  it('is off unless a route (or defaults) sets it; config check shows it where it is on', () => {
    const file = twoRoutes();
    Object.assign(file.routes[1] as Record<string, unknown>, { stripCc: true });
    const path = configFile(file);
    const routes = loadConfigRoutes(path, {}, 'run');
    expect(routes.map((route) => route.stripCc)).toEqual([false, true]);
    const described = describeConfig(loadConfigFile(path), routes) as { routes: Record<string, unknown>[] };
    expect(described.routes.map((route) => route.stripCc)).toEqual([undefined, true]);
    const everywhere = twoRoutes();
    Object.assign(everywhere.defaults, { stripCc: true });
    expect(loadConfigRoutes(configFile(everywhere), {}, 'run').map((route) => route.stripCc)).toEqual([
      true,
      true,
    ]);
  });

  it('takes true or false only, and is a route flag (refused with several routes)', () => {
    const file = twoRoutes();
    Object.assign(file.defaults, { stripCc: 'yes' });
    expect(loadError(configFile(file))).toMatch(/defaults\.stripCc: must be true or false$/);
    expect(loadError(configFile(twoRoutes()), { stripCc: true })).toMatch(
      /^--strip-cc \(or DEDUP_BRIDGE_STRIP_CC\): applies to a single route/,
    );
  });
});

describe('onUnroutable, the old name of onUnforwardable', () => {
  /** The policy of each route of a file of two routes changed by `change`. */
  function policies(change: (file: ReturnType<typeof twoRoutes>) => void, flags: RawOptions = {}) {
    const file = twoRoutes();
    change(file);
    return loadConfigRoutes(configFile(file), flags, 'run').map((route) => route.onUnforwardable);
  }

  it('is read as onUnforwardable, in a route and under defaults, and requeue as retry', () => {
    expect(
      policies((file) => Object.assign(file.routes[0] as object, { onUnroutable: 'dead-letter' })),
    ).toEqual(['dead-letter', 'park']);
    expect(policies((file) => Object.assign(file.routes[0] as object, { onUnroutable: 'requeue' }))).toEqual([
      'retry',
      'park',
    ]);
    expect(
      policies((file) => Object.assign(file.routes[0] as object, { onUnforwardable: 'requeue' })),
    ).toEqual(['retry', 'park']);
    expect(
      policies((file) => {
        Object.assign(file.defaults, { onUnroutable: 'dead-letter' });
        Object.assign(file.routes[1] as object, { onUnforwardable: 'park' });
      }),
    ).toEqual(['dead-letter', 'park']);
    // A route's policy beats its defaults', whichever name each uses.
    expect(
      policies((file) => {
        Object.assign(file.defaults, { onUnroutable: 'dead-letter' });
        Object.assign(file.routes[0] as object, { onUnforwardable: 'retry' });
        Object.assign(file.routes[1] as object, { onUnroutable: 'park' });
      }),
    ).toEqual(['retry', 'park']);
  });

  it('with onUnforwardable in the same place, is refused in one line unless both mean the same', () => {
    const file = twoRoutes();
    Object.assign(file.routes[1] as object, { onUnforwardable: 'park', onUnroutable: 'dead-letter' });
    const path = configFile(file);
    const message = loadError(path);
    expect(message).toBe(
      `${path}: routes[1].onUnroutable: is the old name of onUnforwardable, which is set here too (to park); give only onUnforwardable`,
    );
    expect(message).not.toContain('\n');
    const defaults = twoRoutes();
    Object.assign(defaults.defaults, { onUnforwardable: 'retry', onUnroutable: 'dead-letter' });
    expect(loadError(configFile(defaults))).toMatch(
      /: defaults\.onUnroutable: is the old name of onUnforwardable, which is set here too \(to retry\)/,
    );
    expect(
      policies((same) =>
        Object.assign(same.routes[0] as object, { onUnforwardable: 'retry', onUnroutable: 'requeue' }),
      ),
    ).toEqual(['retry', 'park']);
  });

  it('takes only the policies, and config check prints the new name', () => {
    const file = twoRoutes();
    Object.assign(file.routes[0] as object, { onUnroutable: 'drop' });
    expect(loadError(configFile(file))).toMatch(
      /: routes\[0\]\.onUnroutable: must be retry, dead-letter or park$/,
    );
    const old = twoRoutes();
    Object.assign(old.routes[0] as object, { onUnroutable: 'requeue' });
    const path = configFile(old);
    const described = describeConfig(loadConfigFile(path), loadConfigRoutes(path, {}, 'run')) as {
      routes: Record<string, unknown>[];
    };
    expect(described.routes[0]).toMatchObject({ onUnforwardable: 'retry' });
    expect(described.routes[0]).not.toHaveProperty('onUnroutable');
  });

  it('--on-unroutable replaces the policy of a single route, and is a route flag', () => {
    const single = twoRoutes();
    single.routes = [single.routes[1] as Record<string, unknown>];
    const path = configFile(single);
    const [route] = loadConfigRoutes(path, { onUnroutable: 'requeue' }, 'run');
    expect(route).toMatchObject({ onUnforwardable: 'retry', parkQueue: undefined });
    expect(loadError(path, { onUnforwardable: 'park', onUnroutable: 'dead-letter' })).toBe(
      '--on-unforwardable: is park, but --on-unroutable (its old name) is dead-letter; give only --on-unforwardable',
    );
    const two = configFile(twoRoutes());
    expect(loadError(two, { onUnroutable: 'dead-letter' })).toBe(
      `--on-unroutable: applies to a single route, but ${two} has 2 routes; set it per route in the file`,
    );
  });
});
