// The header names the bridge writes and the library and consumers read: one place for all of them.

/** HornetQ's / Artemis's duplicate-detection ID: the ID every forwarded message carries. */
export const DUPLICATE_ID_HEADER = '_HQ_DUPL_ID';
/** `true` on a copy sent again after a confirm was lost: an earlier copy may be on the target. */
export const IN_DOUBT_HEADER = 'x-dedup-in-doubt';
/** Where a `user_id` the target would refuse (not the publishing user's) travels instead. */
export const SOURCE_USER_HEADER = 'x-dedup-source-user-id';
/** Why a message was parked, on its copy in the park queue. */
export const PARK_REASON_HEADER = 'x-dedup-park-reason';
/** The routes a forwarded message went through (an array of `<cluster>/<vhost>/<queue>`), to see loops. */
export const ROUTE_HEADER = 'x-dedup-route';
