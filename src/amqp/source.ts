import type { Channel, ChannelModel, ConfirmChannel, ConsumeMessage, Message } from 'amqplib';
import { sleep } from '../backoff.js';
import type { SourceDeliveryLimit } from '../config/settings.js';
import { type BridgeError, FatalConnectError } from '../errors.js';
import { PARK_REASON_HEADER, SOURCE_USER_HEADER } from '../headers.js';
import type { Logger } from '../log.js';
import type { Source } from '../ports.js';
import { encodeValue, rawField } from '../wire/fields.js';
import { type ContentHeader, ContentHeaderError, contentHeaderOf } from '../wire/properties.js';
import { accessRefused, replyCodeOf } from './errors.js';
import { InFlightBytes } from './in-flight-bytes.js';
import { publishRaw, routingBytesOf, serverVersionOf } from './internals.js';

// The channel that delivered a message, kept on the message itself: a WeakMap entry per message
// cost the garbage collector more than the rest of the lookup.
const DELIVERED_ON = Symbol('dedup-bridge.delivered-on');
/** Set on a message whose body counts against --max-in-flight-bytes, until it is released. */
const COUNTED = Symbol('dedup-bridge.counted');
type Delivered = ConsumeMessage & { [DELIVERED_ON]?: Channel; [COUNTED]?: boolean };

/** Per consuming channel: delivery tags not yet acked or nacked (in order), and those to ack. */
interface AckState {
  unsettled: Set<number>;
  /** Delivery tags to ack → when they were ready (performance.now()), oldest first. */
  ready: Map<number, number>;
  scheduled: boolean;
  holdTimer: NodeJS.Timeout | undefined;
}

/**
 * How long an ack may wait for the older messages in flight before it goes alone. RabbitMQ finds
 * a single ack's tag by walking the channel's unacked messages from the oldest, so with a full
 * prefetch window an ack out of order cost the source broker as much as hundreds in order (with 10%
 * duplicates, acked as soon as their claim said so, its CPU per message rose by half). Held acks
 * keep their messages' prefetch slots, so they also go at once when they hold a quarter of the
 * window: an old message that waits (a backoff, another owner's claim) must not stall the rest.
 */
const HOLD_OUT_OF_ORDER_MS = 200;
const HOLD_AT_MOST_OF_PREFETCH = 0.25;
// How long a restart of the consumer waits for the broker to send what it still may (then the
// queue is taken to be empty, the settlements held go, and a restart is not tried for a while).
const SPEND_WAIT_MS = 500;
const RESTART_RETRY_MS = 5000;

/** A stand-in message for acking by delivery tag. */
function tagged(deliveryTag: number): Message {
  return { fields: { deliveryTag } } as Message;
}

/**
 * How old the broker's last word on the queue may be for the route to count as consuming: the
 * metrics server asks every 2 s (a passive queue.declare on the source connection), so this
 * allows for answers that take a few seconds; an unanswered ask makes the route not ready by then.
 */
const BROKER_VIEW_MAX_AGE_MS = 10_000;

/** What the broker said of the queue in answer to a passive declare sent at `sentAt`. */
interface QueueView {
  messages: number;
  consumers: number;
  sentAt: number;
  /** The consuming channel and consumer (its consume-ok's number) live when it was asked. */
  channel: Channel | undefined;
  consumer: number | undefined;
}

/**
 * The source queue's type as the broker showed it at attach (see queueTypeOf): 'classic' counts no
 * deliveries; a 'quorum' queue counts each return toward its delivery limit (RabbitMQ 4 gives every
 * quorum queue one, 20 by default), past which the broker drops or dead-letters the message;
 * 'unknown' is treated like a quorum queue.
 */
type SourceQueueType = 'classic' | 'quorum' | 'stream' | 'unknown' | (string & {});

/** Matches a parked copy that came back unroutable to its publish. */
const PARK_SEQ_HEADER = 'x-dedup-park-seq';
const PARK_HEADERS = [PARK_REASON_HEADER, PARK_SEQ_HEADER];

/**
 * Whether a queue of this type counts each message given back toward a delivery limit: anything but
 * a classic queue (a quorum queue has one, by default on RabbitMQ 4; an unknown type may have one).
 */
export function countsDeliveries(type: SourceQueueType | undefined): boolean {
  return type !== 'classic';
}

/** What a consumer reserves its deliveries against (migrate --max-messages: MessageBudget). */
export interface DeliveryBudget {
  readonly available: number;
  reserve(n: number): number;
  delivered(): void;
  release(n: number): void;
  whenReleased(wake: () => void): void;
}

/**
 * The source side: a consuming channel with manual acks and a prefetch, a probe channel for queue
 * depth, and (when parking is on) a confirm channel to move messages to the park queue. It is
 * attached to each new connection; a message is acked or nacked only on the channel that delivered
 * it, so a delivery tag from a lost channel can never ack another message.
 */
