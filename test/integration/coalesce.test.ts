import type { Socket } from 'node:net';
import { describe, expect, it } from 'vitest';
import { connectAmqp } from '../../src/amqp/connect.js';
import { createLogger } from '../../src/observe/log.js';
import { depthOf, servers, takeAll, uniqueName } from '../helpers.js';

// The bridge's connections send a burst of publishes in one socket write (src/amqp/internals.ts,
// which relies on amqplib internals): this fails if an amqplib upgrade moved them.
describe('write coalescing', () => {
  it('sends a burst of publishes in a few socket writes, every message intact and in order', async () => {
    const { targetUrl } = servers();
    const queue = uniqueName('coalesce');
    const connection = await connectAmqp(targetUrl, {
      side: 'target',
      retryForMs: 5000,
      log: createLogger('silent'),
    });
    try {
      const socket = (connection as unknown as { connection: { stream: Socket } }).connection.stream;
      const channel = await connection.createConfirmChannel();
      await channel.assertQueue(queue, { durable: false });
      let writes = 0;
      for (const name of ['_write', '_writev'] as const) {
        const method = socket[name] as (...args: unknown[]) => void;
        const original = method.bind(socket);
        (socket as unknown as Record<string, unknown>)[name] = (...args: unknown[]) => {
          writes++;
          original(...args);
        };
      }
      const count = 500;
      for (let i = 0; i < count; i++) {
        channel.sendToQueue(queue, Buffer.from(`body-${i}`), { headers: { _HQ_DUPL_ID: `id-${i}` } });
      }
      await channel.waitForConfirms();
      console.log(`coalesce: ${count} publishes went out in ${writes} socket writes`);
      // Without coalescing each publish is its own write (500); the confirms' round trip adds none.
      expect(writes).toBeLessThanOrEqual(10);
      expect(await depthOf(targetUrl, queue)).toBe(count);
      const received = await takeAll(targetUrl, queue);
      expect(received.map((message) => message.content.toString())).toEqual(
        Array.from({ length: count }, (_, i) => `body-${i}`),
      );
      expect(received.map((message) => message.properties.headers?._HQ_DUPL_ID)).toEqual(
        Array.from({ length: count }, (_, i) => `id-${i}`),
      );
    } finally {
      await connection.close();
    }
  });
});
