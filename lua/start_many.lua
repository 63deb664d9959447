-- start_many: several vendor submit calls of one shard marked started, each as start would.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix
-- KEYS[2..] task   hash    <ns>:{s<N>}:task:<id>, one per start, in order
-- ARGV[1..]        for each start in KEYS order: n, then that start's n ARGV (task_id,
--                  fence, version, idempotent[, token]) as start takes them
--
-- Returns one reply per start, in KEYS order: what start would reply, or an error reply
-- where start would have raised (bad arguments, a corrupt hash); that one fails alone.
-- Why: as save_many; a daemon's claim of a batch of new tasks starts them together.
-- Invariants: a malformed ARGV layout fails the whole call before anything is written;
-- each start runs in order exactly as the start script would (a later start of the same
-- task under the same fence sees the earlier one: STARTED), under one NOW; a rejected
-- start writes nothing.

--- @include _many
--- @include _roles
--- @include _start

daemon_only()
return run_many(start_one, 'start_many', 1)