export class SourceQueue implements Source {
  private channel: Channel | undefined;
  private probe: Channel | undefined;
  private parkChannel: ConfirmChannel | undefined;
  private consumerTag: string | undefined;
  /** Counts consume-oks, so that a broker's answer can be told to be about the live consumer. */
  private consumerSeq = 0;
  /** The prefetch of the live consumer, and whether it was sized by the bodies seen. */
  private window = { window: 0, sized: false };
  /** Deliveries the live consumer made (a window that opens twofold grows once it is delivered). */
  private delivered = 0;
  /** True while the consumer is cancelled because the bodies held reached the byte bound. */
  private paused = false;
  /** True while the bridge replaces its own consumer with one of another window (not a pause). */
  private recreating = false;
  /** Set when a delivery was returned for the bound since the consumer started: it must pause. */
  private overflowed = false;
  /**
   * Deliveries that did not fit the byte bound, body dropped, waiting to be returned once the
   * consumer is cancelled: returned while it is up, the broker would hand each straight back to it,
   * marked redelivered, and a redelivered message must be taken whatever its size.
   */
  private unread: { channel: Channel; fields: ConsumeMessage['fields'] }[] = [];
  private flowing: Promise<void> | undefined;
  private flowAgain = false;
  /** The broker's last answer about the queue, and the last one asked while our consumer was live. */
  private view: QueueView | undefined;
  private consumingView: QueueView | undefined;
  /** Answers in a row that listed no consumer while ours was live. */
  private unlisted = 0;
  private onMessage: ((message: ConsumeMessage) => void) | undefined;
  private readonly ackStates = new WeakMap<Channel, AckState>();
  private parkSeq = 0;
  private readonly parkPending = new Map<number, { returned: boolean }>();
  private attachments = 0;
  /** The queue's type, read once at the first attach. */
  private type: SourceQueueType | undefined;
  /** Messages handed back to a queue that counts deliveries (requeued, or unacked at a close). */
  private givenBack = 0;
  /** Of those, how many had reached the known delivery limit with that return. */
  private givenBackPastLimit = 0;
  /** Set from the management API at start, when it is configured (see source-ttl.ts). */
  deliveryLimit: SourceDeliveryLimit | undefined;
  /** migrate --max-messages: what each consumer reserves its deliveries against. */
  budget: DeliveryBudget | undefined;
  /** Deliveries the live consumer may still be sent (reserved in the budget), and its channel. */
  private credit = 0;
  private creditOn: Channel | undefined;
  /**
   * The live consumer's first delivery tag: the broker's window is per consumer, so only settling
   * its own deliveries lets it send more (those of a cancelled consumer free nothing).
   */
  private creditFrom: number | undefined;
  /** True while held settlements wait for the budget to have room (see settleCredit). */
  private settleWaiting = false;
  /** True while a cancel waits for the broker to have nothing on its way to the consumer. */
  private holdSettles = false;
  /** Called when the live consumer's credit reaches 0 (see creditSpent). */
  private readonly spentWaiters = new Set<() => void>();
  /** Set from a stop's quiesce on: the consumer is no longer replaced, its settlements stay held. */
  private quiescing = false;
  /** A restart that found deliveries still coming is not tried again before this time. */
  private restartAfter = 0;
  /** The cancel of a consumer being replaced, until its cancel-ok (a stop waits for it). */
  private cancelling: Promise<void> | undefined;
  /** A consumer being started, until it is up or given up (a stop waits for it). */
  private starting: Promise<void> | undefined;
  /** Returns held while the consumer's credit is spent: a return opens a window slot, as an ack. */
  private heldNacks: { channel: Channel; message: ConsumeMessage; requeue: boolean }[] = [];
  /** The source broker's major version (RabbitMQ 4 gives every quorum queue a delivery limit). */
  private brokerMajor: number | undefined;
  /** Runs before consuming on a new connection (the pipeline settles what the old one left). */
  beforeConsume: () => Promise<void> = async () => {};
  /** Called when a channel closes or the broker cancels the consumer: the owner reconnects. */
  onBroken: (reason: string) => void = () => {};
  /** Called when the source refuses us for good (no write permission to park): the owner stops. */
  onFatal: (error: BridgeError) => void = () => {};

  constructor(
    readonly queue: string,
    private readonly prefetch: number,
    private readonly parkQueue: string | undefined,
    private readonly where: string,
    private readonly log: Logger,
    /** The bodies held against --max-in-flight-bytes (by default: no bound). */
    readonly bytes: InFlightBytes = new InFlightBytes(Number.POSITIVE_INFINITY),
  ) {}

  /** Opens the channels on a fresh connection; fails fatally when a queue is missing. */
  async attach(connection: ChannelModel): Promise<void> {
    const attachment = ++this.attachments;
    const probe = await openChannel(connection, this.log);
    await checkQueueExists(probe, this.queue, this.where, '--source-queue');
    if (this.type === undefined) {
      this.brokerMajor = Number.parseInt(serverVersionOf(connection) ?? '', 10) || undefined;
      try {
        this.type = await sourceQueueTypeOf(connection, this.queue, this.where, this.log);
      } catch (error) {
        await probe.close().catch(() => {});
        throw error;
      }
      // Nothing can be returned to it unread: the byte bound takes what the broker sends.
      this.bytes.takesAll = this.countsDeliveries && this.bytes.bound !== Number.POSITIVE_INFINITY;
    }
    if (this.parkQueue !== undefined) {
      await checkQueueExists(probe, this.parkQueue, this.where, '--park-queue');
      const park = await connection.createConfirmChannel();
      park.on('error', (error: Error) => {
        this.log.warn({ error: error.message }, 'park channel error');
        if (replyCodeOf(error) === 403)
          this.onFatal(accessRefused(`--park-queue: ${this.where}`, error, 'write'));
      });
      park.on('return', (message: Message) => {
        const pending = this.parkPending.get(parkSeqOf(message));
        if (pending) {
          pending.returned = true;
        } else {
          // A return we cannot match: no park in flight may count as done, so all go back.
          for (const each of this.parkPending.values()) each.returned = true;
        }
      });
      park.on('close', () => {
        if (this.parkChannel === park) this.onBroken('park channel closed');
      });
      this.parkChannel = park;
    }
    const channel = await openChannel(connection, this.log);
    // A channel closed before the connection is up cannot reset it (it is not up yet): said here.
    let closedEarly: string | undefined;
    const broken = (what: string) => () => {
      closedEarly ??= what;
      if (this.channel === channel) this.consumerTag = undefined;
      if (this.attachments === attachment && this.channel === channel) this.onBroken(`${what} closed`);
    };
    channel.on('close', broken('source channel'));
    probe.on('close', broken('source probe channel'));
    this.probe = probe;
    this.channel = channel;
    if (this.onMessage) await this.startConsumer(channel, attachment > 1);
    if (closedEarly !== undefined) throw new Error(`${closedEarly} closed while opening`);
  }

