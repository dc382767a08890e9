-- lookup: what the cache holds for each ID, without changing anything (inspect, dry run).
-- KEYS[1]        the scope shard's meta hash <base>:m (see committed.lua)
-- KEYS[2..n+1]   the claim key of each ID, in the same hash slot: <base>:c:<id>
-- ARGV[1]        dedup window in ms (which slices count), ARGV[2] slice length in ms
-- ARGV[3]        the IDs' digests, packed (see digest_at in committed.lua)
-- ARGV[4]        now in ms, or '' for the Redis server's clock (see now_ms in committed.lua)
-- Reply: per ID { state, ms left before the record expires (-2 none), claim value or '' }
--   state 0 unknown, 1 committed, 2 claimed (the value says by whom, until when, in-doubt or not)
local now = now_ms(ARGV[4])
local meta = KEYS[1]
local slices = read_slices(meta, tonumber(ARGV[2]), tonumber(ARGV[1]), now)
local reply = {}
for i = 1, #KEYS - 1 do
  local key = KEYS[i + 1]
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
