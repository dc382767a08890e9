import type { StreamClient } from './client.js';

// Whether a stream exists, and the one line that says it does not: shared by migrate's checks
// before anything moves and the stream target's start, so that both say the same.

/** Whether `stream` exists on the broker (its metadata answers anything but STREAM_DOES_NOT_EXIST). */
export async function streamExists(client: Pick<StreamClient, 'metadata'>, stream: string): Promise<boolean> {
  const [found] = await client.metadata([stream]);
  return found?.codeName !== 'STREAM_DOES_NOT_EXIST';
}

/** The line for a missing target stream; `where` names the endpoint, password masked. */
export function missingStreamLine(stream: string, where: string): string {
  return `--target-stream: stream "${stream}" does not exist on the ${where}; create it first (migrate --declare-target creates it), or fix the name`;
}
