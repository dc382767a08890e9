-- claim: take the IDs of a batch before publishing them.
-- KEYS[1]        the scope shard's meta hash <base>:m (see committed.lua)
-- KEYS[2]        the shard's layout key <base>:layout (see slice_length in committed.lua)
-- KEYS[3..n+2]   the claim key of each ID, in the same hash slot: <base>:c:<id>
-- ARGV[1]        owner token of the calling process
-- ARGV[2]        lease in ms: how long the claim protects the ID without renewal
-- ARGV[3]        the dedup window in ms: how long committed IDs count, and how long a claim record
--                is kept after its lease, so that a crashed owner's claim is still recognised as
--                in-doubt when the message comes back
-- ARGV[4]        the caller's layout, "v1 shards=<n> slice=<ms>" (the stored one counts)
-- ARGV[5]        the IDs' digests, packed (see digest_at in committed.lua)
-- ARGV[6]        now in ms, or '' for the Redis server's clock (see now_ms in committed.lua)
-- Reply: one integer per ID
--   0 new       claimed now
--   1 dup       already committed: the target holds it
--   2 busy      claimed by another owner whose lease is live
--   3 in-doubt  claimed by an owner whose lease ran out (now ours): it may be on the target
--   4 reclaimed as 3, from an owner whose token has our tag (`<tag>.<random>`: an earlier owner of
--               the same stream producer, whose writes the producer's new owner settled exactly);
--               our claim is then not flagged. A claim released in doubt (expiry 0) is never this
-- or an error DEDUPLAYOUT when the stored layout has another shard count (see slice_length).
-- A claim value is c:<owner>:<lease expiry ms>:<1 if in-doubt else 0>; a lease expiry of 0 marks a
-- claim its owner released in doubt (release.lua), which no renewal re-arms. The key lives the
-- lease plus the window, from each claim and renewal: as long as its owner renews it, however long
-- the message is in flight, and a window past the last lease. A claim and a committed
-- record never coexist (commit deletes the claim), so the committed IDs are looked up first and a
-- new ID is claimed with SET NX: one command less for the usual case than reading the claim first.
-- Our own claim seen again (ioredis re-sends after a reconnect) is renewed and reported as before.
local now = now_ms(ARGV[6])
local meta = KEYS[1]
local token = ARGV[1]
local lease = tonumber(ARGV[2])
local expiry = tostring(now + lease)
local new_claim = 'c:' .. token .. ':' .. expiry .. ':0'
local window = tonumber(ARGV[3])
local keep = int(lease + window)
local slice_ms, wrong = slice_length(KEYS[2], ARGV[4], true)
if not slice_ms then return redis.error_reply(wrong) end
local slices = read_slices(meta, slice_ms, window, now)
local packed = ARGV[5]
local tag = string.match(token, '^([^.]+)%.')
local reply = {}
for i = 1, #KEYS - 2 do
  local key = KEYS[i + 2]
  local field, h = digest_at(packed, i)
  if find_committed(meta, slices, field, h) then
    reply[i] = 1
  elseif call('SET', key, new_claim, 'PX', keep, 'NX') then
    reply[i] = 0
  else
    local value = redis.call('GET', key)
    local owner, expires, flag = string.match(value, '^c:([^:]*):(%d+):([01])$')
    if owner == token then
      redis.call('SET', key, 'c:' .. token .. ':' .. expiry .. ':' .. flag, 'PX', keep)
      if flag == '1' then reply[i] = 3 else reply[i] = 0 end
    elseif expires and tonumber(expires) > now then
      reply[i] = 2
    elseif tag and expires ~= '0' and owner and string.sub(owner, 1, #tag + 1) == tag .. '.' then
      redis.call('SET', key, new_claim, 'PX', keep)
      reply[i] = 4
    else
      redis.call('SET', key, 'c:' .. token .. ':' .. expiry .. ':1', 'PX', keep)
      reply[i] = 3
    end
  end
end
return reply
