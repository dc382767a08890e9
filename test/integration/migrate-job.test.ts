import { spawnSync } from 'node:child_process';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Redis } from 'ioredis';
import { describe, expect, it } from 'vitest';
import {
  CLI,
  clearOfSliceEnd,
  countDelivery,
  declareQueue,
  depthOf,
  migrateWithReport,
  openBroker,
  publishAll,
  servers,
  startCli,
  takeAll,
  uniqueName,
  waitFor,
} from '../helpers.js';

/** `migrate` over the harness brokers for several queues, each to the queue of the same name. */
function jobArgs(queues: string[], ...extra: string[]): string[] {
  const { sourceUrl, targetUrl, redisUrl } = servers();
  return [
    'migrate',
    '--source',
    sourceUrl,
    '--target',
    targetUrl,
    '--redis',
    redisUrl,
    '--idle-timeout',
    '300ms',
    ...queues.flatMap((queue) => ['--source-queue', queue]),
    ...extra,
  ];
}

async function queuesWith(count: number, perQueue: number, resendEvery: number) {
  const { sourceUrl, targetUrl } = servers();
  const names = Array.from({ length: count }, (_, i) => uniqueName(`job${i}`));
  const ids = new Map<string, string[]>();
  for (const name of names) {
    await declareQueue(sourceUrl, name);
    await declareQueue(targetUrl, name);
    const messages = Array.from({ length: perQueue }, (_, i) => ({
      body: `${name}-${i}`,
      options: { headers: { _HQ_DUPL_ID: `${name}-${i}` } },
    }));
    const resent = messages.filter((_, i) => i % resendEvery === 0);
    await publishAll(sourceUrl, name, [...messages, ...resent]);
    ids.set(
      name,
      messages.map((message) => message.options.headers._HQ_DUPL_ID),
    );
  }
  return { names, ids };
}

