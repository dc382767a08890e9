// The baseline a user would write instead of dedup-bridge: consume with manual acks, publish on a
// confirm channel, ack the source message once its publish is confirmed. No dedup, no batching.
// Usage: tsx bench/loop.ts <source url> <source queue> <target url> <target queue> <prefetch> <count>
import amqp from 'amqplib';
import { coalesceWrites } from '../src/amqp/internals.js';

const [sourceUrl, sourceQueue, targetUrl, targetQueue, prefetchText, countText] = process.argv.slice(2);
if (!sourceUrl || !sourceQueue || !targetUrl || !targetQueue) {
  process.stderr.write(
    'usage: loop.ts <source url> <source queue> <target url> <target queue> <prefetch> <count>\n',
  );
  process.exit(2);
}
const expected = Number(countText);
// Nagle off, as the bridge has it, so the comparison is of the work and not of a socket option.
const source = await amqp.connect(sourceUrl, { noDelay: true });
const target = await amqp.connect(targetUrl, { noDelay: true });
// The bridge's corked socket writes, so that the comparison is of work, not of system calls.
coalesceWrites(source);
coalesceWrites(target);
const consumer = await source.createChannel();
const publisher = await target.createConfirmChannel();
await consumer.prefetch(Number(prefetchText));
let done = 0;
let paused: Promise<void> | undefined;
publisher.on('drain', () => {
  paused = undefined;
});
await consumer.consume(sourceQueue, async (message) => {
  if (!message) return;
  while (paused) await paused;
  const ok = publisher.publish('', targetQueue, message.content, message.properties, (error) => {
    if (error) consumer.nack(message, false, true);
    else consumer.ack(message);
    done++;
    if (done === expected) void finish();
  });
  if (!ok) paused ??= new Promise((resolve) => publisher.once('drain', resolve));
});

// Every ack is out before the exit, as the bridge does: closing the consuming channel sends its
// acks first and waits for the broker's close-ok, so nothing is left unacked on the source.
async function finish(): Promise<void> {
  await consumer.close();
  await publisher.close();
  await Promise.all([source.close(), target.close()]);
  process.exit(0);
}
