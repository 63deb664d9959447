-- quarantine: take a task whose stored data cannot be read out of circulation.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix
-- KEYS[2] task     hash    <ns>:{s<N>}:task:<id>
-- ARGV[1] task_id
-- ARGV[2] reason           short text for the operator
--
-- Returns {1} quarantined, or {-1} NOT_FOUND.
-- The task leaves the due sets (due:find too), the lease index and the deadline index, keeps its status
-- (and so its counter), and is listed in <prefix>quarantine for an operator. Nothing else
-- of the hash is touched but its owner (gone with the lease), so what was corrupt can still
-- be inspected. KEYS[2] must be the
-- key of task_id (else an error, nothing written).

--- @include _roles
--- @include _unschedule

daemon_only()
local tk = KEYS[2]
local id = ARGV[1]
if KEYS[2] ~= P .. 'task:' .. id then
  error('asynctaskd: KEYS[2] is not the key of task ' .. id)
end
if redis.call('EXISTS', tk) == 0 then
  redis.call('ZREM', P .. 'quarantine', id)
  unschedule(id)
  redis.call('ZREM', P .. 'due:find', id)
  redis.call('ZREM', P .. 'leases', id)
  redis.call('ZREM', P .. 'deadlines', id)
  return {-1}
end
unschedule(id)
redis.call('ZREM', P .. 'due:find', id)
redis.call('ZREM', P .. 'leases', id)
redis.call('ZREM', P .. 'deadlines', id)
redis.call('ZADD', P .. 'quarantine', NOW, id)
-- the lease goes with its owner: start and save read a lease from the owner field
redis.call('HSET', tk, 'quarantined', ARGV[2])
redis.call('HDEL', tk, 'owner')
return {1}
