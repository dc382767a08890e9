import type { ConnectionOptions } from 'node:tls';
import { backoffDelay, sleepUnlessStopped } from '../backoff.js';
import { redactStreamUrl } from '../config/stream-url.js';
import {
  BridgeError,
  ConfigError,
  describe,
  FatalConnectError,
  RuntimeFailure,
  StopRequested,
} from '../errors.js';
import { DUPLICATE_ID_HEADER, IN_DOUBT_HEADER, ROUTE_HEADER, SOURCE_USER_HEADER } from '../headers.js';
import type { Logger } from '../log.js';
import type { Publish, PublishOutcome, TargetSide } from '../ports.js';
import { ContentHeader } from '../wire/properties.js';
import { encodeMessage, mappingFor } from './amqp10.js';
import { replaceApplicationProperties } from './amqp10-read.js';
import { StreamClient, type StreamConnectOptions, StreamResponseError } from './client.js';
import { connectAtStart, type StreamEnd, streamStartError } from './connect.js';
import { missingStreamLine, streamExists } from './streams.js';

/**
 * What the stream target keeps in Redis about its producer (src/dedup/producer.ts): who owns it,
 * the last publishing ID given out, and the ledger of claims whose messages were given an ID.
 */
export interface ProducerRecord {
  take(): Promise<
    { ours: true; epoch: string } | { ours: false; waitMs: number } | { ours: false; over: true }
  >;
  ledger(): Promise<Map<string, bigint>>;
  reserve(keys: readonly string[], committed: readonly string[], floor: bigint): Promise<bigint>;
  settle(entries: readonly (readonly [string, bigint])[], floor: bigint): Promise<void>;
  leave(): Promise<void>;
}

/** What a new owner does with the claims an earlier owner's ledger left (the cache, DedupCache). */
export interface LedgerOutcomes {
  /** Their messages are on the stream: committed, so that their next copy is a duplicate. */
  commit(keys: readonly string[]): Promise<unknown>;
  /** Their messages are not on the stream: the claims go, so that their next copy goes unflagged. */
  unclaim(keys: readonly string[]): Promise<unknown>;
}

/** What the target uses of a stream connection (StreamClient; a fake in the unit tests). */
export type StreamConnection = Pick<
  StreamClient,
  | 'on'
  | 'metadata'
  | 'declarePublisher'
  | 'queryPublisherSequence'
  | 'publish'
  | 'drain'
  | 'close'
  | 'destroy'
  | 'isOpen'
  | 'frameMax'
  | 'serverVersion'
>;

export interface StreamTargetOptions {
  /** rabbitmq-stream:// or rabbitmq-stream+tls:// */
  url: string;
  stream: string;
  /** The producer's name on the stream (its publisher reference): one per route. */
  producer: string;
  /** tls.connect options for a rabbitmq-stream+tls:// URL. */
  tls: ConnectionOptions | undefined;
  /** The producer's lease in Redis, as --lease: a stalled owner stops writing well within it. */
  leaseMs: number;
  /** How long start waits for an endpoint that does not answer (--retry-for; 0: for ever). */
  retryForMs: number;
  /** Opens a connection (default StreamClient.connect; the unit tests pass a fake). */
  connect?: (options: StreamConnectOptions) => Promise<StreamConnection>;
  stop: AbortSignal | undefined;
}

/** Another bridge took the route's producer over (this one stalled past its lease): exit. */
class ProducerTakenError extends RuntimeFailure {}

// One publisher per connection: its ID on the connection.
const PUBLISHER_ID = 0;
// The most messages one reservation gives IDs to (one Redis call).
const MAX_RESERVE = 1000;
// As for message claims (see Leases): write only while a third of the producer's lease is left.
const LEASE_WRITE_SHARE = 1 / 3;
// Publish-frame bytes around a message: frame size 4, key 2, version 2, publisher 1, count 4,
// then per message its publishing ID 8 and length 4.
const FRAME_OVERHEAD = 13 + 12;
// Codes after which retrying cannot help: the bridge stops with the broker's word for it.
const FATAL_CODES = new Set(['ACCESS_REFUSED', 'STREAM_DOES_NOT_EXIST']);

