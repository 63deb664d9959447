-- cancel: ask the daemons to cancel a task; they do it when they next take in requests.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix (the script appends to intake and
--                          pushes wake under it, and reads new:<id>)
-- KEYS[2] task     hash    <ns>:{s<N>}:task:<id> (read only)
-- ARGV[1] task_id
-- ARGV[2] check_tenant     '1' to require ARGV[3] to equal the task's tenant, '0' not to
-- ARGV[3] tenant
--
-- Returns {2, version} ACCEPTED (requested), or one of
--   {-1}          NOT_FOUND (also for another tenant's task: existence is not revealed)
--   {-9, status}  TERMINAL: already finished, nothing changed
-- A producer may not write a task (docs/security.md), so the cancel itself is carried out
-- by a daemon (lua/_intake.lua), within milliseconds while one runs: a task nobody holds
-- (PENDING_SUBMIT, SUBMIT_UNKNOWN) becomes CANCELED at once; a held one gets the cancel
-- flag, recorded with cancel_version so the holder's next save merges it instead of
-- failing; an idle SUBMITTED/RUNNING task becomes due at once.
-- Raises before writing on bad ARGV (KEYS[2] must be the key of task_id).
-- Invariants: writes only with commands that add (RPUSH intake, LPUSH wake); a cancel
-- that was already requested, or of a finished task, adds nothing.

--- @include _statuses
--- @include _wake

local tk = KEYS[2]
local id = ARGV[1]
if KEYS[2] ~= P .. 'task:' .. id then
  error('asynctaskd: KEYS[2] is not the key of task ' .. id)
end
if ARGV[2] ~= '0' and ARGV[2] ~= '1' then
  error("asynctaskd: ARGV check_tenant must be '0' or '1', got " .. tostring(ARGV[2]))
end
local t = redis.call('HMGET', tk, 'status', 'tenant', 'cancel_requested', 'version')
if not t[1] then
  -- not taken in yet: the request holds the tenant
  local packed = redis.call('GET', P .. 'new:' .. id)
  if not packed then return {-1} end
  local ok, flat = pcall(cmsgpack.unpack, packed)
  t = {'PENDING_SUBMIT', false, false, '1'}
  if ok and type(flat) == 'table' then
    for i = 1, #flat - 1, 2 do
      if flat[i] == 'tenant' then t[2] = flat[i + 1] end
    end
  end
end
if ARGV[2] == '1' and (t[2] or '') ~= ARGV[3] then return {-1} end
if TERMINAL[t[1]] then return {-9, t[1]} end
-- a flag already set is waiting for the holder; a task nobody holds (a parked one may
-- carry a flag from before it was parked) is canceled whatever its flag says
if t[3] ~= '1' or t[1] == 'PENDING_SUBMIT' or t[1] == 'SUBMIT_UNKNOWN' then
  redis.call('RPUSH', P .. 'intake', 'x:' .. id)
  wake()
end
return {2, tonumber(t[4]) or 0}
