import type { ConnectionOptions } from 'node:tls';
import { backoffDelay, sleep, sleepUnlessStopped } from '../backoff.js';
import { redactStreamUrl } from '../config/stream-url.js';
import { encodePosition, firstToRead, isSettled, positionOf, type ReadPosition } from '../dedup/position.js';
import { type BridgeError, ConfigError, describe, FatalConnectError, RuntimeFailure } from '../errors.js';
import type { Logger } from '../log.js';
import type { Delivery, SourceSide } from '../ports.js';
import { type ContentHeader, ContentHeaderError } from '../wire/properties.js';
import { decodeMessage } from './amqp10-read.js';
import {
  type Chunk,
  type OffsetSpec,
  StreamClient,
  type StreamConnectOptions,
  type StreamMessage,
  StreamResponseError,
} from './client.js';
import { connectAtStart, type StreamEnd } from './connect.js';
import { streamExists } from './streams.js';

/** What the route has settled, kept across runs (src/dedup/position.ts). */
export interface Position {
  load(): Promise<ReadPosition | undefined>;
  init(first: bigint): Promise<ReadPosition>;
  save(position: ReadPosition): Promise<ReadPosition>;
}

export interface StreamSourceOptions {
  /** rabbitmq-stream:// or rabbitmq-stream+tls:// */
  url: string;
  stream: string;
  tls: ConnectionOptions | undefined;
  /** Where a route with no stored position starts (--source-start). */
  start: OffsetSpec;
  /** Messages held at most, give or take one chunk: no more credit is granted past it. */
  prefetch: number;
  /** migrate: read up to the stream's end as it was at start, then stop. */
  toEnd: boolean;
  /**
   * The target is a stream, which writes the stored bytes: an entry whose body has no 0-9-1 form
   * (an amqp-value, say) is forwarded all the same; into a queue it is held as unreadable.
   */
  storedBytes: boolean;
  /** The route may key an entry on its message-id: one too long for 0-9-1 is then held. */
  keysOnMessageId: boolean;
  /** How long start waits for an endpoint that does not answer (--retry-for; 0: for ever). */
  retryForMs: number;
  stop: AbortSignal | undefined;
}

// The consuming subscription, and the one that looks at the stream's last chunk.
const SUBSCRIPTION = 0;
const PROBE = 1;
/** Chunks asked for ahead while the pipeline has room. */
const CREDIT_AHEAD = 2;
/**
 * How long the probe waits for the last chunk. RabbitMQ 3.10 sends a non-empty stream's last chunk
 * at once and says nothing for an empty one (it has no command that tells a stream's end).
 */
const PROBE_WAIT_MS = 3000;
/** How often a moved position is written to Redis while messages are settled. */
const SAVE_EVERY_MS = 200;
/** How long a stop waits to store the last position. */
const FINAL_SAVE_MS = 5000;

/** One message read from the stream, held until the pipeline settles it. */
class StreamDelivery implements Delivery {
  readonly fields: { routingKey: string; exchange: string; redelivered: boolean };
  readonly properties: { messageId?: unknown };
  settled = false;

  constructor(
    readonly offset: bigint,
    readonly amqp10: Buffer,
    readonly content: Buffer,
    readonly header: ContentHeader | undefined,
    readonly unreadable: string | undefined,
    readonly exchange: Buffer,
    readonly routingKey: Buffer,
  ) {
    this.fields = {
      routingKey: routingKey.toString('utf8'),
      exchange: exchange.toString('utf8'),
      redelivered: false,
    };
    const messageId = header?.messageIdBytes;
    this.properties = messageId === undefined ? {} : { messageId: messageId.toString('utf8') };
  }
}

/** What a stream's last chunk says: where it starts and the offset after it. */
interface Tail {
  first: bigint;
  end: bigint;
}

/**
 * A RabbitMQ stream as source, over the stream protocol. Messages are delivered in offset order;
 * the pipeline settles them in any order, and the route's position (what it settled: every offset
 * before one, but the holes it names) goes to Redis, so a restart reads again every message that
 * is not settled and none that is. A message held because it cannot be forwarded is a hole: the
 * route reads on past it. Acks are the bridge's own bookkeeping: a lost connection takes nothing
 * back, and the reader continues after the last message it delivered.
 */
export class StreamSource implements SourceSide {
  onFatal: (error: BridgeError) => void = () => {};
  /** `<cluster>/<vhost>` of the source broker, once connected. */
  identity: string | undefined;
  readonly bytes = { held: 0, peak: 0, returned: 0 };

