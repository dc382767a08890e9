-- Shared by the two scripts here (loaded after src/dedup/lua/committed.lua): an ID's record in the
-- live slices, committed ('') or a claim, with its bucket key and slice.
local function find_record(meta, slices, field, h)
  for i = 1, #slices do
    local s = slices[i]
    for g = 1, #s.buckets do
      local key = bucket_key(meta, s, g, h)
      local value = call('HGET', key, field)
      if value then return key, value, s end
    end
  end
  return nil
end
