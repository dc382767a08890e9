import { type SpawnOptions, spawn, spawnSync } from 'node:child_process';
import {
  chownSync,
  existsSync,
  mkdirSync,
  readdirSync,
  readFileSync,
  readlinkSync,
  rmSync,
  writeFileSync,
} from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

/** Every server this harness starts lives under here, one folder per run. */
const HARNESS_ROOT = join(tmpdir(), 'dedup-bridge-harness');

const RABBIT_BIN = '/usr/lib/rabbitmq/bin';

function commandExists(command: string): boolean {
  return spawnSync('sh', ['-c', `command -v ${command}`], { stdio: 'ignore' }).status === 0;
}

export function haveLocalServers(): boolean {
  return (
    commandExists('redis-server') &&
    (existsSync(join(RABBIT_BIN, 'rabbitmq-server')) || commandExists('rabbitmq-server'))
  );
}

/** A loopback port nobody listens on now, as the kernel hands them out (its ephemeral range). */
export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.unref();
    server.on('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const address = server.address();
      server.close(() => resolve(typeof address === 'object' && address ? address.port : 0));
    });
  });
}

/**
 * A port for a redis-server, from below the kernel's ephemeral range (Linux: 32768 and up). A port
 * from that range can be taken as the local port of any outgoing connection between the check
 * and the server's own bind, and redis-server then exits with "Address already in use" (a CI run
 * of 2026-12-05 lost a Sentinel set so). Not for RabbitMQ nodes: with their ports from this range
 * the next CI's nodes did not boot, for a reason not yet found, so they keep freePort.
 */
export async function freeRedisPort(): Promise<number> {
  for (let attempt = 0; attempt < 200; attempt++) {
    const port = 20_000 + Math.floor(Math.random() * 12_000);
    if (await canListen(port)) return port;
  }
  throw new Error('harness: no free port between 20000 and 32000');
}

function canListen(port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const server = createServer();
    server.unref();
    server.once('error', () => resolve(false));
    server.listen(port, '127.0.0.1', () => server.close(() => resolve(true)));
  });
}

export function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

const lastCpuMs = new Map<number, number>();

/**
 * CPU (user + system) a process has used so far, in ms; for a process that has exited, the last
 * value read (0 for none). The benches read the brokers', Redis's and the movers' this way.
 */
export function processCpuMs(pid: number | undefined): number {
  if (!pid) return 0;
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    // After the command name: state is the 3rd field, utime the 14th, stime the 15th (100 Hz ticks).
    const fields = stat.slice(stat.lastIndexOf(') ') + 2).split(' ');
    const used = (Number(fields[11]) + Number(fields[12])) * 10;
    lastCpuMs.set(pid, used);
    return used;
  } catch {
    return lastCpuMs.get(pid) ?? 0;
  }
}

/** True when the process is one of ours: its command line or working folder is inside `dir`. */
function belongsTo(pid: number, dir: string): boolean {
  try {
    const cmdline = readFileSync(`/proc/${pid}/cmdline`, 'utf8');
    if (cmdline.includes(dir)) return true;
    return readlinkSync(`/proc/${pid}/cwd`).startsWith(dir);
  } catch {
    return false;
  }
}

async function waitForExit(pid: number, timeoutMs: number): Promise<boolean> {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    if (!isAlive(pid)) return true;
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  return !isAlive(pid);
}

/** Stops what an interrupted earlier run left behind: its own servers, by pid, never by name. */
export function cleanLeftovers(): void {
  if (!existsSync(HARNESS_ROOT)) return;
  for (const run of readdirSync(HARNESS_ROOT)) {
    const runDir = join(HARNESS_ROOT, run);
    // The folder's name carries its owner's pid too: another process may be between creating the
    // folder and writing owner.pid into it.
    const ownerPid = Number(readFileSafe(join(runDir, 'owner.pid'))) || Number(/^run-(\d+)-/.exec(run)?.[1]);
    if (ownerPid && isAlive(ownerPid)) continue; // a harness that is still running
    for (const server of safeReaddir(runDir)) {
      const pid = Number(readFileSafe(join(runDir, server, 'server.pid')));
      if (pid && isAlive(pid) && belongsTo(pid, runDir)) process.kill(pid, 'SIGKILL');
    }
    rmSync(runDir, { recursive: true, force: true });
  }
}

function readFileSafe(path: string): string {
  try {
    return readFileSync(path, 'utf8').trim();
  } catch {
    return '';
  }
}

function safeReaddir(path: string): string[] {
  try {
    return readdirSync(path);
  } catch {
    return [];
  }
}

export function newRunDir(): string {
  mkdirSync(HARNESS_ROOT, { recursive: true });
  const dir = join(HARNESS_ROOT, `run-${process.pid}-${Date.now().toString(36)}`);
  mkdirSync(dir, { recursive: true });
  writeFileSync(join(dir, 'owner.pid'), String(process.pid));
  return dir;
}

