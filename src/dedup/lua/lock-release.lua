-- lock-release: drop a job lock, only if we hold it.
-- KEYS[1]  the lock key: <prefix>:job:<job name>
-- ARGV[1]  the holder's value (owner token and start time, as written by SET NX)
-- Reply: 1 released, 0 not ours
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