  private client: StreamClient | undefined;
  private down: number | undefined = Date.now();
  private closed = false;
  private consuming = false;
  private onDelivery: ((delivery: Delivery) => void) | undefined;
  /** Delivered and not settled, by offset, in offset order (deliveries come in that order). */
  private readonly unsettled = new Map<bigint, StreamDelivery>();
  /** The offset after the highest one settled in this run. */
  private settledTop: bigint | undefined;
  /** The position this run started from: what it settled is not delivered again. */
  private loaded: ReadPosition | undefined;
  /** The offset after the last message delivered (or skipped as settled); undefined before. */
  private nextOffset: bigint | undefined;
  /** Where the first subscription starts when nothing was delivered yet. */
  private from: OffsetSpec;
  /** migrate: the offset after the last message to read. */
  private end: bigint | undefined;
  private held = 0;
  private credits = 0;
  /** The position Redis holds, as far as this reader knows. */
  private saved: ReadPosition | undefined;
  private saving: Promise<void> | undefined;
  private saveFailing = false;
  private saveTimer: NodeJS.Timeout | undefined;
  private recovering: Promise<void> | undefined;
  private closing: Promise<void> | undefined;
  private readonly shown: string;

  /** Set at start, once the stream's cluster is known (the position is named after it). */
  private position: Position = {
    load: async () => undefined,
    init: async (first) => ({ next: first, holes: [] }),
    save: async (position) => position,
  };

  constructor(
    private readonly options: StreamSourceOptions,
    private readonly log: Logger,
  ) {
    this.shown = redactStreamUrl(options.url);
    this.from = options.start;
  }

  get where(): string {
    return `source stream "${this.options.stream}" at ${this.shown}`;
  }

  get isUp(): boolean {
    return this.down === undefined;
  }

  get downSince(): number | undefined {
    return this.down;
  }

  /**
   * Connects (a wrong password, vhost or stream is the user's error), reads the route's position
   * and, where it must, the stream's end: migrate reads up to it; `next` and `last` become the
   * offsets they name now, stored at once, so that a restart does not skip what came meanwhile.
   */
  async start(positionFor: (source: string) => Position): Promise<void> {
    const client = await this.firstConnect();
    if (!(await streamExists(client, this.options.stream))) {
      await client.close();
      throw new FatalConnectError(
        `--source-stream: stream "${this.options.stream}" does not exist on the source stream endpoint at ${this.shown}; check the name and the URL's vhost`,
      );
    }
    const cluster = client.serverProperties.cluster_name ?? `${client.endpoint.host}:${client.endpoint.port}`;
    this.identity = `${cluster}/${client.endpoint.vhost}`;
    this.position = positionFor(`${this.identity}/${this.options.stream}`);
    try {
      const stored = await this.position.load();
      const needsTail =
        this.options.toEnd || stored !== undefined || this.from === 'next' || this.from === 'last';
      const tail = needsTail ? await this.tail(client) : undefined;
      if (stored !== undefined) {
        const end = tail?.end ?? 0n;
        if (end < stored.next) {
          throw new ConfigError(
            `${this.where} ends at offset ${end}, but this route has read it up to offset ${stored.next}: the stream was deleted and created again, or did not answer within ${PROBE_WAIT_MS / 1000}s, or the route was started past its end (--source-start) and the stream has not reached that offset yet. A recreated stream's new messages would take the old ones' IDs, so nothing is read: forward such a stream under a new --scope`,
          );
        }
        this.loaded = stored;
      } else if (this.from === 'next' || this.from === 'last') {
        const at = tail === undefined ? 0n : this.from === 'next' ? tail.end : tail.first;
        this.loaded = await this.position.init(at);
      } else if (typeof this.from === 'object' && 'offset' in this.from) {
        // Stored at once too: a run that reaches nothing there yet leaves the route starting there.
        this.loaded = await this.position.init(this.from.offset);
      }
      if (this.loaded) {
        this.saved = this.loaded;
        this.from = { offset: firstToRead(this.loaded) };
      }
      if (this.options.toEnd) this.end = tail?.end ?? 0n;
    } catch (error) {
      await client.close();
      throw error;
    }
    this.attach(client);
    this.saveTimer = setInterval(() => void this.save(), SAVE_EVERY_MS);
    this.log.info(
      {
        stream: this.options.stream,
        from: describeSpec(this.from),
        ...(this.end === undefined ? {} : { to: String(this.end) }),
      },
      'reading the source stream',
    );
  }

  // ---- Source ------------------------------------------------------------------------------------

  async consume(onDelivery: (delivery: Delivery) => void): Promise<void> {
    this.onDelivery = onDelivery;
    this.consuming = true;
    if (this.client) await this.subscribe(this.client);
  }