interface Item {
  publish: Publish;
  answered: (outcome: PublishOutcome) => void;
  data: Buffer;
  /** Its publishing ID, once reserved (0n before). */
  id: bigint;
  /** On a connection now, unanswered. */
  written: boolean;
  /**
   * Ever handed to a connection at its ID: from then on it is only ever written again at that ID
   * (a second write at the same ID can never make a second copy; one at a new ID could).
   */
  sent: boolean;
}

/**
 * A RabbitMQ stream as target, over the stream protocol, with no in-doubt window: the route's
 * producer is named (a publisher reference), has one live owner at a time (fenced in Redis by an
 * epoch), and gives each message a publishing ID, strictly increasing, recorded with its claim in
 * the producer's ledger before it is written. RabbitMQ stores an ID only above the last one it
 * stored for that name (it confirms and drops the others), and says which that last one is. So:
 * - after a lost connection, a written message at or below that last ID is stored; one above it
 *   is not, and goes again at the same ID, so that two writes of it can never make two copies;
 * - a new owner (after a crash or a takeover) splits the ledger the same way: the messages at or
 *   below the last ID are committed (their copies come back as duplicates), the others'
 *   claims are dropped (their copies go unflagged, once);
 * - an ID is never moved past: one not written (its lease ran out first) leaves the ledger before
 *   any higher ID is written, and one the broker refused is given a new ID.
 * Messages are stored as RabbitMQ stores a 0-9-1 publish into a stream (see amqp10.ts).
 */
export class StreamTarget implements TargetSide {
  onFatal: (error: BridgeError) => void = () => {};
  sizeLimit: number | undefined;
  /** The target answers every publish as stored or not stored: the pipeline never flags a copy. */
  readonly exact = true;
  renewLeases: ((publishes: readonly Publish[]) => Promise<void>) | undefined;
  /** Failed for good (another bridge took the producer, the stream went): nothing more is stored. */
  ended = false;

  private client: StreamConnection | undefined;
  private down: number | undefined = Date.now();
  private closed = false;
  /** Encoded, waiting for an ID. */
  private readonly waiting: Item[] = [];
  /** Given an ID, in ID order: written and unanswered, or waiting to be written. */
  private readonly reserved: Item[] = [];
  /** Written, unanswered, by ID. */
  private readonly out = new Map<bigint, Item>();
  /** Claim keys committed since the last reservation: their ledger entries go with the next. */
  private committedKeys: string[] = [];
  /** The highest ID given out that we know of (a floor for the next, should Redis lose it). */
  private lastGiven = 0n;
  private pumping = false;
  /** The last connection's frame max (0 before the first): messages are sized against it. */
  private frameMax = 0;
  /** Ledger entries of refused IDs being dropped: nothing more is reserved or written meanwhile. */
  private voiding: Promise<void> | undefined;
  private leaseUntil = 0;
  private renewTimer: NodeJS.Timeout | undefined;
  private recovering: Promise<void> | undefined;
  private readonly shown: string;

  constructor(
    private readonly options: StreamTargetOptions,
    private readonly record: ProducerRecord,
    private readonly outcomes: LedgerOutcomes,
    private readonly log: Logger,
  ) {
    this.shown = redactStreamUrl(options.url);
  }

  get where(): string {
    return `target stream "${this.options.stream}" at ${this.shown}`;
  }

  get isUp(): boolean {
    return this.down === undefined;
  }

  get downSince(): number | undefined {
    return this.down;
  }

  get blockedSince(): undefined {
    return undefined;
  }

  /** A stream target writes into no queue a 0-9-1 source could be consuming as such. */
  feeds(): boolean {
    return false;
  }

