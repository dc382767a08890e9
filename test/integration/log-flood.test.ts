import { describe, expect, it } from 'vitest';
import {
  declareQueue,
  depthOf,
  migrateArgs,
  migrateWithReport,
  publishAll,
  queuePair,
  servers,
  uniqueName,
} from '../helpers.js';

// A flood of bad messages must not flood the log: lines about single messages are capped per kind,
// and what was left out is counted in a line of its own.
describe('per-message warnings under a flood', () => {
  it('200 messages without an ID: ten lines of each kind, one that counts the rest, every message parked', async () => {
    const { sourceUrl } = servers();
    const { source, target } = await queuePair();
    const park = uniqueName('flood-park');
    await declareQueue(sourceUrl, park);
    await publishAll(
      sourceUrl,
      source,
      Array.from({ length: 200 }, (_, i) => ({ body: `no id ${i}`, routingKey: source })),
    );
    const run = await migrateWithReport(
      migrateArgs(source, ['--target-queue', target], '--id-from', 'header:X-Order', '--park-queue', park),
    );
    expect(run.code, run.stderr).toBe(0);
    expect(run.report).toMatchObject({ noId: 200, parked: 200, forwarded: 0 });
    const lines = run.stdout.split('\n').filter((line) => line.startsWith('{'));
    const withText = (text: string) => lines.filter((line) => line.includes(`"msg":"${text}`));
    expect(withText('message has no ID under any --id-from strategy')).toHaveLength(10);
    expect(withText('message parked')).toHaveLength(10);
    expect(withText('190 more lines like this were left out: message has no ID')).toHaveLength(1);
    expect(withText('190 more lines like this were left out: message parked')).toHaveLength(1);
    // Each line names its message.
    expect(withText('message parked')[0]).toMatch(/"routingKey":"t-src-[0-9a-f]+"/);
    expect(await depthOf(sourceUrl, park)).toBe(200);
  });
});
