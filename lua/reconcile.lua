-- reconcile: settle a parked task from what a vendor lookup found, or schedule the next.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix (leases, due sets, indexes, counts)
-- KEYS[2] task     hash    <ns>:{s<N>}:task:<id>
-- ARGV[1] task_id
-- ARGV[2] fence            fence the worker received from lookup
-- ARGV[3] version          version the worker last read
-- ARGV[4] outcome          'found' (the vendor has a job for this task), 'none' (it has
--                          none) or 'error' (the lookup failed)
-- ARGV[5] retry_ms         when to look again, from now, if this settles nothing: integer
--                          0..316224000000 (a 'none' too early waits at least until the
--                          job would be visible)
-- ARGV[6] max_lookups      lookups after which the task is left to an operator, 1..10000
-- ARGV[7] give_up_ms       time after the started mark after which it is left to an
--                          operator, integer 0..316224000000
-- ARGV[8] external_id      found: the vendor job's id; else ''
-- ARGV[9] handle           found: JSON handle {"external_id": ..., "query": {...}}; else ''
-- ARGV[10] message         error: what the lookup failed with (kept as the reason); else ''
--
-- Returns {1, new_version, final_status, what} saved, what being one of
--   'found'        SUBMITTED with that handle, due for a query at once
--   'resubmitted'  PENDING_SUBMIT, due at once: a lookup made at least find_visible_ms
--                  after the started mark found no job, so none exists
--   'again'        still SUBMIT_UNKNOWN, due for a lookup in retry_ms (or later)
--   'gave_up'      still SUBMIT_UNKNOWN, out of due:find: left to an operator, with
--                  error_code LOOKUP_GAVE_UP and the reason in error_message
-- (final_status is CANCELED instead of PENDING_SUBMIT when a cancel was requested, and
-- TRACKING_TIMED_OUT when the task's deadline passed: the found handle is kept), or
--   {-1} NOT_FOUND  {-2} STALE_FENCE  {-3} WRONG_VERSION  {-4} NO_LEASE
--   {-7} ILLEGAL    the task is not SUBMIT_UNKNOWN (or not due for lookups)
-- Rules: 'none' settles only when lookup_ms (server time at the lookup's claim, before
-- the vendor was asked) minus the started mark's time (`find`, written by start) is at
-- least the visible_ms recorded with it: before that a created job may not be listed yet,
-- and 'none' only means "ask again later". Errors and early 'none's count towards
-- max_lookups and give_up_ms. A cancel that arrives during the lookup ends the task at
-- once (lua/_intake.lua) and this write gets NO_LEASE; a cancel flag the task carried
-- when parked is merged: found -> SUBMITTED due at once (the worker cancels the job),
-- none -> CANCELED. The original submitter's late save wins over a lookup in flight.
-- Raises before writing on bad ARGV (KEYS[2] must be the key of task_id), a bad setting
-- it uses, or a task whose version or deadline_ms is not an integer, that has no
-- handler, or whose `find` record is not '<fence>:<ms>:<ms>'.
-- Invariant: a rejected write changes nothing; an accepted one ends the lookup's lease.

--- @include _emit
--- @include _guards
--- @include _int_arg
--- @include _int_field
--- @include _move
--- @include _roles
--- @include _schedule
--- @include _settings
--- @include _statuses
--- @include _wake

daemon_only()
local tk = KEYS[2]
local id, fence, outcome = ARGV[1], ARGV[2], ARGV[4]
if KEYS[2] ~= P .. 'task:' .. id then
  error('asynctaskd: KEYS[2] is not the key of task ' .. id)
end
if outcome ~= 'found' and outcome ~= 'none' and outcome ~= 'error' then
  error("asynctaskd: ARGV outcome must be 'found', 'none' or 'error', got " .. tostring(outcome))
end
local retry_ms = int_arg(ARGV[5], 'retry_ms', 0, 316224000000)
local max_lookups = int_arg(ARGV[6], 'max_lookups', 1, 10000)
local give_up_ms = int_arg(ARGV[7], 'give_up_ms', 0, 316224000000)
if outcome == 'found' and (ARGV[8] == '' or ARGV[9] == '') then
  error('asynctaskd: a found job needs the external id and the handle')
end

local t = redis.call('HMGET', tk, 'status', 'fence', 'version', 'cancel_requested',
                     'cancel_version', 'deadline_ms', 'handler', 'priority', 'find', 'lookups',
                     'lookup_ms', 'error_code')
local status = t[1]
if not status then return {-1} end
if t[2] ~= fence then return {-2} end
if not redis.call('ZSCORE', P .. 'leases', id) then return {-4} end
if not version_holds(t[3], t[5], ARGV[3]) then return {-3} end
if status ~= 'SUBMIT_UNKNOWN' or not t[9] then return {-7} end
if not int_field(t[3]) then
  error('asynctaskd: task ' .. id .. ' field version is corrupt: ' .. tostring(t[3]))
end
if not t[7] then
  error('asynctaskd: task ' .. id .. ' field handler is corrupt: ' .. tostring(t[7]))
end
local deadline = tonumber(t[6])
if not deadline or deadline % 1 ~= 0 then
  error('asynctaskd: task ' .. id .. ' field deadline_ms is corrupt: ' .. tostring(t[6]))
end
local started, visible = string.match(t[9], '^%d+:(%d+):(%d+)$')
started, visible = tonumber(started), tonumber(visible)
if not started then
  error('asynctaskd: task ' .. id .. ' field find is corrupt: ' .. tostring(t[9]))
end
local looked = tonumber(t[11]) or NOW
local lookups = tonumber(t[10]) or 0
local handler = t[7]

-- what this lookup settles
local final, what = 'SUBMIT_UNKNOWN', 'again'
if outcome == 'found' then
  final, what = 'SUBMITTED', 'found'
elseif outcome == 'none' and looked - started >= visible then
  final, what = 'PENDING_SUBMIT', 'resubmitted'
  if t[4] == '1' then final = 'CANCELED' end
elseif lookups >= max_lookups or NOW - started >= give_up_ms then
  what = 'gave_up'
end
if final ~= 'SUBMIT_UNKNOWN' and final ~= 'CANCELED' and deadline <= NOW then
  final = 'TRACKING_TIMED_OUT'
end
if not legal(status, final, 'W') then return {-7} end
if TERMINAL[final] then settings() else settings(true) end

local v = bump(tk)
redis.call('HDEL', tk, 'owner')
redis.call('ZREM', P .. 'leases', id)
if final == 'SUBMIT_UNKNOWN' then
  local note
  if outcome == 'error' then
    note = 'lookup ' .. lookups .. ' failed: ' .. ARGV[10]
  elseif looked - started < visible then
    note = 'lookup ' .. lookups .. ' found no job ' .. (looked - started) .. ' ms after the '
           .. 'submit started; a job may take ' .. visible .. ' ms to be listed'
  else
    note = 'lookup ' .. lookups .. ' found no job'  -- not reached: such a none settles
  end
  if what == 'gave_up' then
    redis.call('ZREM', P .. 'due:find', id)
    redis.call('HSET', tk, 'error_code', 'LOOKUP_GAVE_UP', 'error_message',
               'left for an operator after ' .. lookups .. ' lookups ('
               .. (t[12] or 'parked') .. '); last: ' .. note)
    emit(id, final, v, {'reconciled', 'gave_up'})
  else
    local due = NOW + retry_ms
    if outcome == 'none' and started + visible > due then due = started + visible end
    redis.call('ZADD', P .. 'due:find', int_s(due), id)
    redis.call('HSET', tk, 'message', note)
  end
  return {1, v, final, what}
end

-- settled: the lookup record and the started mark go, as a save from SUBMIT_UNKNOWN does
redis.call('HDEL', tk, 'started_fence', 'started_by', 'find', 'lookups', 'lookup_ms', 'message')
redis.call('ZREM', P .. 'due:find', id)
local extra = {'reconciled', what}
if what == 'found' then
  redis.call('HSET', tk, 'external_id', ARGV[8], 'handle', ARGV[9])
  redis.call('HDEL', tk, 'error_code', 'error_message')
else
  redis.call('HSET', tk, 'error_code', 'LOOKUP_FOUND_NO_JOB', 'error_message',
             'no vendor job ' .. (looked - started) .. ' ms after the submit started (listed '
             .. 'within ' .. visible .. ' ms): submitted again')
  extra[#extra + 1] = 'reason'
  extra[#extra + 1] = 'no_job'
end
if TERMINAL[final] then
  finish(tk, id, status, final, handler)
else
  move_status(tk, id, status, final, handler)
  redis.call('ZADD', P .. 'deadlines', int_s(deadline), id)
  redis.call('HSET', tk, 'due_ms', schedule(id, PHASE[final], NOW, tonumber(t[8]) or 0))
  wake()
end
emit(id, final, v, extra)
return {1, v, final, what}
