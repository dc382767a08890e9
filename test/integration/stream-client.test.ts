import { rmSync } from 'node:fs';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import {
  type PublishErrorEntry,
  type PublishedMessage,
  StreamAuthenticationError,
  StreamClient,
  StreamResponseError,
} from '../../src/stream/client.js';
import { freePort, newRunDir, RabbitNode } from '../harness/servers.js';

// The stream client against a real node with the stream plugin, and the property the stream
// target's exactness rests on: a named publisher's IDs at or below the last stored one are
// confirmed by the broker and not stored again.

let runDir = '';
let node: RabbitNode;
let streamPort = 0;
const clients: StreamClient[] = [];

function url(user = 'guest', password = 'guest', vhost = ''): string {
  return `rabbitmq-stream://${encodeURIComponent(user)}:${encodeURIComponent(password)}@127.0.0.1:${streamPort}/${vhost}`;
}

async function connect(address = url()): Promise<StreamClient> {
  const client = await StreamClient.connect({ url: address, connectionName: 'stream-client.test' });
  clients.push(client);
  return client;
}

/** Publishes and waits until every publishing ID is confirmed or refused. */
async function publishAll(
  client: StreamClient,
  publisherId: number,
  messages: PublishedMessage[],
  timeoutMs = 20_000,
): Promise<{ confirmed: bigint[]; errors: PublishErrorEntry[] }> {
  const waiting = new Set(messages.map((m) => m.publishingId));
  const confirmed: bigint[] = [];
  const errors: PublishErrorEntry[] = [];
  return new Promise((resolve, reject) => {
    const timer = setTimeout(
      () => reject(new Error(`no outcome for ${waiting.size} publishing IDs, e.g. ${[...waiting][0]}`)),
      timeoutMs,
    );
    const settle = () => {
      if (waiting.size > 0) return;
      clearTimeout(timer);
      client.off('confirm', onConfirm);
      client.off('publish-error', onError);
      resolve({ confirmed, errors });
    };
    const onConfirm = (id: number, ids: bigint[]) => {
      if (id !== publisherId) return;
      for (const one of ids) if (waiting.delete(one)) confirmed.push(one);
      settle();
    };
    const onError = (id: number, list: PublishErrorEntry[]) => {
      if (id !== publisherId) return;
      for (const one of list) if (waiting.delete(one.publishingId)) errors.push(one);
      settle();
    };
    client.on('confirm', onConfirm);
    client.on('publish-error', onError);
    client.publish(publisherId, messages);
  });
}

function numbered(from: number, to: number): PublishedMessage[] {
  const out: PublishedMessage[] = [];
  for (let n = from; n <= to; n++) out.push({ publishingId: BigInt(n), data: Buffer.from(`message-${n}`) });
  return out;
}

beforeAll(async () => {
  runDir = newRunDir();
  streamPort = await freePort();
  node = new RabbitNode(runDir, 'stream', {
    plugins: ['rabbitmq_stream'],
    config: [`stream.listeners.tcp.1 = ${streamPort}`],
  });
  await node.start();
  await node.ctl('add_user', 'reader', 'reader-pw-7f3a');
  await node.ctl('set_permissions', '-p', '/', 'reader', '.*', '', '.*');
}, 180_000);

afterAll(async () => {
  for (const client of clients) await client.close();
  await node?.stop();
  if (runDir) rmSync(runDir, { recursive: true, force: true });
});

