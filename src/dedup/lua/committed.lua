-- committed: shared by the scripts that read or write committed IDs (prepended to them on load).
-- A scope's committed IDs live in hashes, sliced by commit time and split into buckets, so that
-- each hash stays small enough for Redis's compact listpack encoding and whole hashes expire:
--   <base>:m                           meta hash; field <slice> = "<n>:<total>:<B0>,<B1>,..."
--   <base>:d:<slice>:<gen>:<bucket>    field = 12-byte digest of the ID, value ''
-- A slice covers slice_ms of commit time (slice = floor(now / slice_ms)). Within a slice the IDs go
-- to generation 0 with B0 buckets (sized from the previous slice's total) until it holds
-- B0 * FILL IDs, then to generation 1 with 4 times as many buckets, and so on; n counts the IDs in
-- the newest generation. An ID's bucket in a generation is h % B (h: another 32 bits of its digest).
-- A bucket and the slice's meta field expire slice_ms + window after the slice began.
local FILL = 80
local GROWTH = 4

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The slices of the meta hash still inside the window, and the names of those outside it.
local function read_slices(base, slice_ms, window, now)
  local raw = redis.call('HGETALL', base .. ':m')
  local live, expired = {}, {}
  for i = 1, #raw, 2 do
    local slice = tonumber(raw[i])
    if (slice + 1) * slice_ms + window > now then
      local n, total, list = string.match(raw[i + 1], '^(%d+):(%d+):([%d,]+)$')
      local buckets = {}
      for b in string.gmatch(list, '%d+') do buckets[#buckets + 1] = tonumber(b) end
      live[#live + 1] = { slice = slice, n = tonumber(n), total = tonumber(total), buckets = buckets }
    else
      expired[#expired + 1] = raw[i]
    end
  end
  return live, expired
end

-- The bucket key that holds the digest and its slice, or nil when no live slice has it.
local function find_committed(base, slices, field, h)
  for _, s in ipairs(slices) do
    for g, b in ipairs(s.buckets) do
      local key = base .. ':d:' .. s.slice .. ':' .. (g - 1) .. ':' .. (h % b)
      if redis.call('HEXISTS', key, field) == 1 then return key, s end
    end
  end
  return nil
end

-- The meta field value of a slice.
local function format_slice(s)
  return s.n .. ':' .. s.total .. ':' .. table.concat(s.buckets, ',')
end

-- Moves a key's expiry to expire_at unless it already lives longer (another writer's window).
local function extend(key, expire_at, now)
  if redis.call('PTTL', key) < expire_at - now then redis.call('PEXPIREAT', key, expire_at) end
end

-- Opens the current slice for writing (creating it from the previous slice's size), returning a
-- writer: add(field, h) records one ID, finish() saves the meta and sets the expiries.
local function slice_writer(base, slices, slice_ms, window, now)
  local current_slice = math.floor(now / slice_ms)
  local current, previous = nil, nil
  for _, s in ipairs(slices) do
    if s.slice == current_slice then
      current = s
    elseif s.slice < current_slice and (previous == nil or s.slice > previous.slice) then
      previous = s
    end
  end
  if current == nil then
    local first = 1
    if previous then first = math.max(1, math.ceil(previous.total / FILL)) end
    current = { slice = current_slice, n = 0, total = 0, buckets = { first } }
    slices[#slices + 1] = current
  end
  local expire_at = (current_slice + 1) * slice_ms + window
  local touched, changed = {}, false
  local writer = {}
  function writer.add(field, h)
    local b = current.buckets[#current.buckets]
    if current.n >= b * FILL then
      b = b * GROWTH
      current.buckets[#current.buckets + 1] = b
      current.n = 0
    end
    local key = base .. ':d:' .. current_slice .. ':' .. (#current.buckets - 1) .. ':' .. (h % b)
    redis.call('HSET', key, field, '')
    touched[key] = true
    current.n = current.n + 1
    current.total = current.total + 1
    changed = true
  end
  function writer.finish(expired)
    for _, name in ipairs(expired) do redis.call('HDEL', base .. ':m', name) end
    if not changed then return end
    redis.call('HSET', base .. ':m', current_slice, format_slice(current))
    extend(base .. ':m', expire_at, now)
    for key in pairs(touched) do extend(key, expire_at, now) end
  end
  return writer
end

