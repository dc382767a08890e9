import { describe, expect, it } from 'vitest';
import { FaultProxy } from '../harness/proxy.js';
import {
  countDelivery,
  declareQueue,
  depthOf,
  idsOf,
  migrateArgs,
  migrateWithReport,
  numbered,
  publishAll,
  takeAll,
  uniqueName,
  waitFor,
  withOption,
} from '../helpers.js';
import { adminServers, asUser } from './privilege-admin.js';

// A permission revoked on the target mid-transfer is about the route, not about any message: the
// publishes in flight must not be taken for poison and refused (parked, or dropped by a dead-letter
// policy); the route stops and every message stays on the target or in the source.
describe('write permission revoked on the target mid-transfer', () => {
  it('stops the route with exit 2; nothing is parked, every message is on the target or in the source', async () => {
    const admin = await adminServers();
    const user = uniqueName('revoked');
    const password = `p-${uniqueName('pw')}`;
    const all = { configure: '.*', write: '.*', read: '.*' };
    let proxy: FaultProxy | undefined;
    try {
      await admin.addUsers('target', [{ name: user, password, permissions: all }]);
      const source = uniqueName('revoke-src');
      const target = uniqueName('revoke-dst');
      const park = uniqueName('revoke-park');
      await declareQueue(admin.sourceUrl, source);
      await declareQueue(admin.sourceUrl, park);
      await declareQueue(admin.targetUrl, target);
      const total = 3000;
      const { ids, messages } = numbered(source, total);
      await publishAll(admin.sourceUrl, source, messages);
      // Through a proxy: RabbitMQ checks a channel's write permission once, so the revocation
      // shows on the channels the bridge opens after its connection is cut.
      proxy = FaultProxy.forUrl(admin.targetUrl);
      await proxy.start();
      // Slow confirms, so that a window of publishes is in flight when the new channel is refused.
      proxy.setDelay(30);
      let args = migrateArgs(
        source,
        ['--target-queue', target],
        '--park-queue',
        park,
        '--max-rate',
        '300',
        '--prefetch',
        '50',
      );
      args = withOption(args, '--source', admin.sourceUrl);
      args = withOption(args, '--target', proxy.urlFor(asUser(admin.targetUrl, user, password)));
      args = withOption(args, '--redis', admin.redisUrl);
      const running = migrateWithReport(args);
      expect(await waitFor(async () => (await depthOf(admin.targetUrl, target)) >= 300, 30_000)).toBe(true);
      await admin.addUsers('target', [{ name: user, password, permissions: { ...all, write: '^$' } }]);
      const atRevoke = await depthOf(admin.targetUrl, target);
      proxy.resetAll();
      const run = await running;
      process.stdout.write(`revoked with ${atRevoke} of ${total} on the target\n`);
      expect(atRevoke).toBeLessThan(total * 0.95);
      expect(run.code, run.stderr).toBe(2);
      expect(run.stderr).toMatch(/access to .* refused|ACCESS_REFUSED|refused/);
      expect(await depthOf(admin.sourceUrl, park)).toBe(0);
      const onTarget = idsOf(await takeAll(admin.targetUrl, target));
      const inSource = idsOf(await takeAll(admin.sourceUrl, source));
      const onTargetSet = new Set(onTarget);
      const count = countDelivery('permission revoked, target + source', ids, [
        ...new Set(onTarget),
        ...inSource.filter((id) => !onTargetSet.has(id)),
      ]);
      expect(count).toMatchObject({ lost: 0, unexpected: 0 });
    } finally {
      await proxy?.stop();
      await admin.deleteUsers('target', [user]).catch(() => {});
      await admin.stop();
    }
  });
});