  /** The source queue's type (undefined before the first attach). */
  get queueType(): SourceQueueType | undefined {
    return this.type;
  }

  /** Whether the broker counts a return of a message against it (see countsDeliveries). */
  get countsDeliveries(): boolean {
    return countsDeliveries(this.type);
  }

  /** Forgets the channels of a lost connection: their unacked messages go back to the queue. */
  detach(): void {
    // A reset of a link that is still open (a channel of it closed): its held acks still count.
    this.releaseCredit();
    this.sendHeldAcks();
    this.channel = undefined;
    this.probe = undefined;
    this.parkChannel = undefined;
    this.consumerTag = undefined;
    this.paused = false;
    this.overflowed = false;
    this.returnUnread();
  }

  async consume(onMessage: (message: ConsumeMessage) => void): Promise<void> {
    this.onMessage = onMessage;
    if (this.channel) await this.startConsumer(this.channel, false);
  }

  private async startConsumer(channel: Channel, again: boolean): Promise<void> {
    const started = this.startConsumerOn(channel, again);
    const settled = started.then(
      () => {},
      () => {},
    );
    this.starting = settled;
    try {
      await started;
    } finally {
      if (this.starting === settled) this.starting = undefined;
    }
  }

  private async startConsumerOn(channel: Channel, again: boolean): Promise<void> {
    if (again) await this.beforeConsume();
    if (this.channel !== channel || !this.onMessage) return;
    const handler = this.onMessage;
    // basic.qos applies to the consumers started after it: each consumer gets the window that fits.
    const window = this.bytes.windowFor(this.prefetch);
    if (this.budget) {
      window.window = this.budget.reserve(window.window);
      if (window.window === 0) {
        // Spent, or what is left is reserved by another route's consumer: wait for it.
        this.paused = true;
        this.budget.whenReleased(() => this.flow());
        return;
      }
    }
    // Credit is kept where a delivery on its way when the consumer is cancelled costs something: on
    // a queue that counts deliveries, and against a budget.
    if (this.budget || this.countsDeliveries) {
      this.credit = window.window;
      this.creditOn = channel;
      this.creditFrom = undefined;
    }
    await channel.prefetch(window.window);
    this.bytes.consumerStarted(window.window);
    // Before the consume: its first deliveries may come before the consume-ok is handled here, and
    // what they set (a window delivered, the bound reached) is theirs. Not paused meanwhile: a flow
    // change they ask for waits for the consume-ok (see the flow() below), it starts no consumer.
    this.window = window;
    this.delivered = 0;
    this.overflowed = false;
    this.paused = false;
    const reply = await channel
      .consume(this.queue, (message) => this.deliver(channel, handler, message), { noAck: false })
      .catch((error: unknown) => {
        if (replyCodeOf(error) === 403) throw accessRefused(`--source-queue: ${this.where}`, error, 'read');
        throw error;
      });
    if (this.channel !== channel || !this.onMessage) {
      // Stopped or reconnected meanwhile: this consumer is not wanted.
      await channel.cancel(reply.consumerTag).catch(() => {});
      return;
    }
    this.consumerTag = reply.consumerTag;
    this.consumerSeq++;
    this.unlisted = 0;
    this.log.debug({ window: window.window, consumer: this.consumerSeq }, 'source consumer started');
    // The broker's word on the new consumer at once, not at the next poll.
    void this.depth();
    this.flow();
  }

