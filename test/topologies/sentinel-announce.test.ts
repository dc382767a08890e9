import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { FaultProxy } from '../harness/proxy.js';
import { RedisSentinelSet, SENTINEL_MASTER } from '../harness/redis-topologies.js';
import {
  delivered,
  depthOf,
  migrateArgs,
  numbered,
  publishAll,
  queuePair,
  startCli,
  waitFor,
} from '../helpers.js';
import { extraCopies, onRedis } from './topo-helpers.js';

const TOTAL = 3000;
const GAVE_UP = 'the Redis client gave up; connecting it again';
const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

describe('Redis Sentinel: the failover is announced while the bridge asks a sentinel for the master', () => {
  let set: RedisSentinelSet;
  const proxies: FaultProxy[] = [];
  beforeAll(async () => {
    set = await RedisSentinelSet.start();
    // The bridge reaches each sentinel through a proxy, so that its questions can be left unanswered.
    for (const sentinel of set.sentinels) {
      const proxy = new FaultProxy('127.0.0.1', sentinel.port);
      await proxy.start();
      proxies.push(proxy);
    }
  });
  afterAll(async () => {
    await Promise.all(proxies.map((proxy) => proxy.stop()));
    await set?.stop();
  });

  it('the bridge connects to the promoted replica and loses nothing (ioredis gave such a client up for good)', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const { ids, messages } = numbered(source, TOTAL);
    await publishAll(sourceUrl, source, messages);
    const url = `redis-sentinel://${proxies.map((proxy) => `127.0.0.1:${proxy.port}`).join(',')}/${SENTINEL_MASTER}`;
    const bridge = startCli(
      onRedis(migrateArgs(source, ['--target-queue', target], '--max-rate', '400'), url),
    );
    expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= TOTAL / 3, 30_000)).toBe(true);

    // The sentinels keep announcing on the connections the bridge listens on, but leave each new
    // question unanswered: the bridge's reconnects after the master's death wait at a sentinel.
    for (const proxy of proxies) proxy.holdNewConnections(true);
    const depthAtKill = await depthOf(targetUrl, target);
    await set.master.stop(true);
    const promoted = set.replica.port;
    expect(await waitFor(async () => (await set.masterPort()) === promoted, 30_000)).toBe(true);
    // Every sentinel has switched, and so announced it (+switch-master) to its subscribers.
    for (const sentinel of set.sentinels) {
      expect(
        await waitFor(
          async () =>
            (await sentinel.cli('sentinel', 'get-master-addr-by-name', SENTINEL_MASTER)).includes(
              String(promoted),
            ),
          20_000,
        ),
      ).toBe(true);
    }
    await sleep(1000);
    // The fault landed mid-transfer, with the bridge's reconnects waiting for an answer.
    const waiting = proxies.reduce((sum, proxy) => sum + proxy.heldConnections, 0);
    expect(waiting).toBeGreaterThan(0);
    expect(depthAtKill).toBeLessThan(TOTAL);
    const depthAtAnswer = await depthOf(targetUrl, target);
    for (const proxy of proxies) proxy.holdNewConnections(false);

    const ended = await bridge.done;
    expect(ended.code, ended.stderr).toBe(0);
    // ioredis ended the clients whose question was answered after the announcement: the bridge saw it.
    const gaveUp = ended.stdout.split('\n').filter((line) => line.includes(GAVE_UP)).length;
    expect(gaveUp).toBeGreaterThan(0);
    expect(await depthOf(sourceUrl, source)).toBe(0);
    const { messages: received, count } = await delivered(
      'sentinel announced mid-question',
      targetUrl,
      target,
      ids,
    );
    expect(count).toMatchObject({ lost: 0, unexpected: 0 });
    const extra = extraCopies(received);
    expect(extra.unflagged, 'every extra copy is flagged in-doubt').toBe(0);
    process.stdout.write(
      `sentinel announced mid-question: master killed after ${depthAtKill} of ${TOTAL} forwarded · ${waiting} reconnect(s) waiting at a sentinel; ${depthAtAnswer} on the target when answered · clients given up by ioredis and connected again: ${gaveUp} · lost ${count.lost} · duplicated ${count.duplicated} (${extra.flagged} flagged)\n`,
    );
  });
});
