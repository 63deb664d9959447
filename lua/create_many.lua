-- create_many: several new tasks of one shard stored, each as create would.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix
-- KEYS[2..] task, dedup    for each create in order: its task key, then its dedup key
--                          (create's KEYS[2] and KEYS[3])
-- ARGV[1..]        for each create in KEYS order: n, then that create's n ARGV (task_id,
--                  handler, ..., dedup_key) as create takes them
--
-- Returns one reply per create, in KEYS order: what create would reply, or an error reply
-- where create would have raised (bad arguments); that one fails alone.
-- Why: as save_many; a producer's concurrent submits to one shard pay the fixed cost of a
-- script call once.
-- Invariants: a malformed KEYS/ARGV layout fails the whole call before anything is
-- written; each create runs in order exactly as the create script would (a later create
-- with the same tenant and dedup key sees the earlier one: ACCEPTED), under one NOW.

--- @include _create
--- @include _many

return run_many(create_one, 'create_many', 2)
