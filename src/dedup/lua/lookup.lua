-- lookup: what the cache holds for each ID, without changing anything (inspect, dry run).
-- KEYS[1]        the scope shard's meta hash <base>:m (see committed.lua)
-- KEYS[2]        the shard's layout key <base>:layout (see slice_length in committed.lua)
-- KEYS[3..n+2]   the claim key of each ID, in the same hash slot: <base>:c:<id>
-- ARGV[1]        dedup window in ms (which slices count)
-- ARGV[2]        the caller's layout, "v1 shards=<n> slice=<ms>" (the stored one counts)
-- ARGV[3]        the IDs' digests, packed (see digest_at in committed.lua)
-- ARGV[4]        now in ms, or '' for the Redis server's clock (see now_ms in committed.lua)
-- Reply: per ID { state, ms left before the record expires (-2 none), claim value or '' }
--   state 0 unknown, 1 committed, 2 claimed (the value says by whom, until when, in-doubt or not)
-- or an error DEDUPLAYOUT when the stored layout has another shard count (see slice_length).
local now = now_ms(ARGV[4])
local meta = KEYS[1]
-- Read only: a shard with no layout stored is read with the caller's, and keeps none.
local slice_ms, wrong = slice_length(KEYS[2], ARGV[2], false)
if not slice_ms then return redis.error_reply(wrong) end
local slices = read_slices(meta, slice_ms, tonumber(ARGV[1]), now)
local reply = {}
for i = 1, #KEYS - 2 do
  local key = KEYS[i + 2]
  local value = redis.call('GET', key)
  if value then
    reply[i] = { 2, redis.call('PTTL', key), value }
  else
    local bucket = find_committed(meta, slices, digest_at(ARGV[3], i))
    if bucket then
      reply[i] = { 1, redis.call('PTTL', bucket), '' }
    else
      reply[i] = { 0, -2, '' }
    end
  end
end
return reply
