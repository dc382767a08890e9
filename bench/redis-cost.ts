// npm run bench:redis-cost [-- IDS] [--design fields]: the instructions Redis executes per ID to
// claim and commit, counted by valgrind's callgrind. Unlike CPU time, the count does not move with
// the machine's load or speed, so two builds of the scripts compare to the percent (run it on each).
// --design fields measures the claim record of bench/claims-as-fields/ (a field of the bucket hash
// instead of a key of its own) on the same IDs and clock; --clock-step <ms> moves the clock that
// far after each batch (default 5; 72000 crosses four slices of the hour's window). Needs valgrind
// (apt-get install valgrind); starts its own Redis under it on a free port, and stops it after.
import { execFileSync, spawn } from 'node:child_process';
import { hash } from 'node:crypto';
import { mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Redis } from 'ioredis';
import { DedupCache } from '../src/dedup/cache.js';

const args = process.argv.slice(2);
const design = args.includes('--design') ? args[args.indexOf('--design') + 1] : 'keys';
if (design !== 'keys' && design !== 'fields') {
  process.stdout.write(`redis-cost: --design is keys (the shipped scripts) or fields, not ${design}\n`);
  process.exit(2);
}
const STEP_MS = args.includes('--clock-step') ? Number(args[args.indexOf('--clock-step') + 1]) : 5;
const IDS = Number(args.find((arg, i) => /^\d+$/.test(arg) && args[i - 1] !== '--clock-step') ?? 10_000);
const BATCH = 200;
const say = (text: string) => process.stdout.write(`${text}\n`);

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer().listen(0, '127.0.0.1', () => {
      const address = server.address();
      server.close(() =>
        typeof address === 'object' && address ? resolve(address.port) : reject(new Error('no port')),
      );
    });
  });
}

const dir = mkdtempSync(join(tmpdir(), 'redis-cost-'));
const port = await freePort();
const server = spawn(
  'valgrind',
  [
    '--tool=callgrind',
    `--callgrind-out-file=${dir}/callgrind.out`,
    'redis-server',
    '--port',
    String(port),
    '--save',
    '',
    '--appendonly',
    'no',
  ],
  { stdio: 'ignore' },
);
server.on('error', () => {
  say('redis-cost: valgrind could not be started; install it (apt-get install valgrind)');
  process.exit(2);
});
const control = (flag: string) =>
  execFileSync('callgrind_control', [flag, String(server.pid)], { stdio: 'pipe' });

/** Instructions counted since the last zeroing, from the dump callgrind writes next. */
function dumped(before: Set<string>): number {
  control('-d');
  for (let tries = 0; tries < 100; tries++) {
    for (const name of readdirSync(dir).filter((file) => !before.has(file))) {
      const count = /^(?:summary|totals): (\d+)/m.exec(readFileSync(join(dir, name), 'utf8'))?.[1];
      if (count) return Number(count);
    }
    execFileSync('sleep', ['0.1']);
  }
  throw new Error('callgrind wrote no dump');
}

/**
 * The claim and commit of bench/claims-as-fields/, called as the cache calls its own: the shard's
 * meta and layout keys, the same arguments less the claim keys (the claim key names the ID here).
 */
