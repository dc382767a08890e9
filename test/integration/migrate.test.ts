import { readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Redis } from 'ioredis';
import { describe, expect, it } from 'vitest';
import { routeToken } from '../../src/bridge/route-mark.js';
import {
  clearOfSliceEnd,
  countDelivery,
  declareQueue,
  depthOf,
  idText,
  type OutgoingMessage,
  publishAll,
  routeNameOf,
  runCli,
  servers,
  takeAll,
  uniqueName,
} from '../helpers.js';

const UNIQUE = 5000;

/** 5,000 messages, one in ten sent a second time with the same ID; every seventh ID as bytes. */
function workload(): { messages: OutgoingMessage[]; ids: Map<string, OutgoingMessage> } {
  const messages: OutgoingMessage[] = [];
  const ids = new Map<string, OutgoingMessage>();
  const resends: OutgoingMessage[] = [];
  for (let i = 0; i < UNIQUE; i++) {
    const text = `order-${i}-${'x'.repeat(i % 50)}`;
    const id: string | Buffer =
      i % 7 === 0 ? Buffer.from([0xff, 0x00, i & 0xff, (i >> 8) & 0xff, 0xfe]) : `id-${i}`;
    const message: OutgoingMessage = {
      body: text,
      options: {
        contentType: 'text/plain',
        correlationId: `corr-${i}`,
        priority: i % 5,
        timestamp: 1_700_000_000 + i,
        appId: 'test-producer',
        type: 'order',
        headers: { _HQ_DUPL_ID: id, seq: i, region: i % 2 === 0 ? 'eu' : 'us', nested: { a: 1, b: 'two' } },
      },
    };
    messages.push(message);
    ids.set(idText(id), message);
    if (i % 10 === 0) resends.push(message);
  }
  // Resends land among the originals, some while the first copy is still in flight.
  resends.forEach((message, n) => {
    messages.splice(Math.min(messages.length, (n + 1) * 11), 0, message);
  });
  return { messages, ids };
}

describe('migrate: once and only once', () => {
  it('forwards 5,000 messages with 500 duplicates exactly once, intact, and a re-run forwards none', async () => {
    const { sourceUrl, targetUrl, redisUrl } = servers();
    const sourceQueue = uniqueName('orders');
    const targetQueue = uniqueName('orders-new');
    await declareQueue(sourceUrl, sourceQueue);
    await declareQueue(targetUrl, targetQueue);
    const { messages, ids } = workload();
    expect(messages.length).toBe(UNIQUE + UNIQUE / 10);
    await publishAll(sourceUrl, sourceQueue, messages);

    const reportPath = join(tmpdir(), `${sourceQueue}.json`);
    const args = [
      'migrate',
      '--source',
      sourceUrl,
      '--source-queue',
      sourceQueue,
      '--target',
      targetUrl,
      '--target-queue',
      targetQueue,
      '--redis',
      redisUrl,
      '--idle-timeout',
      '500ms',
      '--report',
      reportPath,
    ];
    // The run's IDs are asserted below to fill one slice: the run must not straddle two.
    await clearOfSliceEnd(redisUrl);
    const first = await runCli(args);
    expect(first.stderr).toContain('drained');
    expect(first.code).toBe(0);

    const report = JSON.parse(readFileSync(reportPath, 'utf8'));
    expect(report).toMatchObject({
      outcome: 'drained',
      forwarded: UNIQUE,
      duplicates: UNIQUE / 10,
      inDoubt: 0,
      unroutable: 0,
      deadLettered: 0,
      consumed: messages.length,
      remaining: 0,
    });
    expect(report.forwarded + report.duplicates).toBe(report.consumed);
    expect(report.seconds).toBeGreaterThan(0);
    expect(report.ratePerSecond).toBeGreaterThan(0);
    expect(await depthOf(sourceUrl, sourceQueue)).toBe(0);

    const arrived = await takeAll(targetUrl, targetQueue);
    const count = countDelivery(
      'migrate 5,000 + 500 resent',
      ids.keys(),
      arrived.map((message) => idText(message.properties.headers?._HQ_DUPL_ID)),
    );
    expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0, received: UNIQUE });

    const mark = routeToken(await routeNameOf(sourceUrl, sourceQueue));
    for (const message of arrived) {
      const sent = ids.get(idText(message.properties.headers?._HQ_DUPL_ID)) as OutgoingMessage;
      const options = sent.options ?? {};
      expect(message.content.toString()).toBe(sent.body);
      expect(message.properties).toMatchObject({
        contentType: options.contentType,
        correlationId: options.correlationId,
        priority: options.priority,
        timestamp: options.timestamp,
        appId: options.appId,
        type: options.type,
        deliveryMode: 2,
      });
      // The headers as sent, and the route's mark (the bridge's one documented addition here).
      const { 'x-dedup-route': route, ...headers } = message.properties.headers ?? {};
      expect(headers).toEqual(options.headers);
      expect(route).toBe(mark);
    }

    // The scope was new: its first slice was sized for the backlog (5,500 messages, 86 buckets of
    // 80), so the 5,000 IDs are one generation and each lookup read one bucket.
    const redis = new Redis(redisUrl);
    const slices = Object.values(await redis.hgetall(`dedup:{queue:${targetQueue}}:m`));
    redis.disconnect();
    expect(slices).toEqual([expect.stringMatching(/^5000:5000:\d+:86$/)]);

    // The same messages again: the cache knows every ID, so nothing is forwarded.
    await publishAll(sourceUrl, sourceQueue, messages);
    const second = await runCli(args);
    expect(second.code).toBe(0);
    const again = JSON.parse(readFileSync(reportPath, 'utf8'));
    expect(again).toMatchObject({ forwarded: 0, duplicates: messages.length, remaining: 0 });
    expect(await depthOf(sourceUrl, sourceQueue)).toBe(0);
    expect(await depthOf(targetUrl, targetQueue)).toBe(0);
  });
});
