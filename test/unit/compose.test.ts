import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { parse } from 'yaml';
import { HOW_TO_GET_SERVERS } from '../harness/harness.js';

// docker-compose.yml, the Dockerfile, the CLI and the test harness each name the same ports, variables
// and entry point; these tests fail when one of them changes without the others.

type PortSpec = string | number | { target?: number | string; published?: number | string };

interface ComposeService {
  image?: string;
  build?: unknown;
  command?: string | string[];
  ports?: PortSpec[];
  environment?: Record<string, string | number | boolean | null> | string[];
  depends_on?: string[] | Record<string, { condition?: string }>;
}

function read(relative: string): string {
  return readFileSync(new URL(relative, import.meta.url), 'utf8');
}

const compose = parse(read('../../docker-compose.yml')) as { services?: Record<string, ComposeService> };
const services = compose.services ?? {};

function service(name: string): ComposeService {
  const found = services[name];
  if (!found) throw new Error(`docker-compose.yml has no service "${name}"`);
  return found;
}

/** Host → container port pairs, from the short ("[ip:]host:container[/proto]") or the long syntax. */
function portMappings(name: string): Array<{ host: number; container: number }> {
  return (service(name).ports ?? []).map((spec) => {
    if (typeof spec === 'object') return { host: Number(spec.published), container: Number(spec.target) };
    const parts = String(spec)
      .replace(/\/(tcp|udp)$/, '')
      .split(':');
    const container = Number(parts.at(-1));
    return { host: parts.length >= 2 ? Number(parts.at(-2)) : Number.NaN, container };
  });
}

/** The port a service publishes on the host for the given container port. */
function hostPort(name: string, container: number): number | undefined {
  return portMappings(name).find((mapping) => mapping.container === container)?.host;
}

function environment(name: string): Record<string, string> {
  const env = service(name).environment ?? {};
  if (Array.isArray(env)) {
    return Object.fromEntries(
      env.map((entry) => {
        const at = entry.indexOf('=');
        return at < 0 ? [entry, ''] : [entry.slice(0, at), entry.slice(at + 1)];
      }),
    );
  }
  return Object.fromEntries(Object.entries(env).map(([key, value]) => [key, String(value ?? '')]));
}

function commandText(name: string): string {
  const command = service(name).command ?? '';
  return Array.isArray(command) ? command.join(' ') : command;
}