/** The user RabbitMQ's Debian package runs as; when we are root, nodes run as that user. */
function rabbitUser(): { uid: number; gid: number; home: string } | undefined {
  if (process.getuid?.() !== 0) return undefined;
  const result = spawnSync('id', ['-u', 'rabbitmq'], { encoding: 'utf8' });
  if (result.status !== 0) return undefined;
  const gid = spawnSync('id', ['-g', 'rabbitmq'], { encoding: 'utf8' });
  return { uid: Number(result.stdout.trim()), gid: Number(gid.stdout.trim()), home: '/var/lib/rabbitmq' };
}

function chownTree(path: string, uid: number, gid: number): void {
  chownSync(path, uid, gid);
  for (const item of safeReaddir(path)) {
    const child = join(path, item);
    try {
      chownTree(child, uid, gid);
    } catch {
      chownSync(child, uid, gid);
    }
  }
}

export interface RabbitNodeOptions {
  plugins?: string[];
  /** Serve the management API on a free loopback port (enables rabbitmq_management). */
  management?: boolean;
  /** Extra rabbitmq.conf lines. */
  config?: string[];
  /** Serve the stream protocol on a free loopback port (enables rabbitmq_stream). */
  stream?: boolean;
}

/** A throwaway RabbitMQ node on free loopback ports, in its own folder. */
export class RabbitNode {
  readonly dir: string;
  readonly nodeName: string;
  port = 0;
  managementPort = 0;
  /** The stream protocol's port, when the node serves it; 0 otherwise. */
  streamPort = 0;
  private distPort = 0;
  private readonly user = rabbitUser();

  constructor(
    runDir: string,
    readonly label: string,
    private readonly options: RabbitNodeOptions = {},
  ) {
    this.dir = join(runDir, label);
    this.nodeName = `dbh-${label}-${process.pid}@localhost`;
  }

  get url(): string {
    return `amqp://guest:guest@127.0.0.1:${this.port}`;
  }

  /** The stream protocol endpoint (default vhost), when the node serves it; '' otherwise. */
  get streamUrl(): string {
    return this.streamPort ? `rabbitmq-stream://guest:guest@127.0.0.1:${this.streamPort}/` : '';
  }

  /** The management API, when the node serves it; '' otherwise. */
  get managementUrl(): string {
    return this.managementPort ? `http://guest:guest@127.0.0.1:${this.managementPort}` : '';
  }

  private env(): NodeJS.ProcessEnv {
    return {
      ...process.env,
      HOME: this.user?.home ?? process.env.HOME,
      RABBITMQ_NODENAME: this.nodeName,
      RABBITMQ_NODE_PORT: String(this.port),
      RABBITMQ_DIST_PORT: String(this.distPort),
      RABBITMQ_MNESIA_BASE: join(this.dir, 'mnesia'),
      RABBITMQ_LOG_BASE: join(this.dir, 'log'),
      RABBITMQ_PID_FILE: join(this.dir, 'server.pid'),
      RABBITMQ_ENABLED_PLUGINS_FILE: join(this.dir, 'enabled_plugins'),
      RABBITMQ_CONFIG_FILE: join(this.dir, 'rabbitmq.conf'),
      RABBITMQ_ADVANCED_CONFIG_FILE: join(this.dir, 'advanced.config'),
      RABBITMQ_CONF_ENV_FILE: join(this.dir, 'rabbitmq-env.conf'),
      ERL_CRASH_DUMP: join(this.dir, 'erl_crash.dump'),
    };
  }

  private spawnOptions(): SpawnOptions {
    return {
      cwd: this.dir,
      env: this.env(),
      ...(this.user ? { uid: this.user.uid, gid: this.user.gid } : {}),
    };
  }

  private bin(name: string): string {
    const path = join(RABBIT_BIN, name);
    return existsSync(path) ? path : name;
  }