  async stopConsuming(): Promise<void> {
    if (!this.consuming) return;
    this.consuming = false;
    const client = this.client;
    if (client?.isOpen) await client.unsubscribe(SUBSCRIPTION).catch(() => {});
  }

  headerOf(delivery: Delivery): ContentHeader {
    const message = delivery as StreamDelivery;
    if (message.header === undefined) throw new ContentHeaderError(message.unreadable ?? 'unreadable');
    return message.header;
  }

  routingOf(delivery: Delivery): { exchange: Buffer; routingKey: Buffer } {
    const message = delivery as StreamDelivery;
    return { exchange: message.exchange, routingKey: message.routingKey };
  }

  positionOf(delivery: Delivery): string {
    return `${this.identity}/${this.options.stream}@${(delivery as StreamDelivery).offset}`;
  }

  ack(delivery: Delivery): boolean {
    const message = delivery as StreamDelivery;
    if (message.settled) return false;
    message.settled = true;
    this.unsettled.delete(message.offset);
    if (this.settledTop === undefined || message.offset >= this.settledTop)
      this.settledTop = message.offset + 1n;
    this.release(message);
    return true;
  }

  /** Not settled: it stays a hole in the position, so the next run reads it again. */
  requeue(delivery: Delivery): boolean {
    const message = delivery as StreamDelivery;
    if (message.settled) return false;
    this.release(message);
    return true;
  }

  /** A stream has no dead-lettering (the settings refuse the policy): kept, as a requeue. */
  deadLetter(delivery: Delivery): boolean {
    return this.requeue(delivery);
  }

  async park(): Promise<boolean> {
    return false;
  }

  /** Always, until settled: the broker takes nothing back from a stream reader. */
  holds(delivery: Delivery): boolean {
    return !(delivery as StreamDelivery).settled;
  }

  // ---- SourceSide --------------------------------------------------------------------------------

  /** migrate: messages not yet delivered up to the end; run follows the stream: unknown. */
  async depth(): Promise<number | undefined> {
    if (this.end === undefined) return undefined;
    const next =
      this.nextOffset ?? (typeof this.from === 'object' && 'offset' in this.from ? this.from.offset : 0n);
    return Number(this.end > next ? this.end - next : 0n);
  }

  consumption(): { consuming: boolean; paused: boolean } {
    return { consuming: this.consuming && this.client !== undefined, paused: false };
  }

  /**
   * What this route has settled: what it started from, and what it settled since. The holes are
   * the messages delivered and not settled, and those of the start's holes not yet read again.
   */
  get positionNow(): ReadPosition | undefined {
    let next = this.loaded?.next;
    if (this.settledTop !== undefined && (next === undefined || this.settledTop > next))
      next = this.settledTop;
    if (next === undefined) return undefined;
    return positionOf(next, this.unsettledOffsets());
  }

  /** Ascending: the deliveries not settled, then the start's holes not yet delivered again. */
  private *unsettledOffsets(): Generator<bigint> {
    yield* this.unsettled.keys();
    const read = this.nextOffset ?? this.startOffset;
    for (const [first, last] of this.loaded?.holes ?? []) {
      let offset = first;
      if (offset < read) offset = read;
      for (; offset <= last; offset++) yield offset;
    }
  }

  /** Once: the bridge's stop and the source's close both ask for it. */
  closeConsumer(): Promise<void> {
    this.closing ??= this.finishConsuming();
    return this.closing;
  }

  private async finishConsuming(): Promise<void> {
    await this.stopConsuming();
    if (this.saveTimer) clearInterval(this.saveTimer);
    this.saveTimer = undefined;
    // The last settlements: a few tries within a bound (a Redis that does not answer would hold
    // the stop for ever), then the next run reads those messages again, as duplicates.
    const deadline = Date.now() + FINAL_SAVE_MS;
    for (let attempt = 1; ; attempt++) {
      let timer: NodeJS.Timeout | undefined;
      await Promise.race([
        this.save(),
        new Promise((resolve) => {
          timer = setTimeout(resolve, Math.max(0, deadline - Date.now()));
        }),
      ]);
      clearTimeout(timer);
      const left = this.unsaved();
      if (!left) return;
      if (attempt >= 5 || Date.now() >= deadline) {
        this.log.warn(
          { position: encodePosition(left) },
          `${this.where}: the read position could not be stored; the next run reads again what was settled since the last one stored (duplicates, skipped)`,
        );
        return;
      }
      await sleep(backoffDelay(attempt, 50, 500));
    }
  }

  async close(): Promise<void> {
    await this.closeConsumer();
    this.closed = true;
    const client = this.client;
    this.client = undefined;
    await client?.close();
  }

