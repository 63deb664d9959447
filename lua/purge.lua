-- purge: an operator deletes terminal tasks that finished before a cutoff, bounded.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix
-- ARGV[1] older_than_ms    purge tasks that finished at least this long ago, integer >= 0
-- ARGV[2] limit            how many tasks at most, integer 1..10000
--
-- Returns {count, task_id, task_id, ...} of the tasks purged.
-- Operators only (the daemons' retention is expire); lua/_purge.lua does the work, with
-- exact counters.

--- @include _int_arg
--- @include _purge
--- @include _roles

operator_only()
local older_than_ms = int_arg(ARGV[1], 'older_than_ms', 0)
local limit = int_arg(ARGV[2], 'limit', 1, 10000)
return purge_terminal(older_than_ms, limit)
