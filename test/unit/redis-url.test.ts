import { describe, expect, it } from 'vitest';
import { parseRedisUrl, RedisUrlError } from '../../src/config/redis-url.js';
import { checkRedisUrl } from '../../src/config/settings.js';
import { ConfigError } from '../../src/errors.js';

const SECRET = 'hunter2-Sup3rSecret';

function refusal(url: string): string {
  try {
    checkRedisUrl(url);
  } catch (error) {
    expect(error).toBeInstanceOf(ConfigError);
    return (error as Error).message;
  }
  throw new Error(`expected ${url} to be refused`);
}

describe('--redis URL forms', () => {
  it('reads a Sentinel URL: sentinels, master name, database, credentials', () => {
    expect(
      parseRedisUrl(`redis-sentinel://app:p%40ss@s1.example:26380,s2.example,[::1]:26381/orders/2`),
    ).toEqual({
      kind: 'sentinel',
      sentinels: [
        { host: 's1.example', port: 26380 },
        { host: 's2.example', port: 26379 },
        { host: '::1', port: 26381 },
      ],
      masterName: 'orders',
      db: 2,
      username: 'app',
      password: 'p@ss',
      sentinelUsername: undefined,
      sentinelPassword: undefined,
      tls: false,
    });
  });

  it("reads a Sentinel URL over TLS, with the sentinels' own credentials in its query", () => {
    expect(
      parseRedisUrl('rediss-sentinel://s1:26380/orders?sentinelUsername=watch&sentinelPassword=s%2Fp'),
    ).toMatchObject({
      kind: 'sentinel',
      masterName: 'orders',
      username: undefined,
      password: undefined,
      sentinelUsername: 'watch',
      sentinelPassword: 's/p',
      tls: true,
    });
  });

  it('reads a password with / ? # and @ in it unencoded: the user info ends at the last @', () => {
    expect(parseRedisUrl('redis-sentinel://admin:Top/Se?c#r@et@s1:26379,s2/orders')).toMatchObject({
      sentinels: [
        { host: 's1', port: 26379 },
        { host: 's2', port: 26379 },
      ],
      masterName: 'orders',
      username: 'admin',
      password: 'Top/Se?c#r@et',
    });
    expect(parseRedisUrl('rediss-cluster://admin:Top/Secret@n1:7000')).toMatchObject({
      nodes: [{ host: 'n1', port: 7000 }],
      password: 'Top/Secret',
      tls: true,
    });
  });

  it('reads a Cluster URL: seed nodes and a password without a user', () => {
    expect(parseRedisUrl('redis-cluster://:pw@10.0.0.1:7000,10.0.0.2')).toEqual({
      kind: 'cluster',
      nodes: [
        { host: '10.0.0.1', port: 7000 },
        { host: '10.0.0.2', port: 6379 },
      ],
      username: undefined,
      password: 'pw',
      tls: false,
    });
  });

  it('keeps redis:// and rediss:// as one server', () => {
    expect(parseRedisUrl('rediss://cache.example:6380/1')).toEqual({
      kind: 'standalone',
      url: 'rediss://cache.example:6380/1',
    });
  });

  it.each([
    ['redis-sentinel://s1:26379', /does not name the master/],
    ['redis-sentinel://s1:26379/', /does not name the master/],
    ['redis-sentinel://s1:26379/orders/x', /\/<master-name>\/<db number>/],
    ['redis-sentinel://s1:26379,,s2/orders', /empty host/],
    ['redis-sentinel://s1:99999/orders', /port 99999, outside 1-65535/],
    ['redis-cluster://n1:7000/0', /a Cluster has only database 0/],
    ['redis-cluster://n1:7000?tls=1', /query/],
    ['redis-sentinel://s1/orders?password=x', /query parameter "password"; it takes only sentinelUsername/],
    [
      'memcached://h:11211',
      /scheme memcached; use redis or rediss \(one server\), redis-sentinel or redis-cluster/,
    ],
  ])('refuses %s with one line that says how to fix it', (url, why) => {
    const message = refusal(url);
    expect(message).toMatch(/^--redis \(or DEDUP_BRIDGE_REDIS\): "/);
    expect(message).toMatch(why);
    expect(message).toMatch(/use .*redis/);
  });

  it.each([
    `redis-sentinel://app:${SECRET}@s1:26379`,
    `redis-cluster://:${SECRET}@n1:7000/3`,
    `rediss-sentinel://:${SECRET}@s1/orders/x`,
    `redis-sentinel://s1:26379/orders?sentinelPassword=${SECRET}&x=1`,
    // Was: `has a bad host "admin:hunter2"` (the host list was cut at the first /).
    `redis-sentinel://admin:${SECRET.replace('-', '/')}@s1:26379,s2:x/orders`,
    `redis-cluster://admin:${SECRET.replace('-', '/')}@n1:7000,:7001`,
    `redis://127.0.0.1:6379/x?password=${SECRET}`,
  ])('never echoes the password (%#)', (url) => {
    const message = refusal(url);
    for (const part of SECRET.split('-')) expect(message).not.toContain(part);
    expect(message).toContain('***');
  });

  it('throws its own error type, so callers can tell a bad URL from a failure', () => {
    expect(() => parseRedisUrl('redis-cluster://')).toThrow(RedisUrlError);
  });
});
