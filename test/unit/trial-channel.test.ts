import { EventEmitter } from 'node:events';
import { pino } from 'pino';
import { beforeEach, describe, expect, it, vi } from 'vitest';
import type { Publish, PublishOutcome } from '../../src/ports.js';

// The target's trial channel, driven by a fake broker: publishRaw is replaced, so that each write
// is recorded with its channel and its confirm callback, and the test answers it as RabbitMQ
// would (an ack, a nack, or a channel.close 406 that fails every unconfirmed publish on it).

interface Write {
  channel: FakeChannel;
  content: Buffer;
  answer: (error: unknown) => void;
  answered: boolean;
}
const writes: Write[] = [];

vi.mock('../../src/amqp/internals.js', async (importOriginal) => {
  const actual = await importOriginal<typeof import('../../src/amqp/internals.js')>();
  return {
    ...actual,
    publishRaw: (
      channel: FakeChannel,
      _exchange: unknown,
      _routingKey: unknown,
      _header: Buffer,
      content: Buffer,
      onConfirm: (error: unknown) => void,
    ) => {
      const write: Write = { channel, content, answer: onConfirm, answered: false };
      write.answer = (error) => {
        write.answered = true;
        onConfirm(error);
      };
      writes.push(write);
      return true;
    },
  };
});

const { TargetPublisher } = await import('../../src/amqp/target.js');

class FakeChannel extends EventEmitter {
  constructor(readonly kind: 'ordinary' | 'trial' | 'probe') {
    super();
  }
  async close(): Promise<void> {}
}

class FakeConnection extends EventEmitter {
  readonly confirmChannels: FakeChannel[] = [];
  async createChannel(): Promise<FakeChannel> {
    return new FakeChannel('probe');
  }
  async createConfirmChannel(): Promise<FakeChannel> {
    const channel = new FakeChannel(this.confirmChannels.length === 0 ? 'ordinary' : 'trial');
    this.confirmChannels.push(channel);
    return channel;
  }
}

const settle = () => new Promise<void>((resolve) => setTimeout(resolve, 5));

function publishOf(id: string, size: number): Publish {
  return {
    properties: Buffer.from([0, 0]),
    content: Buffer.alloc(size, id),
    routingKey: 'rk',
    id,
    writeBy: Number.POSITIVE_INFINITY,
  };
}

function unanswered(kind: 'ordinary' | 'trial'): Write[] {
  return writes.filter((write) => !write.answered && write.channel.kind === kind);
}

/** Which message a write is (each body is filled with its ID's first letter). */
function idOf(write: Write): string {
  return write.content.toString('latin1', 0, 1);
}

/** The broker closes the channel with a 406 not about size: every unconfirmed publish on it fails. */
function closeByBroker(channel: FakeChannel): void {
  const text =
    'Channel closed by server: 406 (PRECONDITION-FAILED) with message "PRECONDITION_FAILED - invalid expiration"';
  channel.emit('error', Object.assign(new Error(text), { code: 406 }));
  channel.emit('close');
  for (const write of writes.filter((w) => w.channel === channel && !w.answered))
    write.answer(new Error(text));
}

async function connected() {
  const publisher = new TargetPublisher(
    '',
    'q',
    undefined,
    'target broker at test',
    pino({ level: 'silent' }),
  );
  const connection = new FakeConnection();
  await publisher.attach(connection as never);
  return { publisher, connection };
}

function sent(
  publisher: InstanceType<typeof TargetPublisher>,
  publish: Publish,
): { outcome?: PublishOutcome } {
  const result: { outcome?: PublishOutcome } = {};
  publisher.send(publish, (outcome) => {
    result.outcome = outcome;
  });
  return result;
}

/** A first message proves a size (the first body of any size is tried alone). */
async function proveSize(
  publisher: InstanceType<typeof TargetPublisher>,
  size: number,
  id = 'proof',
): Promise<void> {
  const proof = sent(publisher, publishOf(id, size));
  await settle();
  const write = unanswered('trial')[0] as Write;
  write.answer(null);
  await settle();
  expect(proof.outcome).toBe('stored');
}

beforeEach(() => {
  writes.length = 0;
});

