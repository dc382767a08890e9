-- A stream source's position: the next offset to read, as a decimal string. Only ever raised: a
-- position is the first message not yet settled, so any reader's is safe to keep, and an older
-- one arriving late (a slow write, another replica) must not move it back.
-- KEYS[1] position key; ARGV[1] the new position (decimal, no leading zeros).
-- Returns the position kept.
local current = redis.call('GET', KEYS[1])
local new = ARGV[1]
if current == false or #new > #current or (#new == #current and new > current) then
  redis.call('SET', KEYS[1], new)
  return new
end
return current
