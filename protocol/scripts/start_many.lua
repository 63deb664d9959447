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

-- include: _many
-- _many: one operation run for several tasks of one shard (not a script itself).
--
-- run_many(one, name, per) is the body of a <name> script: KEYS[2..] are each task's `per`
-- keys in turn, and ARGV is, for each task in KEYS order, n then that task's n arguments.
-- It checks that layout first (a malformed one fails the whole call before anything is
-- written), then calls one(k, ARGV, offset, n) for each task in order, where KEYS[k] is
-- the task's first key and ARGV[offset + 1] its first argument. Each runs under pcall: a
-- task whose operation raised gets the error as an error reply in its place, and the
-- others are unaffected. Returns the replies in KEYS order.

local function run_many(one, name, per)
  local count = (#KEYS - 1) / per
  if count ~= math.floor(count) then
    error('asynctaskd: ' .. name .. ' takes ' .. per .. ' keys per task after the prefix')
  end
  local at, starts, sizes = 1, {}, {}
  for i = 1, count do
    local n = tonumber(ARGV[at])
    if not n or n ~= math.floor(n) or n < 0 or at + n > #ARGV then
      error('asynctaskd: ' .. name .. ' ARGV is not n, then n arguments, for each task')
    end
    starts[i], sizes[i] = at, n
    at = at + 1 + n
  end
  if at ~= #ARGV + 1 then
    error('asynctaskd: ' .. name .. ' has keys for ' .. count .. ' tasks and arguments for more')
  end
  local out = {}
  for i = 1, count do
    local ok, reply = pcall(one, 2 + (i - 1) * per, ARGV, starts[i], sizes[i])
    if not ok then
      if type(reply) == 'table' then reply = reply.err end  -- a redis.call error
      reply = redis.error_reply(tostring(reply))
    end
    out[i] = reply
  end
  return out
end

-- include: _roles
-- _roles: the role guards of daemon and operator scripts (an include).
--
-- Roles (docs/security.md). Redis checks each command a script runs against the ACL user
-- that called the script, so a no-op write (HDEL of a field from a key that never exists)
-- to a key that only one role may write asks Redis whether the caller has that role.
-- Daemon and operator scripts call their guard first: a producer (or a daemon running an
-- operator script) gets NOPERM before anything is written.
local function daemon_only() redis.call('HDEL', P .. 'role:daemon', '') end
local function operator_only() redis.call('HDEL', P .. 'role:operator', '') end

-- include: _guards
-- _guards: the lifecycle and version checks of worker and operator writes (an include).

local function legal(old, new, actor)
  return string.find(LEGAL, ' ' .. old .. '>' .. new .. '#' .. actor .. ' ', 1, true) ~= nil
end

-- The fence-and-version check every worker write makes. The version the worker read must
-- still hold, except that a cancel request (the one write others make to a leased task)
-- is merged: it bumps the version once and records that version as cancel_version.
local function version_holds(current, cancel_version, read)
  if current == read then return true end
  return cancel_version ~= false and cancel_version ~= nil and current == cancel_version
         and tonumber(current) == (tonumber(read) or -2) + 1
end

-- include: _int_arg
-- _int_arg: checking an integer argument (an include).
--
-- An integer argument within [lo, hi] (hi: 2^53 - 1 if not given, so a double holds it
-- and what int_s writes back exactly; this also refuses inf). `n % 1 ~= 0` is true for a
-- fraction and for NaN. Other spellings Lua's tonumber reads as that integer ('1e3',
-- '0x10') are that integer: every script writes the number, never the argument's text.
local function int_arg(v, name, lo, hi)
  local n = tonumber(v)
  if not n or n % 1 ~= 0 or (lo and n < lo) or n > (hi or 9007199254740991) then
    error('asynctaskd: ARGV ' .. name .. ' must be an integer'
          .. (lo and (' >= ' .. lo) or '') .. ' <= ' .. (hi or '2^53 - 1')
          .. ', got ' .. tostring(v))
  end
  return n
end

-- include: _int_field
-- _int_field: checking a stored counter (an include).
--
-- A stored counter a script may increment: absent (false), or an integer as Redis itself
-- writes one (no leading zeros, no "-0") with at most 15 digits, so HINCRBY takes it and
-- Lua's doubles hold it and its successor exactly (claim and save add 1 in Lua).
-- Counters of one or two characters (fences, versions and attempts, mostly) are checked
-- by their bytes: a pattern costs Redis several times as much.
local function int_field(v)
  if not v then return true end
  if #v <= 2 then
    local a, b = string.byte(v, 1, 2)  -- 48-57: '0'-'9', 45: '-'
    if not b then return a ~= nil and a >= 48 and a <= 57 end
    return b >= 48 and b <= 57 and ((a >= 49 and a <= 57) or (a == 45 and b ~= 48))
  end
  local digits = string.match(v, '^%-?([1-9]%d*)$')
  return digits ~= nil and #digits <= 15