  async start(): Promise<void> {
    if (this.port === 0) {
      this.port = await freePort();
      this.distPort = await freePort();
      mkdirSync(this.dir, { recursive: true });
      const plugins = [...(this.options.plugins ?? [])];
      const extra = [...(this.options.config ?? [])];
      if (this.options.management) {
        this.managementPort = await freePort();
        plugins.push('rabbitmq_management');
        extra.push(`management.tcp.port = ${this.managementPort}`, 'management.tcp.ip = 127.0.0.1');
      }
      if (this.options.stream) {
        this.streamPort = await freePort();
        plugins.push('rabbitmq_stream');
        // Advertised by its loopback address (metadata answers name the leader by it), not the host name.
        extra.push(
          `stream.listeners.tcp.1 = 127.0.0.1:${this.streamPort}`,
          'stream.advertised_host = 127.0.0.1',
        );
      }
      writeFileSync(join(this.dir, 'enabled_plugins'), `[${plugins.join(',')}].\n`);
      writeFileSync(
        join(this.dir, 'rabbitmq.conf'),
        [`listeners.tcp.default = ${this.port}`, 'loopback_users = none', ...extra, ''].join('\n'),
      );
      writeFileSync(join(this.dir, 'advanced.config'), '[].\n');
      writeFileSync(join(this.dir, 'rabbitmq-env.conf'), '');
      if (this.user) chownTree(this.dir, this.user.uid, this.user.gid);
    }
    await run(this.bin('rabbitmq-server'), ['-detached'], this.spawnOptions(), 30_000, 'exit');
    await run(
      this.bin('rabbitmqctl'),
      ['-n', this.nodeName, 'wait', '--timeout', '90', join(this.dir, 'server.pid')],
      this.spawnOptions(),
      95_000,
    );
  }

  pid(): number {
    return Number(readFileSafe(join(this.dir, 'server.pid')));
  }

  /** Runs rabbitmqctl against this node and returns its stdout. */
  async ctl(...args: string[]): Promise<string> {
    return run(this.bin('rabbitmqctl'), ['-n', this.nodeName, ...args], this.spawnOptions(), 60_000);
  }

  /** Stops the node gracefully (SIGTERM), or at once with `kill`. */
  async stop(kill = false): Promise<void> {
    const pid = this.pid();
    if (!pid || !isAlive(pid)) return;
    process.kill(pid, kill ? 'SIGKILL' : 'SIGTERM');
    if (!(await waitForExit(pid, 30_000))) process.kill(pid, 'SIGKILL');
    await waitForExit(pid, 5000);
  }
}

/** A throwaway Redis on a free loopback port; nothing on disk unless `appendonly`. */
export class RedisServer {
  readonly dir: string;
  port = 0;

  constructor(
    runDir: string,
    readonly label: string,
    private readonly appendonly = false,
    /** More redis-server options, e.g. a TLS port. */
    private readonly extraArgs: string[] = [],
  ) {
    this.dir = join(runDir, label);
  }

  get url(): string {
    return `redis://127.0.0.1:${this.port}`;
  }

  async start(): Promise<void> {
    if (this.port === 0) {
      this.port = await freeRedisPort();
      mkdirSync(this.dir, { recursive: true });
    }
    const args = [
      '--port',
      String(this.port),
      '--bind',
      '127.0.0.1',
      '--dir',
      this.dir,
      '--save',
      '',
      '--appendonly',
      this.appendonly ? 'yes' : 'no',
      '--daemonize',
      'yes',
      '--pidfile',
      join(this.dir, 'server.pid'),
      '--logfile',
      join(this.dir, 'redis.log'),
      ...this.extraArgs,
    ];
    await run('redis-server', args, { cwd: this.dir }, 10_000, 'exit');
    const deadline = Date.now() + 10_000;
    while (Date.now() < deadline) {
      const ping = spawnSync('redis-cli', ['-p', String(this.port), 'ping'], { encoding: 'utf8' });
      if (ping.stdout?.trim() === 'PONG') return;
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
    throw new Error(`harness: Redis on port ${this.port} did not start; see ${join(this.dir, 'redis.log')}`);
  }

  pid(): number {
    return Number(readFileSafe(join(this.dir, 'server.pid')));
  }

  async stop(kill = false): Promise<void> {
    const pid = this.pid();
    if (!pid || !isAlive(pid)) return;
    process.kill(pid, kill ? 'SIGKILL' : 'SIGTERM');
    if (!(await waitForExit(pid, 10_000))) process.kill(pid, 'SIGKILL');
    await waitForExit(pid, 5000);
  }
}

/**
 * Runs a command to completion. Daemonising commands (`-detached`, `--daemonize`) are waited for
 * by their exit, since the daemon may keep the output pipes open.
 */
function run(
  command: string,
  args: string[],
  options: SpawnOptions,
  timeoutMs: number,
  until: 'close' | 'exit' = 'close',
): Promise<string> {
  return new Promise((resolve, reject) => {
    const child = spawn(command, args, { ...options, stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    let err = '';
    child.stdout?.on('data', (chunk: Buffer) => {
      out += chunk.toString();
    });
    child.stderr?.on('data', (chunk: Buffer) => {
      err += chunk.toString();
    });
    const timer = setTimeout(() => child.kill('SIGKILL'), timeoutMs);
    child.on('error', (error) => {
      clearTimeout(timer);
      reject(error);
    });
    child.on(until, (code) => {
      clearTimeout(timer);
      if (code === 0) resolve(out);
      else
        reject(
          new Error(
            `harness: ${command} ${args.join(' ')} exited ${code}: ${(err || out).trim().slice(-2000)}`,
          ),
        );
    });
  });
}
