-- commit: record IDs as held by the target, after the target confirmed them.
-- KEYS[1]        the scope shard's meta hash <base>:m (see committed.lua)
-- KEYS[2]        the shard's layout key <base>:layout (see slice_length in committed.lua)
-- KEYS[3..n+2]   the claim key of each ID, in the same hash slot: <base>:c:<id>
-- ARGV[1]        owner token of the calling process
-- ARGV[2]        dedup window in ms: how long a committed ID is remembered
-- ARGV[3]        the caller's layout, "v1 shards=<n> slice=<ms>" (the stored one counts)
-- ARGV[4]        the IDs' digests, packed (see digest_at in committed.lua)
-- ARGV[5]        IDs a new scope's first slice should have room for (0: no estimate)
-- ARGV[6]        now in ms, or '' for the Redis server's clock (see now_ms in committed.lua)
-- Reply: one integer per ID
--   1 committed   our claim held and is now committed
--   2 already     it was already committed (a re-sent commit, or another owner finished first)
--   3 taken       another owner had taken the claim over (ours ran out); the target confirmed our
--                 copy, so it is committed all the same: the other owner's copy, flagged in-doubt,
--                 is the duplicate, and nobody forwards the ID again
--   4 restored    no record at all (Redis lost it): the target confirmed it, so commit it
-- or an error DEDUPLAYOUT when the stored layout has another shard count (see slice_length).
-- The claim is deleted in every case: a committed ID needs no claim.
local now = now_ms(ARGV[6])
local meta = KEYS[1]
local token = ARGV[1]
local window = tonumber(ARGV[2])
local slice_ms, wrong = slice_length(KEYS[2], ARGV[3], true)
if not slice_ms then return redis.error_reply(wrong) end
local slices, expired = read_slices(meta, slice_ms, window, now)
local writer = slice_writer(meta, slices, slice_ms, window, now, tonumber(ARGV[5]) or 0)
local packed = ARGV[4]
-- Our claim, told by a plain prefix search: a pattern with a capture costs Redis as much again.
local ours = 'c:' .. token .. ':'
local find = string.find
local reply = {}
for i = 1, #KEYS - 2 do
  local key = KEYS[i + 2]
  local field, h = digest_at(packed, i)
  -- Read and delete in one: the claim goes in every case.
  local value = call('GETDEL', key)
  local mine = value and find(value, ours, 1, true) == 1
  if mine or (value and find(value, '^c:[^:]*:')) then
    -- A claim and a committed record never coexist, so there is nothing to look up.
    writer.add(field, h)
    if mine then reply[i] = 1 else reply[i] = 3 end
  elseif find_committed(meta, slices, field, h) then
    reply[i] = 2
  else
    writer.add(field, h)
    reply[i] = 4
  end
end
writer.finish(expired)
return reply
