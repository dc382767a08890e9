import { spawnSync } from 'node:child_process';
import { describe, expect, it } from 'vitest';
import { FaultProxy } from '../harness/proxy.js';
import {
  CLI,
  depthOf,
  migrateArgs,
  type OutgoingMessage,
  publishAll,
  queuePair,
  runArgs,
  runCli,
  startCli,
  waitFor,
} from '../helpers.js';

interface LogLine {
  level: string;
  time: string;
  msg: string;
  route?: string;
  [key: string]: unknown;
}

/** Every stdout line must be one JSON object with a level name, a time and a message. */
function parseLines(stdout: string): LogLine[] {
  return stdout
    .trim()
    .split('\n')
    .map((text) => {
      const line = JSON.parse(text) as LogLine;
      expect(['fatal', 'error', 'warn', 'info', 'debug', 'trace']).toContain(line.level);
      expect(line.time).toMatch(/^\d{4}-\d\d-\d\dT/);
      expect(typeof line.msg).toBe('string');
      return line;
    });
}

function messages(count: number, prefix: string): OutgoingMessage[] {
  return Array.from({ length: count }, (_, i) => ({ body: 'x', options: { messageId: `${prefix}-${i}` } }));
}

describe('logs', () => {
  it('are JSON lines naming level and route, one per connection state change, with passwords masked', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const proxy = FaultProxy.forUrl(targetUrl);
    await proxy.start();
    const throughProxy = proxy.urlFor(targetUrl);
    // Debug level, so that the retries that are not logged at info show up as debug lines.
    const bridge = startCli([
      ...runArgs(source, ['--target-queue', target], '--log-level', 'debug').map((arg) =>
        arg === targetUrl ? throughProxy : arg,
      ),
    ]);
    try {
      expect(await waitFor(() => bridge.output().includes('"msg":"forwarding"'))).toBe(true);
      await publishAll(sourceUrl, source, messages(200, 'a'));
      expect(await waitFor(async () => (await depthOf(targetUrl, target)) === 200)).toBe(true);

      // A reset: lost, then connected again.
      proxy.resetAll();
      expect(await waitFor(() => bridge.output().includes('connected again'))).toBe(true);
      // Then the target refuses connections for a while: lost once, retrying once, attempts at debug.
      await proxy.stop();
      const attemptsSeen = await waitFor(
        () => (bridge.output().match(/target broker at [^"]* not reachable; retrying/g) ?? []).length >= 3,
        20_000,
      );
      expect(attemptsSeen, bridge.output()).toBe(true);
      bridge.signal('SIGTERM');
      const result = await bridge.done;
      expect(result.code, result.stderr).toBe(0);

      const lines = parseLines(result.stdout);
      const routeLines = lines.filter((line) => line.route !== undefined);
      expect(routeLines.every((line) => line.route === source)).toBe(true);
      for (const msg of ['forwarding', 'stopping: finishing in-flight messages', 'stopped']) {
        expect(lines.find((line) => line.msg === msg)?.route).toBe(source);
      }
      const about = (pattern: RegExp, level: string) =>
        lines.filter((line) => pattern.test(line.msg) && line.level === level && line.route === source);
      const where = /^target broker at amqp:\/\/guest:\*\*\*@127\.0\.0\.1:\d+\/?: /;
      expect(about(new RegExp(`${where.source}lost; reconnecting$`), 'warn')).toHaveLength(2);
      expect(about(new RegExp(`${where.source}connected again$`), 'info')).toHaveLength(1);
      expect(about(/not reachable; retrying$/, 'warn')).toHaveLength(1);
      expect(about(/not reachable; retrying$/, 'debug').length).toBeGreaterThanOrEqual(2);
      // 200 messages forwarded, and not one line about any of them at info level or above.
      const notDebug = lines.filter((line) => line.level !== 'debug' && line.level !== 'trace');
      expect(notDebug.length, notDebug.map((line) => line.msg).join('\n')).toBeLessThanOrEqual(10);
      // The harness's password is "guest": shown masked, never in clear.
      expect(result.stdout).toContain('guest:***@');
      expect(result.stdout + result.stderr).not.toContain('guest:guest@');
    } finally {
      bridge.signal('SIGKILL');
      await proxy.stop();
    }
  });

  it('--log-level warn leaves out info lines', async () => {
    const { sourceUrl, source, target } = await queuePair();
    await publishAll(sourceUrl, source, messages(20, 'b'));
    const result = await runCli(
      migrateArgs(source, ['--target-queue', target], '--log-level', 'warn', '--quiet'),
    );
    expect(result.code, result.stderr).toBe(0);
    // Redis without an append-only file may warn; nothing below warn is printed.
    const levels = result.stdout.trim() === '' ? [] : parseLines(result.stdout).map((line) => line.level);
    expect(levels.filter((level) => level !== 'warn' && level !== 'error')).toEqual([]);
    const chatty = await runCli(migrateArgs(source, ['--target-queue', target], '--quiet'));
    expect(parseLines(chatty.stdout).some((line) => line.level === 'info')).toBe(true);
  });

  it('are one readable line each on a terminal', async () => {
    const { sourceUrl, source, target } = await queuePair();
    await publishAll(sourceUrl, source, messages(20, 'c'));
    // `script` gives the CLI a pseudo-terminal, as an operator's shell would.
    const command = [process.execPath, CLI, ...migrateArgs(source, ['--target-queue', target], '--quiet')]
      .map((part) => `'${part}'`)
      .join(' ');
    const result = spawnSync('script', ['-qfec', command, '/dev/null'], {
      encoding: 'utf8',
      timeout: 60_000,
    });
    expect(result.status, result.stdout).toBe(0);
    const escapes = new RegExp(`${String.fromCharCode(27)}\\[[0-9;?]*[A-Za-z]`, 'g');
    const screen = result.stdout.replace(escapes, '');
    const forwarding = screen.split(/\r?\n/).find((line) => line.includes(`[${source}] forwarding`));
    expect(forwarding, screen).toMatch(
      new RegExp(
        `^\\d\\d:\\d\\d:\\d\\d\\.\\d{3} INFO  \\[${source}\\] forwarding source=amqp://guest:\\*\\*\\*@`,
      ),
    );
    expect(screen).not.toContain('{"level"');
    expect(screen).not.toContain('guest:guest@');
  });
});