  /**
   * Connects (a wrong password, vhost or stream is the user's error), then waits to own the
   * route's producer (another replica may hold it: this one stands by), settles what an earlier
   * owner left, and is ready to publish.
   */
  async start(): Promise<void> {
    let client = await this.firstConnect();
    if (!(await streamExists(client, this.options.stream))) {
      await client.close();
      throw new FatalConnectError(
        missingStreamLine(this.options.stream, `target stream endpoint at ${this.shown}`),
      );
    }
    try {
      mappingFor(client.serverVersion);
    } catch (error) {
      await client.close();
      throw new ConfigError(
        `${this.where}: ${(error as Error).message}; a stream target needs RabbitMQ 3.9 to 3.12 for now`,
      );
    }
    await this.waitForProducer(client);
    if (!client.isOpen) client = await this.firstConnect();
    await this.settleLedger(client);
    this.renewTimer = setInterval(
      () => void this.renew(),
      Math.max(100, Math.floor(this.options.leaseMs / 3)),
    );
    try {
      await this.attach(client);
    } catch (error) {
      throw streamStartError(error, this.endpoint);
    }
  }

  /** Connects at start: a refusal is the user's error at once, silence is retried (connect.ts). */
  private firstConnect(): Promise<StreamConnection> {
    return connectAtStart(() => this.connect(), this.endpoint);
  }

  /** This side's endpoint, for connect.ts. */
  private get endpoint(): StreamEnd {
    return {
      side: 'target',
      where: this.where,
      shown: this.shown,
      retryForMs: this.options.retryForMs,
      stop: this.options.stop,
      log: this.log,
    };
  }

  async close(): Promise<void> {
    this.closed = true;
    if (this.renewTimer) clearInterval(this.renewTimer);
    // Whatever is unanswered may be stored or not: the next owner's ledger split decides.
    for (const item of [...this.waiting.splice(0), ...this.reserved.splice(0)]) item.answered('unknown');
    this.out.clear();
    const client = this.client;
    this.client = undefined;
    // Closed politely first: the broker takes every frame before the close, then the producer is
    // free for a standby at once.
    await client?.close();
    await this.record.leave().catch(() => {});
  }

  send(publish: Publish, answered: (outcome: PublishOutcome) => void): void {
    if (this.closed) {
      answered(this.ended ? 'unknown' : 'unsent');
      return;
    }
    let data: Buffer;
    try {
      const header = new ContentHeader(publish.properties);
      data =
        (publish.amqp10 && storedCopy(publish.amqp10, header, publish.idField !== undefined)) ??
        encodeMessage(header, publish.content, { exchange: '', routingKey: this.options.stream }).bytes;
    } catch (error) {
      publish.refusal = `cannot be stored in a stream: ${(error as Error).message}`;
      answered('unpublishable');
      return;
    }
    const frameMax = this.frameMax;
    if (frameMax > 0 && data.length + FRAME_OVERHEAD > frameMax) {
      this.refuseTooLarge(publish, data.length, frameMax, answered);
      return;
    }
    this.waiting.push({ publish, answered, data, id: 0n, written: false, sent: false });
    this.pump();
  }

  private refuseTooLarge(
    publish: Publish,
    size: number,
    frameMax: number,
    answered: (outcome: PublishOutcome) => void,
  ): void {
    this.sizeLimit = frameMax - FRAME_OVERHEAD;
    publish.refusal = `${size} bytes as stored, over the stream connection's frame max of ${frameMax} bytes`;
    answered('too-large');
  }

  /**
   * Drops the connection (what has not left this host is never sent) and connects again; every
   * written publish is then answered by the broker's last stored ID, so none ends unknown.
   */
  reset(reason: string): void {
    this.breakConnection(reason);
  }

  /** These claims are committed: their ledger entries can go (with the next reservation). */
  committed(keys: readonly string[]): void {
    for (const key of keys) this.committedKeys.push(key);
  }

  // ---- the producer ----------------------------------------------------------------------------

