import { hasHiddenPassword, redactUrl } from './redact.js';

/** One host:port of a Sentinel set or a Cluster's seed list. */
export interface RedisNodeAddress {
  host: string;
  port: number;
}

/** Which kind of Redis deployment a --redis URL names, and how to reach it. */
export type RedisTopology =
  | { kind: 'standalone'; url: string }
  | {
      kind: 'sentinel';
      sentinels: RedisNodeAddress[];
      masterName: string;
      db: number;
      username: string | undefined;
      password: string | undefined;
      /** The sentinels' own credentials (`?sentinelUsername=…&sentinelPassword=…`). */
      sentinelUsername: string | undefined;
      sentinelPassword: string | undefined;
      /** rediss-sentinel://: sentinels, master and replicas all over TLS. */
      tls: boolean;
    }
  | {
      kind: 'cluster';
      nodes: RedisNodeAddress[];
      username: string | undefined;
      password: string | undefined;
      /** rediss-cluster://: every node over TLS. */
      tls: boolean;
    };

const REDIS_URL_EXAMPLES =
  'redis://host:6379, redis-sentinel://host:26379,host:26379/mymaster or redis-cluster://host:6379,host:6379 (rediss… for TLS)';

const STANDALONE = ['redis:', 'rediss:'];
const DEFAULT_PORT = { sentinel: 26379, cluster: 6379 } as const;

/** A --redis URL that cannot be used; the message names the (redacted) URL and the fix. */
export class RedisUrlError extends Error {}

/**
 * Reads a --redis URL: `redis://` or `rediss://` (one server), `redis-sentinel://` (a Sentinel
 * set: the hosts are sentinels, the path the master's name) or `redis-cluster://` (seed nodes of
 * a Cluster). The multi-host forms are not WHATWG URLs, so they are split by hand here.
 */
