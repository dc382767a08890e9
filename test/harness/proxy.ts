import { createConnection, createServer, type Server, type Socket } from 'node:net';

export type ProxyMode = 'pass' | 'blackhole';

/** One direction of one connection through a rate-limited link: its bytes waiting their turn. */
interface Lane {
  from: Socket;
  to: Socket;
  slices: Buffer[];
  bytes: number;
  /** Set by a cut: nothing more from `from` is passed on, and this runs once the queue is sent. */
  cut?: () => void;
}

/** Bytes a lane holds before the proxy stops reading its sender (as TCP's window would). */
const LANE_HIGH_WATER = 64 * 1024;
/** A rate-limited link passes bytes on in slices of at most this many. */
const SLICE = 2048;

/**
 * One direction of a slow line: carries at most `bytesPerSecond`, shared fairly by the
 * connections on it (a slice from each lane in turn, so a handshake is not stuck behind another
 * connection's backlog), each connection's bytes in order.
 */
class PacedLink {
  private readonly active: Lane[] = [];
  private timer: NodeJS.Timeout | undefined;
  /** When the line may send its next slice (performance.now() ms). */
  private nextAt = 0;

  constructor(
    private bytesPerSecond: number | undefined,
    private readonly deliver: (to: Socket, chunk: Buffer) => void,
  ) {}

  setRate(bytesPerSecond: number | undefined): void {
    this.bytesPerSecond = bytesPerSecond;
    if (this.timer) clearTimeout(this.timer);
    this.timer = undefined;
    this.pump();
  }

  get limited(): boolean {
    return this.bytesPerSecond !== undefined;
  }

  send(lane: Lane, chunk: Buffer): void {
    for (let offset = 0; offset < chunk.length; offset += SLICE) {
      lane.slices.push(chunk.subarray(offset, offset + SLICE));
    }
    lane.bytes += chunk.length;
    if (lane.bytes > LANE_HIGH_WATER && !lane.from.isPaused()) lane.from.pause();
    if (!this.active.includes(lane)) this.active.push(lane);
    if (!this.timer) this.pump();
  }

  /** Forgets a lane whose connection closed. */
  drop(lane: Lane): void {
    lane.slices = [];
    lane.bytes = 0;
    const at = this.active.indexOf(lane);
    if (at >= 0) this.active.splice(at, 1);
  }

  private pump = (): void => {
    this.timer = undefined;
    const now = performance.now();
    // A line idle (or a loop that was busy) for a while does not send a burst to catch up.
    if (this.nextAt < now - 20) this.nextAt = now - 20;
    while (this.active.length > 0 && (this.bytesPerSecond === undefined || this.nextAt <= now)) {
      const lane = this.active.shift() as Lane;
      const slice = lane.slices.shift() as Buffer;
      lane.bytes -= slice.length;
      this.deliver(lane.to, slice);
      if (lane.slices.length > 0) this.active.push(lane);
      else lane.cut?.();
      if (lane.bytes <= LANE_HIGH_WATER / 2 && lane.from.isPaused() && !lane.from.destroyed)
        lane.from.resume();
      if (this.bytesPerSecond !== undefined) this.nextAt += (slice.length / this.bytesPerSecond) * 1000;
    }
    if (this.active.length > 0) this.timer = setTimeout(this.pump, Math.max(1, this.nextAt - now));
  };
}

const STREAM_DELIVER = 0x0008;

/** Stream frames from a server on their way to one client, each Deliver held back; in order. */
class LateDeliveries {
  private partial: Buffer = Buffer.alloc(0);
  private readonly queue: { frame: Buffer; at: number }[] = [];
  private timer: NodeJS.Timeout | undefined;

  constructor(
    private readonly to: Socket,
    private readonly delayed: () => void,
  ) {}

  get busy(): boolean {
    return this.queue.length > 0 || this.partial.length > 0;
  }

  add(data: Buffer, delayMs: number): void {
    const bytes = Buffer.concat([this.partial, data]);
    let at = 0;
    while (bytes.length - at >= 6) {
      const end = at + 4 + bytes.readUInt32BE(at);
      if (bytes.length < end) break;
      const deliver = (bytes.readUInt16BE(at + 4) & 0x7fff) === STREAM_DELIVER;
      if (deliver && delayMs > 0) this.delayed();
      const last = this.queue[this.queue.length - 1]?.at ?? 0;
      this.queue.push({
        frame: bytes.subarray(at, end),
        at: Math.max(last, Date.now() + (deliver ? delayMs : 0)),
      });
      at = end;
    }
    this.partial = Buffer.from(bytes.subarray(at));
    if (!this.timer) this.pump();
  }

