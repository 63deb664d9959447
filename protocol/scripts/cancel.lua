local LEGAL = ' FAILED>PENDING_SUBMIT#O PENDING_SUBMIT>CANCELED#C PENDING_SUBMIT>CANCELED#O PENDING_SUBMIT>CANCELED#W PENDING_SUBMIT>SUBMITTING#W PENDING_SUBMIT>TRACKING_TIMED_OUT#R PENDING_SUBMIT>TRACKING_TIMED_OUT#W RUNNING>CANCELED#W RUNNING>FAILED#R RUNNING>FAILED#W RUNNING>PENDING_SUBMIT#W RUNNING>RUNNING#R RUNNING>RUNNING#W RUNNING>SUCCEEDED#W RUNNING>TRACKING_TIMED_OUT#R RUNNING>TRACKING_TIMED_OUT#W SUBMITTED>CANCELED#W SUBMITTED>FAILED#R SUBMITTED>FAILED#W SUBMITTED>PENDING_SUBMIT#W SUBMITTED>RUNNING#W SUBMITTED>SUBMITTED#R SUBMITTED>SUBMITTED#W SUBMITTED>SUCCEEDED#W SUBMITTED>TRACKING_TIMED_OUT#R SUBMITTED>TRACKING_TIMED_OUT#W SUBMITTING>CANCELED#R SUBMITTING>CANCELED#W SUBMITTING>FAILED#W SUBMITTING>PENDING_SUBMIT#R SUBMITTING>PENDING_SUBMIT#W SUBMITTING>SUBMITTED#W SUBMITTING>SUBMIT_UNKNOWN#R SUBMITTING>SUBMIT_UNKNOWN#W SUBMITTING>TRACKING_TIMED_OUT#R SUBMITTING>TRACKING_TIMED_OUT#W SUBMIT_UNKNOWN>CANCELED#C SUBMIT_UNKNOWN>CANCELED#O SUBMIT_UNKNOWN>CANCELED#W SUBMIT_UNKNOWN>FAILED#O SUBMIT_UNKNOWN>FAILED#W SUBMIT_UNKNOWN>PENDING_SUBMIT#O SUBMIT_UNKNOWN>PENDING_SUBMIT#W SUBMIT_UNKNOWN>SUBMITTED#O SUBMIT_UNKNOWN>SUBMITTED#W SUBMIT_UNKNOWN>SUBMIT_UNKNOWN#W SUBMIT_UNKNOWN>TRACKING_TIMED_OUT#W TRACKING_TIMED_OUT>PENDING_SUBMIT#O '
-- _core: what every script starts with (an include the loader always puts first).
--
-- Every script receives KEYS[1] = "<ns>:{s<N>}:", the shard prefix. Keys of that shard
-- are built from it here, so they all share the {s<N>} hash tag and one cluster slot.
-- The loader puts LEGAL, the transition table generated from asynctaskd/model.py, before
-- this, and after it the includes a script declares with `--- @include <name>` lines
-- (docs/protocol.md, Calling the scripts): each helper is a closure Lua builds again on
-- every call, so a script carries only those it uses.

local P = KEYS[1]
local TIME_ = redis.call('TIME')
local NOW = tonumber(TIME_[1]) * 1000 + math.floor(tonumber(TIME_[2]) / 1000)
-- Redis 7.0 turns a Lua number argument of redis.call into text with printf's "%.17g",
-- which costs ~5,000 instructions for a 13-digit time: ~10% of a save. So integers go to
-- Redis as strings: NOW_S is NOW as text (no printf: the seconds, then the microseconds
-- zero-padded to 6 digits, cut to milliseconds), and int_s() makes any other integer
-- of a double's exact range text with '%d', a fraction of that cost (anything else it
-- leaves a number).
local function ms_text(sec, usec) return sec .. string.sub('00000' .. usec, -6, -4) end
local NOW_S = ms_text(TIME_[1], TIME_[2])
local function int_s(n)
  if n == math.floor(n) and n > -9007199254740992 and n < 9007199254740992 then
    return string.format('%d', n)
  end
  return n
end
local function task_key(id) return P .. 'task:' .. id end

-- A script whose KEYS name a task and whose ARGV its id checks that they agree (or its
-- writes and its index entries would be about two different tasks), and raises
-- 'asynctaskd: task <id> field <field> is corrupt' for a task field it depends on that
-- is not what the scripts write, before anything is written. Both are written out where
-- needed: a helper function here would cost every script call a closure.

-- include: _statuses
-- _statuses: status sets as tables (an include).

local TERMINAL = {SUCCEEDED = true, FAILED = true, CANCELED = true, TRACKING_TIMED_OUT = true}
local PHASE = {PENDING_SUBMIT = 'submit', SUBMITTING = 'submit', SUBMITTED = 'query',
               RUNNING = 'query'}
local KNOWN = {PENDING_SUBMIT = true, SUBMITTING = true, SUBMITTED = true, RUNNING = true,
               SUCCEEDED = true, FAILED = true, CANCELED = true, TRACKING_TIMED_OUT = true,
               SUBMIT_UNKNOWN = true}
-- The statuses in which a task holds an in-flight slot (admission caps).
local INFLIGHT = {SUBMITTING = true, SUBMITTED = true, RUNNING = true, SUBMIT_UNKNOWN = true}

-- include: _wake
-- _wake: waking idle daemons (an include).
--
-- The wake list holds at most one element, and daemons pop it only between scripts: a
-- second wake in one script call would change nothing (a create_many of 32 would push 32).
-- LLEN, not LTRIM, keeps it at one: a producer may push but not trim.
local WOKEN = false
local function wake()
  if WOKEN then return end
  WOKEN = true
  if redis.call('LLEN', P .. 'wake') == 0 then redis.call('LPUSH', P .. 'wake', '1') end
end

-- script: cancel
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
