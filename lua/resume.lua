-- resume: lift a pause on one shard and put the tasks it held back into the ready set.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix (paused, held:<dim>, ready:submit)
-- ARGV[1] dimension        'handler:<k>', 'provider:<p>', 'tenant:<t>' or 'account:<a>'
-- ARGV[2] limit            how many held tasks to move back at most, integer 1..10000
--
-- Returns {moved, remaining}: call again while remaining > 0.
-- Invariants: the pause flag is gone after the first call, so no new task is held under
-- it; a moved task keeps its ready score (priority, then FIFO) and goes where it waits
-- now: the ready set, or the held set of another pause, a full cap or its rate lane.

--- @include _int_arg
--- @include _roles
--- @include _schedule

operator_only()
local dim = ARGV[1]
if not string.find(dim, '^[a-z]+:') then
  error('asynctaskd: ARGV dimension must look like tenant:<name>, got ' .. tostring(dim))
end
local limit = int_arg(ARGV[2], 'limit', 1, 10000)
redis.call('HDEL', P .. 'paused', dim)
local moved = unhold(dim, 'submit', limit)
return {moved, redis.call('ZCARD', P .. 'held:' .. dim)}
