import type { OutgoingMessage } from '../helpers.js';

/** The same command line with `--redis` pointing at another Redis (a Cluster or a Sentinel set). */
export function onRedis(args: string[], url: string): string[] {
  const at = args.indexOf('--redis');
  if (at < 0) return [...args, '--redis', url];
  return args.map((arg, index) => (index === at + 1 ? url : arg));
}

/** `count` messages with IDs `<prefix>-<n>` in the dedup header. */
export function numbered(prefix: string, count: number): { ids: string[]; messages: OutgoingMessage[] } {
  const ids = Array.from({ length: count }, (_, index) => `${prefix}-${index}`);
  return { ids, messages: ids.map((id) => ({ body: id, options: { headers: { _HQ_DUPL_ID: id } } })) };
}