describe('the trial channel', () => {
  it('a message refused after closing the trial channel alone goes alone again, never on the ordinary channel', async () => {
    const { publisher } = await connected();
    await proveSize(publisher, 100);
    // A body of an untried size goes alone; the broker closes the trial channel over it.
    const poison = publishOf('poison', 1000);
    const first = sent(publisher, poison);
    await settle();
    closeByBroker((unanswered('trial')[0] as Write).channel);
    await settle();
    expect(first.outcome).toBe('rejected');
    // Meanwhile a body that size goes through: 1000 bytes is no longer an untried size.
    await proveSize(publisher, 1000, 'other');
    // The refused message is retried after its backoff (or comes back redelivered): it must go
    // alone again (as before the refactor, when every close remembered its ID as a suspect), not
    // close the ordinary channel and put every publish in flight on it in doubt.
    sent(publisher, { ...poison });
    await settle();
    expect(unanswered('ordinary')).toHaveLength(0);
    expect(unanswered('trial')).toHaveLength(1);
  });

  it('carries one publish at a time: a suspect does not go beside a message of an untried size', async () => {
    const { publisher } = await connected();
    await proveSize(publisher, 100);
    // S was in flight on the ordinary channel when the broker closed it: a suspect.
    const suspect = publishOf('s', 100);
    const killed = sent(publisher, suspect);
    await settle();
    closeByBroker((unanswered('ordinary')[0] as Write).channel);
    await settle();
    expect(killed.outcome).toBe('unknown');
    // The connection comes back.
    publisher.detach();
    await publisher.attach(new FakeConnection() as never);
    // U, of an untried size, goes alone on the trial channel; then S comes back (sent again, flagged).
    const untried = publishOf('u', 1000);
    const tried = sent(publisher, untried);
    await settle();
    const again = sent(publisher, { ...suspect });
    await settle();
    // If both were on the trial channel, a close over S would refuse U "for this message sent
    // alone" (sorted(..., alone = true)), though U was not alone and may well be stored.
    expect(unanswered('trial').map(idOf)).toEqual(['u']);
    (unanswered('trial')[0] as Write).answer(null);
    await settle();
    expect(tried.outcome).toBe('stored');
    expect(unanswered('trial').map(idOf)).toEqual(['s']);
    closeByBroker((unanswered('trial')[0] as Write).channel);
    await settle();
    expect(again.outcome).toBe('rejected');
  });

  it('a close refuses only the message that was alone on the trial channel', async () => {
    const { publisher } = await connected();
    await proveSize(publisher, 100);
    const suspect = publishOf('s', 100);
    sent(publisher, suspect);
    await settle();
    closeByBroker((unanswered('ordinary')[0] as Write).channel);
    await settle();
    publisher.detach();
    await publisher.attach(new FakeConnection() as never);
    const untried = publishOf('u', 1000);
    const tried = sent(publisher, untried);
    await settle();
    sent(publisher, { ...suspect });
    await settle();
    // The broker closes the trial channel (over S, say; U's confirm had not come yet).
    const onTrial = unanswered('trial').map(idOf);
    closeByBroker((unanswered('trial')[0] as Write).channel);
    await settle();
    // U is refused "for this message sent alone" only if it was alone; otherwise it is in doubt.
    if (onTrial.length > 1) expect(tried.outcome).toBe('unknown');
    else expect(tried.outcome).toBe('rejected');
  });

  it('a plain nack after a close on the ordinary channel is not refused with the old close text', async () => {
    const { publisher } = await connected();
    await proveSize(publisher, 100);
    const suspect = publishOf('s', 100);
    sent(publisher, suspect);
    await settle();
    closeByBroker((unanswered('ordinary')[0] as Write).channel);
    await settle();
    publisher.detach();
    await publisher.attach(new FakeConnection() as never);
    // Alone now, and nacked (a full queue with reject-publish), its channel open.
    const again = sent(publisher, suspect);
    await settle();
    (unanswered('trial')[0] as Write).answer(new Error('nack'));
    await settle();
    expect(again.outcome).toBe('rejected');
    // Before the refactor a nack came with no detail; the close text belongs to another message.
    expect(suspect.refusal ?? '').not.toMatch(/invalid expiration/);
  });
});
