import { createConnection, createServer, type Server, type Socket } from 'node:net';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { FaultProxy } from '../harness/proxy.js';
import { startCli } from '../helpers.js';
import { createStream, readStored, StreamWatch, streamMessage, writeStream } from '../stream-helpers.js';
import { countBy, linesOf, migrate, outputOf, StreamNodes, scopeName, srcArgs } from './stream-source-kit.js';

// Attacks on a stream source over bad lines: a slow line to the source's stream port, Redis
// blackholed mid-transfer.

const nodes = new StreamNodes();
beforeAll(() => nodes.start(), 180_000);
afterAll(() => nodes.stop());

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
// Stream protocol handshake commands: PeerProperties, SaslHandshake, SaslAuthenticate, Tune, Open.
const HANDSHAKE = new Set([0x11, 0x12, 0x13, 0x14, 0x15]);

/**
 * A slow line for the stream protocol: the handshake passes at full speed (so the connect itself
 * does not time out), then from the client's first other command on, every chunk either way waits
 * a random 1.5–4 s (in order).
 */
class SlowStreamLine {
  private server: Server | undefined;
  private readonly sockets = new Set<Socket>();
  port = 0;
  constructor(
    private readonly targetPort: number,
    private readonly minMs = 1500,
    private readonly maxMs = 4000,
  ) {}

  async start(): Promise<void> {
    this.server = createServer((client) => this.accept(client));
    await new Promise<void>((resolve) => this.server?.listen(0, '127.0.0.1', resolve));
    const address = this.server.address();
    this.port = typeof address === 'object' && address ? address.port : 0;
  }

  url(): string {
    return `rabbitmq-stream://guest:guest@127.0.0.1:${this.port}/`;
  }

  private accept(client: Socket): void {
    const server = createConnection({ host: '127.0.0.1', port: this.targetPort });
    this.sockets.add(client);
    this.sockets.add(server);
    let slow = false;
    const lane = (from: Socket, to: Socket, up: boolean) => {
      let last = 0;
      from.on('data', (chunk: Buffer) => {
        if (up && !slow) {
          for (let at = 0; at + 6 <= chunk.length; at += 4 + chunk.readUInt32BE(at)) {
            if (!HANDSHAKE.has(chunk.readUInt16BE(at + 4) & 0x7fff)) slow = true;
          }
        }
        if (!slow) {
          if (!to.destroyed) to.write(chunk);
          return;
        }
        const at = Math.max(Date.now() + this.minMs + Math.random() * (this.maxMs - this.minMs), last);
        last = at;
        setTimeout(() => !to.destroyed && to.write(chunk), at - Date.now());
      });
      from.on('close', () => setTimeout(() => to.destroy(), Math.max(0, last - Date.now())));
      from.on('error', () => {});
    };
    lane(client, server, true);
    lane(server, client, false);
  }

  async stop(): Promise<void> {
    for (const s of this.sockets) s.destroy();
    await new Promise<void>((resolve) => (this.server ? this.server.close(() => resolve()) : resolve()));
  }
}

