import { describe, expect, it } from 'vitest';
import { freePort } from '../harness/servers.js';
import { migrateArgs, queuePair, runArgs, startCli, waitFor, withOption } from '../helpers.js';

// A stop signal while a server is still awaited at start ends the process at once and cleanly:
// `run` with 0, `migrate` with 4 (its work is left), one line saying so; every wait is logged once.
describe('signals while connecting', () => {
  async function stopWhileWaiting(
    args: string[],
    waiting: RegExp,
  ): Promise<{ code: number | null; stdout: string; stderr: string; ms: number }> {
    const cli = startCli(args);
    expect(await waitFor(() => waiting.test(cli.output()), 30_000), cli.output()).toBe(true);
    const signalled = Date.now();
    cli.signal('SIGTERM');
    const result = await cli.done;
    const ms = Date.now() - signalled;
    // One "not reachable" line for the whole wait, however many attempts it made.
    expect(cli.output().match(new RegExp(waiting.source, 'g'))).toHaveLength(1);
    return { ...result, ms };
  }

  it('migrate, the source broker unreachable: SIGTERM ends it at once with exit 4 and one line', async () => {
    const { source, target } = await queuePair();
    const closed = `amqp://guest:guest@127.0.0.1:${await freePort()}`;
    const args = withOption(
      migrateArgs(source, ['--target-queue', target], '--retry-for', '60s'),
      '--source',
      closed,
    );
    const result = await stopWhileWaiting(
      args,
      /source broker at amqp:\/\/guest:\*\*\*@127\.0\.0\.1:\d+ not reachable; retrying/,
    );
    expect(result.code, result.stderr).toBe(4);
    expect(result.ms).toBeLessThan(5_000);
    const errors = result.stderr.split('\n').filter((line) => line.startsWith('dedup-bridge:'));
    expect(errors).toEqual([
      'dedup-bridge: stopped by a signal while waiting for the source broker; nothing was moved',
    ]);
  });

  for (const command of ['run', 'migrate'] as const) {
    it(`${command}, Redis unreachable at start: it says so once, and SIGTERM ends it at once`, async () => {
      const { source, target } = await queuePair();
      const base =
        command === 'run'
          ? runArgs(source, ['--target-queue', target], '--retry-for', '60s')
          : migrateArgs(source, ['--target-queue', target], '--retry-for', '60s');
      const args = withOption(base, '--redis', `redis://127.0.0.1:${await freePort()}`);
      const result = await stopWhileWaiting(
        args,
        /Redis at redis:\/\/127\.0\.0\.1:\d+ not reachable; retrying/,
      );
      expect(result.ms).toBeLessThan(5_000);
      if (command === 'run') {
        expect(result.code, result.stderr).toBe(0);
        expect(result.stdout).toContain('"msg":"stopped while starting"');
        expect(result.stderr).toBe('');
      } else {
        expect(result.code, result.stderr).toBe(4);
        expect(result.stderr.split('\n').filter((line) => line.startsWith('dedup-bridge:'))).toEqual([
          expect.stringMatching(
            /^dedup-bridge: stopped by a signal while waiting for Redis at redis:\/\/127\.0\.0\.1:\d+; nothing was moved$/,
          ),
        ]);
      }
    });
  }
});