export function parseRedisUrl(url: string): RedisTopology {
  const shown = `"${redactUrl(url)}"`;
  const schemeEnd = url.indexOf('://');
  const scheme = schemeEnd > 0 ? url.slice(0, schemeEnd).toLowerCase() : '';
  const multi = /^(rediss?)-(sentinel|cluster)$/.exec(scheme);
  if (multi) {
    return parseMultiHost(
      multi[2] as 'sentinel' | 'cluster',
      multi[1] === 'rediss',
      url.slice(schemeEnd + 3),
      shown,
    );
  }
  // "localhost:6379" parses as a URL of scheme "localhost": say what is missing instead.
  if (!url.includes('//')) {
    throw new RedisUrlError(`${shown} has no scheme; add redis://, e.g. ${redactUrl(`redis://${url}`)}`);
  }
  let parsed: URL;
  try {
    parsed = new URL(url);
  } catch {
    throw new RedisUrlError(`${shown} is not a URL; use ${REDIS_URL_EXAMPLES}`);
  }
  if (!STANDALONE.includes(parsed.protocol)) {
    throw new RedisUrlError(
      `${shown} has scheme ${parsed.protocol.replace(':', '')}; use redis or rediss (one server), redis-sentinel or redis-cluster, e.g. ${REDIS_URL_EXAMPLES}`,
    );
  }
  if (parsed.hostname === '') throw new RedisUrlError(`${shown} has no host; use ${REDIS_URL_EXAMPLES}`);
  if (hasHiddenPassword(url)) {
    throw new RedisUrlError(
      `${shown} has an @ after its host, so its password is read as a host, path or query; percent-encode / ? # @ in a password (%2F %3F %23 %40)`,
    );
  }
  // The path is the database number; ioredis would send SELECT NaN for anything else.
  const db = parsed.pathname.replace(/^\//, '');
  if (db !== '' && !/^\d+$/.test(db)) {
    throw new RedisUrlError(
      `${shown} has the path "/${db}", which is not a database number; give redis://host:port/<db> with a number (0 by default) or no path`,
    );
  }
  try {
    decodeURIComponent(parsed.username);
    decodeURIComponent(parsed.password);
  } catch {
    throw new RedisUrlError(
      `${shown} has a % that is not percent-encoding in its user or password; write a literal % as %25`,
    );
  }
  return { kind: 'standalone', url };
}

/** Query parameters of a Sentinel URL: the sentinels' own credentials, named as ioredis names them. */
const SENTINEL_PARAMS = ['sentinelUsername', 'sentinelPassword'] as const;

function parseMultiHost(
  kind: 'sentinel' | 'cluster',
  tls: boolean,
  rest: string,
  shown: string,
): RedisTopology {
  const scheme = `${tls ? 'rediss' : 'redis'}-${kind}`;
  const example =
    kind === 'sentinel'
      ? `${scheme}://[user:password@]host:26379,host:26379/<master-name>[/<db>][?sentinelPassword=…]`
      : `${scheme}://[user:password@]host:6379,host:6379`;
  // Never the parts themselves: they may hold a password (`shown` is the masked URL).
  const fail = (what: string) => new RedisUrlError(`${shown} ${what}; use ${example}`);
  // The user info ends at the last @, so that a password may hold / ? # (or @) unencoded; an @ in
  // the query must then be written %40.
  const at = rest.lastIndexOf('@');
  const userInfo = at < 0 ? undefined : rest.slice(0, at);
  const afterUser = at < 0 ? rest : rest.slice(at + 1);
  if (afterUser.includes('#')) throw fail('has a fragment (#), which this form does not take');
  const question = afterUser.indexOf('?');
  const query = question < 0 ? undefined : afterUser.slice(question + 1);
  const beforeQuery = question < 0 ? afterUser : afterUser.slice(0, question);
  const slash = beforeQuery.indexOf('/');
  const hostList = slash < 0 ? beforeQuery : beforeQuery.slice(0, slash);
  const path = slash < 0 ? '' : beforeQuery.slice(slash + 1);

  let username: string | undefined;
  let password: string | undefined;
  if (userInfo !== undefined) {
    const colon = userInfo.indexOf(':');
    const rawUser = colon < 0 ? userInfo : userInfo.slice(0, colon);
    const rawPassword = colon < 0 ? undefined : userInfo.slice(colon + 1);
    try {
      username = rawUser === '' ? undefined : decodeURIComponent(rawUser);
      password =
        rawPassword === undefined || rawPassword === '' ? undefined : decodeURIComponent(rawPassword);
    } catch {
      throw fail('has a badly percent-encoded user or password (write a literal % as %25)');
    }
  }

  const nodes: RedisNodeAddress[] = [];
  for (const [index, item] of hostList.split(',').entries()) {
    // host, host:port, [v6], [v6]:port
    const match = /^(\[[0-9a-fA-F:.]+\]|[^:[\]]+)(?::(\d{1,5}))?$/.exec(item.trim());
    if (!match)
      throw fail(
        item.trim() === ''
          ? 'has an empty host in its host list'
          : `has a bad host (number ${index + 1} of its host list)`,
      );
    const port = match[2] === undefined ? DEFAULT_PORT[kind] : Number(match[2]);
    if (port < 1 || port > 65535) throw fail(`has port ${port}, outside 1-65535`);
    nodes.push({ host: (match[1] as string).replace(/^\[|\]$/g, ''), port });
  }

  if (kind === 'cluster') {
    if (query !== undefined) throw fail('has a query (?…), which this form does not take');
    if (path !== '') throw fail('has a path; a Cluster has only database 0, so give just the hosts');
    return { kind, nodes, username, password, tls };
  }
  const params = new URLSearchParams(query ?? '');
  for (const name of params.keys()) {
    if (!(SENTINEL_PARAMS as readonly string[]).includes(name)) {
      throw fail(`has the query parameter "${name}"; it takes only ${SENTINEL_PARAMS.join(' and ')}`);
    }
  }
  const [rawName = '', rawDb, ...extra] = path.split('/');
  if (rawName === '') throw fail('does not name the master (the path is the name Sentinel monitors it by)');
  if (extra.length > 0 || (rawDb !== undefined && !/^\d+$/.test(rawDb)))
    throw fail('has a path that is not /<master-name> or /<master-name>/<db number>');
  let masterName: string;
  try {
    masterName = decodeURIComponent(rawName);
  } catch {
    throw fail('has a badly percent-encoded master name');
  }
  return {
    kind,
    sentinels: nodes,
    masterName,
    db: Number(rawDb ?? 0),
    username,
    password,
    sentinelUsername: params.get('sentinelUsername') || undefined,
    sentinelPassword: params.get('sentinelPassword') || undefined,
    tls,
  };
}

/** The address part of a topology, for messages: never the credentials. */
export function describeRedis(topology: RedisTopology): string {
  if (topology.kind === 'standalone') return `Redis at ${redactUrl(topology.url)}`;
  const hosts = (topology.kind === 'sentinel' ? topology.sentinels : topology.nodes)
    .map((node) => `${node.host.includes(':') ? `[${node.host}]` : node.host}:${node.port}`)
    .join(',');
  const tls = topology.tls ? ' over TLS' : '';
  return topology.kind === 'sentinel'
    ? `Redis master "${topology.masterName}" via Sentinel ${hosts}${tls}`
    : `Redis Cluster ${hosts}${tls}`;
}