end

-- include: _start
-- _start: one task's start, shared by start and start_many (not a script itself).
--
-- start_one(k, A, o, n) is the start of the task whose key is KEYS[k], given A[o + 1] ..
-- A[o + n] as start's ARGV (start.lua states the contract). It returns start's reply, and
-- raises on bad arguments or a corrupt hash, before anything is written.

--- @include _guards
--- @include _int_arg
--- @include _int_field

local function start_one(k, A, o, n)
  local tk = KEYS[k]
  if n < 4 or n > 6 then error('asynctaskd: start takes 4 to 6 arguments, got ' .. n) end
  local id, fence = A[o + 1], A[o + 2]
  if KEYS[k] ~= P .. 'task:' .. id then
    error('asynctaskd: KEYS[' .. k .. '] is not the key of task ' .. id)
  end
  if A[o + 4] ~= '0' and A[o + 4] ~= '1' then
    error("asynctaskd: ARGV idempotent must be '0' or '1', got " .. tostring(A[o + 4]))
  end
  local visible = n == 6 and int_arg(A[o + 6], 'find_visible_ms', 0, 316224000000)
  -- owner: a task is leased exactly while its hash has an owner (every script that adds or
  -- removes a lease entry writes or deletes the field with it), so no lease index lookup
  local t = redis.call('HMGET', tk, 'status', 'fence', 'version', 'deadline_ms',
                       'cancel_requested', 'cancel_version', 'started_fence', 'submit_attempts',
                       'owner')
  if not t[1] then return {-1} end
  if t[2] ~= fence then return {-2} end
  if not t[9] then return {-4} end
  if not version_holds(t[3], t[6], A[o + 3]) then return {-3} end
  if t[1] ~= 'SUBMITTING' or (tonumber(t[4]) or 0) <= NOW then return {-7} end
  if t[7] == fence then return {-8} end
  if t[5] == '1' then return {-6, tonumber(t[3])} end
  -- the marks, submit_attempts + 1 and the version bump (as _move's bump): one HSET
  if not int_field(t[3]) then
    error('asynctaskd: task ' .. id .. ' field version is corrupt: ' .. tostring(t[3]))
  end
  if not int_field(t[8]) then
    error('asynctaskd: task ' .. id .. ' field submit_attempts is corrupt: ' .. tostring(t[8]))
  end
  -- int_field vouched for both: `+ 1` reads the text once (tonumber reads it twice)
  local v = (t[3] or 0) + 1
  local token = n >= 5 and A[o + 5] or ''
  local attempts = int_s((t[8] or 0) + 1)
  if visible then
    -- a handler that can look its vendor job up: whoever parks the task schedules lookups
    redis.call('HSET', tk, 'started_fence', fence, 'started_by', token,
               'idempotent', A[o + 4],
               'submit_attempts', attempts, 'version', int_s(v),
               'updated_ms', NOW_S, 'find', fence .. ':' .. NOW_S .. ':' .. int_s(visible))
  else
    redis.call('HSET', tk, 'started_fence', fence, 'started_by', token,
               'idempotent', A[o + 4],
               'submit_attempts', attempts, 'version', int_s(v),
               'updated_ms', NOW_S)
  end
  return {1, v}
end

-- script: start_many
-- start_many: several vendor submit calls of one shard marked started, each as start would.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix
-- KEYS[2..] task   hash    <ns>:{s<N>}:task:<id>, one per start, in order
-- ARGV[1..]        for each start in KEYS order: n, then that start's n ARGV (task_id,
--                  fence, version, idempotent[, token]) as start takes them
--
-- Returns one reply per start, in KEYS order: what start would reply, or an error reply
-- where start would have raised (bad arguments, a corrupt hash); that one fails alone.
-- Why: as save_many; a daemon's claim of a batch of new tasks starts them together.
-- Invariants: a malformed ARGV layout fails the whole call before anything is written;
-- each start runs in order exactly as the start script would (a later start of the same
-- task under the same fence sees the earlier one: STARTED), under one NOW; a rejected
-- start writes nothing.

--- @include _many
--- @include _roles
--- @include _start

daemon_only()
return run_many(start_one, 'start_many', 1)
