// npm run bench:mark-cost [-- --rounds 5 --messages 30000 --only 'no mark;…']: what each form of the
// `x-dedup-route` mark costs the broker that receives it (issue 33). One throwaway RabbitMQ node;
// in rotating rounds, once per header variant, confirmed persistent publishes of 1 KiB, each with
// its own `_HQ_DUPL_ID`, into a durable classic queue that one consumer drains meanwhile (manual
// acks, prefetch 500). The figure is the broker's CPU (utime + stime of beam.smp, from /proc)
// between a round's start and its last ack, per 1,000 messages; the publisher's wall time per
// 1,000 is secondary (the host is shared: CPU time is what to trust). Medians, and the difference
// against no mark. Every variant is published as the bridge publishes: its content header as raw
// bytes, with `mandatory` (since 2026-12-05; the runs below published through amqplib, without).
//
// Run of this script (branch mark-cost on 4edabb9, RabbitMQ 3.10.8, 5 rounds × 30,000, no
// `mandatory`, 2 shared CPUs, load 3–4), broker CPU ms per 1,000, median · vs no mark (paired per
// round): no mark 111.3 · array of 1 name 128.0 +16.7 (+9.7) · array of 4 names 140.0 +28.7 (+31.0) ·
// string of 1 name 141.7 +30.3 (+37.3) · 1 token 138.3 +27.0 (+26.3) · 4 tokens 134.3 +23.0 (+22.0) ·
// JSON of 4 names 180.7 +69.3 (+68.3). Rounds spread ±10–20. An earlier 7-round run (before the
// `string, 1 name` variant; IDs 14 bytes longer with a mark) gave +26.7, +39.7, 1 token +40.3,
// 4 tokens +35.7, JSON +65.3. So on this broker any mark costs ~20–40: one short string is no
// cheaper than a one-element array, beyond the noise; a long JSON string costs about twice that.
import { randomBytes } from 'node:crypto';
import { rmSync } from 'node:fs';
import amqp, { type Channel, type ConsumeMessage } from 'amqplib';
import { publishRaw } from '../src/amqp/internals.js';
import { routeToken } from '../src/bridge/route-mark.js';
import { ROUTE_HEADER } from '../src/headers.js';
import { encodeValue, type FieldValue, rawField } from '../src/wire/fields.js';
import { cleanLeftovers, newRunDir, processCpuMs, RabbitNode } from '../test/harness/servers.js';

const args = process.argv.slice(2);
const option = (name: string, fallback: string) => {
  const index = args.indexOf(name);
  return index >= 0 ? (args[index + 1] ?? fallback) : fallback;
};
const ROUNDS = Number(option('--rounds', '5'));
const MESSAGES = Number(option('--messages', '30000'));
const WARM_UP = Math.min(MESSAGES, 5000);
// By default a round publishes all its messages, then consumes them: every message is stored, and
// the CPU of the publishes is measured apart. --concurrent consumes while it publishes (the broker
// then skips storing some messages, by how far the consumer keeps up: more noise).
const CONCURRENT = args.includes('--concurrent');
// Erlang's schedulers spin for a while when they run out of work, CPU time that measures timing
// rather than work (and the load of the host). Off unless --busy-wait.
const BUSY_WAIT = args.includes('--busy-wait');
const SIZE = 1024;
const PREFETCH = 500;
/** Publishes in flight, unconfirmed, at most. */
const WINDOW = 1000;

// Realistic route names, `<source cluster>/<vhost>/<source queue>` (29–31 bytes).
const ROUTES = [
  'rabbit@old-cluster/%2F/orders',
  'rabbit@new-cluster/%2F/orders',
  'rabbit@edge-cluster/%2F/orders',
  'rabbit@dr-cluster/%2F/billing',
];
const TOKENS = ROUTES.map(routeToken);

