import { createConnection, createServer, type Server, type Socket } from 'node:net';

export type ProxyMode = 'pass' | 'blackhole';

/**
 * A TCP fault proxy between the bridge and one server: passes bytes through, delays them,
 * blackholes them (connections stay open and nothing arrives either way, as in a network partition;
 * the bytes are held, as TCP would retransmit them, and flow again when the partition heals), or
 * resets every open connection on command. Listens on a free loopback port.
 */
export class FaultProxy {
  private server: Server | undefined;
  private readonly pairs = new Set<[Socket, Socket]>();
  private mode: ProxyMode = 'pass';
  private held: [Socket, Buffer][] = [];
  private cutAfter: number | undefined;
  private delayMs = 0;
  port = 0;

  constructor(
    private readonly targetHost: string,
    private readonly targetPort: number,
  ) {}

  /** A proxy for the host and port of a URL; `urlFor` gives the same URL through the proxy. */
  static forUrl(url: string): FaultProxy {
    const parsed = new URL(url);
    const defaults: Record<string, number> = {
      'amqp:': 5672,
      'amqps:': 5671,
      'redis:': 6379,
      'rediss:': 6379,
    };
    return new FaultProxy(parsed.hostname, Number(parsed.port || defaults[parsed.protocol]));
  }

  urlFor(url: string): string {
    const parsed = new URL(url);
    parsed.hostname = '127.0.0.1';
    parsed.port = String(this.port);
    return parsed.toString();
  }

  async start(): Promise<void> {
    this.server = createServer((client) => this.accept(client));
    await new Promise<void>((resolve) => this.server?.listen(0, '127.0.0.1', resolve));
    const address = this.server.address();
    this.port = typeof address === 'object' && address ? address.port : 0;
  }

  private accept(client: Socket): void {
    const upstream = createConnection({ host: this.targetHost, port: this.targetPort });
    const pair: [Socket, Socket] = [client, upstream];
    this.pairs.add(pair);
    const forward = (from: Socket, to: Socket) => {
      from.on('data', (chunk: Buffer) => {
        if (from === client && this.cutAfter !== undefined) {
          // Pass exactly the bytes left before the cut, then reset the connection mid-stream.
          const room = this.cutAfter;
          this.cutAfter = room - chunk.length;
          if (this.cutAfter <= 0) {
            this.cutAfter = undefined;
            upstream.write(chunk.subarray(0, room), () => this.resetAll());
            return;
          }
        }
        if (this.mode === 'blackhole') {
          this.held.push([to, chunk]);
          return;
        }
        if (this.delayMs > 0) setTimeout(() => to.write(chunk), this.delayMs);
        else to.write(chunk);
      });
    };
    forward(client, upstream);
    forward(upstream, client);
    const close = () => {
      this.pairs.delete(pair);
      client.destroy();
      upstream.destroy();
    };
    client.on('error', close);
    upstream.on('error', close);
    client.on('close', close);
    upstream.on('close', close);
  }

  /** pass: bytes flow; blackhole: bytes are dropped silently, connections stay open. */
  setMode(mode: ProxyMode): void {
    this.mode = mode;
    if (mode === 'pass') {
      for (const [to, chunk] of this.held.splice(0)) if (!to.destroyed) to.write(chunk);
    }
  }

  /** Resets every connection once `bytes` more bytes went from the clients to the server. */
  resetAfter(bytes: number): void {
    this.cutAfter = bytes;
  }

  setDelay(ms: number): void {
    this.delayMs = ms;
  }

  /** Resets every open connection (the peers see ECONNRESET). */
  resetAll(): void {
    this.held = [];
    for (const [client, upstream] of this.pairs) {
      client.resetAndDestroy();
      upstream.resetAndDestroy();
    }
    this.pairs.clear();
  }

  get connections(): number {
    return this.pairs.size;
  }

  async stop(): Promise<void> {
    this.resetAll();
    await new Promise<void>((resolve) => (this.server ? this.server.close(() => resolve()) : resolve()));
  }
}
