import { spawn, spawnSync } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import { chmodSync, existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { Redis } from 'ioredis';
import { newRunDir, RabbitNode, RedisServer } from '../harness/servers.js';
import { servers } from '../helpers.js';

/** Runs rabbitmqctl against one broker node; resolves with its output. */
type Ctl = (...args: string[]) => Promise<string>;

/** configure, write and read regexes for one vhost. */
export interface Permissions {
  configure: string;
  write: string;
  read: string;
}

interface NewUser {
  name: string;
  password: string;
  permissions: Permissions;
  tags?: string;
}

/** Brokers and a Redis this test may add users to. */
export interface AdminServers {
  sourceUrl: string;
  targetUrl: string;
  redisUrl: string;
  sourceManagementUrl: string;
  /** Creates (or replaces) users with these permissions on vhost '/'. */
  addUsers(side: 'source' | 'target', users: NewUser[]): Promise<void>;
  deleteUsers(side: 'source' | 'target', names: string[]): Promise<void>;
  /** rabbitmqctl against the target node (`-q` added), e.g. to set a broker limit. */
  targetCtl: Ctl;
  stop(): Promise<void>;
}

const RABBITMQCTL = existsSync('/usr/lib/rabbitmq/bin/rabbitmqctl')
  ? '/usr/lib/rabbitmq/bin/rabbitmqctl'
  : 'rabbitmqctl';

/**
 * rabbitmqctl for a node the harness started: the node is named after the harness process (its
 * pid is in the run folder's owner.pid), and the CLI must share the node's Erlang cookie, so as
 * root it runs as the rabbitmq user with that user's home, as the harness does.
 */
function harnessCtl(runDir: string, label: string): Ctl {
  const owner = readFileSync(join(runDir, 'owner.pid'), 'utf8').trim();
  const node = `dbh-${label}-${owner}@localhost`;
  const id = (flag: string) =>
    Number(spawnSync('id', [flag, 'rabbitmq'], { encoding: 'utf8' }).stdout.trim());
  const asRabbit =
    process.getuid?.() === 0
      ? { uid: id('-u'), gid: id('-g'), env: { ...process.env, HOME: '/var/lib/rabbitmq' } }
      : {};
  return (...args) =>
    new Promise((resolve, reject) => {
      const child = spawn(RABBITMQCTL, ['-q', '-n', node, ...args], {
        ...asRabbit,
        cwd: '/',
        stdio: ['ignore', 'pipe', 'pipe'],
      });
      let out = '';
      const collect = (chunk: Buffer) => {
        out += chunk.toString();
      };
      child.stdout.on('data', collect);
      child.stderr.on('data', collect);
      child.on('error', reject);
      child.on('close', (code) =>
        code === 0 ? resolve(out) : reject(new Error(`rabbitmqctl ${args.join(' ')}: ${out.trim()}`)),
      );
    });
}

/** Calls the management API as its URL's user; throws on an HTTP error. */
export async function management(
  baseUrl: string,
  method: string,
  path: string,
  body?: unknown,
): Promise<unknown> {
  const url = new URL(baseUrl);
  const auth = Buffer.from(`${decodeURIComponent(url.username)}:${decodeURIComponent(url.password)}`);
  const response = await fetch(`${url.protocol}//${url.host}/api/${path}`, {
    method,
    headers: { authorization: `Basic ${auth.toString('base64')}`, 'content-type': 'application/json' },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!response.ok)
    throw new Error(`management ${method} ${path}: HTTP ${response.status} ${await response.text()}`);
  return response.status === 200 ? response.json() : undefined;
}

/**
 * The harness's own servers when it started them; otherwise (servers from SOURCE_URL …, which a
 * test must not add users to) throwaway ones of this file's own, as the chaos suite does. Source
 * users go through the management API, target users through rabbitmqctl (the target has no API).
 */
export async function adminServers(): Promise<AdminServers> {
  const harness = servers();
  let urls: { sourceUrl: string; targetUrl: string; redisUrl: string; sourceManagementUrl: string };
  let targetCtl: Ctl;
  let stop = async () => {};
  if (harness.own) {
    urls = harness;
    targetCtl = harnessCtl(harness.runDir, 'target');
  } else {
    const runDir = newRunDir();
    const source = new RabbitNode(runDir, 'privilege-source', { management: true });
    const target = new RabbitNode(runDir, 'privilege-target');
    const redis = new RedisServer(runDir, 'privilege-redis');
    stop = async () => {
      await Promise.allSettled([source.stop(), target.stop(), redis.stop()]);
      rmSync(runDir, { recursive: true, force: true });
    };
    try {
      await Promise.all([source.start(), target.start(), redis.start()]);
    } catch (error) {
      await stop();
      throw error;
    }
    urls = {
      sourceUrl: source.url,
      targetUrl: target.url,
      redisUrl: redis.url,
      sourceManagementUrl: source.managementUrl,
    };
    targetCtl = (...args) => target.ctl('-q', ...args);
  }
  const api = urls.sourceManagementUrl;
  return {
    ...urls,
    async addUsers(side, users) {
      if (side === 'target') {
        // One rabbitmqctl call for all of them: each call starts an Erlang VM (seconds).
        const file = definitionsFile(users);
        try {
          await targetCtl('import_definitions', file);
        } finally {
          rmSync(dirname(file), { recursive: true, force: true });
        }
        return;
      }
      for (const { name, password, permissions, tags = '' } of users) {
        await management(api, 'PUT', `users/${encodeURIComponent(name)}`, { password, tags });
        await management(api, 'PUT', `permissions/%2F/${encodeURIComponent(name)}`, permissions);
      }
    },
    async deleteUsers(side, names) {
      await Promise.all(
        names.map((name) =>
          side === 'source'
            ? management(api, 'DELETE', `users/${encodeURIComponent(name)}`)
            : targetCtl('delete_user', name),
        ),
      );
    },
    targetCtl,
    stop,
  };
}

/**
 * A definitions file with the users and their permissions on vhost '/'. Passwords go in as
 * RabbitMQ's salted SHA-256 hash: base64(salt, sha256(salt, password)) with a 4-byte salt.
 */
function definitionsFile(users: NewUser[]): string {
  const hash = (password: string) => {
    const salt = randomBytes(4);
    const digest = createHash('sha256').update(salt).update(password).digest();
    return Buffer.concat([salt, digest]).toString('base64');
  };
  const definitions = {
    users: users.map((user) => ({
      name: user.name,
      password_hash: hash(user.password),
      hashing_algorithm: 'rabbit_password_hashing_sha256',
      tags: user.tags ?? '',
    })),
    permissions: users.map((user) => ({ user: user.name, vhost: '/', ...user.permissions })),
  };
  const folder = mkdtempSync(join(tmpdir(), 'dedup-privilege-'));
  const path = join(folder, 'definitions.json');
  writeFileSync(path, JSON.stringify(definitions));
  // rabbitmqctl may run as the rabbitmq user: it must be able to read the file.
  chmodSync(folder, 0o755);
  chmodSync(path, 0o644);
  return path;
}

/** The URL with another user and password. */
export function asUser(url: string, user: string, password: string): string {
  const parsed = new URL(url);
  parsed.username = user;
  parsed.password = password;
  return parsed.toString().replace(/\/$/, '');
}

/** Runs one Redis command as the default user (the harness's Redis has no other admin). */
export async function redisAdmin(redisUrl: string, ...command: string[]): Promise<unknown> {
  const redis = new Redis(redisUrl, { lazyConnect: true });
  try {
    await redis.connect();
    return await redis.call(command[0] as string, ...command.slice(1));
  } finally {
    redis.disconnect();
  }
}
