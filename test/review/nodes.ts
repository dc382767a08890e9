import { rmSync } from 'node:fs';
import amqp from 'amqplib';
import { StreamClient } from '../../src/stream/client.js';
import { freePort, newRunDir, RabbitNode, RedisServer } from '../harness/servers.js';
import { countDelivery, type RunningCli } from '../helpers.js';

/** A source node, a target node with the stream plugin, and Redis: throwaway, per test file. */
export class Nodes {
  runDir = '';
  source!: RabbitNode;
  target!: RabbitNode;
  redis!: RedisServer;
  streamPort = 0;

  async start(): Promise<void> {
    this.runDir = newRunDir();
    this.streamPort = await freePort();
    this.source = new RabbitNode(this.runDir, 'rsrc');
    this.target = new RabbitNode(this.runDir, 'rtgt', {
      plugins: ['rabbitmq_stream'],
      config: [`stream.listeners.tcp.1 = ${this.streamPort}`],
    });
    this.redis = new RedisServer(this.runDir, 'rredis', false);
    await Promise.all([this.source.start(), this.target.start(), this.redis.start()]);
  }

  async stop(): Promise<void> {
    await Promise.allSettled([this.source?.stop(true), this.target?.stop(true), this.redis?.stop(true)]);
    if (this.runDir) rmSync(this.runDir, { recursive: true, force: true });
  }

  streamUrl(port = this.streamPort): string {
    return `rabbitmq-stream://guest:guest@127.0.0.1:${port}/`;
  }

  async createStream(name: string): Promise<void> {
    const admin = await StreamClient.connect({ url: this.streamUrl() });
    await admin.create(name);
    await admin.close();
  }

  /** Publishes `ids` (as _HQ_DUPL_ID, body "m:<id>") to a durable queue, confirmed. */
  async publish(queue: string, ids: readonly string[], bodyBytes = 0): Promise<void> {
    const conn = await amqp.connect(this.source.url);
    const ch = await conn.createConfirmChannel();
    await ch.assertQueue(queue, { durable: true });
    for (const id of ids) {
      const body = bodyBytes > 0 ? Buffer.alloc(bodyBytes, 'x') : Buffer.from(`m:${id}`);
      ch.sendToQueue(queue, body, { headers: { _HQ_DUPL_ID: id }, persistent: true });
    }
    await ch.waitForConfirms();
    await conn.close();
  }

  async depth(queue: string): Promise<{ ready: number; consumers: number }> {
    const conn = await amqp.connect(this.source.url);
    const ch = await conn.createChannel();
    const q = await ch.assertQueue(queue, { durable: true });
    await conn.close();
    return { ready: q.messageCount, consumers: q.consumerCount };
  }

  /**
   * Reads the whole stream over AMQP 0-9-1 (x-stream-offset first), as an independent reader: per
   * message its dedup ID and whether it carries the in-doubt flag. Also reads it with
   * StreamClient.readStream and prints both counts (that reader was seen to stop short).
   */
  async read(stream: string): Promise<{ ids: string[]; flaggedIds: string[] }> {
    const conn = await amqp.connect(this.target.url);
    const ch = await conn.createChannel();
    await ch.prefetch(1000);
    const ids: string[] = [];
    const flaggedIds: string[] = [];
    let last = Date.now();
    await ch.consume(
      stream,
      (m) => {
        if (!m) return;
        last = Date.now();
        const raw = m.properties.headers?._HQ_DUPL_ID;
        const id = Buffer.isBuffer(raw) ? raw.toString() : String(raw);
        ids.push(id);
        if (m.properties.headers?.['x-dedup-in-doubt'] !== undefined) flaggedIds.push(id);
        ch.ack(m);
      },
      { noAck: false, arguments: { 'x-stream-offset': 'first' } },
    );
    while (Date.now() - last < 3000) await new Promise((r) => setTimeout(r, 200));
    await conn.close();
    const reader = await StreamClient.connect({ url: this.streamUrl() });
    const viaStream = await reader.readStream(stream, { idleMs: 3000 });
    await reader.close();
    console.log(
      `read "${stream}": ${ids.length} over AMQP 0-9-1, ${viaStream.length} with StreamClient.readStream`,
    );
    return { ids, flaggedIds };
  }

  count(label: string, expected: readonly string[], ids: string[]) {
    return countDelivery(label, expected, ids);
  }
}

export function idsFrom(from: number, to: number): string[] {
  return Array.from({ length: to - from }, (_, i) => `id-${from + i}`);
}

export async function waitForLine(cli: RunningCli, pattern: RegExp, timeoutMs = 30_000): Promise<string> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const line = cli
      .output()
      .split('\n')
      .find((l) => pattern.test(l));
    if (line) return line;
    if (Date.now() > deadline)
      throw new Error(`no line ${pattern} in ${timeoutMs} ms; output tail:\n${cli.output().slice(-3000)}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

export function linesOf(cli: RunningCli, pattern: RegExp): string[] {
  return cli
    .output()
    .split('\n')
    .filter((l) => pattern.test(l))
    .map((l) => l.slice(0, 400));
}

export const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
