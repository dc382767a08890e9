import type { Channel, ChannelModel, ConfirmChannel, ConsumeMessage, Options } from 'amqplib';
import { FatalConnectError } from '../errors.js';
import type { Logger } from '../observe/log.js';
import { replyCodeOf } from './errors.js';

/**
 * The source side: one consuming channel with manual acks and a prefetch, a probe channel for
 * queue depth, and (when parking is on) a confirm channel to move messages to the park queue.
 */
export class SourceQueue {
  private consumerTag: string | undefined;
  private closed = false;
  private parkChannel: ConfirmChannel | undefined;
  /** Called once when the channel or connection goes away while we still use it. */
  onLost: (reason: string) => void = () => {};
  /** Called when the broker cancels our consumer (queue deleted, node down). */
  onCancelled: () => void = () => {};

  private constructor(
    private readonly connection: ChannelModel,
    private readonly channel: Channel,
    private readonly probe: Channel,
    readonly queue: string,
    private readonly where: string,
    private readonly log: Logger,
  ) {}

  static async open(
    connection: ChannelModel,
    queue: string,
    prefetch: number,
    where: string,
    log: Logger,
  ): Promise<SourceQueue> {
    const probe = await openChannel(connection, log);
    await checkQueueExists(probe, queue, where, '--source-queue');
    const channel = await openChannel(connection, log);
    await channel.prefetch(prefetch);
    const source = new SourceQueue(connection, channel, probe, queue, where, log);
    const lost = (reason: string) => {
      if (source.closed) return;
      source.closed = true;
      source.onLost(reason);
    };
    channel.on('close', () => lost('source channel closed'));
    connection.on('close', () => lost('source connection closed'));
    return source;
  }

  async consume(onMessage: (message: ConsumeMessage) => void): Promise<void> {
    const reply = await this.channel.consume(
      this.queue,
      (message) => {
        if (message === null) {
          this.log.warn({ queue: this.queue }, 'source consumer cancelled by the broker');
          this.onCancelled();
          return;
        }
        onMessage(message);
      },
      { noAck: false },
    );
    this.consumerTag = reply.consumerTag;
  }

  async stopConsuming(): Promise<void> {
    const tag = this.consumerTag;
    this.consumerTag = undefined;
    if (tag && !this.closed) await this.channel.cancel(tag).catch(() => {});
  }

  get isOpen(): boolean {
    return !this.closed;
  }

  /** Acks one message, or every message up to it with `upTo`. False when the channel is gone. */
  ack(message: ConsumeMessage, upTo = false): boolean {
    if (this.closed) return false;
    try {
      this.channel.ack(message, upTo);
      return true;
    } catch {
      return false;
    }
  }

  /** Returns a message to the queue (requeue) or hands it to the queue's dead-letter exchange. */
  nack(message: ConsumeMessage, requeue: boolean): boolean {
    if (this.closed) return false;
    try {
      this.channel.nack(message, false, requeue);
      return true;
    } catch {
      return false;
    }
  }

  /** Ready messages in the queue (unacked ones not counted), or undefined when unknown. */
  async depth(): Promise<number | undefined> {
    try {
      const reply = await this.probe.checkQueue(this.queue);
      return reply.messageCount;
    } catch {
      return undefined;
    }
  }

  async enableParking(parkQueue: string): Promise<void> {
    await checkQueueExists(this.probe, parkQueue, this.where, '--park-queue');
    this.parkChannel = (await this.connection.createConfirmChannel()) as ConfirmChannel;
    this.parkChannel.on('error', (error) => this.log.warn({ error: error.message }, 'park channel error'));
  }

  /** Publishes a copy to the park queue and waits for the broker's confirm. */
  park(parkQueue: string, message: ConsumeMessage, reason: string): Promise<boolean> {
    const channel = this.parkChannel;
    if (!channel) return Promise.resolve(false);
    const headers = { ...(message.properties.headers ?? {}), 'x-dedup-park-reason': reason };
    const options = { ...publishOptionsOf(message), headers, mandatory: true };
    return new Promise((resolve) => {
      try {
        channel.publish('', parkQueue, message.content, options, (error) => resolve(!error));
      } catch {
        resolve(false);
      }
    });
  }

  /**
   * Closes the consuming channel: the broker puts back every message we did not ack before it
   * answers, so a depth read afterwards counts them.
   */
  async closeConsumer(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    await this.channel.close().catch(() => {});
  }

  async close(): Promise<void> {
    this.closed = true;
    await this.connection.close().catch(() => {});
  }
}

export async function openChannel(connection: ChannelModel, log: Logger): Promise<Channel> {
  const channel = await connection.createChannel();
  channel.on('error', (error: Error) => log.debug({ error: error.message }, 'channel error'));
  return channel;
}

/** Fails with an operator's message when the queue is missing; reopens nothing (caller's channel). */
export async function checkQueueExists(
  channel: Channel,
  queue: string,
  where: string,
  flag: string,
): Promise<void> {
  try {
    await channel.checkQueue(queue);
  } catch (error) {
    if (replyCodeOf(error) === 404) {
      throw new FatalConnectError(
        `${flag}: queue "${queue}" does not exist on the ${where}; declare it first or fix the name`,
      );
    }
    if (replyCodeOf(error) === 403) {
      throw new FatalConnectError(
        `${flag}: access to queue "${queue}" refused on the ${where}; grant the user configure/read permission on it`,
      );
    }
    throw error;
  }
}

/** The publish options that reproduce a delivered message's properties. */
export function publishOptionsOf(message: ConsumeMessage): Options.Publish {
  const p = message.properties;
  const options: Options.Publish = {};
  if (p.contentType !== undefined) options.contentType = p.contentType;
  if (p.contentEncoding !== undefined) options.contentEncoding = p.contentEncoding;
  if (p.deliveryMode !== undefined) options.deliveryMode = p.deliveryMode;
  if (p.priority !== undefined) options.priority = p.priority;
  if (p.correlationId !== undefined) options.correlationId = p.correlationId;
  if (p.replyTo !== undefined) options.replyTo = p.replyTo;
  if (p.expiration !== undefined) options.expiration = p.expiration;
  if (p.messageId !== undefined) options.messageId = p.messageId;
  if (p.timestamp !== undefined) options.timestamp = p.timestamp;
  if (p.type !== undefined) options.type = p.type;
  if (p.userId !== undefined) options.userId = p.userId;
  if (p.appId !== undefined) options.appId = p.appId;
  if (p.headers !== undefined) options.headers = p.headers;
  return options;
}
