-- renew: extend the leases of claims still in flight.
-- KEYS[1..n]  the claim key of each ID, all in one hash slot: <base>:c:<id>
-- ARGV[1]     owner token of the calling process
-- ARGV[2]     lease in ms from now
-- ARGV[3]     now in ms, or '' for the Redis server's clock (as now_ms in committed.lua)
-- ARGV[4]     the dedup window in ms: the claim record is kept that long past the new lease (as
--             claim.lua keeps it), so that it lives as long as its owner renews it, and a crashed
--             owner's claim is still recognised as in-doubt a window after its last lease
-- Reply: one integer per key: 1 renewed, 0 no longer ours (committed, taken over, or released)
-- A claim released in doubt (lease expiry 0, see release.lua) is never re-armed: a renewal sent
-- before the release and run after it would otherwise make it a live lease again, and others would
-- wait on it (busy) instead of taking it over in doubt. A lease of ours that ran out unnoticed and
-- that nobody took over is renewed: the message is still in flight with us.
local now = tonumber(ARGV[3])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local token = ARGV[1]
local lease = tonumber(ARGV[2])
local expiry = tostring(now + lease)
local keep = string.format('%d', lease + tonumber(ARGV[4]))
local reply = {}
for i, key in ipairs(KEYS) do
  local value = redis.call('GET', key)
  local owner, expires, flag = nil, nil, nil
  if value then owner, expires, flag = string.match(value, '^c:([^:]*):(%d+):([01])$') end
  if owner == token and expires ~= '0' then
    redis.call('SET', key, 'c:' .. token .. ':' .. expiry .. ':' .. flag, 'PX', keep)
    reply[i] = 1
  else
    reply[i] = 0
  end
end
return reply
