import { spawn } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';

// `npm run demo` as a newcomer sees it: its own brokers and Redis (the variables that would point it
// at other servers are left out), and a first screen with nothing to worry about.

const TSX = fileURLToPath(new URL('../../node_modules/.bin/tsx', import.meta.url));
const DEMO = fileURLToPath(new URL('../../scripts/demo.ts', import.meta.url));

function runDemo(): Promise<{ code: number | null; output: string }> {
  const env = { ...process.env };
  for (const name of ['SOURCE_URL', 'TARGET_URL', 'REDIS_URL']) delete env[name];
  return new Promise((resolve, reject) => {
    const child = spawn(TSX, [DEMO], { env, stdio: ['ignore', 'pipe', 'pipe'] });
    let output = '';
    child.stdout.on('data', (chunk: Buffer) => {
      output += chunk.toString();
    });
    child.stderr.on('data', (chunk: Buffer) => {
      output += chunk.toString();
    });
    child.on('error', reject);
    child.on('close', (code) => resolve({ code, output }));
  });
}

describe('npm run demo (issue 17, the README)', () => {
  it('runs its Redis with an append-only file: no persistence warning, no warning at all', async () => {
    const { code, output } = await runDemo();
    expect(code, output).toBe(0);
    expect(output).not.toMatch(/append-only|appendonly/);
    expect(output).not.toContain('"level":"warn"');
    // What it shows: 8 of 12 arrive on the first run, none on the second.
    expect(output.match(/^ {2}_HQ_DUPL_ID=/gm)).toHaveLength(8);
    expect(output).toContain('demo: the target queue holds 0 new messages after the second run');
  });
});
