import { rmSync } from 'node:fs';
import { cleanLeftovers, haveLocalServers, newRunDir, RabbitNode, RedisServer } from './servers.js';

/** Where the tests find their servers, and whether the harness owns them (may stop and kill them). */
interface HarnessUrls {
  sourceUrl: string;
  targetUrl: string;
  /**
   * The target broker's stream protocol endpoint (rabbitmq-stream://…): TARGET_STREAM_URL, or
   * derived from TARGET_URL (its credentials and vhost, port 5552, the stream plugin's default).
   */
  targetStreamUrl: string;
  /** The source broker's stream endpoint (SOURCE_STREAM_URL, or derived from SOURCE_URL as above). */
  sourceStreamUrl: string;
  redisUrl: string;
  /** The source broker's management API (SOURCE_MANAGEMENT_URL, or derived: port 15672). */
  sourceManagementUrl: string;
  /** True when the harness started these servers itself. */
  own: boolean;
  /** The run folder of servers the harness started ('' when not its own). */
  runDir: string;
}

export interface Harness extends HarnessUrls {
  source?: RabbitNode;
  target?: RabbitNode;
  redis?: RedisServer;
  stop(): Promise<void>;
}

export const HOW_TO_GET_SERVERS =
  'harness: no brokers: set SOURCE_URL, TARGET_URL and REDIS_URL (e.g. after `docker compose up -d`: ' +
  'SOURCE_URL=amqp://bridge:bridge@127.0.0.1:5672 TARGET_URL=amqp://bridge:bridge@127.0.0.1:5673 REDIS_URL=redis://127.0.0.1:6379 ' +
  'SOURCE_STREAM_URL=rabbitmq-stream://bridge:bridge@127.0.0.1:5552 TARGET_STREAM_URL=rabbitmq-stream://bridge:bridge@127.0.0.1:5553), ' +
  'or install rabbitmq-server and redis-server so the harness can start its own';

/**
 * 1. SOURCE_URL, TARGET_URL and REDIS_URL from the environment, when all are set;
 * 2. else its own throwaway RabbitMQ nodes (source, target) and Redis on free loopback ports;
 * 3. else one clear error that says how to get them.
 */
export async function startHarness(options: { redisAppendonly?: boolean } = {}): Promise<Harness> {
  const { SOURCE_URL, TARGET_URL, REDIS_URL } = process.env;
  if (SOURCE_URL && TARGET_URL && REDIS_URL) {
    const source = new URL(SOURCE_URL);
    const management =
      process.env.SOURCE_MANAGEMENT_URL ??
      `http://${source.username}:${source.password}@${source.hostname}:15672`;
    return {
      sourceUrl: SOURCE_URL,
      targetUrl: TARGET_URL,
      targetStreamUrl: process.env.TARGET_STREAM_URL ?? streamUrlOf(TARGET_URL),
      sourceStreamUrl: process.env.SOURCE_STREAM_URL ?? streamUrlOf(SOURCE_URL),
      redisUrl: REDIS_URL,
      sourceManagementUrl: management,
      own: false,
      runDir: '',
      stop: async () => {},
    };
  }
  if (!haveLocalServers()) throw new Error(HOW_TO_GET_SERVERS);

  cleanLeftovers();
  const runDir = newRunDir();
  // Both serve the stream protocol too, for the stream source's and target's tests (a second or
  // so more at start, where a node of its own would cost seven).
  const source = new RabbitNode(runDir, 'source', { management: true, stream: true });
  const target = new RabbitNode(runDir, 'target', { stream: true });
  const redis = new RedisServer(runDir, 'redis', options.redisAppendonly ?? false);
  // Killed, not stopped: the servers and their folder are thrown away, and a graceful stop of the
  // source node (with its management plugin) takes seconds at the end of every run.
  const stop = async () => {
    await Promise.allSettled([source.stop(true), target.stop(true), redis.stop(true)]);
    rmSync(runDir, { recursive: true, force: true });
  };
  // Stop what we started also when the run is interrupted.
  const onSignal = () => {
    void stop().finally(() => process.exit(130));
  };
  process.once('SIGINT', onSignal);
  process.once('SIGTERM', onSignal);
  try {
    await Promise.all([source.start(), target.start(), redis.start()]);
  } catch (error) {
    await stop();
    throw error;
  }
  return {
    sourceUrl: source.url,
    targetUrl: target.url,
    targetStreamUrl: target.streamUrl,
    sourceStreamUrl: source.streamUrl,
    redisUrl: redis.url,
    sourceManagementUrl: source.managementUrl,
    own: true,
    runDir,
    source,
    target,
    redis,
    stop: async () => {
      process.off('SIGINT', onSignal);
      process.off('SIGTERM', onSignal);
      await stop();
    },
  };
}

/** The stream endpoint of an AMQP broker's URL: the same user, password, host and vhost, port 5552. */
function streamUrlOf(amqpUrl: string): string {
  const url = new URL(amqpUrl);
  const user = url.username || url.password ? `${url.username}:${url.password}@` : '';
  return `rabbitmq-stream://${user}${url.hostname}:5552/${url.pathname.replace(/^\//, '')}`;
}
