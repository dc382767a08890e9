import { EventEmitter } from 'node:events';
import pino from 'pino';
import { describe, expect, it } from 'vitest';
import type { Publish, PublishOutcome } from '../../src/ports.js';
import type { PublishedMessage, StreamClientEvents } from '../../src/stream/client.js';
import {
  type LedgerOutcomes,
  type ProducerRecord,
  type StreamConnection,
  StreamTarget,
} from '../../src/stream/target.js';
import { basicProperties } from '../wire.js';

// The stream target's protocol over fakes of its two outside parts: a stream broker that keeps
// RabbitMQ's rule for a named producer (an ID at or below the last stored one is confirmed and not
// stored) and answers when the test says, and the producer's record as the Lua scripts keep it.
// The real ones are exercised by the integration and chaos tests; here each case is one exact
// interleaving, in milliseconds.

const PRODUCER = 'route-1';
const STREAM = 's';

/** The broker side: what was stored per producer name, and the frames not yet handled. */
class FakeBroker {
  readonly stored: { id: bigint; data: Buffer }[] = [];
  last = 0n;
  /** Written and not yet handled, in the order they arrived. */
  pending: { connection: FakeConnection; message: PublishedMessage }[] = [];
  /** IDs to refuse (publish-error) instead of storing. */
  readonly refuse = new Set<bigint>();
  connections: FakeConnection[] = [];

  /** Handles the first `count` pending writes (all by default): store or drop, then confirm. */
  handle(count = this.pending.length): void {
    for (const { connection, message } of this.pending.splice(0, count)) {
      if (!connection.isOpen) continue;
      if (this.refuse.delete(message.publishingId)) {
        connection.emit('publish-error', 0, [
          { publishingId: message.publishingId, code: 0x12, codeName: 'PUBLISHER_DOES_NOT_EXIST' },
        ]);
        continue;
      }
      if (message.publishingId > this.last) {
        this.stored.push({ id: message.publishingId, data: Buffer.from(message.data) });
        this.last = message.publishingId;
      }
      connection.emit('confirm', 0, [message.publishingId]);
    }
  }

  get current(): FakeConnection {
    return this.connections.at(-1) as FakeConnection;
  }
}

class FakeConnection extends EventEmitter<StreamClientEvents> {
  isOpen = true;
  frameMax = 1_048_576;
  serverVersion = '3.10.8';

  constructor(private readonly broker: FakeBroker) {
    super();
  }

  async metadata(streams: readonly string[]) {
    return streams.map((stream) => ({ stream, code: 1, codeName: 'OK', leader: undefined, replicas: [] }));
  }

  async declarePublisher(): Promise<void> {}

  async queryPublisherSequence(): Promise<bigint> {
    return this.broker.last;
  }

  publish(_publisherId: number, messages: readonly PublishedMessage[]): boolean {
    if (!this.isOpen) throw new Error('closed');
    for (const message of messages) this.broker.pending.push({ connection: this, message });
    return true;
  }

  async drain(): Promise<void> {}

  async close(): Promise<void> {
    this.isOpen = false;
  }

  destroy(): void {
    this.cut();
  }

  /** The connection goes (the frames not yet handled are lost with it). */
  cut(): void {
    if (!this.isOpen) return;
    this.isOpen = false;
    this.emit('close', new Error('cut'));
  }
}

/** The producer's record as src/dedup/lua/producer-*.lua keep it, in memory. */
class FakeRecord implements ProducerRecord {
  owner: string | undefined;
  epoch = 0;
  seq = 0n;
  readonly entries = new Map<string, bigint>();
  /** Each reservation's keys, as written to the ledger. */
  readonly reservations: string[][] = [];
  /** Lets a test hold a reservation's answer. */
  hold: Promise<void> | undefined;

  async take() {
    if (this.owner === undefined) {
      this.epoch++;
      this.owner = 'me';
    }
    return { ours: true as const, epoch: String(this.epoch) };
  }

  async ledger(): Promise<Map<string, bigint>> {
    return new Map(this.entries);
  }