function fieldsDesign(redis: Redis, cache: DedupCache, clock: () => number, expected: number) {
  const read = (file: string) => readFileSync(new URL(file, import.meta.url), 'utf8');
  // The shipped writer with one line changed, so that the shipped scripts carry nothing for the
  // sketch: it records a claim's value, and with HSETNX leaves a field already there and returns
  // its bucket key.
  const edits: [string, string][] = [
    ['function writer.add(field, h)', 'function writer.add(field, h, value, command)'],
    [
      "call('HSET', key, field, '')",
      "if call(command or 'HSET', key, field, value or '') == 0 and command then return key end",
    ],
  ];
  let writer = read('../src/dedup/lua/committed.lua');
  for (const [shipped, sketch] of edits) {
    if (!writer.includes(shipped)) throw new Error(`committed.lua no longer has ${shipped}`);
    writer = writer.replace(shipped, sketch);
  }
  const shared = `${writer}\n${read('claims-as-fields/records.lua')}\n`;
  redis.defineCommand('fieldsClaim', { lua: shared + read('claims-as-fields/claim.lua') });
  redis.defineCommand('fieldsCommit', { lua: shared + read('claims-as-fields/commit.lua') });
  const run = redis as unknown as Record<string, (...args: unknown[]) => Promise<number[]>>;
  const [base] = cache.bases();
  const layout = `v1 shards=1 slice=${cache.layout.sliceMs}`;
  // Both scripts take the shard's meta and layout keys and the owner first, as the shipped ones do.
  const head = [2, `${base}:m`, `${base}:layout`, 'redis-cost-owner'];
  const packed = (batch: readonly string[]) =>
    Buffer.concat(
      batch.map((key) =>
        Buffer.from(hash('sha1', key.slice(key.indexOf(':c:') + 3), 'buffer').subarray(0, 16)),
      ),
    );
  const claimStates = ['new', 'dup', 'busy', 'in-doubt'];
  const commitResults = ['', 'committed', 'already', 'taken', 'restored'];
  return {
    claim: async (batch: readonly string[]) =>
      (await run.fieldsClaim?.(...head, 30_000, 3_600_000, layout, packed(batch), clock(), expected))?.map(
        (code) => claimStates[code],
      ) ?? [],
    commit: async (batch: readonly string[]) =>
      (await run.fieldsCommit?.(...head, 3_600_000, layout, packed(batch), expected, clock()))?.map(
        (code) => commitResults[code],
      ) ?? [],
  };
}

let redis: Redis | undefined;
try {
  // Redis under valgrind takes seconds to listen.
  for (let tries = 0; ; tries++) {
    try {
      if (
        execFileSync('redis-cli', ['-p', String(port), 'ping'], { stdio: 'pipe' })
          .toString()
          .includes('PONG')
      )
        break;
    } catch {}
    if (tries > 100) throw new Error('Redis under valgrind did not start');
    execFileSync('sleep', ['0.3']);
  }
  redis = new Redis({ port, maxRetriesPerRequest: 1, retryStrategy: () => null });
  // A fixed clock: the same slices and expiries on every run, wherever the wall clock is.
  let now = Date.UTC(2030, 0, 1, 12, 0, 30);
  const cache = await DedupCache.open(redis, {
    token: 'redis-cost-owner',
    leaseMs: 30_000,
    windowMs: 3_600_000,
    prefix: 'cost',
    scope: 'ids',
    clock: () => now,
  });
  cache.expectedIds = IDS;
  const keys = Array.from({ length: IDS }, (_, i) => cache.keyOf(`id-${i}`));
  const claims = Array.from({ length: IDS / BATCH }, (_, i) => keys.slice(i * BATCH, (i + 1) * BATCH));
  const { claim, commit } = design === 'keys' ? cache : fieldsDesign(redis, cache, () => now, IDS);
  const before = () => new Set(readdirSync(dir));
  let claimed = 0;
  let committed = 0;
  for (const batch of claims) {
    let seen = before();
    control('-z');
    const states = await claim.call(cache, batch);
    claimed += dumped(seen);
    if (states.some((state) => state !== 'new'))
      throw new Error(`a new ID was not claimed: ${states.join(',')}`);
    seen = before();
    control('-z');
    const results = await commit.call(cache, batch);
    committed += dumped(seen);
    if (results.some((result) => result !== 'committed'))
      throw new Error(`a claim did not commit: ${results.join(',')}`);
    now += STEP_MS;
  }
  say(
    `redis-cost: ${IDS} IDs in batches of ${BATCH}, ${design} design, clock step ${STEP_MS} ms, Redis instructions per ID (callgrind)`,
  );
  say(`  claim  ${Math.round(claimed / IDS)}`);
  say(`  commit ${Math.round(committed / IDS)}`);
  say(`  both   ${Math.round((claimed + committed) / IDS)}`);
} finally {
  await redis?.shutdown('NOSAVE').catch(() => {});
  redis?.disconnect();
  server.kill('SIGKILL');
  rmSync(dir, { recursive: true, force: true });
}
