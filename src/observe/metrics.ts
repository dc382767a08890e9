import { Counter, collectDefaultMetrics, Gauge, Histogram, Registry } from 'prom-client';
import type { Bridge } from '../bridge/bridge.js';
import type { RouteCounters } from '../bridge/counters.js';
import type { LatencyStage } from '../bridge/pipeline.js';

const PREFIX = 'dedup_bridge_';

/**
 * The Prometheus counters, each read from a field of a route's RouteCounters at scrape time (the
 * pipeline keeps counting in plain numbers; nothing in it knows about Prometheus). docs/operations.md's metric
 * list follows this table.
 */
const COUNTERS: readonly [keyof RouteCounters, string, string][] = [
  [
    'consumed',
    'consumed_total',
    'Deliveries taken from the source queue (a message delivered again counts again)',
  ],
  [
    'forwarded',
    'forwarded_total',
    'Messages published, confirmed by the target and acked (in-doubt ones included)',
  ],
  ['duplicates', 'duplicates_total', 'Messages acked without publishing: the ID was already forwarded'],
  [
    'inDoubt',
    'in_doubt_total',
    'Messages forwarded flagged x-dedup-in-doubt (an earlier copy may be on the target)',
  ],
  ['unroutable', 'unroutable_total', 'Publishes the target returned as unroutable'],
  ['nacked', 'refused_total', 'Publishes the target refused (basic.nack)'],
  ['parked', 'parked_total', 'Messages moved to the park queue'],
  ['deadLettered', 'dead_lettered_total', "Messages handed to the source queue's dead-letter exchange"],
  [
    'retried',
    'retried_total',
    'Retries of refused or unroutable messages, held by the bridge and published again after a backoff',
  ],
  ['redelivered', 'redelivered_total', 'Deliveries the source broker marked as redelivered'],
  ['noId', 'no_id_total', 'Messages without an ID under any --id-from strategy'],
  [
    'badIdHeader',
    'bad_id_header_total',
    'Messages with an ID header of a type that cannot be an ID (skipped: the next --id-from strategy decided)',
  ],
  [
    'looped',
    'looped_total',
    'Messages that came back to the route that forwarded them (the target routes into the source)',
  ],
  [
    'unforwardable',
    'unforwardable_total',
    'Messages the bridge cannot forward as they are (an unreadable header table, a header over frame_max)',
  ],
  ['resentInDoubt', 'resent_in_doubt_total', 'Publishes lost with the target connection and sent again'],
  [
    'claimTakenOver',
    'claim_taken_over_total',
    'Commits that found the claim taken over after its lease ran out',
  ],
  [
    'fenced',
    'fenced_total',
    'Publishes not sent because their lease was not known to hold any more (claimed again first)',
  ],
  ['leaseLost', 'lease_lost_total', 'Leases a renewal found taken over by another owner'],
  [
    'fenceResets',
    'fence_resets_total',
    'Target connections reset so that publishes outliving their lease were never sent',
  ],
  [
    'claimsLost',
    'claims_lost_total',
    'Commits that found no record of their claim: Redis lost it (FLUSHDB, a restart or failover without persistence)',
  ],
  [
    'alreadyCommitted',
    'commit_already_total',
    'Commits that found the ID committed already (another process first, or a commit sent again)',
  ],
];

// From a local Redis round trip (about a millisecond) to a broker under a resource alarm.
const LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30];

const LATENCY_HELP: Record<LatencyStage, string> = {
  claim: 'Time a message waited for its batch to claim its ID in Redis, in seconds',
  commit: 'Time a message waited for its batch to commit its ID in Redis, in seconds',
  confirm: 'Time from publishing a message to the target confirming it, in seconds',
};

interface Watched {
  bridge: Bridge;
  /** Counter values already added to Prometheus, per field. */
  reported: Partial<Record<keyof RouteCounters, number>>;
  /** Ready messages in the source queue at the last poll; undefined when unknown. */
  depth: number | undefined;
  /** A poll of this route's source is on its way (one at a time per route). */
  polling: boolean;
  /** Deliveries returned unread already added to Prometheus. */
  returned: number;
}

/**
 * The metrics of the running routes, in a registry of their own. Routes are added when their
 * bridge has started and removed when it stops; a removed route keeps its counter totals.
 */
export class BridgeMetrics {
  readonly registry = new Registry();
  private readonly watched = new Map<Bridge, Watched>();
  private readonly counters: [Counter<'route'>, keyof RouteCounters][] = [];
  private readonly latency: Record<LatencyStage, Histogram<'route'>>;
  private polling: NodeJS.Timeout | undefined;
  private readonly returned: Counter<'route'>;

