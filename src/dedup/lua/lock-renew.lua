-- lock-renew: extend a job lock's lease, only while we still hold it.
-- KEYS[1]  the lock key: <prefix>:job:<job name>
-- ARGV[1]  the holder's value (owner token and start time, as written by SET NX)
-- ARGV[2]  lease in ms from now
-- Reply: 1 renewed, 0 the lock is gone or held by another run
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