  // ---- reading -----------------------------------------------------------------------------------

  private release(message: StreamDelivery): void {
    this.held--;
    this.bytes.held -= message.content.length;
    this.topUp();
  }

  private async subscribe(client: StreamClient): Promise<void> {
    if (this.reachedEnd) return;
    const from: OffsetSpec = this.nextOffset === undefined ? this.from : { offset: this.nextOffset };
    this.credits = CREDIT_AHEAD;
    await client.subscribe(SUBSCRIPTION, this.options.stream, from, CREDIT_AHEAD, { manualCredit: true });
  }

  private get reachedEnd(): boolean {
    return this.end !== undefined && (this.nextOffset ?? this.startOffset) >= this.end;
  }

  private get startOffset(): bigint {
    return typeof this.from === 'object' && 'offset' in this.from ? this.from.offset : 0n;
  }

  /** Asks for more chunks while the pipeline holds fewer than the prefetch. */
  private topUp(): void {
    const client = this.client;
    if (!client || !this.consuming || this.reachedEnd) return;
    if (this.held < this.options.prefetch && this.credits < CREDIT_AHEAD) {
      client.credit(SUBSCRIPTION, CREDIT_AHEAD - this.credits);
      this.credits = CREDIT_AHEAD;
    }
  }

  private onChunk(chunk: Chunk): void {
    this.credits = Math.max(0, this.credits - 1);
    if (!this.consuming || !this.onDelivery) return;
    for (const stored of chunk.messages) {
      // The pipeline may stop consuming in the middle of a chunk (--max-messages reached).
      if (!this.consuming) break;
      // A chunk starts where the broker found it: messages before the one asked for come again.
      if (this.nextOffset !== undefined ? stored.offset < this.nextOffset : stored.offset < this.startOffset)
        continue;
      if (this.end !== undefined && stored.offset >= this.end) break;
      // Settled in an earlier run, around a hole read again.
      if (this.loaded && isSettled(this.loaded, stored.offset)) {
        this.nextOffset = stored.offset + 1n;
        continue;
      }
      const message = this.read(stored);
      this.nextOffset = stored.offset + 1n;
      this.unsettled.set(message.offset, message);
      this.held++;
      this.bytes.held += message.content.length;
      if (this.bytes.held > this.bytes.peak) this.bytes.peak = this.bytes.held;
      this.onDelivery(message);
    }
    if (this.reachedEnd) {
      const client = this.client;
      if (client?.isOpen) void client.unsubscribe(SUBSCRIPTION).catch(() => {});
      return;
    }
    this.topUp();
  }

  private read({ offset, data, unreadable }: StreamMessage): StreamDelivery {
    try {
      if (unreadable !== undefined) throw new Error(unreadable);
      const decoded = decodeMessage(data, this.options.stream, {
        anyBody: this.options.storedBytes,
        keepMessageId: this.options.keysOnMessageId,
      });
      return new StreamDelivery(
        offset,
        data,
        decoded.body,
        decoded.header,
        undefined,
        decoded.exchange,
        decoded.routingKey,
      );
    } catch (error) {
      const why = `stream message at offset ${offset}: ${(error as Error).message}`;
      return new StreamDelivery(offset, data, data, undefined, why, Buffer.alloc(0), Buffer.alloc(0));
    }
  }

  /** The position to write, when it differs from what Redis holds (and is not behind it). */
  private unsaved(): ReadPosition | undefined {
    const now = this.positionNow;
    if (now === undefined || this.saved === undefined) return now;
    if (this.saved.next > now.next || encodePosition(this.saved) === encodePosition(now)) return undefined;
    return now;
  }

  /** Writes the position when it moved; one write at a time. */
  private save(): Promise<void> {
    if (this.saving) return this.saving;
    const now = this.unsaved();
    if (now === undefined) return Promise.resolve();
    this.saving = this.position
      .save(now)
      .then(
        (kept) => {
          this.saved = kept;
          this.saveFailing = false;
        },
        (error: unknown) => {
          // Once per streak: the timer tries again every 200 ms.
          if (!this.saveFailing) {
            this.log.warn(
              { error: describe(error) },
              `${this.where}: storing the read position failed; retrying`,
            );
          }
          this.saveFailing = true;
        },
      )
      .finally(() => {
        this.saving = undefined;
      });
    return this.saving;
  }

