-- claim: take the IDs of a batch before publishing them.
-- KEYS[1]        the scope shard's meta hash <base>:m (see committed.lua)
-- KEYS[2..n+1]   the claim key of each ID, in the same hash slot: <base>:c:<id>
-- ARGV[1]        owner token of the calling process
-- ARGV[2]        lease in ms: how long the claim protects the ID without renewal
-- ARGV[3]        the dedup window in ms: how long committed IDs count, and how long a claim record
--                is kept, so that a crashed owner's claim is still recognised as in-doubt when the
--                message comes back
-- ARGV[4]        slice length in ms
-- ARGV[5..]      per ID: the 12-byte digest of its ID and a 32-bit number from the same digest
-- Reply: one integer per ID
--   0 new       claimed now
--   1 dup       already committed: the target holds it
--   2 busy      claimed by another owner whose lease is live
--   3 in-doubt  claimed by an owner whose lease ran out (now ours): it may be on the target
-- A claim value is c:<owner>:<lease expiry ms>:<1 if in-doubt else 0>. A claim and a committed
-- record never coexist (commit deletes the claim), so an ID with a claim is not looked up.
-- Our own claim seen again (ioredis re-sends after a reconnect) is renewed and reported as before.
local now = now_ms()
local meta = KEYS[1]
local token = ARGV[1]
local expiry = tostring(now + tonumber(ARGV[2]))
local keep = ARGV[3]
local slices = nil
local reply = {}
for i = 1, #KEYS - 1 do
  local key = KEYS[i + 1]
  local value = redis.call('GET', key)
  if not value then
    slices = slices or read_slices(meta, tonumber(ARGV[4]), tonumber(keep), now)
    if find_committed(meta, slices, ARGV[3 + 2 * i], tonumber(ARGV[4 + 2 * i])) then
      reply[i] = 1
    else
      redis.call('SET', key, 'c:' .. token .. ':' .. expiry .. ':0', 'PX', keep)
      reply[i] = 0
    end
  else
    local owner, expires, flag = string.match(value, '^c:([^:]*):(%d+):([01])$')
    if owner == token then
      redis.call('SET', key, 'c:' .. token .. ':' .. expiry .. ':' .. flag, 'PX', keep)
      if flag == '1' then reply[i] = 3 else reply[i] = 0 end
    elseif expires and tonumber(expires) > now then
      reply[i] = 2
    else
      redis.call('SET', key, 'c:' .. token .. ':' .. expiry .. ':1', 'PX', keep)
      reply[i] = 3
    end
  end
end
return reply