  /** One delivery: returned unread when it does not fit the byte bound, else handed on. */
  private deliver(
    channel: Channel,
    handler: (message: ConsumeMessage) => void,
    message: ConsumeMessage | null,
  ) {
    if (message === null) {
      if (this.channel === channel) {
        this.consumerTag = undefined;
        this.onBroken('the broker cancelled the consumer');
      }
      return;
    }
    if (this.creditOn === channel) {
      this.creditFrom ??= message.fields.deliveryTag;
      if (this.credit > 0) {
        this.credit--;
        this.budget?.delivered();
        if (this.credit === 0) this.wakeSpent();
      }
    }
    // The bound returns a delivery unread only to a classic queue, and at most once (a redelivered
    // one is taken even past the bound): every return counts toward a quorum queue's delivery
    // limit, past which the broker drops or dead-letters the message. On any other queue what the
    // broker sent is taken, and the consumer pauses once the bound is reached (see overflowed): the
    // bodies held may pass the bound by what the window let the broker send before the pause.
    const returnable = !message.fields.redelivered && !this.countsDeliveries;
    if (!this.bytes.admit(message.content.length, returnable)) {
      // Its body is dropped at once; it goes back once the consumer is cancelled (see unread), and
      // the broker delivers it again once the consumer is back.
      this.overflowed = true;
      this.unread.push({ channel, fields: message.fields });
      // Unsettled until returned: a `multiple` ack of a later message must not cover it.
      this.acksOf(channel).unsettled.add(message.fields.deliveryTag);
      this.flow();
      return;
    }
    (message as Delivered)[COUNTED] = true;
    (message as Delivered)[DELIVERED_ON] = channel;
    this.acksOf(channel).unsettled.add(message.fields.deliveryTag);
    // Nothing can be returned to this queue: the consumer pauses once the bound is reached.
    let grow = false;
    if (this.bytes.takesAll) {
      if (this.bytes.full) this.overflowed = true;
      // Its window was delivered: the next consumer may take twice as many.
      grow = ++this.delivered === this.window.window && this.window.window < this.prefetch;
    }
    handler(message);
    if (this.bytes.full || !this.window.sized || grow) this.flow();
  }

  /** The body of a message the bridge no longer holds leaves the byte count. */
  private release(message: ConsumeMessage): void {
    if (!(message as Delivered)[COUNTED]) return;
    (message as Delivered)[COUNTED] = false;
    const bytes = this.bytes;
    bytes.release(message.content.length);
    // Only when it may change something: a paused consumer may come back, a window open or grow.
    if (this.paused ? bytes.mayResume : bytes.count === 0) this.flow();
  }

  /** Pauses or resumes the consumer for the byte bound, one change at a time. */
  private flow(): void {
    if (this.flowing) {
      this.flowAgain = true;
      return;
    }
    this.flowing = this.changeFlow()
      // A channel that closed under the change: its close resets the connection.
      .catch((error: unknown) => this.log.debug({ error: String(error) }, 'source consumer change failed'))
      .finally(() => {
        this.flowing = undefined;
        if (this.flowAgain) {
          this.flowAgain = false;
          this.flow();
        }
      });
  }

  private async changeFlow(): Promise<void> {
    const channel = this.channel;
    if (!channel || !this.onMessage || this.quiescing) return;
    const tag = this.consumerTag;
    const bytes = this.bytes;
    if (tag !== undefined) {
      // A body came past the bound: the window is too large for the bodies coming now.
      const pause = this.overflowed;
      // The first body tells the size: the window of one opens to as many as fit.
      const size = !this.window.sized && bytes.sizeKnown;
      // Once nothing is held, a window twice as large (the bodies got smaller), or the whole
      // prefetch (a window opened while messages were held was that much smaller), is worth a
      // new consumer.
      const current = this.window.window;
      const next = Math.min(
        bytes.windowFor(this.prefetch).window,
        this.budget ? current + this.budget.available : Number.POSITIVE_INFINITY,
      );
      const grow =
        this.window.sized &&
        (bytes.takesAll
          ? this.delivered >= current && next > current
          : bytes.count === 0 && (next >= 2 * current || (next === this.prefetch && current < next)));
      if (!pause && !size && !grow) return;
      // RabbitMQ (3.10's quorum queues) returns what was on its way to a consumer when it is
      // cancelled, and counts each return toward the delivery limit: cancel it only once the broker
      // has nothing left to send it, with its settlements held meanwhile.
      if (this.creditOn === channel && this.countsDeliveries && !(await this.creditSpent(false))) return;
      // A stop began meanwhile: it cancels this consumer, with what is held still held.
      if (this.quiescing) return;
      if (this.consumerTag !== tag || this.channel !== channel) {
        // Stopped or reset meanwhile (their cancel released the credit); else nothing is held.
        if (this.creditOn === channel) {
          this.holdSettles = false;
          this.settleHeld(channel);
        }
        return;
      }
      this.paused = true;
      // A new window, not a pause: the route goes on consuming, as readiness says (see consumption).
      this.recreating = !pause;
      this.consumerTag = undefined;
      // What was delivered before the cancel stays ours to ack; nothing comes after its cancel-ok.
      const cancelled = channel.cancel(tag).then(
        () => {},
        () => {},
      );
      this.cancelling = cancelled;
      await cancelled;
      if (this.cancelling === cancelled) this.cancelling = undefined;
      this.releaseCredit();
    }
    try {
      this.returnUnread();
      if (this.paused && bytes.mayResume && this.channel === channel)
        await this.startConsumer(channel, false);
    } finally {
      this.recreating = false;
    }
  }

  /** Returns the deliveries that did not fit (see unread); the consumer is cancelled by now. */
  private returnUnread(): void {
    const unread = this.unread;
    this.unread = [];
    for (const { channel, fields } of unread) {
      const acks = this.acksOf(channel);
      acks.unsettled.delete(fields.deliveryTag);
      try {
        channel.nack({ fields } as ConsumeMessage, false, true);
        // The acks held behind it may now be covered by one `multiple` ack.
        if (acks.ready.size > 0) this.flushSoon(channel, acks);
      } catch {
        // The channel closed: the broker gives it back anyway.
      }
    }
  }