  constructor() {
    collectDefaultMetrics({ register: this.registry });
    const metrics = this;
    for (const [field, name, help] of COUNTERS) {
      const counter: Counter<'route'> = new Counter({
        name: PREFIX + name,
        help,
        labelNames: ['route'],
        registers: [this.registry],
        collect() {
          for (const route of metrics.watched.values()) metrics.report(counter, field, route);
        },
      });
      this.counters.push([counter, field]);
    }
    this.latency = {
      claim: this.histogram('claim'),
      commit: this.histogram('commit'),
      confirm: this.histogram('confirm'),
    };
    this.gauge(
      'in_flight',
      'Source messages held by the bridge: delivered and not yet acked or returned',
      [],
      (set) => {
        for (const { bridge } of this.watched.values())
          set({ route: bridge.route }, bridge.pipeline.heldCount);
      },
    );
    this.gauge(
      'in_flight_bytes',
      'Bytes of source message bodies held by the bridge: delivered and not yet acked or returned',
      [],
      (set) => {
        for (const { bridge } of this.watched.values())
          set({ route: bridge.route }, bridge.source.bytes.held);
      },
    );
    this.gauge(
      'in_flight_bytes_peak',
      'The most bytes of source message bodies held at once since the start, a body returned unread included',
      [],
      (set) => {
        for (const { bridge } of this.watched.values())
          set({ route: bridge.route }, bridge.source.bytes.peak);
      },
    );
    const returned: Counter<'route'> = new Counter({
      name: `${PREFIX}returned_unread_total`,
      help: 'Deliveries returned to the source unread: they arrived past --max-in-flight-bytes',
      labelNames: ['route'],
      registers: [this.registry],
      collect() {
        for (const route of metrics.watched.values()) metrics.reportReturned(returned, route);
      },
    });
    this.returned = returned;
    this.gauge(
      'source_queue_depth',
      'Ready messages in the source queue (polled every few seconds)',
      [],
      (set) => {
        for (const { bridge, depth } of this.watched.values()) {
          if (depth !== undefined) set({ route: bridge.route }, depth);
        }
      },
    );
    this.gauge('connection_up', '1 while the connection to that side is up, else 0', ['side'], (set) => {
      for (const { bridge } of this.watched.values()) {
        const status = bridge.status();
        for (const side of ['source', 'target', 'redis'] as const) {
          set({ route: bridge.route, side }, status[side] ? 1 : 0);
        }
      }
    });
    this.gauge(
      'consuming',
      '1 while the consumer is live and the source broker, asked within 10 s, lists a consumer on the queue, else 0',
      [],
      (set) => {
        for (const { bridge } of this.watched.values())
          set({ route: bridge.route }, bridge.status().consuming ? 1 : 0);
      },
    );
    this.gauge(
      'consumer_paused',
      '1 while the bridge paused its consumer: the bodies it holds reached --max-in-flight-bytes',
      [],
      (set) => {
        for (const { bridge } of this.watched.values())
          set({ route: bridge.route }, bridge.status().paused ? 1 : 0);
      },
    );
    this.gauge(
      'target_blocked',
      '1 while the target broker blocks publishing (a resource alarm), else 0',
      [],
      (set) => {
        for (const { bridge } of this.watched.values())
          set({ route: bridge.route }, bridge.status().targetBlocked ? 1 : 0);
      },
    );
  }

  /** Starts watching a route (a started bridge). */
  add(bridge: Bridge): void {
    if (this.watched.has(bridge)) return;
    const histograms = {
      claim: this.latency.claim.labels({ route: bridge.route }),
      commit: this.latency.commit.labels({ route: bridge.route }),
      confirm: this.latency.confirm.labels({ route: bridge.route }),
    };
    // A batch's claim or commit took that long for each of its messages: one observation each.
    bridge.pipeline.onLatency = (stage, seconds, messages) => {
      const histogram = histograms[stage];
      for (let i = 0; i < messages; i++) histogram.observe(seconds);
    };
    const route: Watched = { bridge, reported: {}, depth: undefined, polling: false, returned: 0 };
    this.watched.set(bridge, route);
    void this.poll(route);
  }

  /** Stops watching a route; its counters keep their last totals. */
  remove(bridge: Bridge): void {
    const route = this.watched.get(bridge);
    if (!route) return;
    for (const [counter, field] of this.counters) this.report(counter, field, route);
    this.reportReturned(this.returned, route);
    bridge.pipeline.onLatency = () => {};
    this.watched.delete(bridge);
  }

  get routes(): Bridge[] {
    return [...this.watched.keys()];
  }

  /**
   * Reads each source queue's depth every `everyMs` (a passive queue.declare on the probe
   * channel); its answer is also the broker's word on the route's consumer, for readiness.
   */
  pollDepths(everyMs: number): void {
    this.polling = setInterval(() => {
      for (const route of this.watched.values()) void this.poll(route);
    }, everyMs);
    this.polling.unref();
  }

  /** One read per route at a time: a broker that stopped answering must not pile them up. */
  private async poll(route: Watched): Promise<void> {
    if (route.polling) return;
    route.polling = true;
    try {
      route.depth = await route.bridge.source.depth();
    } finally {
      route.polling = false;
    }
  }

  private reportReturned(counter: Counter<'route'>, route: Watched): void {
    const now = route.bridge.source.bytes.returned;
    counter.inc({ route: route.bridge.route }, now - route.returned);
    route.returned = now;
  }

  stop(): void {
    clearInterval(this.polling);
  }

  /** Adds what a counter field grew by since the last scrape. */
  private report(counter: Counter<'route'>, field: keyof RouteCounters, route: Watched): void {
    const now = route.bridge.pipeline.counters[field];
    const growth = now - (route.reported[field] ?? 0);
    // inc(0) still shows the series, so a route's counters appear from its start.
    if (growth >= 0) counter.inc({ route: route.bridge.route }, growth);
    route.reported[field] = now;
  }

  private histogram(stage: LatencyStage): Histogram<'route'> {
    return new Histogram({
      name: `${PREFIX}${stage}_seconds`,
      help: LATENCY_HELP[stage],
      labelNames: ['route'],
      buckets: LATENCY_BUCKETS,
      registers: [this.registry],
    });
  }

  /** A gauge recomputed from the routes at each scrape. */
  private gauge(
    name: string,
    help: string,
    extraLabels: string[],
    fill: (set: (labels: Record<string, string>, value: number) => void) => void,
  ): void {
    new Gauge({
      name: PREFIX + name,
      help,
      labelNames: ['route', ...extraLabels],
      registers: [this.registry],
      collect() {
        this.reset();
        fill((labels, value) => this.set(labels, value));
      },
    });
  }
}