  /** Takes the producer; while another bridge owns it, this one stands by. */
  private async waitForProducer(client: StreamConnection): Promise<void> {
    let standingBy = false;
    for (let attempt = 1; ; attempt++) {
      if (this.options.stop?.aborted) {
        await client.close();
        throw new StopRequested(`the stream producer "${this.options.producer}"`);
      }
      const askedAt = performance.now();
      const taken = await this.record.take();
      if (taken.ours) {
        this.leaseUntil = askedAt + this.options.leaseMs;
        break;
      }
      const waitMs = 'waitMs' in taken ? taken.waitMs : 0;
      if (!standingBy) {
        standingBy = true;
        this.log.info(
          { producer: this.options.producer, stream: this.options.stream, leaseLeftMs: waitMs },
          'standing by: another bridge owns this route’s stream producer; taking over when its lease runs out',
        );
      }
      await sleepUnlessStopped(
        Math.min(this.options.leaseMs, waitMs) + backoffDelay(attempt, 50, 500),
        this.options.stop,
      );
    }
  }

  /** Settles what earlier owners left, by the broker's last stored ID for our name. */
  private async settleLedger(client: StreamConnection): Promise<void> {
    const ledger = await this.record.ledger();
    const last = await client.queryPublisherSequence(this.options.producer, this.options.stream);
    const landed: string[] = [];
    const notLanded: string[] = [];
    let floor = last;
    for (const [key, id] of ledger) {
      (id <= last ? landed : notLanded).push(key);
      if (id > floor) floor = id;
    }
    if (landed.length > 0) await this.outcomes.commit(landed);
    if (notLanded.length > 0) await this.outcomes.unclaim(notLanded);
    await this.record.settle([...ledger], floor);
    this.lastGiven = floor;
    this.log.info(
      {
        producer: this.options.producer,
        lastStored: String(last),
        landed: landed.length,
        notLanded: notLanded.length,
      },
      'stream producer taken: messages an earlier owner left at or below the last stored ID committed, the others to go again',
    );
  }

  private async renew(): Promise<void> {
    if (this.closed) return;
    const askedAt = performance.now();
    try {
      const taken = await this.record.take();
      if (taken.ours) {
        this.leaseUntil = askedAt + this.options.leaseMs;
        this.pump();
      } else {
        this.fatal(
          new ProducerTakenError(
            `another bridge took over the stream producer "${this.options.producer}" of ${this.where} (this one could not renew it within --lease); stopping, so that what it holds goes back to the source`,
          ),
        );
      }
    } catch (error) {
      this.log.warn({ error: describe(error) }, 'stream producer lease renewal failed; will retry');
    }
  }

  private get leaseHolds(): boolean {
    return performance.now() < this.leaseUntil - this.options.leaseMs * LEASE_WRITE_SHARE;
  }

  // ---- writing ---------------------------------------------------------------------------------

  /** Reserves IDs and writes, one round at a time, while the connection is up. */
  private pump(): void {
    if (this.pumping || this.closed) return;
    this.pumping = true;
    void this.pumpRounds()
      .catch((error: unknown) => {
        if (error instanceof BridgeError) this.fatal(error);
        else {
          this.log.warn({ error: describe(error) }, 'stream target: a Redis call failed; retrying');
          setTimeout(() => this.pump(), 200).unref();
        }
      })
      .finally(() => {
        this.pumping = false;
        if (this.canWrite && (this.waiting.length > 0 || this.unwritten > 0)) this.pump();
      });
  }

  private get canWrite(): boolean {
    return !this.closed && this.client !== undefined && this.client.isOpen && this.leaseHolds;
  }

  private get unwritten(): number {
    let count = 0;
    for (const item of this.reserved) if (!item.written) count++;
    return count;
  }

  private async pumpRounds(): Promise<void> {
    while (this.canWrite) {
      if (this.voiding) {
        await this.voiding;
        continue;
      }
      if (this.unwritten === 0) {
        if (this.waiting.length === 0) return;
        await this.reserveNext();
        continue;
      }
      await this.writeReserved();
    }
  }

  /**
   * Asks for the leases of those whose writeBy passed (see Target.renewLeases), so that a wait
   * does not fence them and send them after the messages behind them. A failed ask fences them.
   */
  private async renewExpired(items: readonly Item[]): Promise<void> {
    const now = performance.now();
    const expired = items
      .filter((item) => !item.sent && item.publish.writeBy <= now)
      .map((item) => item.publish);
    if (expired.length === 0 || !this.renewLeases) return;
    try {
      await this.renewLeases(expired);
    } catch (error) {
      this.log.warn(
        { error: describe(error) },
        'renewing the leases of messages waiting to be written failed',
      );
    }
  }