describe('stream source: bad lines', () => {
  it('6a. migrate over a slow line to the source reads a non-empty stream as non-empty', async () => {
    const prefix = scopeName('slow');
    const src = 'slow-src';
    const dst = 'slow-dst';
    await createStream(nodes.src, src);
    await createStream(nodes.dst, dst);
    await writeStream(
      nodes.src,
      src,
      Array.from({ length: 200 }, (_, n) => streamMessage(n)),
    );
    const line = new SlowStreamLine(nodes.source.streamPort);
    await line.start();
    try {
      const args = srcArgs('migrate', nodes, src, ['--target', nodes.dst, '--target-stream', dst], prefix);
      args[args.indexOf('--source') + 1] = line.url();
      const res = await migrate([...args, '--retry-for', '60s']);
      const stored = await readStored(nodes.dst, dst, { idleMs: 2000 });
      const c = countBy(
        'slow line, fresh route',
        Array.from({ length: 200 }, (_, n) => `body ${n}`),
        stored.map((s) => s.body.toString()),
      );
      console.log(
        `exit ${res.code}, report forwarded ${res.report?.forwarded}, outcome ${res.report?.outcome}`,
      );
      expect({
        code: res.code,
        forwarded: res.report?.forwarded,
        lost: c.lost,
        duplicated: c.duplicated,
      }).toEqual({
        code: 0,
        forwarded: 200,
        lost: 0,
        duplicated: 0,
      });
    } finally {
      await line.stop();
    }
  });

  it('6b. over a slow line, a route with a stored position is not refused as a recreated stream', async () => {
    const prefix = scopeName('slow2');
    const src = 'slow2-src';
    const dst = 'slow2-dst';
    await createStream(nodes.src, src);
    await createStream(nodes.dst, dst);
    await writeStream(
      nodes.src,
      src,
      Array.from({ length: 100 }, (_, n) => streamMessage(n)),
    );
    const to = ['--target', nodes.dst, '--target-stream', dst];
    const first = await migrate(srcArgs('migrate', nodes, src, to, prefix));
    await writeStream(
      nodes.src,
      src,
      Array.from({ length: 100 }, (_, n) => streamMessage(100 + n)),
    );
    const line = new SlowStreamLine(nodes.source.streamPort);
    await line.start();
    try {
      const args = srcArgs('migrate', nodes, src, to, prefix);
      args[args.indexOf('--source') + 1] = line.url();
      const res = await migrate([...args, '--retry-for', '60s']);
      const refused = linesOf(outputOf(res), /created again|deleted/i);
      console.log(
        `first exit ${first.code}; over the slow line exit ${res.code}; ${refused[0] ?? 'no refusal line'}`,
      );
      const stored = await readStored(nodes.dst, dst, { idleMs: 2000 });
      const c = countBy(
        'slow line, stored position',
        Array.from({ length: 200 }, (_, n) => `body ${n}`),
        stored.map((s) => s.body.toString()),
      );
      expect({
        first: first.code,
        code: res.code,
        refused: refused.length,
        lost: c.lost,
        duplicated: c.duplicated,
      }).toEqual({
        first: 0,
        code: 0,
        refused: 0,
        lost: 0,
        duplicated: 0,
      });
    } finally {
      await line.stop();
    }
  });

  it('7. Redis blackholed for 10 s mid-transfer, then back: exactly every entry once on the target', async () => {
    const prefix = scopeName('redis');
    const src = 'rb-src';
    const dst = 'rb-dst';
    await createStream(nodes.src, src);
    await createStream(nodes.dst, dst);
    const N = 20_000;
    await writeStream(
      nodes.src,
      src,
      Array.from({ length: N }, (_, n) => streamMessage(n)),
    );
    const pr = FaultProxy.forUrl(nodes.redis.url);
    await pr.start();
    const watch = new StreamWatch(nodes.dst, dst);
    try {
      const args = srcArgs('migrate', nodes, src, ['--target', nodes.dst, '--target-stream', dst], prefix);
      args[args.indexOf('--redis') + 1] = pr.urlFor(nodes.redis.url);
      const bridge = startCli([...args, '--retry-for', '120s', '--prefetch', '200']);
      await watch.until(2000, 60_000);
      pr.setMode('blackhole');
      const at = watch.count;
      await sleep(10_000);
      console.log(`blackholed at ${at} on the target; after 10 s ${watch.count}`);
      pr.setMode('pass');
      const timer = setTimeout(() => bridge.signal('SIGKILL'), 180_000);
      const res = await bridge.done;
      clearTimeout(timer);
      for (const l of linesOf(outputOf(res), /warn|error|stopped|drained|failed/i).slice(-6))
        console.log('>', l);
      // A re-run, as a user would after any non-zero exit.
      const again = await migrate(
        srcArgs('migrate', nodes, src, ['--target', nodes.dst, '--target-stream', dst], prefix),
      );
      const stored = await readStored(nodes.dst, dst, { idleMs: 3000 });
      const c = countBy(
        'redis blackholed',
        Array.from({ length: N }, (_, n) => `body ${n}`),
        stored.map((s) => s.body.toString()),
      );
      const flagged = stored.filter((s) => s.inDoubt || s.mentionsInDoubt).length;
      console.log(`exit ${res.code}, re-run exit ${again.code}, flagged ${flagged}`);
      expect({ ...c, flagged }).toEqual({
        expected: N,
        got: N,
        lost: 0,
        duplicated: 0,
        unexpected: 0,
        outOfOrder: 0,
        flagged: 0,
      });
    } finally {
      await watch.stop();
      await pr.stop();
    }
  });
});
