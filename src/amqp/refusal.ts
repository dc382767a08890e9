/**
 * What the target's close of a trial channel says about the one message on it. RabbitMQ names the
 * size when a message is over its max_message_size (rabbit_channel's check_msg_size):
 * "message size 8192 is larger than configured max size 4096" ("max size" at its built-in limit).
 */
const TOO_LARGE = /message size (\d+) is larger than (?:configured )?max size (\d+)/;

interface ChannelRefusal {
  /** Why the message is refused, for the log line and the park reason. */
  detail: string;
  /** The target's max_message_size, when that is what refused it. */
  sizeLimit?: number;
}

export function refusalOfClose(closeText: string | undefined): ChannelRefusal {
  const tooLarge = closeText?.match(TOO_LARGE);
  if (tooLarge) {
    const limit = Number(tooLarge[2]);
    return { detail: tooLargeDetail(Number(tooLarge[1]), limit), sizeLimit: limit };
  }
  const words = closeText ? ` (${closeText})` : '';
  return { detail: `the target closed its channel for this message sent alone${words}` };
}

export function tooLargeDetail(size: number, limit: number): string {
  return `larger than the target's max_message_size (${size} bytes; its limit is ${limit}): raise max_message_size on the target, or send it another way`;
}

/**
 * Sorts the publishes a channel had not confirmed when the broker closed it over a message larger
 * than its max_message_size, told in the order they were sent. The broker checks each publish as
 * it reads it: those before the first one over the limit were read and may be stored (in doubt);
 * that one was refused; after its channel.close the broker discards every frame on the channel,
 * so those sent after it were never stored and can go again unflagged.
 */
export class ClosedOverSize {
  private passed = false;

  constructor(readonly limit: number) {}

  next(size: number): 'in-doubt' | 'refused' | 'not-stored' {
    if (this.passed) return 'not-stored';
    if (size <= this.limit) return 'in-doubt';
    this.passed = true;
    return 'refused';
  }
}
