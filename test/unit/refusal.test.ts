import { describe, expect, it } from 'vitest';
import { ClosedOverSize, refusalOfClose } from '../../src/amqp/refusal.js';

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

describe('the publishes a close over a message size left unconfirmed, in the order they were sent', () => {
  const sides = (limit: number, sizes: number[]) => {
    const close = new ClosedOverSize(limit);
    return sizes.map((size) => close.next(size));
  };

  it('before the first one over the limit: in doubt; that one: refused; after it: never stored', () => {
    expect(sides(4096, [10, 4096, 8192, 10, 9000, 10])).toEqual([
      'in-doubt',
      'in-doubt',
      'refused',
      'not-stored',
      // A second large one after the close was discarded unread like the rest: it goes again and
      // is refused before it is sent, now that the limit is known.
      'not-stored',
      'not-stored',
    ]);
  });

  it('the refused one first: everything behind it was dropped unread', () => {
    expect(sides(100, [101, 1, 1])).toEqual(['refused', 'not-stored', 'not-stored']);
  });

  it('a message exactly at the limit is not over it', () => {
    expect(sides(100, [100, 100])).toEqual(['in-doubt', 'in-doubt']);
  });
});
