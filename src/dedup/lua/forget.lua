-- forget: delete every record of the given IDs, claimed or committed in any slice still stored.
-- KEYS[1]        the scope shard's meta hash <base>:m (see committed.lua)
-- KEYS[2]        the shard's layout key <base>:layout (see slice_length in committed.lua)
-- KEYS[3..n+2]   the claim key of each ID, in the same hash slot: <base>:c:<id>
-- ARGV[1]        the caller's layout, "v1 shards=<n> slice=<ms>" (the stored one counts)
-- ARGV[2]        the IDs' digests, packed (see digest_at in committed.lua)
-- ARGV[3]        now in ms, or '' for the Redis server's clock (see now_ms in committed.lua)
-- Reply: per ID 1 when something was deleted, else 0
-- or an error DEDUPLAYOUT when the stored layout has another shard count (see slice_length).
local now = now_ms(ARGV[3])
local meta = KEYS[1]
local slice_ms, wrong = slice_length(KEYS[2], ARGV[1], false)
if not slice_ms then return redis.error_reply(wrong) end
-- Every stored slice counts here, whatever window wrote it.
local slices = read_slices(meta, slice_ms, now, now)
local reply = {}
for i = 1, #KEYS - 2 do
  local key = KEYS[i + 2]
  local deleted = redis.call('DEL', key)
  local field, h = digest_at(ARGV[2], i)
  local bucket, slice = find_committed(meta, slices, field, h)
  while bucket do
    deleted = deleted + redis.call('HDEL', bucket, field)
    -- The slice's total counts its IDs (cache stats, and the size of the next slice).
    slice.total = math.max(0, slice.total - 1)
    redis.call('HSET', meta, int(slice.slice), format_slice(slice))
    bucket, slice = find_committed(meta, slices, field, h)
  end
  if deleted > 0 then reply[i] = 1 else reply[i] = 0 end
end
return reply
