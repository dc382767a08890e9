import type { ChannelModel } from 'amqplib';
import { describe, expect, it } from 'vitest';
import { AMQPLIB_VERSION, AmqplibInternalsError, checkAmqplib } from '../../src/amqp/internals.js';

// The bridge reads and writes content headers through amqplib internals (src/amqp/internals.ts);
// an amqplib that is not shaped as expected must stop it with one line naming the version.
describe('the amqplib internals check', () => {
  it('passes for the pinned version installed here', () => {
    expect(() => checkAmqplib()).not.toThrow();
    expect(AMQPLIB_VERSION).toBe('2.3.1');
  });

  it('names the installed version and what is missing when a connection is not shaped as expected', () => {
    const model = {
      connection: { rest: Buffer.alloc(0), stream: {}, channels: [] },
    } as unknown as ChannelModel;
    let caught: unknown;
    try {
      checkAmqplib(model);
    } catch (error) {
      caught = error;
    }
    expect(caught).toBeInstanceOf(AmqplibInternalsError);
    expect((caught as Error).message).toBe(
      'amqplib 2.3.1 is not as dedup-bridge expects (no connection.recvFrame); install the pinned amqplib 2.3.1 (npm ci)',
    );
    expect((caught as AmqplibInternalsError).exitCode).toBe(1);
  });
});
