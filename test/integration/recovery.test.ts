import { describe, expect, it } from 'vitest';
import { FaultProxy } from '../harness/proxy.js';
import {
  depthOf,
  idsOf,
  migrateWithReport,
  numbered,
  openBroker,
  publishAll,
  queuePair,
  runArgs,
  servers,
  startCli,
  takeAll,
  waitFor,
} from '../helpers.js';

describe('recovery limits', () => {
  it('migrate gives up after --retry-for when the target stays away mid-run: exit 1, nothing lost', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const { redisUrl } = servers();
    const { ids, messages } = numbered(source, 2000);
    await publishAll(sourceUrl, source, messages);
    const proxy = FaultProxy.forUrl(targetUrl);
    await proxy.start();
    // Slow the target down so the outage lands mid-transfer.
    proxy.setDelay(20);
    const run = migrateWithReport([
      'migrate',
      '--source',
      sourceUrl,
      '--source-queue',
      source,
      '--target',
      proxy.urlFor(targetUrl),
      '--target-queue',
      target,
      '--redis',
      redisUrl,
      '--retry-for',
      '2s',
      '--prefetch',
      '50',
    ]);
    expect(await waitFor(async () => (await depthOf(targetUrl, target)) > 0)).toBe(true);
    await proxy.stop();
    const result = await run;
    expect(result.code).toBe(1);
    expect(result.stderr).toMatch(
      /target broker at .* unreachable for \ds \(--retry-for\); nothing unforwarded was acked/,
    );
    // Every message is on the target or still in the source; the in-flight ones may be on both.
    const arrived = new Set(idsOf(await takeAll(targetUrl, target)));
    const left = new Set(idsOf(await takeAll(sourceUrl, source)));
    const lost = ids.filter((id) => !arrived.has(id) && !left.has(id));
    expect(lost).toHaveLength(0);
    expect(left.size).toBeGreaterThan(0);
  });

  it('a source queue deleted under a running bridge ends it with one line and exit 2', async () => {
    const { sourceUrl, source, target } = await queuePair();
    const bridge = startCli(runArgs(source, ['--target-queue', target]));
    expect(await waitFor(() => bridge.output().includes('"msg":"forwarding"'))).toBe(true);
    const broker = await openBroker(sourceUrl);
    await broker.channel.deleteQueue(source);
    await broker.close();
    const result = await bridge.done;
    expect(result.code).toBe(2);
    expect(result.stderr.trim().split('\n')).toHaveLength(1);
    expect(result.stderr).toMatch(
      new RegExp(`--source-queue: queue "${source}" does not exist on the source broker`),
    );
  });
});