  /**
   * Before a stop, on a queue that counts deliveries: lets what the broker may still send the
   * consumer arrive (and be forwarded as any other), its settlements held so that no more is sent,
   * for at most SPEND_WAIT_MS. Its cancel then finds nothing on its way, which would come back
   * counted.
   */
  async quiesce(): Promise<void> {
    if (!this.countsDeliveries) return;
    this.quiescing = true;
    // A consumer being started, replaced or changed: once it is up (or gone), it is the one.
    const pending = [this.starting, this.cancelling, this.flowing].filter((each) => each !== undefined);
    if (pending.length > 0) await Promise.race([Promise.all(pending), sleep(3000)]);
    if (this.creditOn !== this.channel || this.consumerTag === undefined) return;
    await this.creditSpent(true);
  }

  async stopConsuming(): Promise<void> {
    this.onMessage = undefined;
    // A consumer being started or replaced: its credit goes back only after its own cancel-ok.
    const pending = [this.starting, this.cancelling].filter((each) => each !== undefined);
    if (pending.length > 0) await Promise.race([Promise.all(pending), sleep(3000)]);
    const tag = this.consumerTag;
    this.consumerTag = undefined;
    // A broker that does not answer must not hold up a stop: wait at most 3 s for the cancel.
    if (tag && this.channel) await Promise.race([this.channel.cancel(tag).catch(() => {}), sleep(3000)]);
    this.releaseCredit();
    this.quiescing = false;
    // What did not fit goes back now, not when the connection closes.
    this.returnUnread();
  }

  get isConnected(): boolean {
    return this.channel !== undefined;
  }

  /**
   * Whether the route consumes as the broker sees it: our consumer is live (its consume-ok came,
   * no cancel, its channel open) and the broker's answer to a passive declare on this connection,
   * asked while it was live and at most BROKER_VIEW_MAX_AGE_MS ago, listed a consumer on the queue.
   * `paused`: the bridge itself cancelled its consumer at the byte bound, and the broker answers.
   */
  consumption(now = Date.now()): { consuming: boolean; paused: boolean } {
    const fresh = (view: QueueView | undefined): view is QueueView =>
      view !== undefined && view.channel === this.channel && now - view.sentAt <= BROKER_VIEW_MAX_AGE_MS;
    const answering = fresh(this.view);
    const seen = this.consumingView;
    const live = this.consumerTag !== undefined || this.recreating;
    return {
      consuming: live && answering && fresh(seen) && seen.consumers > 0,
      paused: this.paused && !this.recreating && this.consumerTag === undefined && answering,
    };
  }

  /** Acks one message on the channel that delivered it. False when that channel is gone. */
  ack(message: ConsumeMessage): boolean {
    this.release(message);
    const channel = this.liveChannelOf(message);
    if (!channel) return false;
    const acks = this.acksOf(channel);
    acks.ready.set(message.fields.deliveryTag, performance.now());
    this.flushSoon(channel, acks);
    return true;
  }

  /** Flushes the acks once this turn's acks are all collected. */
  private flushSoon(channel: Channel, acks: AckState): void {
    if (acks.scheduled) return;
    acks.scheduled = true;
    setImmediate(() => this.flushAcks(channel, acks));
  }

  private acksOf(channel: Channel): AckState {
    let state = this.ackStates.get(channel);
    if (!state) {
      state = {
        unsettled: new Set(),
        ready: new Map(),
        scheduled: false,
        holdTimer: undefined,
      };
      this.ackStates.set(channel, state);
    }
    return state;
  }

  /**
   * Sends the acks collected in this turn: one `multiple` ack for the run of delivery tags from the
   * oldest unsettled one. The others wait to be covered by a later one, for up to
   * HOLD_OUT_OF_ORDER_MS or until they hold a quarter of the prefetch window, and then go one by
   * one (`everything`: at once).
   */
  private flushAcks(channel: Channel, acks: AckState, everything = false): void {
    acks.scheduled = false;
    if (channel !== this.channel) return;
    let upTo: number | undefined;
    let allowed = Number.POSITIVE_INFINITY;
    if (this.creditOn === channel) {
      let run = 0;
      for (const tag of acks.unsettled) {
        if (!acks.ready.has(tag)) break;
        if (this.needsCredit(channel, tag)) run++;
      }
      allowed = this.settleCredit(channel, run);
    }
    for (const tag of acks.unsettled) {
      if (!acks.ready.has(tag) || (this.needsCredit(channel, tag) && allowed-- <= 0)) break;
      acks.unsettled.delete(tag);
      acks.ready.delete(tag);
      upTo = tag;
    }
    try {
      if (upTo !== undefined) channel.ack(tagged(upTo), true);
      const now = performance.now();
      const all = everything || acks.ready.size >= this.prefetch * HOLD_AT_MOST_OF_PREFETCH;
      for (const [tag, since] of acks.ready) {
        if (!all && now - since < HOLD_OUT_OF_ORDER_MS) {
          acks.holdTimer ??= setTimeout(
            () => {
              acks.holdTimer = undefined;
              this.flushAcks(channel, acks);
            },
            HOLD_OUT_OF_ORDER_MS - (now - since),
          ).unref();
          break;
        }
        // Held for the budget: sent once the consumer is cancelled (see releaseCredit).
        if (this.needsCredit(channel, tag) && this.settleCredit(channel, 1) === 0) break;
        acks.unsettled.delete(tag);
        acks.ready.delete(tag);
        channel.ack(tagged(tag));
      }
    } catch {
      // The channel closed: the broker gives these back, and they come back as duplicates.
    }
  }

