-- lookup: what the cache holds for each ID, without changing anything (inspect, dry run).
-- KEYS[1..n]  the claim key of each ID, all in one hash slot: <base>:c:<id>
-- ARGV[1]     dedup window in ms (which slices count), ARGV[2] slice length in ms,
-- ARGV[3]     the base (<prefix>:{<scope>}) of the committed hashes
-- ARGV[4..]   per key: the 12-byte digest of its ID and a 32-bit number from the same digest
-- Reply: per key { state, ms left before the record expires (-2 none), claim value or '' }
--   state 0 unknown, 1 committed, 2 claimed (the value says by whom, until when, in-doubt or not)
local now = now_ms()
local slices = read_slices(ARGV[3], tonumber(ARGV[2]), tonumber(ARGV[1]), now)
local reply = {}
for i, key in ipairs(KEYS) do
  local value = redis.call('GET', key)
  if value then
    reply[i] = { 2, redis.call('PTTL', key), value }
  else
    local bucket = find_committed(ARGV[3], slices, ARGV[2 + 2 * i], tonumber(ARGV[3 + 2 * i]))
    if bucket then
      reply[i] = { 1, redis.call('PTTL', bucket), '' }
    else
      reply[i] = { 0, -2, '' }
    end
  end
end
return reply
