// npm test's last step: the chaos suite beside the other tests, in two vitest processes at once.
// The chaos scenarios start servers of their own and spend most of their time waiting (a throttled
// link, a broker restarting, a stall running out), so on 2 cores the two together take little more
// than the longer one alone. The other tests stream their output as they run; the chaos suite's is
// kept and printed whole when it ends, so that the two never interleave. With arguments (a file
// filter, say: `npm test -- stream-source`) it is one vitest run with them, as before.
import { spawn } from 'node:child_process';
import { createWriteStream, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const extra = process.argv.slice(2);
const vitest = (args, stdio) =>
  spawn(process.execPath, ['node_modules/vitest/vitest.mjs', 'run', ...args], { stdio });
const exited = (child) =>
  new Promise((resolve) => child.on('close', (code, signal) => resolve(code ?? (signal ? 1 : 0))));

if (extra.length > 0) process.exit(await exited(vitest(extra, 'inherit')));

const dir = mkdtempSync(join(tmpdir(), 'dedup-bridge-chaos-'));
const chaosLog = join(dir, 'chaos.log');
const chaosOut = createWriteStream(chaosLog);
const chaos = vitest(['test/chaos'], ['ignore', 'pipe', 'pipe']);
chaos.stdout.pipe(chaosOut);
chaos.stderr.pipe(chaosOut);
const rest = vitest(['--exclude', 'test/chaos/**'], 'inherit');

// Ctrl-C or a CI timeout stops both.
for (const signal of ['SIGINT', 'SIGTERM']) {
  process.on(signal, () => {
    chaos.kill(signal);
    rest.kill(signal);
  });
}

const restCode = await exited(rest);
const chaosCode = await exited(chaos);
await new Promise((resolve) => chaosOut.end(resolve));
process.stdout.write(`\n---- the chaos suite (test/chaos), run beside the tests above ----\n`);
process.stdout.write(readFileSync(chaosLog, 'utf8'));
rmSync(dir, { recursive: true, force: true });
process.stdout.write(
  `\nnpm test: the tests ${restCode === 0 ? 'passed' : 'FAILED'}, the chaos suite ${chaosCode === 0 ? 'passed' : 'FAILED'}\n`,
);
process.exit(restCode === 0 && chaosCode === 0 ? 0 : 1);