  /** The content header as the broker sent it (see installLosslessReader). */
  headerOf(message: ConsumeMessage): ContentHeader {
    return contentHeaderOf(message.properties);
  }

  /** The exchange and routing key as the broker sent them (amqplib's text may have lost bytes). */
  routingOf(message: ConsumeMessage): { exchange: string | Buffer; routingKey: string | Buffer } {
    return routingBytesOf(message.fields) ?? message.fields;
  }

  /** Returns a message to the queue: the broker delivers it again. */
  requeue(message: ConsumeMessage): boolean {
    return this.nack(message, true);
  }

  /** Hands a message to the queue's dead-letter exchange (dropped where the queue has none). */
  deadLetter(message: ConsumeMessage): boolean {
    return this.nack(message, false);
  }

  private nack(message: ConsumeMessage, requeue: boolean): boolean {
    this.release(message);
    const channel = this.liveChannelOf(message);
    if (!channel) return false;
    if (this.needsCredit(channel, message.fields.deliveryTag) && this.settleCredit(channel, 1) === 0) {
      // Still unsettled, so that no `multiple` ack covers it: sent once the consumer is cancelled.
      this.heldNacks.push({ channel, message, requeue });
      return true;
    }
    return this.sendNack(channel, message, requeue);
  }

  private sendNack(channel: Channel, message: ConsumeMessage, requeue: boolean): boolean {
    const acks = this.acksOf(channel);
    acks.unsettled.delete(message.fields.deliveryTag);
    try {
      channel.nack(message, false, requeue);
      if (requeue) this.countReturn(message);
      // The acks held behind this message may now be covered by one `multiple` ack.
      if (acks.ready.size > 0) this.flushSoon(channel, acks);
      return true;
    } catch {
      return false;
    }
  }

  /** Whether the message's delivery is still ours to settle (its channel is the live one). */
  holds(message: ConsumeMessage): boolean {
    return this.liveChannelOf(message) !== undefined;
  }

  /**
   * The delivery limit the broker applies: what the management API showed, or on RabbitMQ 4 and
   * later, where every quorum queue has one, its default of 20 when the queue sets none.
   */
  private get knownLimit(): SourceDeliveryLimit | undefined {
    const shown = this.deliveryLimit;
    if (shown?.limit === null && this.type === 'quorum' && (this.brokerMajor ?? 4) >= 4)
      return { ...shown, limit: 20, from: 'the default of RabbitMQ 4' };
    return shown;
  }

  /** One return to a queue that counts deliveries: remembered for the warning at close. */
  private countReturn(message: ConsumeMessage | undefined): void {
    if (!this.countsDeliveries) return;
    this.givenBack++;
    const limit = this.knownLimit?.limit;
    if (limit === null || limit === undefined || message === undefined) return;
    // A quorum queue says how often a message came back before (x-delivery-count, RabbitMQ 3.x).
    const before = Number(message.properties.headers?.['x-delivery-count'] ?? 0);
    if (before + 1 > limit) this.givenBackPastLimit++;
  }

  /**
   * Once, when the consumer closes: how many messages went back to a queue that counts each return
   * toward a delivery limit (none are returned while the route runs: see the pipeline's requeue
   * policy and the byte bound; these are the ones held when it stopped).
   */
  private warnGivenBack(unsettled: number): void {
    if (!this.countsDeliveries) return;
    this.givenBack += unsettled;
    const given = this.givenBack;
    const past = this.givenBackPastLimit;
    this.givenBack = 0;
    this.givenBackPastLimit = 0;
    if (given === 0) return;
    const known = this.knownLimit;
    if (known?.limit === null) return;
    const what = this.type === 'quorum' ? 'quorum queue' : `queue (type ${this.type ?? 'unknown'})`;
    const limit =
      known === undefined
        ? 'whose delivery limit is not known (give --source-management to read it; RabbitMQ 4 sets 20 on every quorum queue by default)'
        : `whose delivery limit is ${known.limit} (${known.from})`;
    const whereTo =
      known?.deadLetterExchange === undefined
        ? 'the broker drops them'
        : `the broker dead-letters them to exchange "${known.deadLetterExchange}"`;
    const crossed = past > 0 ? `; ${past} of them reached it with this return: ${whereTo}` : '';
    this.log.warn(
      { queue: this.queue, givenBack: given, deliveryLimit: known?.limit ?? null, pastLimit: past },
      `gave back ${given} message(s) held when the route stopped to ${what} "${this.queue}", ${limit}: each return counts one delivery toward it${crossed}`,
    );
  }

  private liveChannelOf(message: ConsumeMessage): Channel | undefined {
    const channel = (message as Delivered)[DELIVERED_ON];
    return channel !== undefined && channel === this.channel ? channel : undefined;
  }

