/**
 * What the target's close of a trial channel says about the one message on it. RabbitMQ names the
 * size when a message is over its max_message_size (rabbit_channel's check_msg_size):
 * "message size 8192 is larger than configured max size 4096" ("max size" at its built-in limit).
 */
const TOO_LARGE = /message size (\d+) is larger than (?:configured )?max size (\d+)/;

export interface ChannelRefusal {
  /** Why the message is refused, for the log line and the park reason. */
  detail: string;
  /** The target's max_message_size, when that is what refused it. */
  sizeLimit?: number;
}

export function refusalOfClose(closeText: string | undefined): ChannelRefusal {
  const tooLarge = closeText?.match(TOO_LARGE);
  if (tooLarge) {
    return {
      detail: `larger than the target's max_message_size (${tooLarge[1]} bytes; its limit is ${tooLarge[2]}): raise max_message_size on the target, or send it another way`,
      sizeLimit: Number(tooLarge[2]),
    };
  }
  const words = closeText ? ` (${closeText})` : '';
  return { detail: `the target closed its channel for this message sent alone${words}` };
}
