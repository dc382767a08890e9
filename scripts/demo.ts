// npm run demo: brings up local brokers the way the test harness does, publishes a set of orders
// that includes resent duplicates, bridges it twice, and prints what arrived.
import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { fileURLToPath } from 'node:url';
import amqp from 'amqplib';
import { startHarness } from '../test/harness/harness.js';

const CLI = fileURLToPath(new URL('../bin/dedup-bridge.js', import.meta.url));

function orders(): { id: string | Buffer; body: string }[] {
  const list: { id: string | Buffer; body: string }[] = [];
  for (let i = 1; i <= 8; i++) {
    // Two producers send their IDs as bytes, as HornetQ's byte[] IDs.
    const id = i % 4 === 0 ? Buffer.from(`order-${i}`) : `order-${i}`;
    list.push({ id, body: JSON.stringify({ order: i, amount: i * 10 }) });
  }
  // A producer retried four sends after a timeout: same IDs, same bodies.
  for (const i of [2, 3, 4, 7]) list.push({ ...(list[i - 1] as { id: string | Buffer; body: string }) });
  return list;
}

async function main(): Promise<void> {
  process.stdout.write('demo: starting brokers and Redis (or using SOURCE_URL, TARGET_URL, REDIS_URL)…\n');
  // Redis with an append-only file, as production needs it (and the bridge warns without one).
  const harness = await startHarness({ redisAppendonly: true });
  try {
    const suffix = randomBytes(3).toString('hex');
    const sourceQueue = `demo-orders-${suffix}`;
    const targetQueue = `demo-orders-${suffix}`;
    const source = await amqp.connect(harness.sourceUrl);
    const target = await amqp.connect(harness.targetUrl);
    const sourceChannel = await source.createConfirmChannel();
    const targetChannel = await target.createChannel();
    await sourceChannel.assertQueue(sourceQueue, { durable: true });
    await targetChannel.assertQueue(targetQueue, { durable: true });

    const publish = async () => {
      for (const order of orders()) {
        sourceChannel.sendToQueue(sourceQueue, Buffer.from(order.body), {
          persistent: true,
          contentType: 'application/json',
          headers: { _HQ_DUPL_ID: order.id },
        });
      }
      await sourceChannel.waitForConfirms();
    };
    const bridge = (label: string) => {
      process.stdout.write(`\ndemo: ${label}\n`);
      const result = spawnSync(
        process.execPath,
        [
          CLI,
          'migrate',
          '--source',
          harness.sourceUrl,
          '--source-queue',
          sourceQueue,
          '--target',
          harness.targetUrl,
          '--target-queue',
          targetQueue,
          '--redis',
          harness.redisUrl,
          '--idle-timeout',
          '500ms',
          '--log-level',
          'warn',
        ],
        { stdio: ['ignore', 'inherit', 'inherit'] },
      );
      if (result.status !== 0) throw new Error(`dedup-bridge migrate exited ${result.status}`);
    };

    await publish();
    process.stdout.write(
      `demo: published 12 orders to ${sourceQueue} (8 unique, 4 resent with the same _HQ_DUPL_ID)\n`,
    );
    bridge('dedup-bridge migrate, first run');

    process.stdout.write(`\ndemo: what arrived on the target queue ${targetQueue}:\n`);
    for (;;) {
      const message = await targetChannel.get(targetQueue, { noAck: true });
      if (message === false) break;
      const id = message.properties.headers?._HQ_DUPL_ID;
      const shown = Buffer.isBuffer(id) ? `bytes(${id.toString()})` : String(id);
      process.stdout.write(`  _HQ_DUPL_ID=${shown.padEnd(16)} ${message.content.toString()}\n`);
    }

    await publish();
    process.stdout.write('\ndemo: published the same 12 orders again (a producer replaying its outbox)\n');
    bridge('dedup-bridge migrate, second run: every ID is already on the target');
    const { messageCount } = await targetChannel.checkQueue(targetQueue);
    process.stdout.write(
      `\ndemo: the target queue holds ${messageCount} new messages after the second run\n`,
    );
    await source.close();
    await target.close();
  } finally {
    await harness.stop();
  }
}

main().catch((error: unknown) => {
  process.stderr.write(`demo: ${error instanceof Error ? error.message : String(error)}\n`);
  process.exit(1);
});
