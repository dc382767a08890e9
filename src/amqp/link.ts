import type { ChannelModel } from 'amqplib';
import { backoffDelay, sleep } from '../backoff.js';
import { redactUrl } from '../config/redact.js';
import type { TlsFiles } from '../config/tls.js';
import { BridgeError, describe } from '../errors.js';
import type { Logger } from '../log.js';
import { ConnectCancelled, connectAmqpAny, vhostOf } from './connect.js';
import { clusterNameOf } from './internals.js';

// A broker under a resource alarm may never read our Close: give it this long, then drop the socket.
const CLOSE_TIMEOUT_MS = 3000;

/** Closes a connection politely, or destroys its socket when the broker does not answer in time. */
async function closeWithin(connection: ChannelModel, ms: number): Promise<void> {
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

interface LinkOptions {
  side: 'source' | 'target';
  /** Bound on the first connect; 0 retries forever. Later outages are retried until `close()`. */
  retryForMs: number;
  log: Logger;
  /** CA and client certificate for an amqps:// URL. */
  tls?: TlsFiles;
  /** A stop signal: the first connect gives up at once (later outages are ended by close()). */
  stop?: AbortSignal;
}

/**
 * Keeps one AMQP connection to a broker alive. `setup` runs on every (re)connection to open
 * channels; a BridgeError from it (a missing queue, no permission) is fatal, anything else closes
 * the connection and retries with backoff and jitter. Any channel closed by the server is handled
 * by the owner calling `reset()`, which reconnects the whole side.
 */
export class AmqpLink {
  /** The broker in use (with several URLs, the last one tried or reached). */
  where: string;
  /** Which of the URLs the next connect starts at: after a loss, the one after the lost node. */
  private next = 0;
  private connection: ChannelModel | undefined;
  private closing = false;
  private reconnecting = false;
  /** When the link went down; undefined while connected. */
  downSince: number | undefined;
  /**
   * The broker reached last, as `<cluster name>/<vhost>`: the same for every node (and every URL)
   * of one cluster; undefined before the first connection.
   */
  identity: string | undefined;
  onFatal: (error: BridgeError) => void = () => {};

  private readonly urls: readonly string[];

  /** `url` is one broker, or the nodes of a cluster to fail over between. */
  constructor(
    url: string | readonly string[],
    private readonly options: LinkOptions,
    private readonly setup: (connection: ChannelModel) => Promise<void>,
    private readonly teardown: () => void,
  ) {
    this.urls = typeof url === 'string' ? [url] : url;
    this.where = this.describeUrl(0);
  }

  private describeUrl(index: number): string {
    return `${this.options.side} broker at ${redactUrl(this.urls[index] as string)}`;
  }

  /** Connects for the first time; rejects with the operator's error when that fails. */
  async start(): Promise<void> {
    await this.connectOnce(this.options.retryForMs, this.options.stop);
  }

  /** `stop` only for the first connect: a later outage of a running bridge is ended by close(). */
  private async connectOnce(retryForMs: number, stop?: AbortSignal): Promise<void> {
    const { connection, index } = await connectAmqpAny(this.urls, this.next, {
      side: this.options.side,
      retryForMs,
      log: this.options.log,
      cancelled: () => this.closing,
      stop,
      tls: this.options.tls,
    });
    this.where = this.describeUrl(index);
    const url = this.urls[index] as string;
    this.identity = `${clusterNameOf(connection) ?? hostOf(url)}/${vhostOf(url)}`;
    // A failed setup (e.g. that node is out of the cluster) or a later loss moves on to the next node.
    this.next = (index + 1) % this.urls.length;
    // Listening before the setup: amqplib may close the connection in the same read that answered
    // the setup's last call (a frame it cannot parse right after basic.consume-ok), and a close
    // missed then would leave the link up on a dead connection for good.
    let lastError: string | undefined;
    let closed = false;
    connection.on('close', () => {
      closed = true;
      this.lost(connection, lastError ?? 'connection closed');
    });
    connection.on('error', (error: Error) => {
      lastError = describe(error);
      this.options.log.debug(
        { side: this.options.side, error: lastError },
        `${this.where}: connection error`,
      );
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
    // Closed while the channels were opened: a reconnect tries again (with backoff); a first
    // connect counts as made and lost at once, so that the reconnect loop takes over.
    if (closed && this.reconnecting)
      throw new Error(`closed while opening channels: ${lastError ?? 'closed'}`);
    this.connection = connection;
    this.downSince = undefined;
    if (closed) this.lost(connection, lastError ?? 'connection closed');
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
          this.options.log[attempt === 1 ? 'warn' : 'debug'](
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

/** Host and port of a URL, never its credentials. */
function hostOf(url: string): string {
  try {
    return new URL(url).host;
  } catch {
    return 'unknown';
  }
}
