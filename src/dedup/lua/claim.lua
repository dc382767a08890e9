-- claim: take the IDs of a batch before publishing them.
-- KEYS[1..n]  one key per ID, all in one hash slot: <prefix>:{<scope>}:<id>
-- ARGV[1]     owner token of the calling process
-- ARGV[2]     lease in ms: how long the claim protects the ID without renewal
-- ARGV[3]     how long the claim record is kept in ms (the dedup window), so that a crashed
--             owner's claim can still be recognised as in-doubt when the message comes back
-- Reply: one integer per key
--   0 new       claimed now
--   1 dup       already committed: the target holds it
--   2 busy      claimed by another owner whose lease is live
--   3 in-doubt  claimed by an owner whose lease ran out (now ours): it may be on the target
-- A claim value is c:<owner>:<lease expiry ms>:<1 if in-doubt else 0>; committed is d.
-- Our own claim seen again (ioredis re-sends after a reconnect) is renewed and reported as before.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local token = ARGV[1]
local expiry = tostring(now + tonumber(ARGV[2]))
local keep = ARGV[3]
local reply = {}
for i, key in ipairs(KEYS) do
  local value = redis.call('GET', key)
  if not value then
    redis.call('SET', key, 'c:' .. token .. ':' .. expiry .. ':0', 'PX', keep)
    reply[i] = 0
  elseif value == 'd' then
    reply[i] = 1
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
