-- renew: extend the leases of claims still in flight.
-- KEYS[1..n]  the claim key of each ID, all in one hash slot: <base>:c:<id>
-- ARGV[1]     owner token of the calling process
-- ARGV[2]     lease in ms from now
-- ARGV[3]     now in ms, or '' for the Redis server's clock (as now_ms in committed.lua)
-- Reply: one integer per key: 1 renewed, 0 no longer ours
local now = tonumber(ARGV[3])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local token = ARGV[1]
local expiry = tostring(now + tonumber(ARGV[2]))
local reply = {}
for i, key in ipairs(KEYS) do
  local value = redis.call('GET', key)
  local owner, flag = nil, nil
  if value then owner, flag = string.match(value, '^c:([^:]*):%d+:([01])$') end
  if owner == token then
    redis.call('SET', key, 'c:' .. token .. ':' .. expiry .. ':' .. flag, 'KEEPTTL')
    reply[i] = 1
  else
    reply[i] = 0
  end
end
return reply