  /** Gives the next waiting messages their IDs (those whose lease no longer holds go back unsent). */
  private async reserveNext(): Promise<void> {
    await this.renewExpired(this.waiting.slice(0, MAX_RESERVE));
    const now = performance.now();
    const batch: Item[] = [];
    while (this.waiting.length > 0 && batch.length < MAX_RESERVE) {
      const item = this.waiting.shift() as Item;
      if (item.publish.writeBy <= now) item.answered('fenced');
      else batch.push(item);
    }
    if (batch.length === 0) return;
    const committed = this.committedKeys;
    this.committedKeys = [];
    let first: bigint;
    try {
      first = await this.record.reserve(
        batch.map((item) => item.publish.key as string),
        committed,
        this.lastGiven,
      );
    } catch (error) {
      this.waiting.unshift(...batch);
      this.committedKeys.push(...committed);
      throw this.fencedOr(error);
    }
    batch.forEach((item, index) => {
      item.id = first + BigInt(index);
      this.reserved.push(item);
    });
    this.lastGiven = first + BigInt(batch.length - 1);
  }

  /**
   * Writes the reserved messages not yet written, in ID order. One whose lease ran out meanwhile
   * leaves the ledger first (an ID is never moved past while it is recorded), and is not sent.
   */
  private async writeReserved(): Promise<void> {
    await this.renewExpired(this.reserved);
    const now = performance.now();
    const frameMax = this.frameMax;
    // Too large for this connection's frames (its size was not known when it was sent to us).
    const tooLarge = (item: Item) => frameMax > 0 && item.data.length + FRAME_OVERHEAD > frameMax;
    const dropped = this.reserved.filter(
      (item) => !item.sent && (item.publish.writeBy <= now || tooLarge(item)),
    );
    if (dropped.length > 0) {
      try {
        await this.record.settle(
          dropped.map((item) => [item.publish.key as string, item.id] as const),
          0n,
        );
      } catch (error) {
        throw this.fencedOr(error);
      }
      for (const item of dropped) {
        this.remove(item);
        if (tooLarge(item)) this.refuseTooLarge(item.publish, item.data.length, frameMax, item.answered);
        else item.answered('fenced');
      }
      // The settle took a Redis round trip: the next round looks at every lease again, then writes.
      return;
    }
    const client = this.client as StreamConnection;
    const batch = this.reserved.filter((item) => !item.written);
    for (const item of batch) {
      item.written = true;
      item.sent = true;
      item.publish.written = true;
      this.out.set(item.id, item);
    }
    let writable: boolean;
    try {
      writable = client.publish(
        PUBLISHER_ID,
        batch.map((item) => ({ publishingId: item.id, data: item.data })),
      );
    } catch (error) {
      // The connection went as we wrote: the recovery answers them by the last stored ID.
      this.breakConnection(`write failed: ${describe(error)}`);
      return;
    }
    if (!writable) await client.drain();
  }

  private remove(item: Item): void {
    const at = this.reserved.indexOf(item);
    if (at >= 0) this.reserved.splice(at, 1);
    this.out.delete(item.id);
  }

  private onConfirm(ids: readonly bigint[]): void {
    for (const id of ids) {
      const item = this.out.get(id);
      if (!item) continue;
      this.remove(item);
      item.answered('stored');
    }
  }

