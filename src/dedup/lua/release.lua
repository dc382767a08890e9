-- release: give up claims that were not forwarded (nacked, unroutable, shutting down).
-- KEYS[1..n]  one key per ID, all in one hash slot: <prefix>:{<scope>}:<id>
-- ARGV[1]     owner token of the calling process
-- Reply: one integer per key: 1 released, 0 not ours (committed, or another owner's)
local token = ARGV[1]
local reply = {}
for i, key in ipairs(KEYS) do
  local value = redis.call('GET', key)
  if value and string.match(value, '^c:([^:]*):') == token then
    redis.call('DEL', key)
    reply[i] = 1
  else
    reply[i] = 0
  end
end
return reply
