-- save: write a worker's outcome for one task if its fence and version still hold.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix (leases, due sets, indexes, counts)
-- KEYS[2] task     hash    <ns>:{s<N>}:task:<id>
-- ARGV[1] task_id
-- ARGV[2] fence            fence the worker received from claim
-- ARGV[3] version          version the worker last read
-- ARGV[4] status           the status the outcome asks for
-- ARGV[5] delay_ms         next due time from now for a non-terminal status, integer >= 0
-- ARGV[6..] field, value   pairs to write; only handle, external_id, result, error_code,
--                          error_message, progress, stage, message, consecutive_errors,
--                          poll_count; an empty value deletes the field; a field given
--                          twice takes its last value
--
-- Returns {1, new_version, final_status} saved, or one of
--   {-1} NOT_FOUND  {-2} STALE_FENCE  {-3} WRONG_VERSION  {-4} NO_LEASE
--   {-7} ILLEGAL    the lifecycle does not allow this worker transition
-- Rules, in order:
--   * The fence must be current and the task leased, except the late save of the
--     original submitter: a task parked in SUBMIT_UNKNOWN by the reaper whose started
--     fence is this fence accepts SUBMITTED, FAILED or PENDING_SUBMIT (the handle is
--     never lost; no other submit attempt can have happened under the same fence).
--   * A terminal outcome wins over a cancel that arrived during the call. Otherwise a
--     merged cancel turns PENDING_SUBMIT into CANCELED and makes SUBMITTED/RUNNING due
--     at once, so a worker calls the vendor's cancel and saves CANCELED.
--   * A non-terminal outcome after the deadline becomes TRACKING_TIMED_OUT (data kept).
-- Invariant: a rejected save writes nothing; a saved one releases the lease.

workers_only()
local tk = KEYS[2]
local id = ARGV[1]
local want = ARGV[4]
if not KNOWN[want] then error('asynctaskd: ARGV status is not a status: ' .. tostring(want)) end
local delay_ms = int_arg(ARGV[5], 'delay_ms', 0)
if #ARGV % 2 ~= 1 then error('asynctaskd: save takes field, value pairs after ARGV[5]') end
local WRITABLE = {handle = true, external_id = true, result = true, error_code = true,
  error_message = true, progress = true, stage = true, message = true,
  consecutive_errors = true, poll_count = true}
for i = 6, #ARGV, 2 do
  if not WRITABLE[ARGV[i]] then error('asynctaskd: save may not write field ' .. ARGV[i]) end
end

local t = redis.call('HMGET', tk, 'status', 'fence', 'version', 'cancel_requested',
                     'cancel_version', 'deadline_ms', 'started_fence', 'handler', 'priority',
                     'progress', 'stage', 'message')
local old = t[1]
if not old then return {-1} end
if t[2] ~= ARGV[2] then return {-2} end
local leased = redis.call('ZSCORE', P .. 'leases', id)
if leased then
  if not version_holds(t[3], t[5], ARGV[3]) then return {-3} end
elseif not (old == 'SUBMIT_UNKNOWN' and t[7] == ARGV[2]
            and (want == 'SUBMITTED' or want == 'FAILED' or want == 'PENDING_SUBMIT')) then
  return {-4}
end
if not legal(old, want, 'W') then return {-7} end

local final = want
local cancel = t[4] == '1'
if cancel and not TERMINAL[want] then
  if want == 'PENDING_SUBMIT' then final = 'CANCELED' end
  if want == 'SUBMITTED' or want == 'RUNNING' then delay_ms = 0 end
end
if not TERMINAL[final] and final ~= 'SUBMIT_UNKNOWN' and (tonumber(t[6]) or 0) <= NOW then
  final = 'TRACKING_TIMED_OUT'
end

-- The version bump (as the prelude's bump), the fields, updated_ms, due_ms, and the
-- removal of owner, started_fence and emptied fields: one HSET and one HDEL. Each call a
-- script makes costs Redis far more than the command itself; saves run for every task
-- several times, so they are batched here.
if not int_field(t[3]) then error('asynctaskd: the task version is not an integer') end
local v = (tonumber(t[3]) or 0) + 1
local sets = {'HSET', tk, 'version', int_s(v), 'updated_ms', NOW_S}
local dels = {'HDEL', tk, 'owner'}
local last = {}
for i = 6, #ARGV, 2 do last[ARGV[i]] = i end
for i = 6, #ARGV, 2 do
  if last[ARGV[i]] == i then
    if ARGV[i + 1] == '' then
      dels[#dels + 1] = ARGV[i]
    else
      sets[#sets + 1] = ARGV[i]
      sets[#sets + 1] = ARGV[i + 1]
    end
  end
end
if old == 'SUBMITTING' or old == 'SUBMIT_UNKNOWN' then dels[#dels + 1] = 'started_fence' end
if final == 'SUBMIT_UNKNOWN' then
  dels[#dels + 1] = 'due_ms'
elseif not TERMINAL[final] then
  sets[#sets + 1] = 'due_ms'
  sets[#sets + 1] = int_s(NOW + delay_ms)  -- what schedule() below returns
end
redis.call(unpack(sets))
redis.call(unpack(dels))
local handler = t[8]
redis.call('ZREM', P .. 'leases', id)
if TERMINAL[final] then
  finish(tk, id, old, final, handler)
else
  if final ~= old then move_status(tk, id, old, final, handler) end
  if final == 'SUBMIT_UNKNOWN' then
    redis.call('ZREM', P .. 'deadlines', id)
  else
    schedule(id, PHASE[final], NOW + delay_ms, tonumber(t[9]) or 0)
    if old == 'SUBMIT_UNKNOWN' then
      redis.call('ZADD', P .. 'deadlines', tonumber(t[6]) or NOW, id)
    end
    if delay_ms == 0 then wake() end
  end
end
local extra = nil
if final == 'RUNNING' then
  -- the hash's progress, stage and message now: as written above, else as read
  extra = {}
  for k, name in ipairs({'progress', 'stage', 'message'}) do
    local value = t[9 + k]
    if last[name] then value = ARGV[last[name] + 1] ~= '' and ARGV[last[name] + 1] end
    if value then extra[#extra + 1] = name; extra[#extra + 1] = value end
  end
end
if final ~= old or extra then emit(id, final, v, extra) end
return {1, v, final}
