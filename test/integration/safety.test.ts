import { describe, expect, it } from 'vitest';
import { freePort } from '../harness/servers.js';
import {
  declareQueue,
  depthOf,
  migrateArgs,
  publishAll,
  runArgs,
  runCli,
  servers,
  startCli,
  takeAll,
  uniqueName,
  waitFor,
} from '../helpers.js';
import { management } from './privilege-admin.js';

const DAY = 86_400_000;
const HOUR = 3_600_000;

/** A source queue (with these arguments) holding one message, and an empty target queue. */
async function queuesWithOneMessage(label: string, args: Record<string, unknown> = {}) {
  const { sourceUrl, targetUrl } = servers();
  const source = uniqueName(`${label}-src`);
  const target = uniqueName(`${label}-dst`);
  await declareQueue(sourceUrl, source, { arguments: args });
  await declareQueue(targetUrl, target);
  await publishAll(sourceUrl, source, [{ body: 'x', options: { headers: { _HQ_DUPL_ID: `${source}-1` } } }]);
  return { source, target };
}

/** The warn-level log lines of a run, by their message. */
const warnings = (stdout: string) =>
  stdout
    .split('\n')
    .filter((line) => line.startsWith('{'))
    .map((line) => JSON.parse(line) as { level: string; msg: string })
    .filter((line) => line.level === 'warn')
    .map((line) => line.msg);

