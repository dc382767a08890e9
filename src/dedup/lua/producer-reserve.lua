-- producer-reserve: give the next publishing IDs of a stream producer to the claims about to be
-- written, in order, and record each in the producer's ledger; forget the ledger entries of
-- claims committed since (their messages are on the stream and their IDs in the cache).
-- KEYS[1]  <base>:owner   see producer-take.lua
-- KEYS[2]  <base>:seq     the last publishing ID given out
-- KEYS[3]  <base>:ledger  hash: claim key -> publishing ID, for IDs written or about to be
-- ARGV[1]  the owner's "<token>:<epoch>"
-- ARGV[2]  the lowest ID the caller may be given, less one (its own last: a floor if Redis lost seq)
-- ARGV[3]  d, the number of committed claim keys that follow
-- ARGV[4..3+d]   committed claim keys: their ledger entries go
-- ARGV[4+d..]    claim keys to reserve IDs for, in the order they will be written
-- Reply: the first ID given (the others follow it one by one), or the error DEDUPFENCED when the
-- caller no longer owns the producer (nothing is changed then).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('DEDUPFENCED the stream producer has another owner')
end
local done = tonumber(ARGV[3])
for i = 4, 3 + done do redis.call('HDEL', KEYS[3], ARGV[i]) end
local seq = tonumber(redis.call('GET', KEYS[2]) or '0')
local floor = tonumber(ARGV[2])
if seq < floor then seq = floor end
local first = seq + 1
for i = 4 + done, #ARGV do
  seq = seq + 1
  redis.call('HSET', KEYS[3], ARGV[i], string.format('%d', seq))
end
redis.call('SET', KEYS[2], string.format('%d', seq))
return first
