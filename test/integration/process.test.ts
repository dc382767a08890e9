import { type ChildProcess, execFileSync, spawn } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { CLI, delivered, depthOf, numbered, publishAll, queuePair, runArgs, waitFor } from '../helpers.js';

/** The command line a process runs now, as the kernel shows it. */
function commandLine(pid: number): string[] {
  return readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0').filter(Boolean);
}

/** `dedup-bridge run` started with the given Node options; resolves once it forwards. */
async function startRun(nodeOptions: string[], args: string[], env: NodeJS.ProcessEnv = process.env) {
  const child: ChildProcess = spawn(process.execPath, [...nodeOptions, CLI, ...args], {
    stdio: ['ignore', 'pipe', 'pipe'],
    env,
  });
  let output = '';
  child.stdout?.on('data', (chunk: Buffer) => {
    output += chunk.toString();
  });
  child.stderr?.on('data', (chunk: Buffer) => {
    output += chunk.toString();
  });
  const done = new Promise<number | null>((resolve) => child.on('close', (code) => resolve(code)));
  const started = await waitFor(() => output.includes('"msg":"forwarding"'), 30_000);
  expect(started, output).toBe(true);
  return { pid: child.pid as number, output: () => output, stop: () => child.kill('SIGTERM'), done };
}

/** The command line a `run` started this way ends up with, after it stopped cleanly on SIGTERM. */
async function settledCommandLine(nodeOptions: string[], args: string[], env?: NodeJS.ProcessEnv) {
  const bridge = await startRun(nodeOptions, args, env);
  const line = commandLine(bridge.pid);
  bridge.stop();
  expect(await bridge.done).toBe(0);
  return line;
}

describe('the CLI process', () => {
  it('runs with 8 MiB semi-spaces and a heap growing by 100%, as the same process (its pid, its signals), and forwards', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const bridge = await startRun([], runArgs(source, ['--target-queue', target]));
    let line: string[] = [];
    try {
      line = commandLine(bridge.pid);
      // The log's pid is the one started: it replaced itself, it did not start a child.
      expect(bridge.output()).toContain(`"pid":${bridge.pid},`);
      await publishAll(sourceUrl, source, numbered('semi', 20).messages);
      expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= 20, 30_000)).toBe(true);
    } finally {
      bridge.stop();
    }
    expect(await bridge.done).toBe(0);
    expect(line).toContain('--max-semi-space-size=8');
    expect(line).toContain('--heap-growing-percent=100');
    expect(line).toContain(CLI);
    const { count } = await delivered('semi-space run', targetUrl, target, numbered('semi', 20).ids);
    expect([count.lost, count.duplicated, count.unexpected]).toEqual([0, 0, 0]);
  });

  it('keeps the memory settings the user chose, and adds only the others', async () => {
    const { source, target } = await queuePair();
    const line = await settledCommandLine(
      ['--max-semi-space-size=4'],
      runArgs(source, ['--target-queue', target]),
    );
    expect(line.filter((arg) => arg.startsWith('--max-semi-space-size'))).toEqual([
      '--max-semi-space-size=4',
    ]);
    expect(line.filter((arg) => arg.startsWith('--heap-growing-percent'))).toEqual([
      '--heap-growing-percent=100',
    ]);

    const bothLine = await settledCommandLine(
      ['--heap-growing-percent=50', '--max-semi-space-size=2'],
      runArgs(source, ['--target-queue', target]),
    );
    // Nothing to add: the process runs with the user's settings alone.
    expect(bothLine.filter((arg) => arg.startsWith('--heap-growing-percent'))).toEqual([
      '--heap-growing-percent=50',
    ]);
    expect(bothLine.filter((arg) => arg.startsWith('--max-semi-space-size'))).toEqual([
      '--max-semi-space-size=2',
    ]);

    // In NODE_OPTIONS, spelled with underscores as V8 also takes it: still the user's.
    const envLine = await settledCommandLine([], runArgs(source, ['--target-queue', target]), {
      ...process.env,
      NODE_OPTIONS: '--max_semi_space_size=4',
    });
    expect(envLine.filter((arg) => /^--max[-_]semi/.test(arg))).toEqual([]);
    expect(envLine).toContain('--heap-growing-percent=100');
  });

  it("starts without loading what only --metrics-port or --source-management use (Node's HTTP stack and fetch client, prom-client)", () => {
    // Each is tens of ms of every start (docs/performance.md); the modules a run needs are loaded.
    const probe = `import { createRequire } from 'node:module';
      await import(${JSON.stringify(new URL('../../dist/cli/main.js', import.meta.url).href)});
      const loaded = Object.keys(createRequire(import.meta.url).cache);
      console.log(JSON.stringify({
        builtins: process.moduleLoadList.filter((m) => /^NativeModule (http|https|http2|internal\\/deps\\/undici\\/undici)$/.test(m)),
        packages: [...new Set(loaded.map((path) => path.split('node_modules/')[1]?.split('/')[0]).filter(Boolean))],
      }));`;
    const out = execFileSync(process.execPath, ['--input-type=module', '-e', probe], { encoding: 'utf8' });
    const { builtins, packages } = JSON.parse(out) as { builtins: string[]; packages: string[] };
    expect(builtins).toEqual([]);
    expect(packages).not.toContain('prom-client');
    expect(packages).toEqual(expect.arrayContaining(['amqplib', 'ioredis', 'pino', 'commander']));
  });
});