  /**
   * Ready messages in the queue (unacked ones not counted), or undefined when unknown. The answer
   * (a passive declare on the probe channel) also says how many consumers the broker lists.
   */
  async depth(): Promise<number | undefined> {
    const probe = this.probe;
    if (!probe) return undefined;
    const sentAt = Date.now();
    const channel = this.channel;
    const consumer = this.consumerTag !== undefined ? this.consumerSeq : undefined;
    try {
      const ok = await probe.checkQueue(this.queue);
      const view = { messages: ok.messageCount, consumers: ok.consumerCount, sentAt, channel, consumer };
      this.view = view;
      // About the consumer it was asked for, and only while that one is still live: an answer that
      // comes after our own cancel (the broker may take the cancel, on the consuming channel,
      // before this passive declare, on the probe) says nothing about the consumer that follows.
      if (consumer !== undefined && consumer === this.consumerSeq && this.consumerTag !== undefined) {
        this.consumingView = view;
      }
      this.checkListed(view);
      return ok.messageCount;
    } catch {
      return undefined;
    }
  }

  /**
   * Our consumer is live but the broker, asked after its consume-ok, lists none on the queue
   * twice in a row: the consumer is gone without our hearing of it, and only a new connection
   * brings it back.
   */
  private checkListed(view: QueueView): void {
    const ours = view.channel === this.channel && view.consumer === this.consumerSeq;
    if (!ours || this.consumerTag === undefined) return;
    this.unlisted = view.consumers === 0 ? this.unlisted + 1 : 0;
    if (this.unlisted >= 2) {
      this.unlisted = 0;
      this.onBroken('the broker lists no consumer on the queue');
    }
  }

  /**
   * Publishes a copy to the park queue and waits for the broker's confirm. False (the message
   * stays in the source) when the park queue refused or could not route it.
   */
  park(message: ConsumeMessage, reason: string): Promise<boolean> {
    const channel = this.parkChannel;
    if (!channel || this.parkQueue === undefined || !this.liveChannelOf(message))
      return Promise.resolve(false);
    let header: ContentHeader;
    try {
      header = contentHeaderOf(message.properties);
    } catch (error) {
      // Its property list cannot be read, so nothing can be added to it: it stays in the source.
      if (error instanceof ContentHeaderError) return Promise.resolve(false);
      throw error;
    }
    const seq = ++this.parkSeq;
    const userId = header.userIdBytes;
    const append = [
      rawField(PARK_REASON_HEADER, encodeValue({ type: 'S', value: Buffer.from(reason, 'utf8') })),
      rawField(PARK_SEQ_HEADER, encodeValue({ type: 'l', value: BigInt(seq) })),
    ];
    // The broker refuses a user_id that is not the publishing user's.
    if (userId !== undefined)
      append.push(rawField(SOURCE_USER_HEADER, encodeValue({ type: 'S', value: userId })));
    const bytes = header.splice({
      remove: userId !== undefined ? [...PARK_HEADERS, SOURCE_USER_HEADER] : PARK_HEADERS,
      append,
      dropUserId: true,
    });
    const pending = { returned: false };
    this.parkPending.set(seq, pending);
    const parkQueue = this.parkQueue;
    return new Promise((resolve) => {
      const done = (ok: boolean) => {
        this.parkPending.delete(seq);
        resolve(ok);
      };
      try {
        publishRaw(channel, '', parkQueue, bytes, message.content, (error) =>
          done(!error && !pending.returned),
        );
      } catch {
        done(false);
      }
    });
  }

  /** Sends every ack still collected or waiting for an older message (before a close). */
  /**
   * How many of `n` settlements may go now: while a consumer with reserved credit is live, each one
   * lets the broker send one more delivery, so it needs one more reserved in the budget.
   */
  private settleCredit(channel: Channel, n: number): number {
    if (this.creditOn !== channel) return n;
    if (this.holdSettles) return 0;
    const granted = this.budget ? this.budget.reserve(n) : n;
    this.credit += granted;
    if (granted < n && this.budget && !this.settleWaiting) {
      // Another route holds what is left: what is held here goes once it lets some go.
      this.settleWaiting = true;
      this.budget.whenReleased(() => {
        this.settleWaiting = false;
        if (this.creditOn === channel) this.settleHeld(channel);
      });
    }
    return granted;
  }

  /**
   * Holds the live consumer's settlements until the broker has no delivery left to send it (its
   * credit is spent): true then, and they stay held until its cancel-ok (see releaseCredit). False
   * when deliveries stop first (the queue is empty): they go, and the restart waits a while.
   */
  private async creditSpent(stopping: boolean): Promise<boolean> {
    if (this.credit > 0 && !stopping && Date.now() < this.restartAfter) return false;
    this.holdSettles = true;
    if (this.credit === 0) return true;
    const spent = await new Promise<boolean>((resolve) => {
      const wake = () => {
        clearTimeout(timer);
        this.spentWaiters.delete(wake);
        resolve(true);
      };
      const timer = setTimeout(() => {
        this.spentWaiters.delete(wake);
        resolve(false);
      }, SPEND_WAIT_MS);
      this.spentWaiters.add(wake);
    });
    // A stop keeps them held until the cancel-ok: sent now, they would let the broker send more,
    // which the cancel would return.
    if (!spent && !stopping && !this.quiescing) {
      this.holdSettles = false;
      const channel = this.creditOn;
      if (channel) this.settleHeld(channel);
      this.restartAfter = Date.now() + RESTART_RETRY_MS;
      // Then the change is looked at again, whatever comes meanwhile.
      setTimeout(() => this.flow(), RESTART_RETRY_MS).unref();
    }
    return spent;
  }

