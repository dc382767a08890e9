-- producer-settle: forget ledger entries the owner settled without writing them at their ID
-- (resolved after taking the producer over, or given up before their write), and raise the
-- sequence so that no ID given out before is given again.
-- KEYS[1]  <base>:owner   see producer-take.lua
-- KEYS[2]  <base>:seq     see producer-reserve.lua
-- KEYS[3]  <base>:ledger  see producer-reserve.lua
-- ARGV[1]  the owner's "<token>:<epoch>"
-- ARGV[2]  the sequence's floor: seq becomes at least this
-- ARGV[3..]  pairs of claim key and publishing ID: an entry goes only while it holds that ID
-- Reply: entries forgotten, or the error DEDUPFENCED when the caller no longer owns the producer.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('DEDUPFENCED the stream producer has another owner')
end
local seq = tonumber(redis.call('GET', KEYS[2]) or '0')
local floor = tonumber(ARGV[2])
if seq < floor then redis.call('SET', KEYS[2], ARGV[2]) end
local gone = 0
for i = 3, #ARGV, 2 do
  if redis.call('HGET', KEYS[3], ARGV[i]) == ARGV[i + 1] then
    gone = gone + redis.call('HDEL', KEYS[3], ARGV[i])
  end
end
return gone
