-- A second design of the claim record, for measurement only (npm run bench:redis-cost -- --design
-- fields): the claim is a field of the bucket hash its ID will commit to, value
-- c:<owner>:<lease expiry ms>:<flag> as in src/dedup/lua/claim.lua, instead of a key with its own
-- expiry. The slice's buckets then live a lease longer, so that a crashed owner's claim is kept a
-- window past its lease as today. The arguments and replies are claim.lua's, without the claim keys.
local now = now_ms(ARGV[6])
local meta = KEYS[1]
local token = ARGV[1]
local lease = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local slice_ms, wrong = slice_length(KEYS[2], ARGV[4], true)
if not slice_ms then return redis.error_reply(wrong) end
local slices, expired = read_slices(meta, slice_ms, window, now)
newest_first(slices)
local writer = slice_writer(meta, slices, slice_ms, window + lease, now, tonumber(ARGV[7]) or 0)
local current_slice = math.floor(now / slice_ms)
local current
for _, s in ipairs(slices) do
  if s.slice == current_slice then current = s end
end
local expiry = tostring(now + lease)
local new_claim = 'c:' .. token .. ':' .. expiry .. ':0'
local packed = ARGV[5]
local reply = {}
for i = 1, #packed / 16 do
  local field, h = digest_at(packed, i)
  -- Every bucket but the one the claim goes to is looked in; there, HSETNX takes the field or
  -- finds it.
  local newest = #current.buckets
  local key, value = find_record(meta, slices, field, h, current, newest)
  if not key then
    key = writer.add(field, h, new_claim, 'HSETNX')
    if key then
      value = call('HGET', key, field)
    elseif #current.buckets > newest then
      -- The slice grew a generation for this ID: the one skipped above is looked in after all.
      local older = bucket_key(meta, current, newest, h)
      value = call('HGET', older, field)
      if value then
        call('HDEL', bucket_key(meta, current, #current.buckets, h), field)
        key = older
      end
    end
  end
  if not key then
    reply[i] = 0
  elseif value == '' then
    reply[i] = 1
  else
    local owner, expires, flag = string.match(value, '^c:([^:]*):(%d+):([01])$')
    if owner == token then
      call('HSET', key, field, 'c:' .. token .. ':' .. expiry .. ':' .. flag)
      if flag == '1' then reply[i] = 3 else reply[i] = 0 end
    elseif expires and tonumber(expires) > now then
      reply[i] = 2
    else
      call('HSET', key, field, 'c:' .. token .. ':' .. expiry .. ':1')
      reply[i] = 3
    end
  end
end
writer.finish(expired)
return reply