  /**
   * The stream's last chunk, through a subscription of its own at `last`; undefined for an empty
   * stream. The broker sends a non-empty stream's last chunk right after its answer to the
   * subscribe, so by the answer to a request sent after that, the chunk has come: a line however
   * slow cannot make a stream look empty. The wait on top (from the subscribe) is for a broker that
   * sends the chunk later.
   */
  private async tail(client: StreamClient): Promise<Tail | undefined> {
    let onChunk: ((id: number, chunk: Chunk) => void) | undefined;
    let found: Tail | undefined;
    let arrived: () => void = () => {};
    try {
      const came = new Promise<void>((resolve) => {
        arrived = resolve;
      });
      onChunk = (id, chunk) => {
        if (id !== PROBE || found) return;
        found = { first: chunk.firstOffset, end: chunk.firstOffset + BigInt(chunk.numRecords) };
        arrived();
      };
      client.on('chunk', onChunk);
      const asked = Date.now();
      await client.subscribe(PROBE, this.options.stream, 'last', 1, { manualCredit: true });
      await streamExists(client, this.options.stream);
      if (!found) {
        let timer: NodeJS.Timeout | undefined;
        const waited = new Promise<void>((resolve) => {
          timer = setTimeout(resolve, Math.max(0, PROBE_WAIT_MS - (Date.now() - asked)));
        });
        await Promise.race([came, waited]);
        clearTimeout(timer);
      }
      return found;
    } finally {
      if (onChunk) client.off('chunk', onChunk);
      if (client.isOpen) await client.unsubscribe(PROBE).catch(() => {});
    }
  }

  // ---- the connection ----------------------------------------------------------------------------

  private connect(): Promise<StreamClient> {
    return StreamClient.connect(this.connectOptions());
  }

  private connectOptions(): StreamConnectOptions {
    return {
      url: this.options.url,
      tls: this.options.tls,
      connectionName: `dedup-bridge source ${this.options.stream}`,
    };
  }

  /** Connects at start: a refusal is the user's error at once, silence is retried (connect.ts). */
  private firstConnect(): Promise<StreamClient> {
    return connectAtStart(() => this.connect(), this.endpoint);
  }

  /** This side's endpoint, for connect.ts. */
  private get endpoint(): StreamEnd {
    return {
      side: 'source',
      where: this.where,
      shown: this.shown,
      retryForMs: this.options.retryForMs,
      stop: this.options.stop,
      log: this.log,
    };
  }

  private attach(client: StreamClient): void {
    client.on('chunk', (id, chunk) => {
      if (id === SUBSCRIPTION && client === this.client) this.onChunk(chunk);
    });
    client.on('metadata-update', (stream) => {
      if (stream === this.options.stream && client === this.client) {
        this.lost(client, `the broker says stream "${stream}" changed (its leader moved, or it was deleted)`);
      }
    });
    client.on('close', (error) => {
      if (client === this.client) this.lost(client, `connection lost: ${error ? describe(error) : 'closed'}`);
    });
    this.client = client;
    this.down = undefined;
  }

  private lost(client: StreamClient, reason: string): void {
    if (this.client !== client) return;
    this.client = undefined;
    client.destroy();
    if (this.closed) return;
    this.down ??= Date.now();
    if (this.recovering) return;
    this.log.warn({ reason }, `${this.where}: reconnecting`);
    this.recovering = this.reconnect().finally(() => {
      this.recovering = undefined;
    });
  }

  /** Connects again and reads on after the last message delivered (what is held stays held). */
  private async reconnect(): Promise<void> {
    for (let attempt = 1; !this.closed; attempt++) {
      await sleepUnlessStopped(backoffDelay(attempt, 100, 5000), this.options.stop);
      if (this.closed || this.options.stop?.aborted) return;
      let client: StreamClient | undefined;
      try {
        client = await this.connect();
        if (!(await streamExists(client, this.options.stream))) {
          await client.close();
          this.onFatal(
            new RuntimeFailure(`${this.where}: the stream no longer exists; nothing unforwarded was settled`),
          );
          return;
        }
        this.attach(client);
        if (this.consuming) await this.subscribe(client);
        this.log.info({ attempt }, `${this.where}: reconnected`);
        return;
      } catch (error) {
        if (client && this.client === client) this.client = undefined;
        client?.destroy();
        if (error instanceof StreamResponseError && error.codeName === 'ACCESS_REFUSED') {
          this.onFatal(new RuntimeFailure(`${this.where}: ${error.message}`));
          return;
        }
        this.down ??= Date.now();
        this.log.warn({ attempt, error: describe(error) }, `${this.where}: reconnect failed; retrying`);
      }
    }
  }
}

function describeSpec(spec: OffsetSpec): string {
  if (typeof spec === 'string') return spec;
  return 'offset' in spec
    ? `offset ${spec.offset}`
    : `timestamp ${new Date(Number(spec.timestamp)).toISOString()}`;
}
