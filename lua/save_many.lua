-- save_many: several workers' outcomes for tasks of one shard, each saved as save would.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix
-- KEYS[2..] task   hash    <ns>:{s<N>}:task:<id>, one per save, in order
-- ARGV[1..]        for each save in KEYS order: n, then that save's n ARGV (task_id,
--                  fence, version, status, delay_ms, field, value pairs) as save takes them
--
-- Returns one reply per save, in KEYS order: what save would reply, or an error reply
-- where save would have raised (bad arguments, a corrupt hash); that one fails alone.
-- Why: every script call pays a fixed cost before its first command (the call itself and
-- the helpers it includes, ~a quarter of a save); a daemon's concurrent saves to one shard
-- pay it once; and the saves' writes to leases, deadlines, status indexes, counters and due
-- sets go as one command per key (lua/_defer.lua).
-- Invariants: a malformed ARGV layout fails the whole call before anything is written;
-- each save runs in order exactly as the save script would (a later save of the same task
-- sees the earlier one), under one NOW; a rejected save writes nothing.

--- @include _defer
--- @include _many
--- @include _roles
--- @include _save

daemon_only()
defer_on()
local replies = run_many(save_one, 'save_many', 1)
flush()
return replies
