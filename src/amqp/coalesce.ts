import type { ChannelModel } from 'amqplib';

// amqplib's internals this relies on (amqplib 2.x, pinned): ChannelModel.connection is the
// Connection; its muxer moves frames from each channel's buffer to the socket in one loop.
interface Writable {
  cork(): void;
  uncork(): void;
}
interface Muxer {
  _readIncoming(): void;
}
interface Internals {
  connection?: { stream?: Partial<Writable>; muxer?: Partial<Muxer> };
}

/**
 * Sends the frames of one write cycle in one socket write. amqplib writes every frame to the
 * socket on its own: with Nagle off that is a system call and a TCP segment per publish, which
 * costs the bridge and the receiving broker more CPU than the publish itself. Corking the socket
 * around the muxer's loop turns a burst of publishes into one writev, without delaying any frame.
 * Returns false, changing nothing, where amqplib's internals are not as expected.
 */
export function coalesceWrites(model: ChannelModel): boolean {
  const connection = (model as unknown as Internals).connection;
  const stream = connection?.stream;
  const muxer = connection?.muxer;
  if (
    typeof stream?.cork !== 'function' ||
    typeof stream.uncork !== 'function' ||
    typeof muxer?._readIncoming !== 'function'
  ) {
    return false;
  }
  const socket = stream as Writable;
  const readIncoming = muxer._readIncoming.bind(muxer);
  muxer._readIncoming = () => {
    socket.cork();
    try {
      readIncoming();
    } finally {
      socket.uncork();
    }
  };
  return true;
}
