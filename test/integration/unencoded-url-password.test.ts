import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { expectNoSecret, runCli } from '../helpers.js';

// Review of issue 18. A user name may hold an @ (an e-mail address), and a password may start with
// digits: "alice@corp" with password "1234/abc" written unencoded reads as user "alice", host
// "corp", port 1234 and a path. URL readers then see a user and no password, and the password was
// printed whole. No broker is needed: the URL must be refused before anything is contacted.

const PIECES = ['4711', 'zq9xk', 'w8vy'];

describe('a user name with an @ and an unencoded password that reads as a port and a path', () => {
  let files: string;

  beforeAll(() => {
    files = mkdtempSync(join(tmpdir(), 'dedup-unencoded-url-'));
  });

  afterAll(() => {
    if (files) rmSync(files, { recursive: true, force: true });
  });

  const common = ['--source-queue', 'q', '--target-queue', 'q2', '--log-level', 'trace'];

  it.each([
    ['/', `4711/zq9xk#w8vy`],
    ['?', `4711?zq9xk/w8vy`],
    ['#', `4711#zq9xk?w8vy`],
  ])(
    '--redis with %s: refused with the encoding to use, exit 2, no piece of the password printed',
    async (_, password) => {
      const result = await runCli([
        'run',
        ...['--source', 'amqp://guest:guest@127.0.0.1:1', '--target', 'amqp://guest:guest@127.0.0.1:1'],
        ...['--redis', `redis://alice@corp:${password}@127.0.0.1:1`, ...common],
      ]);
      expect(result.code, result.stdout + result.stderr).toBe(2);
      expect(result.stderr).toContain('percent-encode / ? # @ in a password');
      expectNoSecret(result.stdout + result.stderr, [{ pieces: PIECES }]);
    },
  );

  it('--source: refused with the encoding to use, exit 2, no piece of the password printed', async () => {
    const result = await runCli([
      'run',
      ...['--source', 'amqp://alice@corp:4711/zq9xk?w8vy@127.0.0.1:1/vh'],
      ...['--target', 'amqp://guest:guest@127.0.0.1:1', '--redis', 'redis://127.0.0.1:1', ...common],
    ]);
    expect(result.code, result.stdout + result.stderr).toBe(2);
    expect(result.stderr).toContain('percent-encode / ? # @ in a password');
    expectNoSecret(result.stdout + result.stderr, [{ pieces: PIECES }]);
  });

  it('DEDUP_BRIDGE_TARGET_FILE: refused, exit 2, no piece of the password printed', async () => {
    const path = join(files, 'target-url');
    writeFileSync(path, 'amqp://alice@corp:4711#zq9xk/w8vy@127.0.0.1:1/vh\n');
    const result = await runCli(
      ['run', ...['--source', 'amqp://guest:guest@127.0.0.1:1', '--redis', 'redis://127.0.0.1:1'], ...common],
      { env: { DEDUP_BRIDGE_TARGET_FILE: path } },
    );
    expect(result.code, result.stdout + result.stderr).toBe(2);
    expectNoSecret(result.stdout + result.stderr, [{ pieces: PIECES }]);
  });
});
