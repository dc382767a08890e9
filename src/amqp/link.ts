import type { ChannelModel } from 'amqplib';
import { redactUrl } from '../config/redact.js';
import type { TlsFiles } from '../config/tls.js';
import { BridgeError } from '../errors.js';
import type { Logger } from '../observe/log.js';
import { backoffDelay, sleep } from './backoff.js';
import { ConnectCancelled, connectAmqp } from './connect.js';
import { describe } from './errors.js';

// A broker under a resource alarm may never read our Close: give it this long, then drop the socket.
const CLOSE_TIMEOUT_MS = 3000;

/** Closes a connection politely, or destroys its socket when the broker does not answer in time. */
export async function closeWithin(connection: ChannelModel, ms: number): Promise<void> {
  const timedOut = await Promise.race([
    connection.close().then(
      () => false,
      () => false,
    ),
    sleep(ms).then(() => true),
  ]);
  if (timedOut) {
    const stream = (connection as unknown as { connection?: { stream?: { destroy?: () => void } } })
      .connection?.stream;
    stream?.destroy?.();
  }
}

export interface LinkOptions {
  side: 'source' | 'target';
  /** Bound on the first connect; 0 retries forever. Later outages are retried until `close()`. */
  retryForMs: number;
  log: Logger;
  /** CA and client certificate for an amqps:// URL. */
  tls?: TlsFiles;
}

/**
 * Keeps one AMQP connection to a broker alive. `setup` runs on every (re)connection to open
 * channels; a BridgeError from it (a missing queue, no permission) is fatal, anything else closes
 * the connection and retries with backoff and jitter. Any channel closed by the server is handled
 * by the owner calling `reset()`, which reconnects the whole side.
 */
export class AmqpLink {
  readonly where: string;
  private connection: ChannelModel | undefined;
  private closing = false;
  private reconnecting = false;
  /** When the link went down; undefined while connected. */
  downSince: number | undefined;
  onFatal: (error: BridgeError) => void = () => {};

  constructor(
    private readonly url: string,
    private readonly options: LinkOptions,
    private readonly setup: (connection: ChannelModel) => Promise<void>,
    private readonly teardown: () => void,
  ) {
    this.where = `${options.side} broker at ${redactUrl(url)}`;
  }

  /** Connects for the first time; rejects with the operator's error when that fails. */
  async start(): Promise<void> {
    await this.connectOnce(this.options.retryForMs);
  }

  private async connectOnce(retryForMs: number): Promise<void> {
    const connection = await connectAmqp(this.url, {
      side: this.options.side,
      retryForMs,
      log: this.options.log,
      cancelled: () => this.closing,
      tls: this.options.tls,
    });
    try {
      await this.setup(connection);
    } catch (error) {
      await connection.close().catch(() => {});
      throw error;
    }
    if (this.closing) {
      await connection.close().catch(() => {});
      throw new ConnectCancelled('closing');
    }
    this.connection = connection;
    this.downSince = undefined;
    connection.on('close', () => this.lost(connection, 'connection closed'));
    connection.on('error', (error: Error) => {
      this.options.log.warn(
        { side: this.options.side, error: describe(error) },
        `${this.where}: connection error`,
      );
    });
  }

  /** Drops the connection (e.g. after a channel was closed by the server) and reconnects. */
  reset(reason: string): void {
    const connection = this.connection;
    if (connection) this.lost(connection, reason);
  }

  private lost(connection: ChannelModel, reason: string): void {
    if (this.connection !== connection || this.closing) return;
    this.connection = undefined;
    this.downSince = Date.now();
    this.teardown();
    void closeWithin(connection, CLOSE_TIMEOUT_MS);
    this.options.log.warn({ side: this.options.side, reason }, `${this.where}: lost; reconnecting`);
    void this.reconnect();
  }

  private async reconnect(): Promise<void> {
    if (this.reconnecting) return;
    this.reconnecting = true;
    try {
      for (let attempt = 1; !this.closing; attempt++) {
        try {
          await this.connectOnce(0);
          this.options.log.info({ side: this.options.side, attempt }, `${this.where}: connected again`);
          return;
        } catch (error) {
          if (error instanceof ConnectCancelled || this.closing) return;
          if (error instanceof BridgeError) {
            this.onFatal(error);
            return;
          }
          const delay = backoffDelay(attempt, 200, 5000);
          this.options.log.warn(
            { side: this.options.side, attempt, delayMs: delay, error: describe(error) },
            `${this.where}: reconnect failed; retrying`,
          );
          await sleep(delay);
        }
      }
    } finally {
      this.reconnecting = false;
    }
  }

  get isUp(): boolean {
    return this.connection !== undefined;
  }

  async close(): Promise<void> {
    this.closing = true;
    const connection = this.connection;
    this.connection = undefined;
    if (connection) await closeWithin(connection, CLOSE_TIMEOUT_MS);
  }
}
