// A plain deduplicating forwarder, as a floor for the bridge's own CPU: bench/loop.ts plus the
// protocol's Redis work, through the bridge's own cache module and scripts (a claim call per
// batch, at most two out; a commit call for the confirms that came while the last one was out),
// `mandatory` on each publish, and a copy whose ID is in flight waiting for that one's outcome. It
// leaves out what the bridge does beyond that: the lossless content header (amqplib re-encodes it
// here), the route mark, acks of a run at once, retries and backoff, lease renewal, reconnects,
// stops, limits, metrics and logs. A refused publish is only requeued. So it is no usable bridge:
// it is what the dedup work itself costs, written the plain way.
// Usage: tsx bench/dedup-loop.ts <source url> <source queue> <target url> <target queue> <prefetch> <count> <redis url>
import type { ConsumeMessage } from 'amqplib';
import amqp from 'amqplib';
import { Redis } from 'ioredis';
import { coalesceWrites } from '../src/amqp/internals.js';
import { DedupCache, newOwnerToken } from '../src/dedup/cache.js';
import { keyOfValue } from '../src/dedup/id.js';

const [sourceUrl, sourceQueue, targetUrl, targetQueue, prefetchText, countText, redisUrl] =
  process.argv.slice(2);
if (!sourceUrl || !sourceQueue || !targetUrl || !targetQueue || !redisUrl) {
  process.stderr.write(
    'usage: dedup-loop.ts <source url> <source queue> <target url> <target queue> <prefetch> <count> <redis url>\n',
  );
  process.exit(2);
}
const expected = Number(countText);
// The bridge's defaults: --batch-size, its claims out and its largest commit.
const BATCH = 200;
const CLAIMS_OUT = 2;
const COMMIT_MAX = 1000;

const redis = new Redis(redisUrl);
const cache = await DedupCache.open(redis, {
  token: newOwnerToken(),
  leaseMs: 15_000,
  windowMs: 7 * 86_400_000,
  prefix: 'dedup',
  scope: `floor:${targetQueue}`,
});
// Sized for the backlog, as the bridge sizes a new scope's first slice (one generation to look in).
cache.expectedIds = expected;
const source = await amqp.connect(sourceUrl, { noDelay: true });
const target = await amqp.connect(targetUrl, { noDelay: true });
coalesceWrites(source);
coalesceWrites(target);
const consumer = await source.createChannel();
const publisher = await target.createConfirmChannel();
await consumer.prefetch(Number(prefetchText));

interface Item {
  message: ConsumeMessage;
  key: string;
}
const inFlight = new Map<string, ConsumeMessage[]>();
let batch: Item[] = [];
let flushScheduled = false;
let claimsOut = 0;
let confirmed: Item[] = [];
let committing = false;
let commitScheduled = false;
/** Keys of publishes the target returned unroutable: their confirm must not commit them. */
const returned = new Set<string>();
let done = 0;
let paused: Promise<void> | undefined;
publisher.on('return', (message) => {
  returned.add(keyOf(message));
});
publisher.on('drain', () => {
  paused = undefined;
});

await consumer.consume(sourceQueue, (message) => {
  if (message) take(message);
});

function keyOf(message: { properties: ConsumeMessage['properties'] }): string {
  return cache.keyOf(keyOfValue(message.properties.headers?._HQ_DUPL_ID) as string);
}

/** A failed Redis call ends the run: the bench then counts a mover that did not finish. */
function fail(error: unknown): never {
  process.stderr.write(`dedup-loop: ${error instanceof Error ? error.message : String(error)}\n`);
  process.exit(1);
}

function take(message: ConsumeMessage): void {
  const key = keyOf(message);
  const waiting = inFlight.get(key);
  if (waiting) {
    waiting.push(message);
    return;
  }
  inFlight.set(key, []);
  batch.push({ message, key });
  if (batch.length >= BATCH) flush();
  else if (!flushScheduled) {
    flushScheduled = true;
    setImmediate(flush);
  }
}

function flush(): void {
  flushScheduled = false;
  while (batch.length > 0 && claimsOut < CLAIMS_OUT) {
    const items = batch.slice(0, BATCH);
    batch = batch.slice(BATCH);
    claimAndPublish(items).catch(fail);
  }
}

async function claimAndPublish(items: Item[]): Promise<void> {
  claimsOut++;
  let states: Awaited<ReturnType<DedupCache['claim']>>;
  try {
    states = await cache.claim(items.map((item) => item.key));
  } finally {
    claimsOut--;
  }
  if (batch.length > 0) flush();
  for (const [index, item] of items.entries()) {
    const state = states[index];
    if (state === 'dup') settle(item, true);
    else if (state === 'busy') setTimeout(() => settle(item, false), 250);
    else {
      while (paused) await paused;
      publish(item);
    }
  }
}

function publish(item: Item): void {
  const { message } = item;
  const ok = publisher.publish(
    '',
    targetQueue as string,
    message.content,
    { ...message.properties, mandatory: true },
    (error) => {
      const wasReturned = returned.delete(item.key);
      if (error || wasReturned) {
        cache
          .release([item.key])
          .then(() => settle(item, false))
          .catch(fail);
        return;
      }
      confirmed.push(item);
      // The confirms of one read go in one call.
      if (!committing && !commitScheduled) {
        commitScheduled = true;
        setImmediate(() => {
          commitScheduled = false;
          commit().catch(fail);
        });
      }
    },
  );
  if (!ok) paused ??= new Promise((resolve) => publisher.once('drain', resolve));
}

async function commit(): Promise<void> {
  committing = true;
  while (confirmed.length > 0) {
    const group = confirmed.slice(0, COMMIT_MAX);
    confirmed = confirmed.slice(COMMIT_MAX);
    await cache.commit(group.map((item) => item.key));
    for (const item of group) settle(item, true);
  }
  committing = false;
}

/** Acks (or requeues) a message, then lets a copy of its ID that waited go on. */
function settle(item: Item, ack: boolean): void {
  if (ack) consumer.ack(item.message);
  else consumer.nack(item.message, false, true);
  if (ack) done++;
  const waiting = inFlight.get(item.key) ?? [];
  const next = waiting.shift();
  if (next) {
    batch.push({ message: next, key: item.key });
    if (!flushScheduled) {
      flushScheduled = true;
      setImmediate(flush);
    }
  } else {
    inFlight.delete(item.key);
  }
  if (done === expected) void finish();
}

// Every ack is out before the exit, as in the bridge and bench/loop.ts.
async function finish(): Promise<void> {
  await consumer.close();
  await publisher.close();
  await Promise.all([source.close(), target.close(), redis.quit()]);
  process.exit(0);
}
