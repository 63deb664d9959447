-- resolve: an operator settles a SUBMIT_UNKNOWN task, or requeues a failed one.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix
-- KEYS[2] task     hash    <ns>:{s<N>}:task:<id>
-- ARGV[1] task_id
-- ARGV[2] target           SUBMITTED, PENDING_SUBMIT, FAILED or CANCELED (not a status:
--                          an error)
-- ARGV[3] external_id      for SUBMITTED: the vendor job id found at the vendor
-- ARGV[4] handle           for SUBMITTED: JSON handle {"external_id": ..., "query": {...}}
-- ARGV[5] message          operator's note, stored as error_message for FAILED/CANCELED
--
-- Returns {1, version, final_status} resolved, or one of
--   {-1} NOT_FOUND
--   {-7, status} ILLEGAL  the task is not in a status the operator may move to target
-- From SUBMIT_UNKNOWN: SUBMITTED (due for a query at once), PENDING_SUBMIT (a knowing
-- resubmit: the next claim changes the fence, so the old submitter's late save can no
-- longer land), FAILED or CANCELED. From FAILED or TRACKING_TIMED_OUT: PENDING_SUBMIT
-- (requeue: a new attempt with a fresh deadline of the original tracking timeout).
-- A knowing resubmit of a task whose cancel was requested ends CANCELED instead: the
-- producer asked for it to stop, and nothing new has reached the vendor.
-- Raises before writing on bad ARGV (KEYS[2] must be the key of task_id), bad settings,
-- or a task whose version is not an integer or that has no handler.

--- @include _emit
--- @include _guards
--- @include _int_field
--- @include _move
--- @include _roles
--- @include _schedule
--- @include _settings
--- @include _statuses
--- @include _wake

operator_only()
local tk = KEYS[2]
local id = ARGV[1]
local target = ARGV[2]
if KEYS[2] ~= P .. 'task:' .. id then
  error('asynctaskd: KEYS[2] is not the key of task ' .. id)
end
if not KNOWN[target] then error('asynctaskd: ARGV target is not a status: ' .. tostring(target)) end
local t = redis.call('HMGET', tk, 'status', 'handler', 'priority', 'deadline_ms', 'timeout_ms',
                     'cancel_requested', 'version')
local status, handler = t[1], t[2]
if not status then return {-1} end
if not legal(status, target, 'O') then return {-7, status} end
if target == 'SUBMITTED' and (ARGV[3] == '' or ARGV[4] == '') then
  error('asynctaskd: resolving as SUBMITTED needs the external id and the handle')
end
if not int_field(t[7]) then
  error('asynctaskd: task ' .. id .. ' field version is corrupt: ' .. tostring(t[7]))
end
if not handler then
  error('asynctaskd: task ' .. id .. ' field handler is corrupt: ' .. tostring(handler))
end
settings()

if target == 'PENDING_SUBMIT' and status == 'SUBMIT_UNKNOWN' and t[6] == '1' then
  target = 'CANCELED'
end
local v = bump(tk)
redis.call('HDEL', tk, 'started_fence', 'owner', 'find', 'lookups', 'lookup_ms')
redis.call('ZREM', P .. 'leases', id)
redis.call('ZREM', P .. 'due:find', id)  -- a lookup in flight gets NO_LEASE
if TERMINAL[status] then
  -- requeue: a fresh attempt; the hash was set to expire when it finished
  redis.call('PERSIST', tk)
  redis.call('HDEL', tk, 'finished_ms', 'error_code', 'error_message', 'result',
             'cancel_requested', 'cancel_version', 'consecutive_errors', 'reclaims',
             'throttles')
  local deadline_ms = NOW + (tonumber(t[5]) or 3600000)
  redis.call('HSET', tk, 'deadline_ms', deadline_ms)
  t[4] = deadline_ms
end
if TERMINAL[target] then
  redis.call('HSET', tk, 'error_code', 'RESOLVED_' .. target,
             'error_message', ARGV[5] ~= '' and ARGV[5] or 'resolved by an operator')
  finish(tk, id, status, target, handler)
else
  if target == 'SUBMITTED' then
    redis.call('HSET', tk, 'external_id', ARGV[3], 'handle', ARGV[4])
  end
  move_status(tk, id, status, target, handler)
  redis.call('ZADD', P .. 'deadlines', tonumber(t[4]) or NOW, id)
  redis.call('HSET', tk, 'due_ms', schedule(id, PHASE[target], NOW, tonumber(t[3]) or 0))
  wake()
end
emit(id, target, v, {'resolved', '1'})
return {1, v, target}