describe('migrate: the scheduled job', () => {
  it('migrates three queues of 3,000 (with duplicates) in one job, and deletes the sources only with the flag', async () => {
    const { sourceUrl, targetUrl } = servers();
    const { names, ids } = await queuesWith(3, 3000, 10);
    const run = await migrateWithReport(jobArgs(names, '--parallel', '2'));
    expect(run.code, run.stderr).toBe(0);
    const report = run.report as Record<string, unknown> & { queues: Record<string, unknown>[] };
    expect(report).toMatchObject({
      outcome: 'drained',
      forwarded: 9000,
      duplicates: 900,
      remaining: 0,
      accounted: true,
    });
    expect(report.queues).toHaveLength(3);
    for (const row of report.queues) {
      expect(row).toMatchObject({
        outcome: 'drained',
        forwarded: 3000,
        duplicates: 300,
        remaining: 0,
        deleted: false,
      });
      expect(Number(row.ratePerSecond)).toBeGreaterThan(0);
    }
    expect(run.stderr).toMatch(/total\s+drained\s+9000\s+900/);
    for (const name of names) {
      const arrived = await takeAll(targetUrl, name);
      const count = countDelivery(
        `job queue ${name}`,
        ids.get(name) ?? [],
        arrived.map((message) => String(message.properties.headers?._HQ_DUPL_ID)),
      );
      expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
      // Without --delete-source-when-empty the drained source queue stays.
      expect(await depthOf(sourceUrl, name)).toBe(0);
    }

    // With the flag: an empty queue is deleted; one that a producer refilled after the drain is not.
    await publishAll(sourceUrl, names[0] as string, [
      { body: 'late', options: { headers: { _HQ_DUPL_ID: 'late' } } },
    ]);
    const again = await migrateWithReport(jobArgs(names, '--delete-source-when-empty'));
    expect(again.code).toBe(0);
    expect(again.report).toMatchObject({ forwarded: 1, duplicates: 0 });
    const broker = await openBroker(sourceUrl);
    for (const name of names) {
      await expect(broker.channel.checkQueue(name)).rejects.toThrow(/404/);
      broker.channel = await broker.connection.createConfirmChannel();
      broker.channel.on('error', () => {});
    }
    await broker.close();
  });

  it('does not delete a source queue that still holds messages, even with the flag', async () => {
    const { sourceUrl, targetUrl } = servers();
    const queue = uniqueName('busy');
    await declareQueue(sourceUrl, queue);
    await declareQueue(targetUrl, queue);
    // The job stops at --max-messages with messages left: the flag must not delete the queue.
    await publishAll(
      sourceUrl,
      queue,
      Array.from({ length: 10 }, (_, i) => ({
        body: `m${i}`,
        options: { headers: { _HQ_DUPL_ID: `${queue}-${i}` } },
      })),
    );
    const run = await migrateWithReport(
      jobArgs([queue], '--delete-source-when-empty', '--max-messages', '4'),
    );
    expect(run.code).toBe(4);
    expect(run.report).toMatchObject({ outcome: 'limit', forwarded: 4, remaining: 6 });
    expect((run.report as { queues: { deleted: boolean }[] }).queues[0]?.deleted).toBe(false);
    expect(await depthOf(sourceUrl, queue)).toBe(6);
  });

  it('stops at --max-messages with exit 4 and the work left reported; the next run continues exactly', async () => {
    const { targetUrl } = servers();
    const { names, ids } = await queuesWith(2, 500, 1000);
    const first = await migrateWithReport(jobArgs(names, '--max-messages', '300'));
    expect(first.code, JSON.stringify(first.report)).toBe(4);
    // 2 × (500 + 1 resent) = 1,002 messages; 300 taken.
    expect(first.report).toMatchObject({ outcome: 'limit', consumed: 300, remaining: 702 });
    const second = await migrateWithReport(jobArgs(names, '--max-duration', '60s'));
    expect(second.code).toBe(0);
    expect(second.report).toMatchObject({ outcome: 'drained', remaining: 0 });
    for (const name of names) {
      const arrived = await takeAll(targetUrl, name);
      expect(
        countDelivery(
          `limit then continue ${name}`,
          ids.get(name) ?? [],
          arrived.map((message) => String(message.properties.headers?._HQ_DUPL_ID)),
        ),
      ).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
    }
  });

  it("sizes a new scope's first slice for what --max-messages lets the run take, not the whole backlog", async () => {
    const { redisUrl } = servers();
    const { names } = await queuesWith(1, 3000, 3000);
    // The run's IDs are asserted below to fill one slice: the run must not straddle two.
    await clearOfSliceEnd(redisUrl);
    const run = await migrateWithReport(jobArgs(names, '--max-messages', '100'));
    expect(run.code).toBe(4);
    // Room for 100 IDs is the 16-bucket minimum; the 3,001 in the queue would have taken 47.
    const redis = new Redis(redisUrl);
    const slices = Object.values(await redis.hgetall(`dedup:{queue:${names[0]}}:m`));
    redis.disconnect();
    expect(slices).toEqual([expect.stringMatching(/^100:100:\d+:16$/)]);
  });

  it('stops at --max-duration with exit 4', async () => {
    const { names } = await queuesWith(1, 1000, 1000);
    const run = await migrateWithReport(jobArgs(names, '--max-duration', '1s', '--max-rate', '200'));
    expect(run.code).toBe(4);
    expect(run.report).toMatchObject({ outcome: 'limit' });
    expect(Number(run.report?.remaining)).toBeGreaterThan(0);
    expect(Number(run.report?.forwarded)).toBeLessThan(1000);
  });

  it('--max-rate caps the forwarding rate of the job', async () => {
    const { names } = await queuesWith(2, 300, 1000);
    const run = await migrateWithReport(jobArgs(names, '--max-rate', '300'));
    expect(run.code).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 600 });
    // 600 messages at 300/s (bursts of a tenth of a second): about two seconds of forwarding, and
    // neither queue's share above the cap. A queue's 300 messages can take one burst (30) plus
    // 300/s, so no less than 0.9 s: at most 333/s measured over the queue's own span.
    for (const row of (run.report as { queues: { ratePerSecond: number }[] }).queues) {
      expect(row.ratePerSecond).toBeLessThanOrEqual(340);
    }
    expect(Number(run.report?.seconds)).toBeGreaterThanOrEqual(1.8);
  });

  it('one job at a time: an overlapping run exits 3 naming the holder; a crashed run’s lock expires', async () => {
    const { sourceUrl, targetUrl } = servers();
    const queue = uniqueName('locked');
    await declareQueue(sourceUrl, queue);
    await declareQueue(targetUrl, queue);
    // The first run idles on an empty queue for a long time, holding the lock.
    // A lease long enough that the run started right after the kill still finds the lock, on a
    // loaded machine too.
    const holder = startCli(jobArgs([queue], '--idle-timeout', '60s', '--job-lock-lease', '6s'));
    expect(await waitFor(() => holder.output().includes('"msg":"forwarding"'))).toBe(true);
    const overlap = await migrateWithReport(jobArgs([queue]));
    expect(overlap.code).toBe(3);
    expect(overlap.stderr.trim().split('\n')).toHaveLength(1);
    expect(overlap.stderr).toMatch(
      /job "migrate-[0-9a-f]{12}" is already running \(held by .+ pid \d+ since \d{4}-/,
    );
    // The report says so too: a scheduled run always leaves one.
    expect(overlap.report).toMatchObject({
      outcome: 'locked',
      exitCode: 3,
      problem: overlap.stderr.trim().replace(/^dedup-bridge: /, ''),
      forwarded: 0,
    });

    holder.signal('SIGKILL');
    await holder.done;
    expect((await migrateWithReport(jobArgs([queue]))).code).toBe(3);
    // The crashed run's lock lives out its lease (6 s): until Redis drops the key, then one more run.
    const { redisUrl } = servers();
    const job = /job "(migrate-[0-9a-f]{12})"/.exec(overlap.stderr)?.[1];
    const redis = new Redis(redisUrl);
    const lockKey = `dedup:job:${job}`;
    expect(await redis.exists(lockKey), `the job lock ${lockKey} in Redis`).toBe(1);
    const expired = await waitFor(async () => (await redis.exists(lockKey)) === 0, 15_000);
    await redis.quit();
    expect(expired, `the crashed run's lock ${lockKey} expired`).toBe(true);
    const next = await migrateWithReport(jobArgs([queue]));
    expect(next.code).toBe(0);
  });

  it('--dry-run counts what would move and moves, acks and claims nothing', async () => {
    const { sourceUrl, targetUrl, redisUrl } = servers();
    const { names } = await queuesWith(1, 200, 4);
    const queue = names[0] as string;
    // Half of the IDs are on the target already.
    const half = await migrateWithReport(jobArgs(names, '--max-messages', '100'));
    expect(half.code).toBe(4);
    const before = await depthOf(sourceUrl, queue);
    const redis = new Redis(redisUrl);
    const scopeKeys = async () => (await redis.keys(`dedup:{queue:${queue}}:*`)).sort();
    const keysBefore = await scopeKeys();
    const run = await migrateWithReport(jobArgs(names, '--dry-run'));
    expect(run.code).toBe(0);
    expect(run.report).toMatchObject({ outcome: 'dry-run', dryRun: true, consumed: before });
    expect(Number(run.report?.forwarded) + Number(run.report?.duplicates)).toBe(before);
    expect(Number(run.report?.duplicates)).toBeGreaterThan(0);
    expect(await depthOf(sourceUrl, queue)).toBe(before);
    expect(await depthOf(targetUrl, queue)).toBe(100);
    // Nothing written: the same keys as before, and no claim among them.
    const keysAfter = await scopeKeys();
    await redis.quit();
    expect(keysAfter).toEqual(keysBefore);
    expect(keysAfter.filter((key) => key.includes('}:c:'))).toEqual([]);
    expect(keysAfter).toContain(`dedup:{queue:${queue}}:m`);
  });

  it('--declare-target creates target queues like their sources (type and arguments), from the management API, and says what it declared', async () => {
    const { sourceUrl, targetUrl, sourceManagementUrl } = servers();
    const classic = uniqueName('shape-classic');
    const quorum = uniqueName('shape-quorum');
    const args = { 'x-dead-letter-exchange': 'dlx', 'x-max-priority': 5 };
    await declareQueue(sourceUrl, classic, { arguments: args });
    await declareQueue(sourceUrl, quorum, { arguments: { 'x-queue-type': 'quorum' } });
    await publishAll(sourceUrl, classic, [
      { body: 'a', options: { headers: { _HQ_DUPL_ID: `${classic}-a` } } },
    ]);

    const missing = await migrateWithReport(jobArgs([classic, quorum]));
    expect(missing.code).toBe(2);
    expect(missing.stderr).toMatch(
      /--target-queue: queue "t-shape-classic-[0-9a-f]+" does not exist on the target broker/,
    );

    const run = await migrateWithReport(
      jobArgs([classic, quorum], '--declare-target', '--source-management', sourceManagementUrl),
    );
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 1 });
    // One line per queue, with what it was declared with.
    const declared = run.stdout.split('\n').filter((line) => line.includes('declared'));
    expect(declared).toHaveLength(2);
    expect(declared.join('\n')).toContain(
      `target queue \\"${classic}\\" declared (classic, durable) with arguments {\\"x-dead-letter-exchange\\":\\"dlx\\",\\"x-max-priority\\":5}`,
    );
    expect(declared.join('\n')).toContain(
      `target queue \\"${quorum}\\" declared (quorum, durable) with arguments {\\"x-queue-type\\":\\"quorum\\"}`,
    );
    // The target queues exist with the same settings: an identical declaration is accepted, another refused.
    const broker = await openBroker(targetUrl);
    await broker.channel.assertQueue(classic, { durable: true, arguments: args });
    await broker.channel.assertQueue(quorum, { durable: true, arguments: { 'x-queue-type': 'quorum' } });
    await expect(broker.channel.assertQueue(classic, { durable: true })).rejects.toThrow(
      /PRECONDITION_FAILED/,
    );
    await broker.close();
  });

  it.each([
    ['x-max-length', 100, 'drops \\(or refuses\\) messages past a count'],
    ['x-message-ttl', 3_600_000, 'drops \\(or dead-letters\\) messages not consumed in time'],
    ['x-expires', 600_000, 'deletes itself, with its messages, when unused for a while'],
  ])(
    '--declare-target refuses a source queue with %s (the target would discard messages) unless --declare-target-force',
    async (argument, value, why) => {
      const { sourceUrl, targetUrl, sourceManagementUrl } = servers();
      const queue = uniqueName('discarding');
      const other = uniqueName('plain');
      await declareQueue(sourceUrl, queue, { arguments: { [argument]: value } });
      await declareQueue(sourceUrl, other);
      const batch = (name: string) =>
        Array.from({ length: 5 }, (_, n) => ({
          body: `${name}-${n}`,
          options: { headers: { _HQ_DUPL_ID: `${name}-${n}` } },
        }));
      await publishAll(sourceUrl, queue, batch(queue));
      await publishAll(sourceUrl, other, batch(other));
      const declare = ['--declare-target', '--source-management', sourceManagementUrl];

      const refused = await migrateWithReport(jobArgs([other, queue], ...declare));
      expect(refused.code).toBe(2);
      expect(refused.stderr).toMatch(
        new RegExp(
          `^dedup-bridge: --declare-target: source queue "${queue}" has ${argument}=${value}, under which target queue "${queue}" ${why}; declare the target queue yourself, or give --declare-target-force to copy it anyway\n`,
        ),
      );
      // Refused before anything was declared or moved, on either broker.
      expect(await depthOf(sourceUrl, queue)).toBe(5);
      expect(await depthOf(sourceUrl, other)).toBe(5);
      const broker = await openBroker(targetUrl);
      await expect(broker.channel.checkQueue(queue)).rejects.toThrow(/NOT_FOUND/);
      await broker.close();
      const broker2 = await openBroker(targetUrl);
      await expect(broker2.channel.checkQueue(other)).rejects.toThrow(/NOT_FOUND/);
      await broker2.close();

      const forced = await migrateWithReport(jobArgs([other, queue], ...declare, '--declare-target-force'));
      expect(forced.code, forced.stderr).toBe(0);
      expect(forced.stdout).toContain(
        `target queue \\"${queue}\\" declared (classic, durable) with arguments {\\"${argument}\\":${value}`,
      );
      expect(await depthOf(sourceUrl, queue)).toBe(0);
      expect(await depthOf(sourceUrl, other)).toBe(0);
      expect(await depthOf(targetUrl, other)).toBe(5);
      expect(await depthOf(targetUrl, queue)).toBe(5);
      expect(forced.report).toMatchObject({ forwarded: 10 });
    },
  );

  it('shows a live bar per queue on a terminal, with what is left and an ETA while it moves', async () => {
    const { names } = await queuesWith(2, 300, 1000);
    // `script` gives the CLI a pseudo-terminal, as an operator's shell would; wide enough for the ETA.
    const cli = [process.execPath, CLI, ...jobArgs(names, '--max-rate', '300', '--log-level', 'warn')]
      .map((part) => `'${part}'`)
      .join(' ');
    const command = `stty cols 200; ${cli}`;
    const result = spawnSync('script', ['-qfec', command, '/dev/null'], {
      encoding: 'utf8',
      timeout: 60_000,
    });
    expect(result.status).toBe(0);
    const escapes = new RegExp(`${String.fromCharCode(27)}\\[[0-9;?]*[A-Za-z]`, 'g');
    const screen = result.stdout.replace(escapes, '');
    // Each queue: 300 messages and 1 resent.
    for (const name of names) {
      expect(screen).toMatch(new RegExp(`${name} \\|█+\\| 301/301 moved · 1 dups · \\d+ msg/s · ETA 0s`));
      // While it moves, the total is the whole queue (read from the source while messages are in
      // flight), and the ETA is known.
      const moving = [
        ...screen.matchAll(
          new RegExp(
            `${name} \\|[█░]+\\| (\\d+)/(\\d+) moved · \\d+ dups · [1-9]\\d* msg/s · ETA (\\d+)s`,
            'g',
          ),
        ),
      ]
        .map((match) => ({ done: Number(match[1]), total: Number(match[2]) }))
        .filter((frame) => frame.done > 0 && frame.done < 301);
      expect(moving.length, screen).toBeGreaterThan(0);
      for (const frame of moving) expect(frame.total).toBe(301);
    }
    expect(screen).toMatch(/total\s+drained\s+600/);
  });

  it('reads its queues from a job file and reports progress off a terminal', async () => {
    const { targetUrl } = servers();
    const { names, ids } = await queuesWith(2, 300, 1000);
    const renamed = uniqueName('renamed');
    await declareQueue(targetUrl, renamed);
    const file = join(mkdtempSync(join(tmpdir(), 'job-')), 'job.yaml');
    writeFileSync(file, `queues:\n  - ${names[0]}\n  - source: ${names[1]}\n    target: ${renamed}\n`);
    const { sourceUrl, redisUrl } = servers();
    const run = await migrateWithReport([
      'migrate',
      '--job-file',
      file,
      '--source',
      sourceUrl,
      '--target',
      targetUrl,
      '--redis',
      redisUrl,
      '--idle-timeout',
      '300ms',
      '--max-rate',
      '300',
      '--progress-interval',
      '300ms',
    ]);
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ forwarded: 600 });
    expect(run.stdout).toMatch(/"msg":"progress"/);
    expect(await depthOf(targetUrl, names[0] as string)).toBe(300);
    const moved = await takeAll(targetUrl, renamed);
    expect(
      countDelivery(
        'job file, renamed target',
        ids.get(names[1] as string) ?? [],
        moved.map((message) => String(message.properties.headers?._HQ_DUPL_ID)),
      ),
    ).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });

    writeFileSync(file, 'queues:\n  - name: x\n');
    const bad = await migrateWithReport([
      'migrate',
      '--job-file',
      file,
      '--source',
      sourceUrl,
      '--target',
      targetUrl,
    ]);
    expect(bad.code).toBe(2);
    expect(bad.stderr).toMatch(/^dedup-bridge: --job-file .*: queues\[0\]: /);
  });
});
