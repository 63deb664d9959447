-- release: give leases back without an outcome (drain, or claimed but not started).
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix
-- ARGV[1..] task_id, fence, version triples
--
-- Returns {code, code, ...}, one per triple, in order: 1 released (due at once), or
--   -1 NOT_FOUND  -2 STALE_FENCE  -4 NO_LEASE  -7 ILLEGAL (not a leased phase status)
--   -8 STARTED    the submit call had been marked started: the task was parked in
--                 SUBMIT_UNKNOWN (or requeued, for an idempotent handler), as reap does;
--                 due for a lookup (due:find) if its start recorded `find` under the fence
-- Invariants: a released SUBMITTING task whose call never started goes back to
-- PENDING_SUBMIT; SUBMITTED/RUNNING stay and become due at once; the fence is kept, so
-- the next claim makes this holder stale. Only the fence and the lease are checked, not
-- the version: a holder may give back a lease after losing the reply to its own write.
-- A rejected release writes nothing. The whole call raises, before anything is written,
-- on a malformed triple (an empty task_id, fence or version) or a task it would release
-- whose version is not an integer or that has no handler.

--- @include _emit
--- @include _int_field
--- @include _move
--- @include _roles
--- @include _schedule
--- @include _settings
--- @include _statuses
--- @include _wake

daemon_only()
if #ARGV % 3 ~= 0 then error('asynctaskd: release takes task_id, fence, version triples') end
local leases = P .. 'leases'
-- Every triple and every task it would write is checked first: a bad one raises before
-- any triple is released.
local read = {}
for i = 1, #ARGV, 3 do
  local id = ARGV[i]
  if id == '' or ARGV[i + 1] == '' or ARGV[i + 2] == '' then
    error('asynctaskd: release needs task_id, fence, version; got an empty one in triple '
          .. (i + 2) / 3)
  end
  local t = redis.call('HMGET', task_key(id), 'status', 'fence', 'version', 'idempotent',
                       'started_fence', 'handler', 'priority', 'find')
  if t[1] and t[2] == ARGV[i + 1] and PHASE[t[1]] then
    if not int_field(t[3]) then
      error('asynctaskd: task ' .. id .. ' field version is corrupt: ' .. tostring(t[3]))
    end
    if not t[6] then
      error('asynctaskd: task ' .. id .. ' field handler is corrupt: ' .. tostring(t[6]))
    end
  end
  read[i] = t
end
settings()

local out = {}
local any = false
local seen = {}
for i = 1, #ARGV, 3 do
  local id = ARGV[i]
  local tk = task_key(id)
  local t = read[i]
  -- the same task twice: the second sees what the first wrote (all of it valid)
  if seen[id] then
    t = redis.call('HMGET', tk, 'status', 'fence', 'version', 'idempotent', 'started_fence',
                   'handler', 'priority', 'find')
  end
  seen[id] = true
  if not t[1] then
    out[#out + 1] = -1
  elseif t[2] ~= ARGV[i + 1] then
    out[#out + 1] = -2
  elseif not redis.call('ZSCORE', leases, id) then
    out[#out + 1] = -4
  elseif t[1] == 'SUBMITTING' and t[5] == t[2] then
    local v = bump(tk)
    redis.call('ZREM', leases, id)
    redis.call('HDEL', tk, 'owner')
    if t[4] == '1' then
      redis.call('HDEL', tk, 'started_fence')
      move_status(tk, id, 'SUBMITTING', 'PENDING_SUBMIT', t[6])
      redis.call('HSET', tk, 'due_ms', schedule(id, 'submit', NOW, tonumber(t[7]) or 0))
      emit(id, 'PENDING_SUBMIT', v)
      any = true
    else
      redis.call('HSET', tk, 'error_code', 'INTERRUPTED_IN_SUBMIT',
        'error_message', 'the worker stopped after starting the vendor submit')
      move_status(tk, id, 'SUBMITTING', 'SUBMIT_UNKNOWN', t[6])
      redis.call('ZREM', P .. 'deadlines', id)
      redis.call('HDEL', tk, 'due_ms')
      if t[8] and string.match(t[8], '^(%d+):') == t[2] then
        redis.call('ZADD', P .. 'due:find', NOW_S, id)  -- a lookup can settle it
      end
      emit(id, 'SUBMIT_UNKNOWN', v)
    end
    out[#out + 1] = -8
  elseif not PHASE[t[1]] then
    out[#out + 1] = -7
  else
    local v = bump(tk)
    redis.call('ZREM', leases, id)
    redis.call('HDEL', tk, 'owner')
    local status = t[1]
    if status == 'SUBMITTING' then
      status = 'PENDING_SUBMIT'
      move_status(tk, id, 'SUBMITTING', status, t[6])
      emit(id, status, v)
    end
    redis.call('HSET', tk, 'due_ms', schedule(id, PHASE[status], NOW, tonumber(t[7]) or 0))
    out[#out + 1] = 1
    any = true
  end
end
if any then wake() end
return out