describe('start-up check: the dedup window against what the source queue can redeliver', () => {
  it('warns when x-message-ttl outlives --dedup-window, and --strict refuses to start (exit 2)', async () => {
    const { sourceUrl, targetUrl, sourceManagementUrl } = servers();
    const { source, target } = await queuesWithOneMessage('ttl', { 'x-message-ttl': 10 * DAY });
    const args = migrateArgs(source, ['--target-queue', target], '--source-management', sourceManagementUrl);
    const expected = `source queue "${source}" keeps messages up to 10d (x-message-ttl), longer than --dedup-window 7d: a copy delivered after its ID expired is forwarded again; raise --dedup-window to at least 10d`;

    const strict = await runCli([...args, '--strict']);
    expect(strict.code).toBe(2);
    expect(strict.stderr).toBe(`dedup-bridge: --strict: ${expected}\n`);
    expect(await depthOf(sourceUrl, source)).toBe(1);

    const warned = await runCli(args);
    expect(warned.code).toBe(0);
    expect(warnings(warned.stdout)).toContain(expected);
    expect((await takeAll(targetUrl, target)).length).toBe(1);

    // A window as long as the TTL: nothing to say.
    await publishAll(sourceUrl, source, [
      { body: 'y', options: { headers: { _HQ_DUPL_ID: `${source}-2` } } },
    ]);
    const quiet = await runCli([...args, '--dedup-window', '10d']);
    expect(quiet.code).toBe(0);
    expect(warnings(quiet.stdout).filter((line) => line.includes('source queue'))).toEqual([]);
  });

  it('run reads a policy message-ttl (the lower of policy and argument wins) through --source-management', async () => {
    const { sourceUrl, targetUrl, sourceManagementUrl } = servers();
    const policyQueue = await queuesWithOneMessage('policy');
    const both = await queuesWithOneMessage('both', { 'x-message-ttl': 1 * HOUR });
    const policy = uniqueName('ttl-policy');
    await management(sourceManagementUrl, 'PUT', `policies/%2F/${policy}`, {
      pattern: `^(${policyQueue.source}|${both.source})$`,
      definition: { 'message-ttl': 2 * HOUR },
      'apply-to': 'queues',
    });
    try {
      // The broker applies a policy in the background: wait until the API shows it.
      const applied = await waitFor(async () => {
        const queue = (await management(sourceManagementUrl, 'GET', `queues/%2F/${policyQueue.source}`)) as {
          effective_policy_definition?: Record<string, unknown>;
        };
        return queue.effective_policy_definition?.['message-ttl'] === 2 * HOUR;
      }, 10_000);
      expect(applied).toBe(true);

      // The management URL can come from the environment.
      const refused = await runCli(
        [
          ...runArgs(policyQueue.source, ['--target-queue', policyQueue.target]),
          '--dedup-window',
          '90m',
          '--strict',
        ],
        { env: { DEDUP_BRIDGE_SOURCE_MANAGEMENT: sourceManagementUrl } },
      );
      expect(refused.code).toBe(2);
      expect(refused.stderr).toBe(
        `dedup-bridge: --strict: source queue "${policyQueue.source}" keeps messages up to 2h (policy message-ttl), longer than --dedup-window 90m: a copy delivered after its ID expired is forwarded again; raise --dedup-window to at least 2h\n`,
      );
      expect(await depthOf(sourceUrl, policyQueue.source)).toBe(1);

      // The queue's own 1h argument is lower than the policy's 2h: a 90m window is enough.
      const run = startCli([
        ...runArgs(both.source, ['--target-queue', both.target]),
        '--dedup-window',
        '90m',
        '--source-management',
        sourceManagementUrl,
      ]);
      const forwarded = await waitFor(async () => (await depthOf(targetUrl, both.target)) === 1, 20_000);
      run.signal('SIGTERM');
      const stopped = await run.done;
      expect(forwarded, stopped.stderr).toBe(true);
      expect(stopped.code).toBe(0);
      expect(warnings(stopped.stdout).filter((line) => line.includes('source queue'))).toEqual([]);
    } finally {
      await management(sourceManagementUrl, 'DELETE', `policies/%2F/${policy}`);
    }
  });

  it('warns when a queue without TTL gets a window below the default, and says at debug level when it cannot check', async () => {
    const { sourceManagementUrl } = servers();
    const first = await queuesWithOneMessage('forever');
    const second = await queuesWithOneMessage('forever');
    const job = (...extra: string[]) =>
      migrateArgs(
        first.source,
        [],
        '--source-queue',
        second.source,
        '--map',
        `${first.source}=${first.target}`,
        '--map',
        `${second.source}=${second.target}`,
        '--dedup-window',
        '1d',
        ...extra,
      );

    const warned = await runCli(job('--source-management', sourceManagementUrl));
    expect(warned.code).toBe(0);
    for (const queue of [first.source, second.source]) {
      expect(warnings(warned.stdout)).toContain(
        `source queue "${queue}" has no message TTL (messages may stay forever) and --dedup-window 1d is shorter than the default 7d: a copy delivered after its ID expired is forwarded again; raise --dedup-window, or give the queue a message-ttl no longer than the window`,
      );
    }

    // Without a management API there is nothing to compare: no warning, and no info line either (it
    // would be the same on every run); one line at debug level says the check was skipped.
    const skippedIn = (stdout: string) =>
      stdout.split('\n').filter((line) => line.includes('source queue TTL not compared with --dedup-window'));
    const unchecked = await runCli(job());
    expect(unchecked.code).toBe(0);
    expect(skippedIn(unchecked.stdout)).toEqual([]);
    expect(warnings(unchecked.stdout).filter((line) => line.includes('source queue'))).toEqual([]);
    const debug = await runCli(job('--log-level', 'debug'));
    expect(debug.code).toBe(0);
    expect(skippedIn(debug.stdout).map((line) => JSON.parse(line).level)).toEqual(['debug']);

    // A management API that does not answer: one warning for all queues, a refusal with --strict.
    await publishAll(servers().sourceUrl, first.source, [
      { body: 'z', options: { headers: { _HQ_DUPL_ID: `${first.source}-z` } } },
    ]);
    const closed = `http://guest:guest@127.0.0.1:${await freePort()}`;
    const unanswered = await runCli(job('--source-management', closed, '--strict'));
    expect(unanswered.code).toBe(2);
    expect(unanswered.stderr).toMatch(
      /^dedup-bridge: --strict: source queue TTL not compared with --dedup-window: --source-management: http:\/\/guest:\*\*\*@127\.0\.0\.1:\d+\/? did not answer \([^)]*\); check the URL and that the management plugin runs\n$/,
    );
    expect(await depthOf(servers().sourceUrl, first.source)).toBe(1);
  });
});