  async reserve(keys: readonly string[], committed: readonly string[], floor: bigint): Promise<bigint> {
    for (const key of committed) this.entries.delete(key);
    if (this.seq < floor) this.seq = floor;
    const first = this.seq + 1n;
    for (const key of keys) this.entries.set(key, ++this.seq);
    this.reservations.push([...keys]);
    await this.hold;
    return first;
  }

  async settle(entries: readonly (readonly [string, bigint])[], floor: bigint): Promise<void> {
    if (this.seq < floor) this.seq = floor;
    for (const [key, id] of entries) if (this.entries.get(key) === id) this.entries.delete(key);
  }

  async leave(): Promise<void> {
    this.owner = undefined;
  }
}

class FakeOutcomes implements LedgerOutcomes {
  readonly committed: string[] = [];
  readonly unclaimed: string[] = [];
  async commit(keys: readonly string[]) {
    this.committed.push(...keys);
  }
  async unclaim(keys: readonly string[]) {
    this.unclaimed.push(...keys);
  }
}

const tick = () => new Promise((resolve) => setTimeout(resolve, 0));
async function settleDown(rounds = 20): Promise<void> {
  for (let i = 0; i < rounds; i++) await tick();
}

/** A world: a broker, a record, the target on them, and publishes with their answers. */
async function world(setup: (record: FakeRecord, broker: FakeBroker) => void = () => {}) {
  const broker = new FakeBroker();
  const record = new FakeRecord();
  const outcomes = new FakeOutcomes();
  setup(record, broker);
  const target = new StreamTarget(
    {
      url: 'rabbitmq-stream://guest:guest@127.0.0.1:5552/',
      stream: STREAM,
      producer: PRODUCER,
      tls: undefined,
      leaseMs: 60_000,
      retryForMs: 1000,
      stop: undefined,
      connect: async () => {
        const connection = new FakeConnection(broker);
        broker.connections.push(connection);
        return connection as unknown as StreamConnection;
      },
    },
    record,
    outcomes,
    pino({ level: 'silent' }),
  );
  await target.start();
  const answers = new Map<string, PublishOutcome[]>();
  const send = (key: string, writeBy = performance.now() + 60_000): Publish => {
    const publish: Publish = {
      properties: basicProperties({}),
      content: Buffer.from(key),
      routingKey: 'q',
      id: key,
      key,
      writeBy,
    };
    target.send(publish, (outcome) => answers.set(key, [...(answers.get(key) ?? []), outcome]));
    return publish;
  };
  return { broker, record, outcomes, target, answers, send };
}

const storedKeys = (broker: FakeBroker) =>
  broker.stored.map((entry) => entry.data.toString('latin1').slice(-2));

