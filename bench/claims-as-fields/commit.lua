-- The commit of the second design (see claim.lua here): the claim's field becomes the committed
-- record in place, one HSET, where today's commit deletes a key and writes a field. A claim found in
-- another slice's bucket (the slice turned meanwhile) moves to the current one. Arguments and
-- replies are src/dedup/lua/commit.lua's, without the claim keys.
local now = now_ms(ARGV[6])
local meta = KEYS[1]
local token = ARGV[1]
local window = tonumber(ARGV[2])
local slice_ms, wrong = slice_length(KEYS[2], ARGV[3], true)
if not slice_ms then return redis.error_reply(wrong) end
local slices, expired = read_slices(meta, slice_ms, window, now)
newest_first(slices)
local current_slice = math.floor(now / slice_ms)
local writer = slice_writer(meta, slices, slice_ms, window, now, tonumber(ARGV[5]) or 0)
local packed = ARGV[4]
local ours = 'c:' .. token .. ':'
local find = string.find
local reply = {}
for i = 1, #packed / 16 do
  local field, h = digest_at(packed, i)
  local key, value, s = find_record(meta, slices, field, h)
  if value == '' then
    reply[i] = 2
  else
    if not key then
      writer.add(field, h)
      reply[i] = 4
    else
      if s.slice == current_slice then
        call('HSET', key, field, '')
      else
        call('HDEL', key, field)
        writer.add(field, h)
      end
      if find(value, ours, 1, true) == 1 then reply[i] = 1 else reply[i] = 3 end
    end
  end
end
writer.finish(expired)
return reply
