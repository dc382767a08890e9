-- relayout: give a slot shard with nothing committed the slice length of a longer window.
-- KEYS[1]  the scope shard's meta hash <base>:m (see committed.lua)
-- KEYS[2]  the shard's layout key <base>:layout (see slice_length in committed.lua)
-- ARGV[1]  the new layout, "v1 shards=<n> slice=<ms>"
-- Reply: the layout the shard keeps: the new one, or, when it holds committed IDs, the one it has
-- (nil if it has none stored).
-- The check and the change are one script, so that no commit lands between them: IDs committed
-- with one slice length are never read with another. Processes already running pick the new one
-- up from the key, on their next call.
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('SET', KEYS[2], ARGV[1]) end
return redis.call('GET', KEYS[2])
