-- A stream source's position: "<next> <hole> <first>-<last> ...", decimal (position.ts). Every
-- position a reader writes is true (it names only what that reader settled), so the one with the
-- later next is kept: an older one arriving late (another replica) must not move it back. At the
-- same next, the newer one: a reader's holes only ever close.
-- KEYS[1] position key; ARGV[1] the new position. Returns the position kept.
local current = redis.call('GET', KEYS[1])
local new = ARGV[1]
if current ~= false then
  local a = string.match(new, '^%d+')
  local b = string.match(current, '^%d+')
  if #a < #b or (#a == #b and a < b) then
    return current
  end
end
redis.call('SET', KEYS[1], new)
return new