describe('the stream target, over fakes', () => {
  it('writes in ID order, each ID in the ledger before its write, and answers stored on confirm', async () => {
    const { broker, record, answers, send } = await world();
    const ledgerAtWrite: boolean[] = [];
    const keys = ['k1', 'k2', 'k3'];
    for (const key of keys) send(key);
    await settleDown();
    for (const { message } of broker.pending) {
      ledgerAtWrite.push([...record.entries.values()].includes(message.publishingId));
    }
    expect(broker.pending.map((p) => p.message.publishingId)).toEqual([1n, 2n, 3n]);
    expect(ledgerAtWrite).toEqual([true, true, true]);
    broker.handle();
    await settleDown();
    expect(keys.map((key) => answers.get(key))).toEqual([['stored'], ['stored'], ['stored']]);
    expect(broker.stored.map((entry) => entry.id)).toEqual([1n, 2n, 3n]);
  });

  it('after a cut, what the broker stored is answered stored and the rest goes again at the same IDs: one copy each', async () => {
    const { broker, answers, send } = await world();
    for (const key of ['k1', 'k2', 'k3', 'k4']) send(key);
    await settleDown();
    broker.handle(2); // k1, k2 stored and confirmed
    // The broker stored k3 as well, but its confirm was lost with the connection; k4 was lost.
    const k3 = broker.pending.shift();
    broker.stored.push({
      id: k3?.message.publishingId as bigint,
      data: Buffer.from(k3?.message.data as Uint8Array),
    });
    broker.last = k3?.message.publishingId as bigint;
    broker.pending = [];
    broker.current.cut();
    await new Promise((resolve) => setTimeout(resolve, 400)); // the reconnect's backoff
    await settleDown();
    expect(answers.get('k3')).toEqual(['stored']);
    expect(answers.get('k4')).toBeUndefined();
    expect(broker.pending.map((p) => p.message.publishingId)).toEqual([4n]);
    broker.handle();
    await settleDown();
    expect(answers.get('k4')).toEqual(['stored']);
    expect(storedKeys(broker)).toEqual(['k1', 'k2', 'k3', 'k4']);
  });

  it('a write of the same ID that also lands from the lost connection is dropped by the broker: still one copy', async () => {
    const { broker, answers, send } = await world();
    send('k1');
    send('k2');
    await settleDown();
    const lost = [...broker.pending];
    broker.pending = [];
    broker.current.cut();
    await new Promise((resolve) => setTimeout(resolve, 400));
    await settleDown();
    // Both go again at IDs 1 and 2; the old connection's frames then land late too.
    expect(broker.pending.map((p) => p.message.publishingId)).toEqual([1n, 2n]);
    broker.handle();
    for (const { message } of lost) {
      if (message.publishingId > broker.last)
        broker.stored.push({ id: message.publishingId, data: Buffer.from(message.data) });
    }
    await settleDown();
    expect(answers.get('k1')).toEqual(['stored']);
    expect(answers.get('k2')).toEqual(['stored']);
    expect(storedKeys(broker)).toEqual(['k1', 'k2']);
  });

  it('an ID the broker refused is never taken as stored because a later one was: it goes again under a new ID', async () => {
    const { broker, answers, send } = await world();
    for (const key of ['k1', 'k2', 'k3']) send(key);
    await settleDown();
    broker.refuse.add(2n);
    broker.handle(); // 1 stored, 2 refused, 3 stored: the last stored ID is 3
    await new Promise((resolve) => setTimeout(resolve, 400));
    await settleDown();
    broker.handle();
    await settleDown();
    expect(answers.get('k2')).toEqual(['stored']);
    expect(storedKeys(broker)).toEqual(['k1', 'k3', 'k2']);
    expect(broker.stored.map((entry) => entry.id)).toEqual([1n, 3n, 4n]);
  });

  it('a message whose lease ran out while its ID was reserved leaves the ledger before any higher ID is written', async () => {
    let release: () => void = () => {};
    const { broker, record, answers, send } = await world((rec) => {
      rec.hold = new Promise((resolve) => {
        release = resolve;
      });
    });
    send('k1', performance.now() + 20);
    send('k2');
    await settleDown();
    expect(record.entries.get('k1')).toBe(1n);
    await new Promise((resolve) => setTimeout(resolve, 40)); // k1's lease is now not known to hold
    record.hold = undefined;
    release();
    await settleDown();
    expect(answers.get('k1')).toEqual(['fenced']);
    expect(record.entries.has('k1')).toBe(false);
    expect(broker.pending.map((p) => p.message.publishingId)).toEqual([2n]);
  });

  it('a new owner splits the ledger it finds by the last stored ID: at or below committed, above unclaimed', async () => {
    const { outcomes, record } = await world((rec, broker) => {
      rec.entries.set('landed-1', 7n);
      rec.entries.set('landed-2', 9n);
      rec.entries.set('not-landed', 10n);
      rec.seq = 10n;
      broker.last = 9n;
    });
    expect(outcomes.committed.sort()).toEqual(['landed-1', 'landed-2']);
    expect(outcomes.unclaimed).toEqual(['not-landed']);
    expect(record.entries.size).toBe(0);
    expect(record.seq).toBe(10n);
  });
});
