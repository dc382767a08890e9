-- Shared by the two scripts here (loaded after src/dedup/lua/committed.lua).

-- The live slices newest first: a claim is in the newest slice but for those that turned meanwhile.
local function newest_first(slices)
  table.sort(slices, function(a, b) return a.slice > b.slice end)
  return slices
end

-- An ID's record in the live slices, committed ('') or a claim, with its bucket key and slice;
-- generation `skip` of slice `skip_slice` is not looked in (the caller takes the field there).
local function find_record(meta, slices, field, h, skip_slice, skip)
  for i = 1, #slices do
    local s = slices[i]
    for g = #s.buckets, 1, -1 do
      if not (s == skip_slice and g == skip) then
        local key = bucket_key(meta, s, g, h)
        local value = call('HGET', key, field)
        if value then return key, value, s end
      end
    end
  end
  return nil
end
