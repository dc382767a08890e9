-- producer-leave: give up the ownership of a stream producer (a clean stop), so that a standby
-- takes it over at once instead of after the lease.
-- KEYS[1]  <base>:owner   see producer-take.lua
-- ARGV[1]  the owner's "<token>:<epoch>"
-- Reply: 1 given up, 0 it was not ours
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
