-- committed: shared by the scripts that read or write committed IDs (prepended to them on load).
-- A scope's committed IDs live in hashes, sliced by commit time and split into buckets, so that
-- each hash stays small enough for Redis's compact listpack encoding and whole hashes expire:
--   <base>:m                           meta hash; field <slice> = "<n>:<total>:<expire at>:<B0>,<B1>,..."
--   <base>:d:<slice>:<gen>:<bucket>    field = 12-byte digest of the ID, value ''
-- The meta key is each script's KEYS[1] (and the shard's layout key KEYS[2], see slice_length), so
-- Redis Cluster routes (and, while a slot moves, redirects) the call by it; the buckets share its
-- hash tag.
-- A slice covers slice_ms of commit time (slice = floor(now / slice_ms)). Within a slice the IDs go
-- to generation 0 with B0 buckets (sized from the previous slice's total, with headroom) until it
-- holds B0 * FILL IDs, then to generation 1 with 4 times as many buckets, and so on; n counts the
-- IDs in the newest generation. An ID's bucket in a generation is h % B (h: another 32 bits of its
-- digest). A slice's buckets and its meta field live until its <expire at>: slice_ms + window after
-- the slice began, for the longest window any writer of the slice had. A reader counts a slice
-- while its own window covers it too.
local FILL = 80
local GROWTH = 4
-- A scope's first slice has no previous one to go by. It is sized for the IDs its writer expects
-- (the bridge passes the source queue's backlog at start), and at least 16 buckets (1,280 IDs), so
-- that a migration's first run is not split into generations, each a lookup more per new ID.
local FIRST_BUCKETS = 16

-- The library functions called once or more per ID, as locals: a global's lookup costs more than
-- the call does (measured in Redis's instructions per ID).
local call, byte, sub = redis.call, string.byte, string.sub

-- The time the script goes by, in ms: the caller's clock when it passes one (its last ARGV, a
-- test's fixed moment), else ('') the Redis server's, which every process on the scope shares.
local function now_ms(given)
  if given ~= nil and given ~= '' then return tonumber(given) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A number given to redis.call as an argument: Redis 7.2.0-7.2.4 may render a Lua number in
-- exponent form (1.7e+12), which PEXPIRE refuses. (Joined with '..', Lua 5.1 prints integers
-- below 1e14 in full.)
local function int(x)
  return string.format('%d', x)
end

-- Bucket key names. Lua turns a number into text through sprintf, and building every looked-up
-- key from three numbers was a seventh of the scripts' work: the parts are made once per call.
local number_texts = {}
local function text_of(n)
  local text = number_texts[n]
  if text == nil then
    text = int(n)
    number_texts[n] = text
  end
  return text
end

local bases = {}
local function base_of(meta)
  local base = bases[meta]
  if base == nil then
    base = string.sub(meta, 1, -3)
    bases[meta] = base
  end
  return base
end

-- <base>:d:<slice>:<generation>:<bucket> of the ID with bucket number h, in generation g of slice s.
local function bucket_key(meta, s, g, h)
  s.prefixes = s.prefixes or {}
  local prefix = s.prefixes[g]
  if prefix == nil then
    prefix = base_of(meta) .. ':d:' .. int(s.slice) .. ':' .. int(g - 1) .. ':'
    s.prefixes[g] = prefix
  end
  return prefix .. text_of(h % s.buckets[g])
end

-- A shard's layout, "v1 shards=<n> slice=<ms>", is stored in its own hash slot (<base>:layout, each
-- script's KEYS[2]; with one shard that is the scope's layout key) and is the one that counts: a
-- process goes on with the layout it read at start, and an empty scope may have been re-sliced for
-- a longer window since (see DedupCache.open), which would make it judge the newer slices dead.
-- Returns the stored slice length in ms; a shard with none stored takes the caller's (stored when
-- `store`). nil and an error text when the stored layout spreads the scope over another number
-- of shards: the caller's keys would be on the wrong ones, which no retry can mend.
local function slice_length(layout_key, caller, store)
  local stored = redis.call('GET', layout_key)
  if not stored then
    stored = caller
    if store then redis.call('SET', layout_key, caller) end
  end
  local shards, slice = string.match(stored, '^v1 shards=(%d+) slice=(%d+)$')
  if slice and shards == string.match(caller, '^v1 shards=(%d+) ') then return tonumber(slice) end
  return nil, 'DEDUPLAYOUT ' .. layout_key .. ' holds "' .. stored .. '", not "' .. caller .. '" as read at start'
end

