import { Redis } from 'ioredis';
import { describe, expect, it } from 'vitest';
import { FaultProxy } from '../harness/proxy.js';
import { freePort } from '../harness/servers.js';
import {
  countDelivery,
  delivered,
  depthOf,
  idsOf,
  numbered,
  openBroker,
  publishAll,
  queuePair,
  runArgs,
  servers,
  startCli,
  takeAll,
  uniqueName,
  waitFor,
  withOption,
} from '../helpers.js';

describe('dedup-bridge run', () => {
  it('forwards while producers publish, and SIGTERM mid-transfer finishes in-flight work: source + target hold each message once', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const total = 15_000;
    await publishAll(sourceUrl, source, numbered('id', total).messages);
    const bridge = startCli(runArgs(source, ['--target-queue', target], '--prefetch', '500'));
    // The target's depth read cheaply (a passive declare on one open channel), to stop mid-way.
    const probe = await openBroker(targetUrl);
    let atSignal = 0;
    try {
      await publishAll(sourceUrl, source, numbered('id', 500).messages); // resent while the bridge runs
      expect(
        await waitFor(
          async () => (await probe.channel.checkQueue(target)).messageCount >= total * 0.15,
          60_000,
        ),
      ).toBe(true);
      bridge.signal('SIGTERM');
      atSignal = (await probe.channel.checkQueue(target)).messageCount;
    } finally {
      await probe.close();
    }
    const result = await bridge.done;
    process.stdout.write(`run SIGTERM landed with ${atSignal} of ${total} on the target\n`);
    expect(atSignal).toBeLessThan(total * 0.95);
    expect(result.code).toBe(0);
    expect(result.stdout).toContain('"msg":"stopped"');
    // Every message is in exactly one place: forwarded and acked, or still in the source queue.
    const onTarget = idsOf(await takeAll(targetUrl, target));
    const leftInSource = idsOf(await takeAll(sourceUrl, source));
    const onTargetSet = new Set(onTarget);
    const onlyInSource = new Set(leftInSource.filter((id) => !onTargetSet.has(id)));
    const count = countDelivery('run stopped mid-transfer, target + source', numbered('id', total).ids, [
      ...onTarget,
      ...onlyInSource,
    ]);
    expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
    // An ID both forwarded and still in the source can only be a resent copy (IDs 0-499).
    const inBoth = leftInSource.filter((id) => onTargetSet.has(id));
    expect(inBoth.filter((id) => Number(id.slice('id-'.length)) >= 500)).toEqual([]);
    // Each delivery is in exactly one place: none was forwarded and left unacked as well.
    expect(onTarget.length + leftInSource.length).toBe(total + 500);
  });

  it('three replicas on one queue forward each message once', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const replicas = [0, 1, 2].map(() =>
      startCli(runArgs(source, ['--target-queue', target], '--prefetch', '50')),
    );
    // Every message is published three times, so the replicas race for the same IDs.
    const { ids, messages } = numbered('id', 2000);
    await Promise.all([
      publishAll(sourceUrl, source, messages),
      publishAll(sourceUrl, source, messages),
      publishAll(sourceUrl, source, [...messages].reverse()),
    ]);
    expect(await waitFor(async () => (await depthOf(sourceUrl, source)) === 0, 60_000)).toBe(true);
    for (const replica of replicas) replica.signal('SIGTERM');
    const results = await Promise.all(replicas.map((replica) => replica.done));
    expect(results.map((result) => result.code)).toEqual([0, 0, 0]);
    const { count } = await delivered('three replicas, every message sent 3x', targetUrl, target, ids);
    expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
  });

  it('keeps unroutable messages in the source until a binding exists, then forwards them once', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const exchange = uniqueName('ex');
    const broker = await openBroker(targetUrl);
    await broker.channel.assertExchange(exchange, 'direct', { durable: true });
    const bridge = startCli(
      runArgs(source, ['--target-exchange', exchange, '--target-routing-key', 'orders']),
    );
    await publishAll(sourceUrl, source, numbered('id', 20).messages);
    // Held unacked by the bridge and retried by it (no longer returned to the source: issue 34).
    expect(await waitFor(() => bridge.output().includes('the bridge holds it unacked and retries it'))).toBe(
      true,
    );
    expect(await depthOf(targetUrl, target)).toBe(0);
    await broker.channel.bindQueue(target, exchange, 'orders');
    await broker.close();
    expect(await waitFor(async () => (await depthOf(targetUrl, target)) === 20, 60_000)).toBe(true);
    bridge.signal('SIGTERM');
    expect((await bridge.done).code).toBe(0);
    expect(await depthOf(sourceUrl, source)).toBe(0);
    expect(await depthOf(targetUrl, target)).toBe(20);
  });

  it('a stop signal while the source is still unreachable ends the run at once, exit 0', async () => {
    const { source, target } = await queuePair();
    const closed = `amqp://guest:guest@127.0.0.1:${await freePort()}`;
    const bridge = startCli(withOption(runArgs(source, ['--target-queue', target]), '--source', closed));
    expect(await waitFor(() => bridge.output().includes('not reachable; retrying'))).toBe(true);
    // One signal is enough: before, the run kept retrying (forever, by default) until a second one.
    bridge.signal('SIGTERM');
    const result = await bridge.done;
    expect(result.code).toBe(0);
    expect(result.stderr).toBe('');
    expect(result.stdout).toContain('"msg":"stopping while starting"');
  });

  it('a second signal exits at once with 130, and nothing unconfirmed is acked', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    // The target answers nothing through a blackholed proxy: publishes wait for confirms forever.
    const proxy = FaultProxy.forUrl(targetUrl);
    await proxy.start();
    try {
      const bridge = startCli(
        withOption(
          runArgs(source, ['--target-queue', target], '--shutdown-timeout', '60s'),
          '--target',
          proxy.urlFor(targetUrl),
        ),
      );
      expect(await waitFor(() => bridge.output().includes('"msg":"forwarding"'))).toBe(true);
      proxy.setMode('blackhole');
      await publishAll(sourceUrl, source, numbered('id', 5).messages);
      expect(await waitFor(async () => (await depthOf(sourceUrl, source)) === 0)).toBe(true);
      bridge.signal('SIGINT');
      expect(await waitFor(() => bridge.output().includes('stopping: finishing in-flight messages'))).toBe(
        true,
      );
      const started = Date.now();
      bridge.signal('SIGINT');
      const result = await bridge.done;
      expect(result.code).toBe(130);
      expect(Date.now() - started).toBeLessThan(5000);
      expect(result.stderr).toContain('second SIGINT: exiting now');
      // Nothing was acked: all five are back in the source.
      expect(await waitFor(async () => (await depthOf(sourceUrl, source)) === 5)).toBe(true);
    } finally {
      await proxy.stop();
    }
  });

  it('Redis refusing the password on a reconnect: one error line, messages wait, and they flow once it is fixed', async () => {
    const { sourceUrl, targetUrl, redisUrl, source, target } = { ...(await queuePair()), ...servers() };
    const admin = new Redis(redisUrl);
    const user = uniqueName('redis-user');
    const password = 'first-Secret-1';
    await admin.call('ACL', 'SETUSER', user, 'on', `>${password}`, '~*', '&*', '+@all');
    const url = new URL(redisUrl);
    url.username = user;
    url.password = password;
    const bridge = startCli(
      withOption(runArgs(source, ['--target-queue', target]), '--redis', url.toString()),
    );
    try {
      await publishAll(sourceUrl, source, numbered('id', 100).messages);
      expect(await waitFor(async () => (await depthOf(targetUrl, target)) === 100)).toBe(true);
      // The password is rotated in Redis but not in the bridge's URL, and its connection dropped.
      await admin.call('ACL', 'SETUSER', user, 'resetpass', '>rotated-Secret-2');
      await admin.call('CLIENT', 'KILL', 'USER', user);
      await publishAll(sourceUrl, source, numbered('id', 100, 100).messages);
      // The refusal is said, and the bridge has taken the new messages and holds them: a claim
      // failed, nothing was forwarded without Redis, and they wait unacked in the source.
      const said = () =>
        /WRONGPASS on reconnecting/.test(bridge.output()) && /Redis call failed/.test(bridge.output());
      expect(await waitFor(said, 30_000), bridge.output()).toBe(true);
      expect(await waitFor(async () => (await depthOf(sourceUrl, source)) === 0)).toBe(true);
      expect(await depthOf(targetUrl, target)).toBe(100);
      await admin.call('ACL', 'SETUSER', user, 'resetpass', `>${password}`);
      expect(await waitFor(async () => (await depthOf(targetUrl, target)) === 200, 30_000)).toBe(true);
      bridge.signal('SIGTERM');
      const result = await bridge.done;
      expect(result.code).toBe(0);
      // One error line that says what to fix, and one line for the calls held meanwhile.
      const lines = result.stdout.split('\n');
      const refused = lines.filter((line) => line.includes('"level":"error"'));
      expect(refused, refused.join('\n')).toHaveLength(1);
      expect(refused[0]).toMatch(
        /WRONGPASS on reconnecting — .*check the user, password and database in the URL/,
      );
      const held = lines.filter((line) => line.includes('Redis call failed'));
      expect(held, held.join('\n')).toHaveLength(1);
      expect(lines.filter((line) => line.includes('Redis answers again'))).toHaveLength(1);
      expect(result.stdout + result.stderr).not.toContain(password);
      const { count } = await delivered(
        'Redis password rotated mid-run, then restored',
        targetUrl,
        target,
        numbered('id', 200).ids,
      );
      expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
      expect(await depthOf(sourceUrl, source)).toBe(0);
    } finally {
      bridge.signal('SIGKILL');
      await admin.call('ACL', 'DELUSER', user);
      admin.disconnect();
    }
  });
});