  private wakeSpent(): void {
    for (const wake of [...this.spentWaiters]) wake();
  }

  /** Sends the settlements held on `channel` that may go now. */
  private settleHeld(channel: Channel): void {
    const held = this.heldNacks;
    this.heldNacks = [];
    for (const each of held) {
      if (each.channel !== channel || channel !== this.channel) continue;
      if (this.needsCredit(channel, each.message.fields.deliveryTag) && this.settleCredit(channel, 1) === 0)
        this.heldNacks.push(each);
      else this.sendNack(channel, each.message, each.requeue);
    }
    if (channel === this.channel) this.flushAcks(channel, this.acksOf(channel));
  }

  private needsCredit(channel: Channel, tag: number): boolean {
    return this.creditOn === channel && this.creditFrom !== undefined && tag >= this.creditFrom;
  }

  /** The consumer is cancelled (or its channel gone): its credit goes back, what it held is sent. */
  private releaseCredit(): void {
    const channel = this.creditOn;
    if (channel === undefined) return;
    this.creditOn = undefined;
    this.creditFrom = undefined;
    this.holdSettles = false;
    this.wakeSpent();
    this.budget?.release(this.credit);
    this.credit = 0;
    this.settleHeld(channel);
  }

  sendHeldAcks(): void {
    if (this.channel) this.flushAcks(this.channel, this.acksOf(this.channel), true);
  }

  /**
   * Closes the consuming channel: the broker puts back every message we did not ack before it
   * answers, so a depth read afterwards counts them.
   */
  async closeConsumer(): Promise<void> {
    const channel = this.channel;
    this.sendHeldAcks();
    // What is still unacked on it goes back with the close: one delivery each, counted too.
    this.warnGivenBack(channel ? this.acksOf(channel).unsettled.size : 0);
    this.channel = undefined;
    if (channel) await channel.close().catch(() => {});
  }
}

export async function openChannel(connection: ChannelModel, log: Logger): Promise<Channel> {
  const channel = await connection.createChannel();
  channel.on('error', (error: Error) => log.debug({ error: error.message }, 'channel error'));
  return channel;
}

/**
 * The queue's type, read without the management API: a basic.consume with the consumer argument
 * `x-stream-offset` on a throwaway channel. A stream takes it (the consumer is dropped with the
 * channel; a stream counts no deliveries); any other queue refuses it with PRECONDITION_FAILED
 * "invalid arg 'x-stream-offset' for queue 'Q' in vhost '/' of queue type rabbit_quorum_queue"
 * (rabbit_classic_queue for a classic one; RabbitMQ 3.10 to 4.x) and delivers nothing. Anything
 * else is 'unknown'.
 */
async function queueTypeOf(connection: ChannelModel, queue: string, log: Logger): Promise<SourceQueueType> {
  let channel: Channel;
  try {
    channel = await openChannel(connection, log);
  } catch {
    return 'unknown';
  }
  try {
    await channel.prefetch(1);
    await channel.consume(queue, () => {}, {
      noAck: false,
      arguments: { 'x-stream-offset': 'first' },
    });
    return 'stream';
  } catch (error) {
    const named = /of queue type rabbit_(\w+?)_queue/.exec(error instanceof Error ? error.message : '');
    return replyCodeOf(error) === 406 && named?.[1] ? named[1] : 'unknown';
  } finally {
    // A refusal closed the channel already; a stream consumer goes with it.
    await channel.close().catch(() => {});
  }
}

/**
 * The source queue's type (see queueTypeOf); a stream is refused: it is not consumed as a queue is
 * (a consumer starts from an offset, and nothing it acks leaves the stream).
 */
export async function sourceQueueTypeOf(
  connection: ChannelModel,
  queue: string,
  where: string,
  log: Logger,
): Promise<SourceQueueType> {
  const type = await queueTypeOf(connection, queue, log);
  log.debug({ queue, type }, 'source queue type');
  if (type === 'stream') {
    throw new FatalConnectError(
      `--source-queue: queue "${queue}" on the ${where} is a stream; over AMQP it would be read from an offset nobody stores; nothing was consumed: read it over the stream protocol (--source rabbitmq-stream://…:5552/vhost --source-stream ${queue}), or give a classic or quorum queue`,
    );
  }
  return type;
}

/** Fails with an operator's message when the queue is missing (the check closes the channel then). */
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
        `${flag}: access to queue "${queue}" refused on the ${where}; grant the user permission on it`,
      );
    }
    throw error;
  }
}

/** Fails with an operator's message when the target exchange is missing. */
export async function checkExchangeExists(channel: Channel, exchange: string, where: string): Promise<void> {
  try {
    await channel.checkExchange(exchange);
  } catch (error) {
    if (replyCodeOf(error) === 404) {
      throw new FatalConnectError(
        `--target-exchange: exchange "${exchange}" does not exist on the ${where}; declare it first or fix the name`,
      );
    }
    throw error;
  }
}

/** The park sequence number a returned parked copy carries (0 when none can be read). */
function parkSeqOf(message: Message): number {
  try {
    const header = contentHeaderOf(message.properties);
    const span = header.field(PARK_SEQ_HEADER);
    const value = span ? header.valueOf(span) : undefined;
    return value?.type === 'l' ? Number(value.value) : 0;
  } catch {
    return 0;
  }
}
