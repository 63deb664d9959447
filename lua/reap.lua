-- reap: act on leases that expired, bounded; the holder is presumed dead.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix
-- ARGV[1] limit            how many expired leases at most, integer 1..10000
-- ARGV[2] max_reclaims     query-phase lease expiries tolerated before FAILED (poison task)
--
-- Returns {count, task_id, new_status, task_id, new_status, ...}
-- Per expired lease, re-checked inside the script so two reapers never both act:
--   SUBMITTING, call marked started under the current fence -> SUBMIT_UNKNOWN, or
--       PENDING_SUBMIT due now if the handler declared idempotent submits; the fence is
--       kept so the original submitter's late save can still land its handle; due for a
--       lookup (due:find) if its start recorded `find` under the fence
--   SUBMIT_UNKNOWN (a lookup's lease, lua/lookup.lua) -> the lease and owner go; its
--       due:find entry makes it due for the next lookup
--   SUBMITTING, call never started -> PENDING_SUBMIT, due now (CANCELED if a cancel
--       was requested meanwhile: nothing reached the vendor)
--   SUBMITTED / RUNNING -> the same status, due now (reclaims + 1), or FAILED with
--       error_code RECLAIM_LIMIT once reclaims exceed max_reclaims
--   deadline passed (and no started submit) -> TRACKING_TIMED_OUT
--   anything else (hash gone, terminal, parked) -> the stray lease entry is removed
--   counters that are not integers -> the task is quarantined (never a half-done write)
-- Bad ARGV or settings raise before anything is written.
-- Invariant: after the script, no task in the lease index has an expired lease among
-- those it looked at.

--- @include _emit
--- @include _int_arg
--- @include _int_field
--- @include _move
--- @include _roles
--- @include _schedule
--- @include _settings
--- @include _statuses
--- @include _wake

daemon_only()
local limit = int_arg(ARGV[1], 'limit', 1, 10000)
local max_reclaims = int_arg(ARGV[2], 'max_reclaims', 0)
settings()
local leases = P .. 'leases'
local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', NOW, 'LIMIT', 0, limit)
local out = {0}
local any_due = false
for _, id in ipairs(expired) do
  redis.call('ZREM', leases, id)
  local tk = task_key(id)
  local t = redis.pcall('HMGET', tk, 'status', 'fence', 'started_fence', 'idempotent',
                        'reclaims', 'handler', 'priority', 'deadline_ms', 'cancel_requested',
                        'version', 'find')
  if type(t) ~= 'table' or t.err ~= nil then t = {} end
  local status, handler = t[1], t[6]
  local new = nil
  if status and not (int_field(t[10]) and int_field(t[5])) then
    redis.call('ZADD', P .. 'quarantine', NOW, id)  -- unreadable: park it for an operator
    redis.call('HDEL', tk, 'owner')  -- its lease went above: start and save read the owner
  elseif status == 'SUBMIT_UNKNOWN' then
    -- a lookup's lease (lua/lookup.lua): its due:find entry brings the task back
    redis.call('HDEL', tk, 'owner')
  elseif status and PHASE[status] and handler then
    redis.call('HDEL', tk, 'owner')
    local started = status == 'SUBMITTING' and t[3] and t[3] == t[2]
    local late = (tonumber(t[8]) or 0) <= NOW
    local v = bump(tk)
    if started then
      if t[4] == '1' and not late then
        new = 'PENDING_SUBMIT'
        redis.call('HDEL', tk, 'started_fence')
      else
        new = 'SUBMIT_UNKNOWN'
        redis.call('HSET', tk, 'error_code', 'LEASE_EXPIRED_IN_SUBMIT',
          'error_message', 'the worker lost its lease after starting the vendor submit')
      end
    elseif late then
      new = 'TRACKING_TIMED_OUT'
    elseif status == 'SUBMITTING' then
      new = t[9] == '1' and 'CANCELED' or 'PENDING_SUBMIT'
    else
      local reclaims = redis.call('HINCRBY', tk, 'reclaims', 1)
      if reclaims > max_reclaims then
        new = 'FAILED'
        redis.call('HSET', tk, 'error_code', 'RECLAIM_LIMIT', 'error_message',
          'the task lost its lease ' .. reclaims .. ' times in the query phase')
      else
        new = status
      end
    end
    if TERMINAL[new] then
      finish(tk, id, status, new, handler)
    elseif new == 'SUBMIT_UNKNOWN' then
      move_status(tk, id, status, new, handler)
      redis.call('ZREM', P .. 'deadlines', id)
      redis.call('HDEL', tk, 'due_ms')
      if t[11] and string.match(t[11], '^(%d+):') == t[2] then
        redis.call('ZADD', P .. 'due:find', NOW_S, id)  -- a lookup can settle it
      end
    else
      move_status(tk, id, status, new, handler)
      redis.call('HSET', tk, 'due_ms', schedule(id, PHASE[new], NOW, tonumber(t[7]) or 0))
      any_due = true
    end
    emit(id, new, v, {'reaped', '1'})
    out[1] = out[1] + 1
    out[#out + 1] = id
    out[#out + 1] = new
  end
end
if any_due then wake() end
return out
