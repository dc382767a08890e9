import { existsSync, mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { freePort } from '../harness/servers.js';
import {
  declareQueue,
  depthOf,
  lines,
  migrateArgs,
  migrateWithReport,
  numbered,
  openBroker,
  publishAll,
  runCli,
  servers,
  takeAll,
  uniqueName,
} from '../helpers.js';

// Issue 17, item 5: progress that says what is left, rates over active time only, a report on
// every exit, and --delete-source-when-empty on a quorum queue.

type Row = Record<string, unknown> & {
  forwarded: number;
  duplicates: number;
  parked: number;
  deadLettered: number;
  seconds: number;
  activeSeconds: number;
  ratePerSecond: number;
};
type Report = Row & { outcome: string; exitCode: number; problem: string | null; queues: Row[] };

const handled = (row: Row) => row.forwarded + row.duplicates + row.parked + row.deadLettered;

/** A report path in a fresh folder, and a reader for it (undefined when none was written). */
function reportFile(): { path: string; read(): Report | undefined } {
  const path = join(mkdtempSync(join(tmpdir(), 'dedup-report-')), 'report.json');
  return {
    path,
    read: () => (existsSync(path) ? (JSON.parse(readFileSync(path, 'utf8')) as Report) : undefined),
  };
}

describe('migrate: progress and reports', () => {
  it('progress lines say what is left while messages are in flight; rates count active time only, rows and total alike', async () => {
    const { sourceUrl, targetUrl } = servers();
    const queues = [uniqueName('rate-a'), uniqueName('rate-b')];
    for (const queue of queues) {
      await declareQueue(sourceUrl, queue);
      await declareQueue(targetUrl, queue);
      await publishAll(sourceUrl, queue, numbered(queue, 400).messages);
    }
    // One queue after the other, each proving its drain with a 1.5 s idle wait: the old total
    // divided by the whole run (idle waits included) and came out below both rows.
    const run = await migrateWithReport([
      ...migrateArgs(queues[0] as string, [], '--source-queue', queues[1] as string),
      '--parallel',
      '1',
      '--idle-timeout',
      '1500ms',
      '--max-rate',
      '400',
      '--progress-interval',
      '200ms',
    ]);
    expect(run.code, run.stderr).toBe(0);
    const report = run.report as Report;
    expect(report).toMatchObject({ outcome: 'drained', exitCode: 0, problem: null, forwarded: 800 });
    for (const row of [...report.queues, report]) {
      // The rate is what was handled per active second, the same way for each row and the total.
      expect(row.activeSeconds).toBeGreaterThan(0);
      expect(Math.abs(row.ratePerSecond - handled(row) / row.activeSeconds)).toBeLessThanOrEqual(1);
      expect(row.activeSeconds).toBeLessThan(row.seconds);
    }
    const [a, b] = report.queues as [Row, Row];
    // The job's active time joins its queues': not their two idle waits of 1.5 s.
    expect(report.activeSeconds).toBeLessThanOrEqual(a.activeSeconds + b.activeSeconds + 0.01);
    expect(report.seconds - report.activeSeconds).toBeGreaterThanOrEqual(3);
    expect(report.ratePerSecond).toBeGreaterThanOrEqual(Math.min(a.ratePerSecond, b.ratePerSecond));
    // The table prints the same figures.
    expect(run.stderr).toMatch(
      new RegExp(`\\ntotal\\s+drained\\s+800\\s.*\\s${report.ratePerSecond}\\s+[\\d.]+\\n`),
    );

    // Off a terminal: progress lines with what is left, read while messages are in flight.
    const progress = lines(run.stdout)
      .filter((line) => line.includes('"msg":"progress"'))
      .map((line) => JSON.parse(line) as { queue: string; forwarded: number; remaining?: number });
    const first = progress.filter((line) => line.queue === queues[0] && line.forwarded < 400);
    expect(first.length).toBeGreaterThanOrEqual(2);
    for (const line of first) {
      expect(line.remaining).toBeGreaterThan(0);
      // What is left and what moved add up to the queue (nothing else publishes to it).
      expect(line.forwarded + (line.remaining as number)).toBe(400);
    }
    expect(await depthOf(sourceUrl, queues[0] as string)).toBe(0);
    expect(await depthOf(targetUrl, queues[1] as string)).toBe(400);
  });

  it('writes the report on every exit: options refused (2), a missing queue (2), a server unreachable (1)', async () => {
    const { sourceUrl, targetUrl } = servers();
    const source = uniqueName('rep-src');
    const target = uniqueName('rep-dst');
    await declareQueue(sourceUrl, source);
    await publishAll(sourceUrl, source, numbered(source, 5).messages);

    // Options refused after --report was read: exit 2, the one line, and a report that says so.
    const badOption = reportFile();
    const refused = await runCli([
      ...migrateArgs(source, ['--target-queue', target]),
      '--prefetch',
      '-5',
      '--report',
      badOption.path,
    ]);
    expect(refused.code).toBe(2);
    expect(lines(refused.stderr)).toHaveLength(1);
    expect(badOption.read()).toMatchObject({
      job: null,
      outcome: 'refused',
      exitCode: 2,
      problem: refused.stderr.trim().replace(/^dedup-bridge: /, ''),
      forwarded: 0,
      remaining: null,
      queues: [],
    });

    // The target queue does not exist: found before anything moves.
    const missing = reportFile();
    const noQueue = await runCli([
      ...migrateArgs(source, ['--target-queue', target]),
      '--report',
      missing.path,
    ]);
    expect(noQueue.code).toBe(2);
    expect(lines(noQueue.stderr)).toHaveLength(1);
    expect(missing.read()).toMatchObject({
      job: expect.stringMatching(/^migrate-[0-9a-f]{12}$/),
      outcome: 'refused',
      exitCode: 2,
      problem: expect.stringContaining(`queue "${target}" does not exist on the target broker`),
    });

    // Redis not there: exit 1 after --retry-for.
    await declareQueue(targetUrl, target);
    const port = await freePort();
    const away = reportFile();
    const unreachable = await runCli([
      ...migrateArgs(source, ['--target-queue', target]),
      '--redis',
      `redis://127.0.0.1:${port}`,
      '--retry-for',
      '1s',
      '--report',
      away.path,
    ]);
    expect(unreachable.code).toBe(1);
    expect(lines(unreachable.stderr)).toHaveLength(1);
    expect(away.read()).toMatchObject({
      outcome: 'failed',
      exitCode: 1,
      problem: unreachable.stderr.trim().replace(/^dedup-bridge: /, ''),
    });
    // Nothing moved on any of these.
    expect(await depthOf(sourceUrl, source)).toBe(5);
    expect(await depthOf(targetUrl, target)).toBe(0);
  });

  it('--delete-source-when-empty on a quorum queue: kept, said plainly, while another consumer is attached or the broker cannot delete it only if empty', async () => {
    const { sourceUrl, targetUrl } = servers();
    const queue = uniqueName('quorum');
    await declareQueue(sourceUrl, queue, { arguments: { 'x-queue-type': 'quorum' } });
    await declareQueue(targetUrl, queue);
    await publishAll(sourceUrl, queue, numbered(queue, 5).messages);
    // Another consumer holds one message unacked.
    const other = await openBroker(sourceUrl);
    await other.channel.prefetch(1);
    let held = 0;
    await other.channel.consume(queue, () => {
      held++;
    });
    await new Promise((resolve) => setTimeout(resolve, 300));
    expect(held).toBe(1);
    const args = migrateArgs(queue, [], '--delete-source-when-empty');
    const first = await migrateWithReport(args);
    expect(first.code, first.stderr).toBe(0);
    const row = (first.report as Report).queues[0] as Row;
    expect(row).toMatchObject({ outcome: 'drained', forwarded: 4, deleted: false });
    const kept = `${queue}: drained, but not deleted: it is a quorum queue with 1 other consumer(s) attached, which may hold messages unacked; stop them and run again`;
    expect(row.problem).toBe(kept);
    expect(lines(first.stderr).at(-1)).toBe(`dedup-bridge: ${kept}`);
    expect(first.stderr).not.toContain('Channel ended');
    await other.close();
    expect(await depthOf(sourceUrl, queue)).toBe(1);

    // The other consumer gone: its message moves; then the queue is deleted only where the broker
    // can delete a quorum queue only if empty, else kept with the reason (RabbitMQ 3.x).
    const second = await migrateWithReport(args);
    expect(second.code, second.stderr).toBe(0);
    expect(second.report).toMatchObject({ outcome: 'drained', forwarded: 1, remaining: 0 });
    const again = (second.report as Report).queues[0] as Row;
    if (again.deleted) {
      expect(again.problem).toBeNull();
      await expect(depthOf(sourceUrl, queue)).rejects.toThrow(/404/);
    } else {
      expect(again.problem).toBe(
        `${queue}: drained, but not deleted: it is a quorum queue, and this RabbitMQ deletes quorum queues neither if-empty nor if-unused, so it cannot be deleted only while empty; it is drained: delete it yourself once no producer publishes to it`,
      );
      expect(lines(second.stderr).at(-1)).toBe(`dedup-bridge: ${again.problem}`);
      expect(await depthOf(sourceUrl, queue)).toBe(0);
    }
    expect((await takeAll(targetUrl, queue)).length).toBe(5);
  });
});