interface Variant {
  name: string;
  /** The mark's value in the header (headerBytes): an array becomes an AMQP array (`A`), a string `S`. */
  mark: string[] | string | undefined;
  /** The mark carried in the reserved `cluster-id` property instead of a header (a candidate only). */
  clusterId?: string;
}
const VARIANTS: Variant[] = [
  { name: 'no mark', mark: undefined },
  { name: 'array of 1 name (old)', mark: ROUTES.slice(0, 1) },
  { name: 'array of 4 names (old)', mark: ROUTES },
  { name: 'string, 1 name', mark: ROUTES[0] },
  { name: 'string, 1 token (new)', mark: TOKENS[0] },
  { name: 'string, 4 tokens (new)', mark: TOKENS.join(' ') },
  { name: 'string, JSON of 4 names', mark: JSON.stringify(ROUTES) },
  // A candidate measured, not written by the bridge: no header entry at all, one property slot.
  { name: 'cluster-id property, 1 token', mark: undefined, clusterId: TOKENS[0] },
];
// --only 'no mark;string, 1 token (new)': a subset of the variants, by name (a shorter run).
const ONLY = option('--only', '');
const RUN_VARIANTS = ONLY
  ? VARIANTS.filter((variant) => ONLY.split(';').some((name) => name.trim() === variant.name))
  : VARIANTS;
const unknown = ONLY.split(';')
  .map((name) => name.trim())
  .filter((name) => name && !VARIANTS.some((variant) => variant.name === name));
if (unknown.length > 0) {
  process.stderr.write(
    `mark-cost: --only names no variant called ${unknown.map((name) => `'${name}'`).join(', ')}; the variants are ${VARIANTS.map((variant) => `'${variant.name}'`).join(', ')}\n`,
  );
  process.exit(2);
}
if (!RUN_VARIANTS.some((variant) => variant.name === 'no mark')) {
  process.stderr.write("mark-cost: --only must include 'no mark', the baseline\n");
  process.exit(2);
}

// Property flags (AMQP 0-9-1 basic): headers, delivery-mode, and the reserved cluster-id slot.
const FLAG_HEADERS = 1 << 13;
const FLAG_DELIVERY_MODE = 1 << 12;
const FLAG_CLUSTER_ID = 1 << 2;

/**
 * A variant's content header as raw bytes (flags, then the properties in order): every variant is
 * published the same way, through the bridge's own raw publish, which also sets cluster-id (amqplib
 * leaves it out).
 */
function headerBytes(variant: Variant, id: string): Buffer {
  const fields = [rawField('_HQ_DUPL_ID', encodeValue({ type: 'S', value: Buffer.from(id) }))];
  if (variant.mark !== undefined) {
    const value: FieldValue = Array.isArray(variant.mark)
      ? { type: 'A', value: variant.mark.map((name) => ({ type: 'S', value: Buffer.from(name) })) }
      : { type: 'S', value: Buffer.from(variant.mark) };
    fields.push(rawField(ROUTE_HEADER, encodeValue(value)));
  }
  const table = Buffer.concat(fields);
  const parts = [Buffer.alloc(2), Buffer.alloc(4), table, Buffer.from([2])];
  let flags = FLAG_HEADERS | FLAG_DELIVERY_MODE;
  (parts[1] as Buffer).writeUInt32BE(table.length);
  if (variant.clusterId !== undefined) {
    flags |= FLAG_CLUSTER_ID;
    parts.push(Buffer.from([variant.clusterId.length]), Buffer.from(variant.clusterId, 'latin1'));
  }
  (parts[0] as Buffer).writeUInt16BE(flags);
  return Buffer.concat(parts);
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
const median = (values: number[]) => {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.floor(sorted.length / 2)] ?? 0;
};
const say = (text: string) => process.stdout.write(`${text}\n`);

/** Counts deliveries and acks each one; `until(n)` resolves at the n-th since the last `reset`. */
class Drain {
  private count = 0;
  private target = 0;
  private resolve: (() => void) | undefined;
  private check: ((message: ConsumeMessage) => void) | undefined;
  redelivered = 0;
  /** What the check found wrong, if anything (thrown by the round, not in amqplib's dispatch). */
  problem: Error | undefined;

  constructor(private readonly channel: Channel) {}