  private pump = (): void => {
    this.timer = undefined;
    while (this.queue.length > 0 && (this.queue[0] as { at: number }).at <= Date.now()) {
      const { frame } = this.queue.shift() as { frame: Buffer };
      if (!this.to.destroyed) this.to.write(frame);
    }
    const next = this.queue[0];
    if (next && !this.timer) this.timer = setTimeout(this.pump, Math.max(1, next.at - Date.now()));
  };
}

/** A frame of type 1 on channel 0, empty, without its end octet (0xCE): amqplib cannot parse it. */
const BAD_FRAME = Buffer.from([1, 0, 0, 0, 0, 0, 0, 0]);

/** Whether a chunk from an AMQP server holds a basic.consume-ok method frame (class 60, method 21). */
function hasConsumeOk(chunk: Buffer): boolean {
  const method = Buffer.from([0, 60, 0, 21]);
  for (let at = chunk.indexOf(method); at >= 0; at = chunk.indexOf(method, at + 1)) {
    if (at >= 7 && chunk[at - 7] === 1) return true;
  }
  return false;
}

/**
 * A TCP fault proxy between the bridge and one server: passes bytes through, delays them, caps
 * their rate (a slow line, shared by every connection through the proxy), blackholes them
 * (connections stay open and nothing arrives either way, as in a network partition;
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
  private deliveryDelayMs = 0;
  private poisonConsumeOk = false;
  /** AMQP methods (class << 16 | method) the server sends that never reach the client. */
  private readonly swallowed = new Set<number>();
  /** How many frames were swallowed. */
  swallowedCount = 0;
  /** Set once the armed consume-ok went by with a bad frame behind it. */
  poisoned = false;
  /** Each direction of the line: to the server (up) and back (down). */
  private readonly links = {
    up: new PacedLink(undefined, (to, chunk) => this.deliver(to, chunk)),
    down: new PacedLink(undefined, (to, chunk) => this.deliver(to, chunk)),
  };
  port = 0;
  /** Stream Deliver frames held back by delayStreamDeliveries. */
  deliveriesDelayed = 0;
  /** Bytes the clients sent towards the server so far (what a fault test reads to time a fault). */
  clientBytes = 0;
  /** Told of every chunk a client sends, as it reaches the proxy (a test that must say when a copy left). */
  onClientData: ((data: Buffer) => void) | undefined;

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

  /** Whether connections made now wait, unanswered, until holdNewConnections(false). */
  private holding = false;
  /** Connections accepted while holding, not yet passed on to the server. */
  private readonly waiting = new Set<Socket>();

  /**
   * On: connections made from now on are accepted and then left hanging, their bytes unread and
   * nothing sent on to the server (a server too busy to answer); connections made before go on
   * flowing. Off: the waiting ones are passed on, with what they sent meanwhile.
   */
  holdNewConnections(on: boolean): void {
    this.holding = on;
    if (on) return;
    const waiting = [...this.waiting];
    this.waiting.clear();
    for (const client of waiting) {
      if (client.destroyed) continue;
      this.accept(client);
      client.resume();
    }
  }

  /** How many connections are waiting (holdNewConnections). */
  get heldConnections(): number {
    return this.waiting.size;
  }

  private accept(client: Socket): void {
    if (this.holding) {
      client.pause();
      this.waiting.add(client);
      client.once('close', () => this.waiting.delete(client));
      return;
    }
    const upstream = createConnection({ host: this.targetHost, port: this.targetPort });
    const pair: [Socket, Socket] = [client, upstream];
    this.pairs.add(pair);
    const lanes: [PacedLink, Lane][] = [];
    const forward = (from: Socket, to: Socket) => {
      const link = from === client ? this.links.up : this.links.down;
      const lane: Lane = { from, to, slices: [], bytes: 0 };
      lanes.push([link, lane]);
      // Server bytes not yet a whole frame, while frames are being swallowed.
      let partial: Buffer = Buffer.alloc(0);
      const lateDeliveries = new LateDeliveries(to, () => this.deliveriesDelayed++);
      from.on('data', (data: Buffer) => {
        // Cut: what came after the cut point never reaches the server.
        if (lane.cut) return;
        if (from === upstream && (this.deliveryDelayMs > 0 || lateDeliveries.busy)) {
          lateDeliveries.add(data, this.deliveryDelayMs);
          return;
        }
        if (from === client) {
          this.clientBytes += data.length;
          this.onClientData?.(data);
        }
        let chunk = data;
        if (from === upstream && (this.swallowed.size > 0 || partial.length > 0)) {
          const kept = this.swallow(Buffer.concat([partial, chunk]));
          partial = kept.partial;
          chunk = kept.whole;
          if (chunk.length === 0) return;
        }
        if (from === client && this.cutAfter !== undefined) {
          // Pass exactly the bytes left before the cut, then reset the connection mid-stream.
          const room = this.cutAfter;
          this.cutAfter = room - chunk.length;
          if (this.cutAfter <= 0) {
            this.cutAfter = undefined;
            const reset = () => upstream.write(Buffer.alloc(0), () => this.resetAll());
            lane.cut = reset;
            const tail = chunk.subarray(0, room);
            // Bytes still queued on a slow line go first, as on any TCP link: the server gets a
            // prefix of the stream, then the reset.
            if (lane.slices.length > 0 || (link.limited && tail.length > 0)) link.send(lane, tail);
            else upstream.write(tail, () => this.resetAll());
            return;
          }
        }
        if (from === upstream && this.poisonConsumeOk && hasConsumeOk(chunk)) {
          // A frame the client cannot parse, in the same write as the consume-ok; then nothing flows.
          this.poisonConsumeOk = false;
          this.poisoned = true;
          this.deliver(to, Buffer.concat([chunk, BAD_FRAME]));
          this.setMode('blackhole');
          return;
        }
        // Bytes still queued on the line go first, also after the cap was lifted.
        if (link.limited || lane.slices.length > 0) link.send(lane, chunk);
        else this.deliver(to, chunk);
      });
    };
    forward(client, upstream);
    forward(upstream, client);
    const close = () => {
      for (const [link, lane] of lanes) link.drop(lane);
      this.pairs.delete(pair);
      client.destroy();
      upstream.destroy();
    };
    client.on('error', close);
    upstream.on('error', close);
    client.on('close', close);
    upstream.on('close', close);
  }

  /** Sends a chunk on: held while blackholed, else after the delay, if any. */
  private deliver(to: Socket, chunk: Buffer): void {
    if (to.destroyed) return;
    if (this.mode === 'blackhole') {
      this.held.push([to, chunk]);
      return;
    }
    if (this.delayMs > 0) setTimeout(() => !to.destroyed && to.write(chunk), this.delayMs);
    else to.write(chunk);
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

  /**
   * AMQP: the next basic.consume-ok from the server reaches the client with an unparseable frame
   * right behind it, in one write (the client's parser fails in the same read that answered its
   * consume, as amqplib did on a 12,000-deep header table); the proxy then blackholes (setMode).
   */
  poisonNextConsumeOk(): void {
    this.poisonConsumeOk = true;
    this.poisoned = false;
  }

  /** AMQP: server frames of this method (e.g. basic.cancel, 60/30) are dropped, not passed on. */
  swallowServerMethod(classId: number, methodId: number): void {
    this.swallowed.add((classId << 16) | methodId);
  }

  /** Splits server bytes into whole frames (minus the swallowed ones) and a partial rest. */
  private swallow(bytes: Buffer): { whole: Buffer; partial: Buffer } {
    const kept: Buffer[] = [];
    let at = 0;
    while (bytes.length - at >= 8) {
      const size = bytes.readUInt32BE(at + 3);
      const end = at + 7 + size + 1;
      if (bytes.length < end) break;
      const method = bytes[at] === 1 && size >= 4 ? bytes.readUInt32BE(at + 7) : -1;
      if (this.swallowed.has(method)) this.swallowedCount++;
      else kept.push(bytes.subarray(at, end));
      at = end;
    }
    return { whole: Buffer.concat(kept), partial: Buffer.from(bytes.subarray(at)) };
  }

  setDelay(ms: number): void {
    this.delayMs = ms;
  }

  /**
   * Stream protocol: each Deliver frame from the server reaches the client `ms` late, and what
   * follows it waits behind it (a broker slow to read a chunk from disk); 0 stops delaying.
   */
  delayStreamDeliveries(ms: number): void {
    this.deliveryDelayMs = ms;
  }

  /** Caps each direction of the line at `bytesPerSecond` (a slow line), or lifts the cap. */
  setRate(bytesPerSecond: number | undefined): void {
    this.links.up.setRate(bytesPerSecond);
    this.links.down.setRate(bytesPerSecond);
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
    for (const client of this.waiting) client.destroy();
    this.resetAll();
    await new Promise<void>((resolve) => (this.server ? this.server.close(() => resolve()) : resolve()));
  }
}
