import { rmSync } from 'node:fs';
import { FaultProxy } from '../harness/proxy.js';
import { cleanLeftovers, haveLocalServers, newRunDir, RabbitNode, RedisServer } from '../harness/servers.js';
import { type RunningCli, startCli } from '../helpers.js';
import {
  countStored,
  offenders,
  read091,
  readStored,
  type StreamCount,
  StreamWatch,
} from '../stream-helpers.js';
import { DepthProbe, type LogLine, logLines, sleep, totalMessages } from './world.js';

/**
 * The stream link carries at most this many bytes a second (each way, every connection through the
 * proxy together): about 600 of the suite's messages a second, so that a fault lands inside a
 * transfer of thousands whatever else the CPU is doing, as the AMQP chaos suite paces its target.
 */
export const STREAM_LINK_BYTES_PER_S = 250_000;

/** A short lease, so that a killed owner's producer and claims are taken over in seconds. */
export const LEASE = '2s';

/**
 * Servers the stream chaos suite owns, so it may kill and restart them: a source node, a target
 * node serving the stream protocol, a Redis with AOF, and a fault proxy (a slow line) in front of
 * the target's stream port, through which the bridges write.
 */
export class StreamWorld {
  readonly source: RabbitNode;
  readonly target: RabbitNode;
  readonly redis: RedisServer;
  proxy!: FaultProxy;
  readonly sourceProbe: DepthProbe;

  private constructor(readonly runDir: string) {
    // It serves the stream protocol too, for the stream-to-stream scenarios.
    this.source = new RabbitNode(runDir, 'stream-chaos-source', { stream: true });
    this.target = new RabbitNode(runDir, 'stream-chaos-target', { stream: true });
    this.redis = new RedisServer(runDir, 'stream-chaos-redis', true);
    this.sourceProbe = new DepthProbe(() => this.source.url);
  }

  static async create(): Promise<StreamWorld> {
    if (!haveLocalServers()) {
      throw new Error('chaos: needs rabbitmq-server and redis-server installed, to stop and restart them');
    }
    cleanLeftovers();
    const world = new StreamWorld(newRunDir());
    await Promise.all([world.source.start(), world.target.start(), world.redis.start()]);
    world.proxy = await world.streamProxy();
    return world;
  }

  /** A proxy of its own in front of the target's stream port, paced as the shared one. */
  async streamProxy(): Promise<FaultProxy> {
    const proxy = new FaultProxy('127.0.0.1', this.target.streamPort);
    await proxy.start();
    proxy.setRate(STREAM_LINK_BYTES_PER_S);
    return proxy;
  }

  /** The stream URL through a proxy (the shared one by default). */
  streamUrlVia(proxy: FaultProxy = this.proxy): string {
    return `rabbitmq-stream://guest:guest@127.0.0.1:${proxy.port}/`;
  }

  /** `dedup-bridge run` into `stream` through a proxy, with a short lease and source heartbeat. */
  startBridge(
    sourceQueue: string,
    stream: string,
    options: { proxy?: FaultProxy; prefetch?: number; extra?: string[] } = {},
  ): RunningCli {
    return startCli([
      'run',
      '--source',
      `${this.source.url}/?heartbeat=2`,
      '--source-queue',
      sourceQueue,
      '--target',
      this.streamUrlVia(options.proxy),
      '--target-stream',
      stream,
      '--redis',
      this.redis.url,
      '--lease',
      LEASE,
      '--prefetch',
      String(options.prefetch ?? 200),
      '--shutdown-timeout',
      '20s',
      ...(options.extra ?? []),
    ]);
  }

  /** `dedup-bridge run` from a stream of the source node into `stream` through the shared proxy. */
  startStreamBridge(sourceStream: string, stream: string): RunningCli {
    return startCli([
      'run',
      '--source',
      this.source.streamUrl,
      '--source-stream',
      sourceStream,
      '--target',
      this.streamUrlVia(),
      '--target-stream',
      stream,
      '--redis',
      this.redis.url,
      '--lease',
      LEASE,
      '--shutdown-timeout',
      '20s',
    ]);
  }

  /** A watch on a stream of the target node, straight to its port (not through the proxy). */
  watch(stream: string): StreamWatch {
    return new StreamWatch(this.target.streamUrl, stream);
  }

  /**
   * Waits until the source queue holds nothing (ready or unacked) and the stream holds at least
   * `count` messages; false when the time is up, or when the stream has not grown for `stuckMs`
   * while messages are still to come (a transfer that stopped: no use waiting out the rest).
   */
  async untilTransferred(
    sourceQueue: string,
    watch: StreamWatch,
    count: number,
    timeoutMs: number,
    stuckMs = 60_000,
  ) {
    const deadline = Date.now() + timeoutMs;
    let seen = watch.count;
    let movedAt = Date.now();
    while (Date.now() < deadline) {
      if (watch.count >= count && (await this.sourceProbe.depth(sourceQueue)) === 0) {
        if ((await totalMessages(this.source, sourceQueue)) === 0) return true;
      }
      if (watch.count !== seen) {
        seen = watch.count;
        movedAt = Date.now();
      } else if (watch.count < count && Date.now() - movedAt > stuckMs) return false;
      await sleep(200);
    }
    return false;
  }

  /** Reads the whole stream straight from the target node and counts it by ID. */
  async count(
    label: string,
    stream: string,
    ids: readonly string[],
  ): Promise<{ count: StreamCount; evidence: string }> {
    const stored = await readStored(this.target.streamUrl, stream, { idleMs: 2000 });
    const count = countStored(label, ids, stored);
    let evidence = offenders(ids, stored);
    if (count.lost > 0) {
      // A second reader, over 0-9-1, tells a message the stream lacks from one the reader missed.
      const again = await read091(this.target.url, stream, ids.length).catch((error: Error) => error);
      const other =
        again instanceof Error
          ? again.message
          : `${new Set(again.map((message) => message.id)).size} distinct IDs`;
      evidence += `; a 0-9-1 reader of the stream found ${other}`;
    }
    return { count, evidence };
  }

  async stop(): Promise<void> {
    await this.sourceProbe.close().catch(() => {});
    await this.proxy?.stop().catch(() => {});
    await Promise.allSettled([this.source.stop(true), this.target.stop(true), this.redis.stop(true)]);
    rmSync(this.runDir, { recursive: true, force: true });
  }
}

/** A bridge's warnings and errors after `since` (ms since the epoch): what it noticed. */
export function warningsSince(output: string, since: number): LogLine[] {
  return logLines(output).filter(
    (line) => line.time >= since && line.level !== 'info' && line.level !== 'debug',
  );
}
