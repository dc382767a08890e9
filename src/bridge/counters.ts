/** Counts of source messages by what happened to them; one set per route. */
export interface RouteCounters {
  /** Deliveries taken from the source queue (a message the broker delivers again counts again). */
  consumed: number;
  /** Published and confirmed by the target, then acked (in-doubt ones included). */
  forwarded: number;
  /** Acked without publishing: the target already held the ID. */
  duplicates: number;
  /** Forwarded with `x-dedup-in-doubt: true`: an earlier attempt may also be on the target. */
  inDoubt: number;
  /** Returned by the target as unroutable. */
  unroutable: number;
  /** Refused by the target (basic.nack). */
  nacked: number;
  /** Moved to the park queue on the source broker. */
  parked: number;
  /** Handed to the source queue's dead-letter exchange. */
  deadLettered: number;
  /**
   * Retries the bridge made itself of messages the target refused (or returned as unroutable): it
   * holds them unacked and publishes them again after a backoff, never returning them to the source.
   */
  retried: number;
  /** Given back to the source unforwarded because the bridge stopped (or a stop ran out of time). */
  returned: number;
  /** Had no ID under any `--id-from` strategy. */
  noId: number;
  /** Came back to the route that forwarded them (the target routes into the source queue). */
  looped: number;
  /** Cannot be forwarded as they are: a header table too deeply nested, a header over frame_max. */
  unforwardable: number;
  /** Had an ID header of a type that cannot be an ID (the next strategy decided). */
  badIdHeader: number;
  /** Deliveries the broker marked as redelivered. */
  redelivered: number;
  /** Publishes lost with the target connection and sent again flagged in-doubt. */
  resentInDoubt: number;
  /** Commits that found our claim taken over by another owner (our lease ran out). */
  claimTakenOver: number;
  /** Publishes not sent because their lease was not known to hold any more (claimed again). */
  fenced: number;
  /** Leases a renewal found no longer ours (another owner took the ID over). */
  leaseLost: number;
  /** Target connections reset because unconfirmed publishes were about to outlive their lease. */
  fenceResets: number;
  /** Commits that found no record of the ID at all: Redis lost our claim (FLUSHDB, a restart). */
  claimsLost: number;
  /** Commits that found the ID committed already (by another process, or a commit sent again). */
  alreadyCommitted: number;
}

export function newCounters(): RouteCounters {
  return {
    consumed: 0,
    forwarded: 0,
    duplicates: 0,
    inDoubt: 0,
    unroutable: 0,
    nacked: 0,
    parked: 0,
    deadLettered: 0,
    retried: 0,
    returned: 0,
    noId: 0,
    unforwardable: 0,
    looped: 0,
    badIdHeader: 0,
    redelivered: 0,
    resentInDoubt: 0,
    claimTakenOver: 0,
    fenced: 0,
    leaseLost: 0,
    fenceResets: 0,
    claimsLost: 0,
    alreadyCommitted: 0,
  };
}