  /**
   * The broker refused these IDs (not stored). A later ID may be stored already, so each goes
   * again with a new ID; and the connection is started again, as after any failure, so that
   * nothing moves past them unseen.
   */
  private onPublishError(errors: readonly { publishingId: bigint; codeName: string }[]): void {
    const refused: Item[] = [];
    const voids: (readonly [string, bigint])[] = [];
    for (const { publishingId, codeName } of errors) {
      const item = this.out.get(publishingId);
      if (FATAL_CODES.has(codeName)) {
        this.fatal(
          new RuntimeFailure(
            `${this.where} refused a publish: ${codeName}${codeName === 'ACCESS_REFUSED' ? ' (the user may not write to it; grant write on the stream)' : ' (the stream was deleted)'}; nothing refused was acked`,
          ),
        );
        return;
      }
      if (!item) continue;
      this.remove(item);
      // Not stored, and a later ID may be: its ledger entry must not outlive this (a new owner
      // would take it for stored).
      voids.push([item.publish.key as string, item.id]);
      item.written = false;
      item.sent = false;
      item.id = 0n;
      refused.push(item);
    }
    if (refused.length === 0) return;
    this.log.warn(
      { count: refused.length, code: errors[0]?.codeName },
      'stream publishes refused by the broker; sending them again under new IDs',
    );
    this.waiting.unshift(...refused);
    this.dropFromLedger(voids);
    this.breakConnection(`${refused.length} publish(es) refused: ${errors[0]?.codeName}`);
  }

  /** Drops ledger entries at once, whatever the connection does; the pump waits for it. */
  private dropFromLedger(entries: readonly (readonly [string, bigint])[]): void {
    const previous = this.voiding ?? Promise.resolve();
    const voiding: Promise<void> = previous.then(async () => {
      for (let attempt = 1; !this.closed; attempt++) {
        try {
          await this.record.settle(entries, 0n);
          return;
        } catch (error) {
          const fenced = this.fencedOr(error);
          if (fenced instanceof BridgeError) {
            this.fatal(fenced);
            return;
          }
          this.log.warn(
            { error: describe(error) },
            'stream target: dropping refused IDs from the ledger failed; retrying',
          );
          await sleepUnlessStopped(backoffDelay(attempt, 100, 2000), this.options.stop);
        }
      }
    });
    this.voiding = voiding;
    void voiding.finally(() => {
      if (this.voiding === voiding) this.voiding = undefined;
      this.pump();
    });
  }

  // ---- the connection --------------------------------------------------------------------------

  private connectOptions(): StreamConnectOptions {
    return {
      url: this.options.url,
      tls: this.options.tls,
      connectionName: `dedup-bridge target ${this.options.producer}`,
    };
  }

  private connect(): Promise<StreamConnection> {
    return (this.options.connect ?? StreamClient.connect)(this.connectOptions());
  }

  /** Takes a connection into use: declares the publisher, answers what was written before by the last stored ID. */
  private async attach(client: StreamConnection): Promise<void> {
    client.on('confirm', (publisherId, ids) => {
      if (publisherId === PUBLISHER_ID && client === this.client) this.onConfirm(ids);
    });
    client.on('publish-error', (publisherId, errors) => {
      if (publisherId === PUBLISHER_ID && client === this.client) this.onPublishError(errors);
    });
    client.on('metadata-update', (stream) => {
      if (stream === this.options.stream && client === this.client) {
        this.breakConnection(
          `the broker says stream "${stream}" changed (its leader moved, or it was deleted)`,
        );
      }
    });
    client.on('close', (error) => {
      if (client !== this.client) return;
      this.client = undefined;
      if (!this.closed) this.recover(`connection lost: ${error ? describe(error) : 'closed'}`);
    });
    await client.declarePublisher(PUBLISHER_ID, this.options.producer, this.options.stream);
    // The last stored ID says what of ours is stored only while nobody else wrote under our name:
    // the producer must still be ours, at our epoch, from before the query to after its answer.
    const askedAt = performance.now();
    const taken = await this.record.take();
    if (!taken.ours) throw this.taken();
    this.leaseUntil = askedAt + this.options.leaseMs;
    const last = await client.queryPublisherSequence(this.options.producer, this.options.stream);
    if (!this.leaseHolds) throw new Error('the producer lease ran low while settling the connection');
    this.frameMax = client.frameMax;
    this.settleWritten(last);
    if (this.closed) {
      await client.close();
      return;
    }
    this.client = client;
    this.down = undefined;
    this.pump();
  }

