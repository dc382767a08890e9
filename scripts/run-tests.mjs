// npm test's last step: the unit and integration tests, and beside them, in vitest processes of
// their own, the chaos suite and the Redis topology tests. Those two start servers of their own and
// spend most of their time waiting (a throttled link, a broker restarting, a failover), so on 2
// cores all three together take little more than the first alone. The first streams its output as
// it runs; each of the others is kept and printed whole when all have ended, so that none
// interleave. With arguments (a file filter, say: `npm test -- stream-source`) it is one vitest
// run of the main suite with them.
import { spawn } from 'node:child_process';
import { createWriteStream, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const vitest = (args, stdio) =>
  spawn(process.execPath, ['node_modules/vitest/vitest.mjs', 'run', ...args], { stdio });
const exited = (child) =>
  new Promise((resolve) => child.on('close', (code, signal) => resolve(code ?? (signal ? 1 : 0))));

const extra = process.argv.slice(2);
if (extra.length > 0) process.exit(await exited(vitest(extra, 'inherit')));

const SIDE_SUITES = [
  { name: 'the chaos suite (test/chaos)', args: ['--config', 'vitest.chaos.config.ts'] },
  { name: 'the Redis topology tests (test/topologies)', args: ['--config', 'vitest.topologies.config.ts'] },
];

const dir = mkdtempSync(join(tmpdir(), 'dedup-bridge-tests-'));
const sides = SIDE_SUITES.map((suite, index) => {
  const log = join(dir, `${index}.log`);
  const out = createWriteStream(log);
  const child = vitest(suite.args, ['ignore', 'pipe', 'pipe']);
  child.stdout.pipe(out, { end: false });
  child.stderr.pipe(out, { end: false });
  // Watched from the start: a side suite may end before the main one.
  const code = exited(child).then(async (code) => {
    await new Promise((resolve) => out.end(resolve));
    return code;
  });
  return { ...suite, log, child, code };
});
const main = vitest([], 'inherit');
const mainCode = exited(main);

// Ctrl-C or a CI timeout stops them all.
for (const signal of ['SIGINT', 'SIGTERM']) {
  process.on(signal, () => {
    main.kill(signal);
    for (const side of sides) side.child.kill(signal);
  });
}

const outcomes = [{ name: 'the unit and integration tests', code: await mainCode }];
for (const side of sides) {
  const code = await side.code;
  process.stdout.write(`\n---- ${side.name}, run beside the tests above ----\n`);
  process.stdout.write(readFileSync(side.log, 'utf8'));
  outcomes.push({ name: side.name, code });
}
rmSync(dir, { recursive: true, force: true });
process.stdout.write(
  `\nnpm test: ${outcomes.map(({ name, code }) => `${name} ${code === 0 ? 'passed' : 'FAILED'}`).join('; ')}\n`,
);
// Not process.exit: where stdout is an asynchronous pipe (macOS), it could cut the logs written above.
process.exitCode = outcomes.every(({ code }) => code === 0) ? 0 : 1;
