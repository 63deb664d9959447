-- cancel: cancel a task now if no worker holds it, or ask its worker to (persisted flag).
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix
-- KEYS[2] task     hash    <ns>:{s<N>}:task:<id>
-- ARGV[1] task_id
-- ARGV[2] check_tenant     '1' to require ARGV[3] to equal the task's tenant, '0' not to
-- ARGV[3] tenant
--
-- Returns {1, version} CANCELED now (PENDING_SUBMIT, or SUBMIT_UNKNOWN by decision), or
--   {2, version}  ACCEPTED (requested): a worker holds or will promptly take the task and cancels it
--                 at its next save (calling the handler's cancel() for a submitted job)
--   {-1}          NOT_FOUND (also for another tenant's task: existence is not revealed)
--   {-9, status}  TERMINAL: already finished, nothing changed
-- Invariants: the cancel flag is the one write others make to a leased task; it records
-- cancel_version so the holder's next save merges it instead of failing WRONG_VERSION.
-- An idle SUBMITTED/RUNNING task becomes due at once: cancel does not wait for its poll.

local tk = KEYS[2]
local id = ARGV[1]
local t = redis.call('HMGET', tk, 'status', 'tenant', 'cancel_requested', 'handler',
                     'priority', 'version')
local status = t[1]
if not status then return {-1} end
if ARGV[2] == '1' and (t[2] or '') ~= ARGV[3] then return {-1} end
if TERMINAL[status] then return {-9, status} end

-- Nobody holds these (a parked task may carry a flag from before it was parked).
if status == 'PENDING_SUBMIT' or status == 'SUBMIT_UNKNOWN' then
  local v = bump(tk)
  redis.call('HSET', tk, 'cancel_requested', '1')
  finish(tk, id, status, 'CANCELED', t[4])
  emit(id, 'CANCELED', v)
  return {1, v}
end
if t[3] == '1' then return {2, tonumber(t[6])} end

local v = bump(tk)
redis.call('HSET', tk, 'cancel_requested', '1', 'cancel_version', v)
-- A leased task has an owner (claim sets it; every write that ends the lease removes it).
if (status == 'SUBMITTED' or status == 'RUNNING') and redis.call('HEXISTS', tk, 'owner') == 0 then
  unschedule(id)
  redis.call('HSET', tk, 'due_ms', schedule(id, 'query', NOW, tonumber(t[5]) or 0))
  wake()
end
emit(id, status, v, {'cancel_requested', '1'})
return {2, v}
