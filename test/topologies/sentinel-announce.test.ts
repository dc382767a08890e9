import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import { createIdempotentConsumer } from '../../src/client/consumer.js';
import { closeRedis, connectRedis } from '../../src/dedup/redis.js';
import { createLogger } from '../../src/observe/log.js';
import { FaultProxy } from '../harness/proxy.js';
import { RedisSentinelSet, SENTINEL_MASTER } from '../harness/redis-topologies.js';
import {
  countDelivery,
  declareQueue,
  delivered,
  depthOf,
  migrateArgs,
  numbered,
  openBroker,
  publishAll,
  queuePair,
  servers,
  startCli,
  uniqueName,
  waitFor,
} from '../helpers.js';
import { extraCopies, onRedis } from './topo-helpers.js';

const TOTAL = 3000;
const GAVE_UP = 'the Redis client gave up; connecting it again';
const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

describe('Redis Sentinel: the failover is announced while a client asks a sentinel for the master', () => {
  let set: RedisSentinelSet;
  let proxies: FaultProxy[] = [];
  beforeEach(async () => {
    set = await RedisSentinelSet.start();
    // Clients reach each sentinel through a proxy, so that their questions can be left unanswered.
    proxies = [];
    for (const sentinel of set.sentinels) {
      const proxy = new FaultProxy('127.0.0.1', sentinel.port);
      await proxy.start();
      proxies.push(proxy);
    }
  });
  afterEach(async () => {
    await Promise.all(proxies.map((proxy) => proxy.stop()));
    await set?.stop();
  });

  const proxiedUrl = () =>
    `redis-sentinel://${proxies.map((proxy) => `127.0.0.1:${proxy.port}`).join(',')}/${SENTINEL_MASTER}`;

  /**
   * Kills the master with every new question to the sentinels left unanswered, waits until every
   * sentinel has switched to the promoted replica (and so announced it, +switch-master, to its
   * subscribers), then lets the questions through. Returns how many waited.
   */
  async function failOverMidQuestion(): Promise<number> {
    for (const proxy of proxies) proxy.holdNewConnections(true);
    await set.master.stop(true);
    const promoted = String(set.replica.port);
    for (const sentinel of set.sentinels) {
      const switched = async () =>
        (await sentinel.cli('sentinel', 'get-master-addr-by-name', SENTINEL_MASTER)).includes(promoted);
      expect(await waitFor(switched, 30_000)).toBe(true);
    }
    await sleep(1000);
    const waiting = proxies.reduce((sum, proxy) => sum + proxy.heldConnections, 0);
    for (const proxy of proxies) proxy.holdNewConnections(false);
    return waiting;
  }

  it('the bridge connects to the promoted replica and loses nothing (ioredis gave such a client up for good)', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const { ids, messages } = numbered(source, TOTAL);
    await publishAll(sourceUrl, source, messages);
    const bridge = startCli(
      onRedis(migrateArgs(source, ['--target-queue', target], '--max-rate', '400'), proxiedUrl()),
    );
    expect(await waitFor(async () => (await depthOf(targetUrl, target)) >= TOTAL / 3, 30_000)).toBe(true);

    // The sentinels keep announcing on the connections the bridge listens on, but leave each new
    // question unanswered: the bridge's reconnects after the master's death wait at a sentinel.
    const depthAtKill = await depthOf(targetUrl, target);
    const waiting = await failOverMidQuestion();
    // The fault landed mid-transfer, with the bridge's reconnects waiting for an answer.
    expect(waiting).toBeGreaterThan(0);
    expect(depthAtKill).toBeLessThan(TOTAL);
    const depthAtAnswer = await depthOf(targetUrl, target);

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

  it('the idempotent consumer connects its commit connections again, and the effect of each message lands once', async () => {
    const { targetUrl } = servers();
    const queue = uniqueName('sentinel-app');
    await declareQueue(targetUrl, queue);
    // The application's client, kept up as the CLI keeps its own (docs/library.md says how).
    const redis = await connectRedis(proxiedUrl(), 10_000, createLogger('silent'));
    const broker = await openBroker(targetUrl);
    const effects = `effects:${uniqueName('app')}`;
    let calls = 0;
    const failures: string[] = [];
    const consumer = await createIdempotentConsumer({
      channel: broker.channel,
      queue,
      redis,
      scope: uniqueName('app'),
      retryDelayMs: 100,
      handler: (message, context) => {
        calls++;
        // The effect, in the commit's transaction: it lands once, whatever attempt commits. A
        // handler whose commit failed (its connection given up or closed) runs again.
        context.transaction().hincrby(effects, String(message.properties.headers?._HQ_DUPL_ID), 1);
      },
      onError: (error) => failures.push(String((error as Error).message)),
    });
    try {
      const before = numbered('app-before', 300);
      await publishAll(targetUrl, queue, before.messages);
      expect(await waitFor(() => consumer.counts.processed === 300, 30_000)).toBe(true);
      // The consumer's commit connections and the application's client all reconnect at once.
      const waiting = await failOverMidQuestion();
      expect(waiting).toBeGreaterThan(1);
      const after = numbered('app-after', 300);
      await publishAll(targetUrl, queue, after.messages);
      // Messages that failed in the moment are retried after their backoff (up to 30 s).
      expect(await waitFor(() => consumer.counts.processed === 600, 90_000)).toBe(true);
      const landed = (await redis.hgetall(effects)) as Record<string, string>;
      const count = countDelivery(
        'idempotent consumer, sentinel announced mid-question',
        [...before.ids, ...after.ids],
        Object.entries(landed).flatMap(([id, times]) => Array.from({ length: Number(times) }, () => id)),
      );
      expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
      expect(await depthOf(targetUrl, queue)).toBe(0);
      process.stdout.write(
        `idempotent consumer, sentinel announced mid-question: ${waiting} connections waiting at a sentinel · 600 effects landed once, in ${calls} handler calls · ${failures.length} attempts failed and were retried (${[...new Set(failures)].join('; ')})\n`,
      );
    } finally {
      await consumer.stop();
      await broker.close();
      closeRedis(redis);
    }
  }, 150_000);
});