  handle(message: ConsumeMessage | null): void {
    if (!message) return;
    if (message.fields.redelivered) this.redelivered++;
    if (this.count === 0) {
      try {
        this.check?.(message);
      } catch (error) {
        this.problem ??= error as Error;
      }
    }
    this.channel.ack(message);
    this.count++;
    if (this.count === this.target) this.resolve?.();
  }

  until(target: number, check: (message: ConsumeMessage) => void): Promise<void> {
    this.count = 0;
    this.target = target;
    this.check = check;
    return new Promise((resolve) => {
      this.resolve = resolve;
    });
  }
}

/** That the first message of a round carries the variant's mark in the form meant. */
function checkMark(variant: Variant): (message: ConsumeMessage) => void {
  return (message) => {
    const value: unknown = message.properties.headers?.[ROUTE_HEADER];
    if (message.properties.clusterId !== variant.clusterId) {
      throw new Error(`mark-cost: ${variant.name}: cluster-id arrived as ${message.properties.clusterId}`);
    }
    const ok =
      variant.mark === undefined
        ? value === undefined
        : Array.isArray(variant.mark)
          ? Array.isArray(value) && value.join('\n') === variant.mark.join('\n')
          : (typeof value === 'string' || Buffer.isBuffer(value)) && String(value) === variant.mark;
    if (!ok) throw new Error(`mark-cost: ${variant.name}: the mark arrived as ${JSON.stringify(value)}`);
  };
}

