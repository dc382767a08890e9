import { redactUrl } from './redact.js';

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
    }
  | {
      kind: 'cluster';
      nodes: RedisNodeAddress[];
      username: string | undefined;
      password: string | undefined;
    };

export const REDIS_URL_EXAMPLES =
  'redis://host:6379, redis-sentinel://host:26379,host:26379/mymaster or redis-cluster://host:6379,host:6379';

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
  if (scheme === 'redis-sentinel' || scheme === 'redis-cluster') {
    return parseMultiHost(
      scheme === 'redis-sentinel' ? 'sentinel' : 'cluster',
      url.slice(schemeEnd + 3),
      shown,
    );
  }
  if (scheme === 'rediss-sentinel' || scheme === 'rediss-cluster') {
    throw new RedisUrlError(
      `${shown}: TLS to a Sentinel set or a Cluster is not supported; use ${scheme.replace('rediss', 'redis')}:// on a trusted network, or a single server over rediss://`,
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

function parseMultiHost(kind: 'sentinel' | 'cluster', rest: string, shown: string): RedisTopology {
  const example =
    kind === 'sentinel'
      ? 'redis-sentinel://[user:password@]host:26379,host:26379/<master-name>[/<db>]'
      : 'redis-cluster://[user:password@]host:6379,host:6379';
  const fail = (what: string) => new RedisUrlError(`${shown} ${what}; use ${example}`);
  if (/[?#]/.test(rest)) throw fail('has a query or fragment, which this form does not take');
  const slash = rest.indexOf('/');
  const authority = slash < 0 ? rest : rest.slice(0, slash);
  const path = slash < 0 ? '' : rest.slice(slash + 1);
  const at = authority.lastIndexOf('@');
  const userInfo = at < 0 ? undefined : authority.slice(0, at);
  const hostList = at < 0 ? authority : authority.slice(at + 1);

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
      throw fail('has a badly percent-encoded user or password');
    }
  }

  const nodes: RedisNodeAddress[] = [];
  for (const item of hostList.split(',')) {
    // host, host:port, [v6], [v6]:port
    const match = /^(\[[0-9a-fA-F:.]+\]|[^:[\]]+)(?::(\d{1,5}))?$/.exec(item.trim());
    if (!match)
      throw fail(item.trim() === '' ? 'has an empty host in its host list' : `has a bad host "${item}"`);
    const port = match[2] === undefined ? DEFAULT_PORT[kind] : Number(match[2]);
    if (port < 1 || port > 65535) throw fail(`has port ${port}, outside 1-65535`);
    nodes.push({ host: (match[1] as string).replace(/^\[|\]$/g, ''), port });
  }

  if (kind === 'cluster') {
    if (path !== '') throw fail('has a path; a Cluster has only database 0, so give just the hosts');
    return { kind, nodes, username, password };
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
  return { kind, sentinels: nodes, masterName, db: Number(rawDb ?? 0), username, password };
}

/** The address part of a topology, for messages: never the credentials. */
export function describeRedis(topology: RedisTopology): string {
  if (topology.kind === 'standalone') return `Redis at ${redactUrl(topology.url)}`;
  const hosts = (topology.kind === 'sentinel' ? topology.sentinels : topology.nodes)
    .map((node) => `${node.host.includes(':') ? `[${node.host}]` : node.host}:${node.port}`)
    .join(',');
  return topology.kind === 'sentinel'
    ? `Redis master "${topology.masterName}" via Sentinel ${hosts}`
    : `Redis Cluster ${hosts}`;
}
