-- expire: the daemons delete terminal tasks past retention, bounded.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix
-- ARGV[1] older_than_ms    the retention: tasks that finished at least this long ago,
--                          integer >= 0
-- ARGV[2] limit            how many tasks at most, integer 1..10000
--
-- Returns {count, task_id, task_id, ...} of the tasks deleted.
-- What purge does for an operator (lua/_purge.lua), for the daemons' reaper: a daemon
-- may not run purge, an operator's script.

--- @include _int_arg
--- @include _purge
--- @include _roles

daemon_only()
local older_than_ms = int_arg(ARGV[1], 'older_than_ms', 0)
local limit = int_arg(ARGV[2], 'limit', 1, 10000)
return purge_terminal(older_than_ms, limit)