async function main(): Promise<void> {
  cleanLeftovers();
  const runDir = newRunDir();
  if (!BUSY_WAIT) {
    // The harness starts the node with this process's environment.
    process.env.RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS = '+sbwt none +sbwtdcpu none +sbwtdio none';
  }
  const node = new RabbitNode(runDir, 'mark-cost');
  say('mark-cost: starting a RabbitMQ node…');
  await node.start();
  const brokerPid = node.pid();
  const queue = `mark-cost-${process.pid}`;
  const publisherConnection = await amqp.connect(node.url, { noDelay: true });
  const consumerConnection = await amqp.connect(node.url, { noDelay: true });
  try {
    const publisher = await publisherConnection.createConfirmChannel();
    await publisher.assertQueue(queue, { durable: true, arguments: { 'x-queue-type': 'classic' } });
    const consumer = await consumerConnection.createChannel();
    await consumer.prefetch(PREFETCH);
    const drain = new Drain(consumer);
    const consume = async () =>
      (await consumer.consume(queue, (message) => drain.handle(message), { noAck: false })).consumerTag;
    const body = Buffer.alloc(SIZE, 'x');
    const runTag = randomBytes(4).toString('hex');

    /** One round of one variant: broker CPU ms and publisher wall ms, per 1,000 messages. */
    async function round(variant: Variant, label: number, count: number) {
      await sleep(500); // the last round's tail (queue index, GC) lands before the start
      const drained = drain.until(count, checkMark(variant));
      const cpuStart = processCpuMs(brokerPid);
      const start = performance.now();
      let consumerTag = CONCURRENT ? await consume() : undefined;
      let confirmed = 0;
      let failed = 0;
      let wake: (() => void) | undefined;
      const settled = () => {
        confirmed++;
        wake?.();
      };
      for (let i = 0; i < count; i++) {
        while (i - confirmed >= WINDOW) await new Promise<void>((resolve) => (wake = resolve));
        const header = headerBytes(variant, `${runTag}-${label}-${String(i).padStart(6, '0')}`);
        // The raw publish always sets `mandatory`, as the bridge does.
        const ok = publishRaw(publisher, '', queue, header, body, (error) => {
          if (error) failed++;
          settled();
        });
        if (!ok) await new Promise((resolve) => publisher.once('drain', resolve));
      }
      await publisher.waitForConfirms();
      const published = performance.now();
      const cpuPublished = processCpuMs(brokerPid);
      consumerTag ??= await consume();
      await drained;
      if (drain.problem) throw drain.problem;
      // The broker has taken every ack before it answers the cancel on the same channel.
      await consumer.cancel(consumerTag);
      const cpuEnd = processCpuMs(brokerPid);
      if (failed > 0) throw new Error(`mark-cost: ${failed} publishes were nacked`);
      const perThousand = (x: number) => (x * 1000) / count;
      return {
        cpu: perThousand(cpuEnd - cpuStart),
        publishCpu: perThousand(cpuPublished - cpuStart),
        publish: perThousand(published - start),
      };
    }

    say(`mark-cost: warm-up, ${WARM_UP} messages per variant (not counted)`);
    for (const variant of RUN_VARIANTS) await round(variant, 100 + RUN_VARIANTS.indexOf(variant), WARM_UP);

    type Figure = 'cpu' | 'publishCpu' | 'publish';
    const figures = Object.fromEntries(
      RUN_VARIANTS.map(({ name }) => [
        name,
        { cpu: [], publishCpu: [], publish: [] } as Record<Figure, number[]>,
      ]),
    );
    for (let r = 1; r <= ROUNDS; r++) {
      // Each round starts with the next variant, so that none always runs first or last.
      const order = RUN_VARIANTS.map((_, i) => RUN_VARIANTS[(i + r - 1) % RUN_VARIANTS.length] as Variant);
      for (const variant of order) {
        const result = await round(variant, 100 * r + 100 + RUN_VARIANTS.indexOf(variant), MESSAGES);
        for (const figure of ['cpu', 'publishCpu', 'publish'] as const) {
          figures[variant.name]?.[figure].push(result[figure]);
        }
        say(
          `  round ${r} · ${variant.name}: broker ${result.cpu.toFixed(1)} ms CPU per 1,000 (publishing ${result.publishCpu.toFixed(1)}), publisher ${result.publish.toFixed(1)} ms wall per 1,000`,
        );
      }
    }
    if (drain.redelivered > 0) throw new Error(`mark-cost: ${drain.redelivered} messages were redelivered`);

    say(
      `\nmark-cost: ${ROUNDS} rotating rounds × ${MESSAGES} messages of ${SIZE} B, persistent, confirmed, mandatory, ` +
        `${CONCURRENT ? 'consumed meanwhile' : 'then consumed'} with prefetch ${PREFETCH}${BUSY_WAIT ? ', schedulers busy-waiting' : ''}; ` +
        'medians (rounds), per 1,000 messages',
    );
    const of = (name: string, figure: Figure) => median(figures[name]?.[figure] ?? []);
    const sign = (x: number) => (x >= 0 ? `+${x.toFixed(1)}` : x.toFixed(1));
    say(
      '| variant | mark bytes | broker CPU ms | vs no mark | paired | rounds | publishing only | vs no mark | publisher wall ms | vs no mark |',
    );
    say('| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |');
    for (const variant of RUN_VARIANTS) {
      // The field's value on the wire: type tag and length, and each element's tag and length too.
      const bytes =
        variant.mark === undefined
          ? variant.clusterId === undefined
            ? 0
            : 1 + variant.clusterId.length
          : Array.isArray(variant.mark)
            ? variant.mark.reduce((sum, name) => sum + 5 + Buffer.byteLength(name), 5)
            : 5 + Buffer.byteLength(variant.mark);
      const cells = (figure: Figure) => {
        const value = of(variant.name, figure);
        return `${value.toFixed(1)} | ${variant.name === 'no mark' ? '' : sign(value - of('no mark', figure))}`;
      };
      const rounds = figures[variant.name]?.cpu ?? [];
      // Against no mark in the same round, then the median: the host's load moves from round to round.
      const base = figures['no mark']?.cpu ?? [];
      const paired = variant.name === 'no mark' ? '' : sign(median(rounds.map((x, i) => x - (base[i] ?? 0))));
      say(
        `| ${variant.name} | ${bytes} | ${cells('cpu')} | ${paired} | ${rounds.map((x) => x.toFixed(0)).join(', ')} | ` +
          `${cells('publishCpu')} | ${cells('publish')} |`,
      );
    }
  } finally {
    await Promise.allSettled([publisherConnection.close(), consumerConnection.close()]);
    await node.stop();
    rmSync(runDir, { recursive: true, force: true });
  }
}

await main();
