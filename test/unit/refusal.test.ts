import { describe, expect, it } from 'vitest';
import { refusalOfClose } from '../../src/amqp/refusal.js';

describe("what a trial channel's close says about its message", () => {
  it('names the size and the limit when RabbitMQ refused it over max_message_size', () => {
    const configured = refusalOfClose(
      'Channel closed by server: 406 (PRECONDITION-FAILED) with message "PRECONDITION_FAILED - message size 8192 is larger than configured max size 4096"',
    );
    expect(configured).toEqual({
      detail:
        "larger than the target's max_message_size (8192 bytes; its limit is 4096): raise max_message_size on the target, or send it another way",
      sizeLimit: 4096,
    });
    // At RabbitMQ's built-in limit the words leave out "configured".
    expect(
      refusalOfClose('PRECONDITION_FAILED - message size 600000000 is larger than max size 536870912'),
    ).toMatchObject({
      sizeLimit: 536870912,
    });
  });

  it("passes on the broker's words for any other close", () => {
    expect(refusalOfClose('PRECONDITION_FAILED - invalid expiration')).toEqual({
      detail:
        'the target closed its channel for this message sent alone (PRECONDITION_FAILED - invalid expiration)',
    });
    expect(refusalOfClose(undefined)).toEqual({
      detail: 'the target closed its channel for this message sent alone',
    });
  });
});
