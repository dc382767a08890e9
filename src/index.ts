// The package's library surface: what the CLI uses, for programs that embed the bridge.
export { type Bridge, startBridge } from './bridge/bridge.js';
export type { RouteCounters } from './bridge/counters.js';
export {
  createIdempotentConsumer,
  type HandlerContext,
  type IdempotentConsumer,
  type IdempotentConsumerOptions,
} from './client/consumer.js';
export { DedupPublishError, DedupPublisher, newDedupId, withDedupId } from './client/producer.js';
export {
  publishUnit,
  UNIT_ID_HEADER,
  UNIT_INDEX_HEADER,
  UNIT_SIZE_HEADER,
  type UnitMessage,
} from './client/unit.js';
export { type IdStrategy, parseIdFrom } from './config/id-from.js';
export { type BridgeSettings, resolveBridgeSettings } from './config/settings.js';
export { DedupCache } from './dedup/cache.js';
export { deriveId, keyOfValue } from './dedup/id.js';
export type { RedisClient } from './dedup/redis.js';
export {
  BridgeError,
  ConfigError,
  ExitCode,
  FatalConnectError,
  RuntimeFailure,
  UnavailableError,
} from './errors.js';
export { DUPLICATE_ID_HEADER, IN_DOUBT_HEADER, ROUTE_HEADER, SOURCE_USER_HEADER } from './headers.js';
