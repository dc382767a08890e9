-- release: give up claims that were not forwarded (nacked, unroutable, shutting down).
-- KEYS[1..n]  the claim key of each ID, all in one hash slot: <base>:c:<id>
-- ARGV[1]     owner token of the calling process; '*' for a claim of any owner (a stream producer's
--             new owner drops the claims of IDs it found were never stored, see StreamTarget)
-- ARGV[2]     drop: delete the claim (nothing of it reached the target)
--             doubt: keep the claim, expired and flagged in-doubt (an earlier copy may be on the
--             target), so that the next claim by anyone answers in-doubt
-- ARGV[3]     the dedup window in ms: a claim kept in doubt is kept at least that long from now
-- Reply: one integer per key: 1 released, 0 not ours (committed, or another owner's)
-- A claim kept in doubt has lease expiry 0: the mark of a released claim, which renew.lua never
-- re-arms (a real expiry is now plus a lease). Only a new claim takes it again (claim.lua).
local token = ARGV[1]
local mode = ARGV[2]
local window = tonumber(ARGV[3])
local reply = {}
for i, key in ipairs(KEYS) do
  local value = redis.call('GET', key)
  local owner = value and string.match(value, '^c:([^:]*):')
  if owner and (owner == token or token == '*') then
    if mode == 'doubt' then
      local keep = math.max(redis.call('PTTL', key), window)
      redis.call('SET', key, 'c:' .. token .. ':0:1', 'PX', string.format('%d', keep))
    else
      redis.call('DEL', key)
    end
    reply[i] = 1
  else
    reply[i] = 0
  end
end
return reply
