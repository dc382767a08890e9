-- commit: record IDs as held by the target, after the target confirmed them.
-- KEYS[1..n]  one key per ID, all in one hash slot: <prefix>:{<scope>}:<id>
-- ARGV[1]     owner token of the calling process
-- ARGV[2]     dedup window in ms: how long a committed ID is remembered
-- Reply: one integer per key
--   1 committed   our claim held and is now committed
--   2 already     it was already committed (a re-sent commit, or another owner finished first)
--   3 taken       another owner had taken the claim over (ours ran out); the target confirmed our
--                 copy, so it is committed all the same: the other owner's copy, flagged in-doubt,
--                 is the duplicate, and nobody forwards the ID again
--   4 restored    no record at all (Redis lost it): the target confirmed it, so commit it
local token = ARGV[1]
local window = ARGV[2]
local reply = {}
for i, key in ipairs(KEYS) do
  local value = redis.call('GET', key)
  if value == 'd' then
    reply[i] = 2
  else
    redis.call('SET', key, 'd', 'PX', window)
    if not value then
      reply[i] = 4
    elseif string.match(value, '^c:([^:]*):') == token then
      reply[i] = 1
    else
      reply[i] = 3
    end
  end
end
return reply
