import { setTimeout as sleep } from 'node:timers/promises';
import type { Channel, ConsumeMessage } from 'amqplib';
import { describe, expect, it } from 'vitest';
import { connectAmqp } from '../../src/amqp/connect.js';
import { SourceQueue } from '../../src/amqp/source.js';
import { createLogger } from '../../src/observe/log.js';
import { declareQueue, depthOf, publishAll, servers, uniqueName, waitFor } from '../helpers.js';

/** A source queue holding `count` messages, consumed; its acks as the broker is sent them. */
async function consumed(count: number, prefetch = 100) {
  const { sourceUrl } = servers();
  const queue = uniqueName('acks');
  await declareQueue(sourceUrl, queue);
  await publishAll(
    sourceUrl,
    queue,
    Array.from({ length: count }, (_, i) => ({ body: `m${i + 1}` })),
  );
  const log = createLogger('silent');
  const connection = await connectAmqp(sourceUrl, { side: 'source', retryForMs: 5000, log });
  const source = new SourceQueue(queue, prefetch, undefined, 'source', log);
  await source.attach(connection);
  const messages: ConsumeMessage[] = [];
  await source.consume((message) => messages.push(message));
  expect(await waitFor(() => messages.length === count)).toBe(true);
  // What goes out on the wire: [delivery tag, whether it acks every older tag too].
  const sent: [number, boolean][] = [];
  const channel = (source as unknown as { channel: Channel }).channel;
  const ack = channel.ack.bind(channel);
  channel.ack = (message, allUpTo) => {
    sent.push([message.fields.deliveryTag, allUpTo === true]);
    ack(message, allUpTo);
  };
  const byBody = (body: string) => messages.find((m) => m.content.toString() === body) as ConsumeMessage;
  return { queue, source, connection, sent, byBody, depth: () => depthOf(sourceUrl, queue) };
}

const turn = () => new Promise((resolve) => setImmediate(resolve));

/** Acks m2 and m3 while m1 is still in flight: nothing goes out yet. */
async function ackBehindFirst({ source, sent, byBody }: Awaited<ReturnType<typeof consumed>>) {
  source.ack(byBody('m2'));
  source.ack(byBody('m3'));
  await turn();
  expect(sent).toEqual([]);
}

describe('source acks', () => {
  it('an ack out of order waits for the older messages and goes with their multiple ack, or alone after a moment', async () => {
    const acks = await consumed(5);
    const { source, connection, sent, byBody, depth } = acks;
    try {
      await ackBehindFirst(acks);
      source.ack(byBody('m1'));
      await turn();
      expect(sent).toEqual([[3, true]]);
      // m4 never settles: m5's ack waits for it, then goes alone.
      source.ack(byBody('m5'));
      await turn();
      expect(sent).toEqual([[3, true]]);
      expect(await waitFor(() => sent.length === 2, 5000)).toBe(true);
      expect(sent).toEqual([
        [3, true],
        [5, false],
      ]);
      source.ack(byBody('m4'));
      await turn();
      expect(sent.at(-1)).toEqual([4, true]);
      await source.closeConsumer();
      // An ack lost would put its message back in the queue, shortly after the channel closed.
      await sleep(500);
      expect(await depth()).toBe(0);
    } finally {
      await connection.close();
    }
  });

  it('held acks go at once when they hold a quarter of the prefetch window', async () => {
    const { source, connection, sent, byBody } = await consumed(8, 8);
    try {
      // m1 waits (a backoff, say): its followers must not keep their prefetch slots for long.
      source.ack(byBody('m2'));
      await turn();
      expect(sent).toEqual([]);
      source.ack(byBody('m3'));
      await turn();
      expect(sent).toEqual([
        [2, false],
        [3, false],
      ]);
    } finally {
      await connection.close();
    }
  });

  it('returning the oldest message lets the acks held behind it go as one multiple ack', async () => {
    const acks = await consumed(3);
    const { source, connection, sent, byBody, depth } = acks;
    try {
      await ackBehindFirst(acks);
      source.requeue(byBody('m1'));
      await turn();
      expect(sent).toEqual([[3, true]]);
      // m1 is back in the queue (once our consumer, to which the broker may give it again, is gone).
      await source.closeConsumer();
      expect(await waitFor(async () => (await depth()) === 1)).toBe(true);
    } finally {
      await connection.close();
    }
  });

  it('closing the consumer sends the acks still waiting; only the unacked message goes back', async () => {
    const acks = await consumed(3);
    const { source, connection, sent, depth } = acks;
    try {
      await ackBehindFirst(acks);
      await source.closeConsumer();
      expect(sent).toEqual([
        [2, false],
        [3, false],
      ]);
      expect(await waitFor(async () => (await depth()) === 1)).toBe(true);
    } finally {
      await connection.close();
    }
  });
});