describe('the stream client', () => {
  it('connects, learns the broker version and tunes', async () => {
    const client = await connect();
    expect(client.serverVersion).toMatch(/^\d+\.\d+/);
    expect(client.serverProperties.product).toBe('RabbitMQ');
    expect(client.frameMax).toBeGreaterThan(0);
    console.log(
      `stream broker ${client.serverVersion}; frame max ${client.frameMax}, heartbeat ${client.heartbeat}s`,
    );
  });

  it('a wrong password is a typed error that does not contain the password', async () => {
    const password = 'Wr0ng-S3cret-pw';
    const error = await StreamClient.connect({ url: url('guest', password) }).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(StreamAuthenticationError);
    expect((error as StreamAuthenticationError).codeName).toBe('AUTHENTICATION_FAILURE');
    const text = `${(error as Error).message} ${(error as Error).stack} ${JSON.stringify(error)}`;
    expect(text).not.toContain(password);
    expect((error as Error).message).toContain('AUTHENTICATION_FAILURE');
  });

  it('an unknown vhost is VIRTUAL_HOST_ACCESS_FAILURE', async () => {
    const error = await StreamClient.connect({ url: url('guest', 'guest', 'no-such-vhost') }).catch(
      (e: unknown) => e,
    );
    expect(error).toBeInstanceOf(StreamResponseError);
    expect((error as StreamResponseError).codeName).toBe('VIRTUAL_HOST_ACCESS_FAILURE');
  });

  it('creates and deletes streams; every refusal names its code', async () => {
    const client = await connect();
    await client.create('s-create', { 'max-length-bytes': '100000000' });
    const again = await client
      .create('s-create', { 'max-length-bytes': '100000000' })
      .catch((e: unknown) => e);
    expect((again as StreamResponseError).codeName).toBe('STREAM_ALREADY_EXISTS');
    expect((again as Error).message).toContain('s-create');
    // Other arguments for an existing stream.
    const other = await client.create('s-create').catch((e: unknown) => e);
    expect((other as StreamResponseError).codeName).toBe('PRECONDITION_FAILED');
    const metadata = await client.metadata(['s-create', 's-none']);
    const meta = metadata.find((m) => m.stream === 's-create');
    expect(meta?.codeName).toBe('OK');
    expect(meta?.leader?.port).toBe(streamPort);
    expect(metadata.find((m) => m.stream === 's-none')?.codeName).toBe('STREAM_DOES_NOT_EXIST');
    await client.delete('s-create');
    const gone = await client.delete('s-create').catch((e: unknown) => e);
    expect((gone as StreamResponseError).codeName).toBe('STREAM_DOES_NOT_EXIST');
    const noStream = await client.declarePublisher(1, 'p', 's-create').catch((e: unknown) => e);
    expect((noStream as StreamResponseError).codeName).toBe('STREAM_DOES_NOT_EXIST');
    const noPublisher = await client.deletePublisher(9).catch((e: unknown) => e);
    expect((noPublisher as StreamResponseError).codeName).toBe('PUBLISHER_DOES_NOT_EXIST');
  });

  it('a user without write permission is ACCESS_REFUSED', async () => {
    const admin = await connect();
    await admin.create('s-acl');
    const reader = await connect(url('reader', 'reader-pw-7f3a'));
    const refused = await reader.declarePublisher(1, 'r', 's-acl').catch((e: unknown) => e);
    expect((refused as StreamResponseError).codeName).toBe('ACCESS_REFUSED');
  });

  it('publishing to an undeclared publisher ID gets PUBLISHER_DOES_NOT_EXIST per ID', async () => {
    const client = await connect();
    await client.create('s-undeclared');
    const { confirmed, errors } = await publishAll(client, 7, numbered(1, 3));
    expect(confirmed).toEqual([]);
    expect(errors.map((e) => [e.publishingId, e.codeName])).toEqual([
      [1n, 'PUBLISHER_DOES_NOT_EXIST'],
      [2n, 'PUBLISHER_DOES_NOT_EXIST'],
      [3n, 'PUBLISHER_DOES_NOT_EXIST'],
    ]);
  });

  it('a named publisher: IDs at or below the last stored one are confirmed and not stored', async () => {
    const client = await connect();
    const stream = 's-dedup';
    await client.create(stream);
    await client.declarePublisher(3, 'route-a', stream);
    expect(await client.queryPublisherSequence('route-a', stream)).toBe(0n);

    const first = await publishAll(client, 3, numbered(1, 1000));
    expect(first.errors).toEqual([]);
    expect(first.confirmed).toHaveLength(1000);
    expect(await client.queryPublisherSequence('route-a', stream)).toBe(1000n);

    // The replay after an in-doubt window: 990..1000 were stored, 1001..1010 were not.
    const replay = await publishAll(client, 3, numbered(990, 1010));
    expect(replay.errors).toEqual([]);
    expect(replay.confirmed).toHaveLength(21);
    expect(await client.queryPublisherSequence('route-a', stream)).toBe(1010n);

    // Another connection, as after a crash: the sequence is the stream's, not the connection's.
    const other = await connect();
    expect(await other.queryPublisherSequence('route-a', stream)).toBe(1010n);
    const read = await other.readStream(stream, { count: 1031, idleMs: 1500 });
    const bodies = read.map((m) => m.data.toString());
    const distinct = new Set(bodies);
    console.log(
      `dedup by publishing ID: published 1000 + replayed 21 (990..1010); confirmed ${first.confirmed.length + replay.confirmed.length}, ` +
        `stored ${read.length} messages, ${distinct.size} distinct, ${read.length - distinct.size} duplicates; ` +
        `last stored ID ${await other.queryPublisherSequence('route-a', stream)}`,
    );
    expect(read).toHaveLength(1010);
    expect(distinct.size).toBe(1010);
    expect(bodies).toEqual(numbered(1, 1010).map((m) => Buffer.from(m.data).toString()));
    expect(read.map((m) => m.offset)).toEqual(read.map((_, i) => BigInt(i)));
  });

  it('another publisher reference on the same stream has its own sequence', async () => {
    const client = await connect();
    const stream = 's-two-refs';
    await client.create(stream);
    await client.declarePublisher(0, 'route-a', stream);
    await client.declarePublisher(1, 'route-b', stream);
    await publishAll(client, 0, numbered(1, 5));
    await publishAll(client, 1, numbered(1, 3));
    expect(await client.queryPublisherSequence('route-a', stream)).toBe(5n);
    expect(await client.queryPublisherSequence('route-b', stream)).toBe(3n);
    await client.deletePublisher(1);
    // A new declaration of the same reference continues its sequence.
    await client.declarePublisher(1, 'route-b', stream);
    const again = await publishAll(client, 1, numbered(2, 4));
    expect(again.confirmed).toHaveLength(3);
    expect(await client.readStream(stream, { count: 9 })).toHaveLength(9);
  });

  it('publishes in several frames when a batch exceeds the frame max', async () => {
    const client = await connect();
    const stream = 's-large';
    await client.create(stream);
    await client.declarePublisher(0, 'big', stream);
    const size = Math.floor(client.frameMax / 3);
    const messages = numbered(1, 10).map((m) => ({ ...m, data: Buffer.alloc(size, Number(m.publishingId)) }));
    const { confirmed } = await publishAll(client, 0, messages);
    expect(confirmed).toHaveLength(10);
    const read = await client.readStream(stream, { count: 10 });
    expect(read.map((m) => m.data[0])).toEqual([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
    expect(read.every((m) => m.data.length === size)).toBe(true);
    expect(() => client.publish(0, [{ publishingId: 11n, data: Buffer.alloc(client.frameMax) }])).toThrow(
      /does not fit the frame max/,
    );
  });
});
