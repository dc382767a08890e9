// --id-from: which strategies a message's dedup ID comes from, in order. The parser lives with
// the settings; deriving the ID from a message is dedup/id.ts's job.
import { ConfigError } from '../errors.js';

/** Where a message's dedup ID comes from; `--id-from` is an ordered list of these. */
export type IdStrategy =
  | { kind: 'header'; name: string }
  | { kind: 'message-id' }
  | { kind: 'content' }
  | { kind: 'offset' };

export const DEFAULT_ID_FROM = 'header:_HQ_DUPL_ID,header:_AMQ_DUPL_ID,message-id,content';

/** `streamSource`: `offset` (a stream message's position) is a strategy only for a stream source. */
export function parseIdFrom(text: string, streamSource = false): IdStrategy[] {
  const items = text
    .split(',')
    .map((item) => item.trim())
    .filter((item) => item.length > 0);
  if (items.length === 0) {
    throw new ConfigError('--id-from: empty list; give e.g. header:_HQ_DUPL_ID,message-id,content');
  }
  return items.map((item): IdStrategy => {
    if (item === 'message-id') return { kind: 'message-id' };
    if (item === 'content') return { kind: 'content' };
    if (item === 'offset') {
      if (!streamSource) {
        throw new ConfigError(
          "--id-from: offset is a stream message's position and goes with a stream source (--source rabbitmq-stream://…); use header:NAME, message-id or content",
        );
      }
      return { kind: 'offset' };
    }
    if (item.startsWith('header:') && item.length > 'header:'.length) {
      return { kind: 'header', name: item.slice('header:'.length) };
    }
    throw new ConfigError(
      `--id-from: "${item}" is not a strategy; use header:NAME, message-id, content or, for a stream source, offset (comma-separated, first match wins)`,
    );
  });
}

export function describeStrategy(strategy: IdStrategy): string {
  return strategy.kind === 'header' ? `header:${strategy.name}` : strategy.kind;
}
