import { redactUrl } from '../config/redact.js';
import type { TlsFiles } from '../config/tls.js';
import type { BridgeError } from '../errors.js';
import type { Logger } from '../log.js';
import type { Publish, PublishOutcome, TargetSide } from '../ports.js';
import { AmqpLink } from './link.js';
import { TargetPublisher } from './target.js';

export interface QueueTargetOptions {
  /** The broker, or the nodes of a cluster to fail over between. */
  urls: readonly string[];
  /** '' is the default exchange (then the routing key names the target queue). */
  exchange: string;
  /** The routing key of every publish; undefined: each message's own. */
  routingKey: string | undefined;
  /** The target queue, checked at connect, when one was named. */
  queue: string | undefined;
  retryForMs: number;
  tls: TlsFiles | undefined;
  stop: AbortSignal | undefined;
}

/**
 * The AMQP 0-9-1 target: a confirm publisher to an exchange or queue on a broker (or a cluster's
 * nodes), on a link that reconnects with backoff.
 */
export class QueueTarget implements TargetSide {
  private readonly publisher: TargetPublisher;
  private readonly link: AmqpLink;

  constructor(
    private readonly options: QueueTargetOptions,
    log: Logger,
  ) {
    this.link = new AmqpLink(
      options.urls,
      { side: 'target', retryForMs: options.retryForMs, log, tls: options.tls, stop: options.stop },
      (connection) => this.publisher.attach(connection),
      () => this.publisher.detach(),
    );
    // Named by its first URL, as at start, whichever node it reaches.
    const where = `target broker at ${redactUrl(options.urls[0] ?? '')}`;
    this.publisher = new TargetPublisher(options.exchange, options.routingKey, options.queue, where, log);
    this.publisher.onBroken = (reason) => this.link.reset(reason);
    this.publisher.onStaleWrites = () => this.onStaleWrites?.();
  }

  onStaleWrites: (() => void) | undefined;

  set onFatal(report: (error: BridgeError) => void) {
    this.link.onFatal = report;
    this.publisher.onFatal = report;
  }

  get where(): string {
    return this.link.where;
  }

  get isUp(): boolean {
    return this.link.isUp;
  }

  get downSince(): number | undefined {
    return this.link.downSince;
  }

  get blockedSince(): { since: number; reason: string } | undefined {
    return this.publisher.blockedSince;
  }

  get sizeLimit(): number | undefined {
    return this.publisher.sizeLimit;
  }

  start(): Promise<void> {
    return this.link.start();
  }

  async close(): Promise<void> {
    this.publisher.close();
    await this.link.close();
  }

  feeds(identity: string | undefined, queue: string): boolean {
    return (
      this.options.exchange === '' && this.options.routingKey === queue && this.link.identity === identity
    );
  }

  send(publish: Publish, answered: (outcome: PublishOutcome) => void): void {
    this.publisher.send(publish, answered);
  }

  reset(reason: string): void {
    this.publisher.reset(reason);
  }
}