/** The environment variables the CLI reads: every `.env('...')` in src/cli/options.ts. */
function cliEnvNames(): string[] {
  const source = read('../../src/cli/options.ts');
  const names = [...source.matchAll(/\.env\(\s*(['"`])([A-Za-z0-9_]+)\1/g)].map((match) => match[2] ?? '');
  return [...new Set(names)].sort();
}

describe('docker-compose.yml', () => {
  it('has the two brokers, Redis and the bridge', () => {
    expect(Object.keys(services)).toEqual(
      expect.arrayContaining(['rabbitmq-source', 'rabbitmq-target', 'redis', 'bridge']),
    );
  });

  it('publishes source 5672, target 5673 and Redis 6379 on the host', () => {
    expect(portMappings('rabbitmq-source')).toContainEqual({ host: 5672, container: 5672 });
    expect(portMappings('rabbitmq-target')).toContainEqual({ host: 5673, container: 5672 });
    expect(portMappings('redis')).toContainEqual({ host: 6379, container: 6379 });
  });

  it('enables the stream plugin on both brokers and publishes its port: source 5552, target 5553', () => {
    for (const name of ['rabbitmq-source', 'rabbitmq-target']) {
      expect(commandText(name)).toContain('rabbitmq-plugins enable --offline rabbitmq_stream');
      expect(commandText(name)).toContain('exec docker-entrypoint.sh rabbitmq-server');
    }
    expect(portMappings('rabbitmq-source')).toContainEqual({ host: 5552, container: 5552 });
    expect(portMappings('rabbitmq-target')).toContainEqual({ host: 5553, container: 5552 });
    for (const url of [
      'SOURCE_STREAM_URL=rabbitmq-stream://bridge:bridge@127.0.0.1:5552',
      'TARGET_STREAM_URL=rabbitmq-stream://bridge:bridge@127.0.0.1:5553',
    ]) {
      expect(HOW_TO_GET_SERVERS).toContain(url);
      expect(read('../../docker-compose.yml')).toContain(url);
    }
  });

  it('runs Redis with an append-only file', () => {
    expect(commandText('redis')).toContain('--appendonly yes');
  });

  it('gives the bridge only variables the CLI reads, and every one its run needs', () => {
    const names = cliEnvNames();
    const needed = [
      'DEDUP_BRIDGE_SOURCE',
      'DEDUP_BRIDGE_SOURCE_QUEUE',
      'DEDUP_BRIDGE_TARGET',
      'DEDUP_BRIDGE_REDIS',
      'DEDUP_BRIDGE_METRICS_PORT',
    ];
    // The regex must keep finding the options, or this test would compare nothing.
    expect(names).toEqual(expect.arrayContaining(needed));
    const given = Object.keys(environment('bridge'));
    expect(given.filter((name) => !names.includes(name))).toEqual([]);
    expect(given).toEqual(expect.arrayContaining(needed));
  });

  it("publishes the bridge's metrics port and checks its health on /readyz", () => {
    const port = Number(environment('bridge').DEDUP_BRIDGE_METRICS_PORT);
    expect(portMappings('bridge')).toContainEqual({ host: port, container: port });
    const check = (services.bridge as ComposeService & { healthcheck?: { test?: string[] } }).healthcheck;
    expect(check?.test?.join(' ')).toContain(`http://127.0.0.1:${port}/readyz`);
  });

  it("points the bridge's URLs at the compose services, their ports and the brokers' user", () => {
    const env = environment('bridge');
    const cases = [
      { variable: 'DEDUP_BRIDGE_SOURCE', name: 'rabbitmq-source', protocol: 'amqp:', port: 5672 },
      { variable: 'DEDUP_BRIDGE_TARGET', name: 'rabbitmq-target', protocol: 'amqp:', port: 5672 },
      { variable: 'DEDUP_BRIDGE_REDIS', name: 'redis', protocol: 'redis:', port: 6379 },
    ];
    for (const { variable, name, protocol, port } of cases) {
      const url = new URL(env[variable] ?? '');
      expect({ variable, protocol: url.protocol, host: url.hostname, port: url.port }).toEqual({
        variable,
        protocol,
        host: name,
        port: String(port),
      });
      // The port inside the compose network is the container side of what the service publishes.
      expect(hostPort(name, port), `${name} publishes container port ${port}`).toBeDefined();
      if (protocol === 'amqp:') {
        const broker = environment(name);
        expect(decodeURIComponent(url.username)).toBe(broker.RABBITMQ_DEFAULT_USER);
        expect(decodeURIComponent(url.password)).toBe(broker.RABBITMQ_DEFAULT_PASS);
      }
    }
  });

  it('declares the source and target queues before the bridge starts', () => {
    const sourceQueue = environment('bridge').DEDUP_BRIDGE_SOURCE_QUEUE;
    const command = service('bridge').command;
    expect(Array.isArray(command) ? command[0] : undefined).toBe('run');
    const args = Array.isArray(command) ? command : [];
    const targetQueue = args[args.indexOf('--target-queue') + 1];
    expect(args).toContain('--target-queue');

    const setup = commandText('setup');
    expect(setup).toContain('rabbitmq-source');
    expect(setup).toContain('rabbitmq-target');
    expect(setup).toContain(`name=${sourceQueue} `);
    expect(setup).toContain(`name=${targetQueue} `);

    expect(service('bridge').depends_on).toMatchObject({
      'rabbitmq-source': { condition: 'service_healthy' },
      'rabbitmq-target': { condition: 'service_healthy' },
      redis: { condition: 'service_healthy' },
      setup: { condition: 'service_completed_successfully' },
    });
  });

  it("matches the host ports in the harness's how-to-get-servers message", () => {
    const urlIn = (variable: string) => {
      const match = HOW_TO_GET_SERVERS.match(new RegExp(`${variable}=([^\\s)]+)`));
      return new URL(match?.[1] ?? 'missing://');
    };
    expect(urlIn('SOURCE_URL').port).toBe(String(hostPort('rabbitmq-source', 5672)));
    expect(urlIn('TARGET_URL').port).toBe(String(hostPort('rabbitmq-target', 5672)));
    expect(urlIn('REDIS_URL').port).toBe(String(hostPort('redis', 6379)));
    for (const port of [5672, 5673, 6379]) expect(HOW_TO_GET_SERVERS).toContain(`127.0.0.1:${port}`);
  });
});

describe('Dockerfile', () => {
  it("runs the package's bin entry", () => {
    const dockerfile = read('../../Dockerfile');
    const entrypoints = [...dockerfile.matchAll(/^ENTRYPOINT\s+(.+)$/gm)];
    // The last ENTRYPOINT wins; in the exec (JSON) form.
    const entrypoint = JSON.parse(entrypoints.at(-1)?.[1] ?? 'null') as unknown;
    expect(entrypoint).toEqual(['node', 'bin/dedup-bridge.js']);

    const pkg = JSON.parse(read('../../package.json')) as { bin?: Record<string, string> };
    expect(pkg.bin?.['dedup-bridge']?.replace(/^\.\//, '')).toBe('bin/dedup-bridge.js');
  });
});
