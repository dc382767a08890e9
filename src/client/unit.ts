import type { ConfirmChannel, Options } from 'amqplib';
import { DUPLICATE_ID_HEADER } from '../headers.js';

export const UNIT_ID_HEADER = 'x-dedup-unit-id';
export const UNIT_SIZE_HEADER = 'x-dedup-unit-size';
export const UNIT_INDEX_HEADER = 'x-dedup-unit-index';

export interface UnitMessage {
  exchange?: string;
  routingKey: string;
  /** The body: bytes, or a string (sent as its UTF-8 bytes). */
  content: Buffer | string;
  options?: Options.Publish;
}

/**
 * Publishes a unit of messages — the seed's transaction — with its ID set once: message i carries
 * `_HQ_DUPL_ID` `<unitId>:<i>` and the unit's size. Re-sending the unit with the same `unitId`
 * after a failure is always safe: the bridge drops the messages that already went through and
 * forwards the rest, so the target ends up with each message of the unit exactly once.
 *
 * `channel` must be a confirm channel (`connection.createConfirmChannel()`); a plain one is refused
 * with a TypeError before anything is sent. A message's content is a Buffer, or a string sent as UTF-8.
 *
 * Not atomic: amqplib has no AMQP transactions, and confirms are per message. A consumer may see
 * part of a unit before the rest arrives; the size header lets it wait for the whole unit.
 */
export async function publishUnit(
  channel: ConfirmChannel,
  messages: readonly UnitMessage[],
  options: { unitId: string },
): Promise<void> {
  if (!options.unitId) throw new TypeError('publishUnit: unitId must not be empty');
  // Checked before anything is sent: a plain channel would publish the unit, then fail to confirm it.
  if (typeof (channel as Partial<ConfirmChannel> | undefined)?.waitForConfirms !== 'function') {
    throw new TypeError(
      'publishUnit: needs a confirm channel (await connection.createConfirmChannel()), not a plain channel: it waits for the broker to confirm every message of the unit',
    );
  }
  const bodies = messages.map((message, index) => {
    if (Buffer.isBuffer(message.content)) return message.content;
    if (typeof message.content === 'string') return Buffer.from(message.content, 'utf8');
    throw new TypeError(
      `publishUnit: messages[${index}].content must be a Buffer or a string, not ${message.content === null ? 'null' : typeof message.content}`,
    );
  });
  const size = messages.length;
  messages.forEach((message, index) => {
    const headers = {
      ...(message.options?.headers ?? {}),
      [DUPLICATE_ID_HEADER]: `${options.unitId}:${index}`,
      [UNIT_ID_HEADER]: options.unitId,
      [UNIT_INDEX_HEADER]: index,
      [UNIT_SIZE_HEADER]: size,
    };
    channel.publish(message.exchange ?? '', message.routingKey, bodies[index] as Buffer, {
      ...message.options,
      headers,
    });
  });
  await channel.waitForConfirms();
}