-- The slices this caller's window covers, and the names of those whose expiry has passed.
local function read_slices(meta, slice_ms, window, now)
  local raw = redis.call('HGETALL', meta)
  local live, expired = {}, {}
  for i = 1, #raw, 2 do
    local slice = tonumber(raw[i])
    local n, total, expire_at, list = string.match(raw[i + 1], '^(%d+):(%d+):(%d+):([%d,]+)$')
    expire_at = tonumber(expire_at)
    if expire_at <= now then
      expired[#expired + 1] = raw[i]
    elseif (slice + 1) * slice_ms + window > now then
      local buckets = {}
      for b in string.gmatch(list, '%d+') do buckets[#buckets + 1] = tonumber(b) end
      live[#live + 1] = {
        slice = slice, n = tonumber(n), total = tonumber(total), expire_at = expire_at, buckets = buckets,
      }
    end
  end
  return live, expired
end

-- The i-th ID of a packed digest argument (16 bytes per ID, one string for the whole batch, so
-- that Redis parses one argument instead of two per ID): its 12-byte field and its 32-bit bucket
-- number, big-endian.
local function digest_at(packed, i)
  local at = (i - 1) * 16
  local a, b, c, d = byte(packed, at + 13, at + 16)
  return sub(packed, at + 1, at + 12), ((a * 256 + b) * 256 + c) * 256 + d
end

-- The bucket key that holds the digest and its slice, or nil when no live slice has it.
local function find_committed(meta, slices, field, h)
  for i = 1, #slices do
    local s = slices[i]
    for g = 1, #s.buckets do
      local key = bucket_key(meta, s, g, h)
      if call('HEXISTS', key, field) == 1 then return key, s end
    end
  end
  return nil
end

-- The meta field value of a slice.
local function format_slice(s)
  return s.n .. ':' .. s.total .. ':' .. s.expire_at .. ':' .. table.concat(s.buckets, ',')
end

-- Moves a key's expiry to expire_at unless it already lives longer (another writer's window).
-- expire_at is on the script's clock, which may be the caller's: so the key is given the time left
-- (PEXPIRE), not the moment (PEXPIREAT), which Redis would read on its own clock.
local function extend(key, expire_at, now)
  local left = expire_at - now
  if redis.call('PTTL', key) < left then redis.call('PEXPIRE', key, int(left)) end
end

-- Opens the current slice for writing (creating it from the previous slice's size, or for the
-- `expected` IDs when there is none), returning a writer: add(field, h) records one ID, finish()
-- saves the meta and sets the expiries.
local function slice_writer(meta, slices, slice_ms, window, now, expected)
  local current_slice = math.floor(now / slice_ms)
  local current, previous = nil, nil
  for _, s in ipairs(slices) do
    if s.slice == current_slice then
      current = s
    elseif s.slice < current_slice and (previous == nil or s.slice > previous.slice) then
      previous = s
    end
  end
  local expire_at = (current_slice + 1) * slice_ms + window
  -- A writer with a longer window than the slice's writers so far: every bucket of the slice must
  -- now live as long, not only those this call touches.
  local raised = current ~= nil and expire_at > current.expire_at
  if current == nil then
    -- A quarter more than the previous slice took: traffic that grows a little stays in one generation.
    local first = math.max(FIRST_BUCKETS, math.ceil(expected * 1.25 / FILL))
    if previous then first = math.max(1, math.ceil(previous.total * 1.25 / FILL)) end
    current = { slice = current_slice, n = 0, total = 0, expire_at = expire_at, buckets = { first } }
    slices[#slices + 1] = current
  end
  current.expire_at = math.max(current.expire_at, expire_at)
  local touched, changed = {}, false
  local writer = {}
  function writer.add(field, h)
    local b = current.buckets[#current.buckets]
    if current.n >= b * FILL then
      b = b * GROWTH
      current.buckets[#current.buckets + 1] = b
      current.n = 0
    end
    local key = bucket_key(meta, current, #current.buckets, h)
    call('HSET', key, field, '')
    touched[key] = true
    current.n = current.n + 1
    current.total = current.total + 1
    changed = true
  end
  function writer.finish(expired)
    for _, name in ipairs(expired) do redis.call('HDEL', meta, name) end
    if not changed then return end
    redis.call('HSET', meta, int(current_slice), format_slice(current))
    extend(meta, current.expire_at, now)
    if raised then
      for g = 1, #current.buckets do
        for b = 0, current.buckets[g] - 1 do extend(bucket_key(meta, current, g, b), current.expire_at, now) end
      end
    else
      for key in pairs(touched) do extend(key, current.expire_at, now) end
    end
  end
  return writer
end
