-- producer-take: take, keep or renew the one live ownership of a stream producer (a route's named
-- publisher on its target stream), fenced by an epoch that grows at every new owner.
-- KEYS[1]  <base>:owner   the owner's "<token>:<epoch>", with the lease as its TTL
-- KEYS[2]  <base>:epoch   the last epoch given out and who took it, "<epoch> <token>" (never expires)
-- ARGV[1]  owner token of the calling process
-- ARGV[2]  lease in ms from now
-- ARGV[3]  the epoch the caller holds, or '' to take the producer anew
-- Reply: {1, epoch}  ours: taken anew (a new epoch), or kept (ours still, or lapsed and not taken)
--        {0, pttl}   another owner holds it for pttl ms more (taking anew only)
--        {-1, epoch} the caller's epoch is over: another owner took the producer since
-- A holder whose lease lapsed unnoticed keeps the producer while nobody took it: the epoch record
-- still names it, so nobody settled its ledger meanwhile and its own view is still the truth. The
-- record names the token as well as the number, so that a Redis that lost everything (and counts
-- epochs from 1 again) never hands an old owner's number back to it.
local owner = redis.call('GET', KEYS[1])
local token = ARGV[1]
local held = ARGV[3]
local record = redis.call('GET', KEYS[2])
if held ~= '' then
  if record ~= held .. ' ' .. token or (owner and owner ~= token .. ':' .. held) then
    return {-1, record and string.match(record, '^(%d+)') or '0'}
  end
  redis.call('SET', KEYS[1], token .. ':' .. held, 'PX', ARGV[2])
  return {1, held}
end
if owner then
  -- Ours already: this call is one ioredis sent again after a reconnect, and the first one ran.
  local mine = token .. ':'
  if string.sub(owner, 1, #mine) == mine then return {1, string.sub(owner, #mine + 1)} end
  return {0, redis.call('PTTL', KEYS[1])}
end
local last = record and tonumber(string.match(record, '^(%d+)')) or 0
local epoch = string.format('%d', last + 1)
redis.call('SET', KEYS[2], epoch .. ' ' .. token)
redis.call('SET', KEYS[1], token .. ':' .. epoch, 'PX', ARGV[2])
return {1, epoch}