  /** Written and unanswered: at or below `last` it is stored; above, it goes again at its ID. */
  private settleWritten(last: bigint): void {
    let stored = 0;
    let again = 0;
    for (const item of [...this.out.values()]) {
      if (item.id <= last) {
        this.remove(item);
        item.answered('stored');
        stored++;
      } else {
        this.out.delete(item.id);
        // Still in `reserved`, at its ID, unwritten: the next write sends it again at that ID.
        item.written = false;
        again++;
      }
    }
    if (stored + again > 0) {
      this.log.info(
        { lastStored: String(last), stored, again },
        'stream connection back: unanswered publishes at or below the last stored ID are stored, the others sent again at their IDs',
      );
    }
  }

  private breakConnection(reason: string): void {
    const client = this.client;
    if (!client) return;
    this.client = undefined;
    client.destroy();
    if (!this.closed) this.recover(reason);
  }

  private recover(reason: string): void {
    this.down ??= Date.now();
    if (this.recovering) return;
    this.log.warn({ reason }, `${this.where}: reconnecting`);
    this.recovering = (async () => {
      for (let attempt = 1; !this.closed; attempt++) {
        await sleepUnlessStopped(backoffDelay(attempt, 100, 5000), this.options.stop);
        if (this.closed || this.options.stop?.aborted) return;
        let client: StreamConnection | undefined;
        try {
          client = await this.connect();
          await this.attach(client);
          this.log.info({ attempt }, `${this.where}: reconnected`);
          return;
        } catch (error) {
          client?.destroy();
          if (error instanceof ProducerTakenError) {
            this.fatal(error);
            return;
          }
          if (error instanceof StreamResponseError && FATAL_CODES.has(error.codeName)) {
            this.fatal(new RuntimeFailure(`${this.where}: ${error.message}`));
            return;
          }
          this.log.warn({ attempt, error: describe(error) }, `${this.where}: reconnect failed; retrying`);
        }
      }
    })().finally(() => {
      this.recovering = undefined;
      // A break while this recovery was finishing (inside attach) found it still running.
      if (!this.client && !this.closed) this.recover('connection lost as it was taken into use');
    });
  }

  private fencedOr(error: unknown): unknown {
    if (error instanceof Error && error.name === 'ProducerFencedError') return this.taken();
    return error;
  }

  private taken(): ProducerTakenError {
    return new ProducerTakenError(
      `another bridge took over the stream producer "${this.options.producer}" of ${this.where}; stopping, so that what it holds goes back to the source`,
    );
  }

  private fatal(error: BridgeError): void {
    if (this.ended) return;
    this.closed = true;
    this.ended = true;
    if (this.renewTimer) clearInterval(this.renewTimer);
    const client = this.client;
    this.client = undefined;
    client?.destroy();
    // Nothing more can be stored by this process: what it holds ends at once, unacked (the ledger
    // and the claims stay for the producer's next owner to settle).
    for (const item of [...this.waiting.splice(0), ...this.reserved.splice(0)]) item.answered('unknown');
    this.out.clear();
    this.onFatal(error);
  }
}

/**
 * A message read from a stream, written to this one as its source stored it: the same sections,
 * byte for byte, but for the bridge's own headers in its application-properties (the route mark,
 * and `_HQ_DUPL_ID` when the pipeline set it), as the 0-9-1 copy gets them. Undefined when one of
 * them is not a string (an ID from an integer header, a flag): then the 0-9-1 mapping writes it.
 */
function storedCopy(stored: Buffer, header: ContentHeader, setsId: boolean): Buffer | undefined {
  const set: [string, Buffer][] = [];
  const names = setsId ? [DUPLICATE_ID_HEADER, ROUTE_HEADER] : [ROUTE_HEADER];
  for (const name of names) {
    const span = header.field(name);
    if (span === undefined) return undefined;
    const value = header.valueOf(span);
    if (value.type !== 'S') return undefined;
    set.push([name, value.value]);
  }
  if (header.field(IN_DOUBT_HEADER) !== undefined) return undefined;
  // As a 0-9-1 copy: a flag or a source user an earlier hop (or a producer) left goes.
  return replaceApplicationProperties(stored, [...names, IN_DOUBT_HEADER, SOURCE_USER_HEADER], set);
}
