import type { GetMessage } from 'amqplib';

/** The same command line with `--redis` pointing at another Redis (a Cluster or a Sentinel set). */
export function onRedis(args: string[], url: string): string[] {
  const at = args.indexOf('--redis');
  if (at < 0) return [...args, '--redis', url];
  return args.map((arg, index) => (index === at + 1 ? url : arg));
}

/**
 * Extra copies on the target, counted from what arrived: each ID's first copy is the original,
 * every other copy is a duplicate, flagged (`x-dedup-in-doubt`) or not.
 */
export function extraCopies(received: GetMessage[]): {
  duplicated: number;
  flagged: number;
  unflagged: number;
} {
  const seen = new Set<string>();
  let flagged = 0;
  let unflagged = 0;
  for (const message of received) {
    const id = String(message.properties.headers?._HQ_DUPL_ID);
    const inDoubt = message.properties.headers?.['x-dedup-in-doubt'] === true;
    if (!seen.has(id)) {
      seen.add(id);
      continue;
    }
    if (inDoubt) flagged++;
    else unflagged++;
  }
  return { duplicated: flagged + unflagged, flagged, unflagged };
}
