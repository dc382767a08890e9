-- forget: delete every record of the given IDs, claimed or committed in any slice still stored.
-- KEYS[1..n]  the claim key of each ID, all in one hash slot: <base>:c:<id>
-- ARGV[1]     slice length in ms, ARGV[2] the base (<prefix>:{<scope>}) of the committed hashes
-- ARGV[3..]   per key: the 12-byte digest of its ID and a 32-bit number from the same digest
-- Reply: per key 1 when something was deleted, else 0
local now = now_ms()
-- Every stored slice counts here, whatever window wrote it.
local slices = read_slices(ARGV[2], tonumber(ARGV[1]), now, now)
local reply = {}
for i, key in ipairs(KEYS) do
  local deleted = redis.call('DEL', key)
  local field, h = ARGV[1 + 2 * i], tonumber(ARGV[2 + 2 * i])
  local bucket, slice = find_committed(ARGV[2], slices, field, h)
  while bucket do
    deleted = deleted + redis.call('HDEL', bucket, field)
    -- The slice's total counts its IDs (cache stats, and the size of the next slice).
    slice.total = math.max(0, slice.total - 1)
    redis.call('HSET', ARGV[2] .. ':m', slice.slice, format_slice(slice))
    bucket, slice = find_committed(ARGV[2], slices, field, h)
  end
  if deleted > 0 then reply[i] = 1 else reply[i] = 0 end
end
return reply
