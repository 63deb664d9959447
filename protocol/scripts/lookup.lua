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

-- script: lookup
-- lookup: lease up to n parked tasks whose vendor lookup is due, each with a new fence.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix; the script uses, under it:
--                          due:find leases quarantine task:<id>
-- ARGV[1] n                how many tasks at most, integer 0..1000 (0: only report)
-- ARGV[2] lease_ms         lease length, integer > 0
-- ARGV[3] owner            worker id, recorded in the task, not empty
-- ARGV[4..] handler        the handlers this daemon can look up (at least one)
--
-- Returns {next_due_ms, due_left, dropped, task, task, ...} where each task is
-- {task_id, fence, version, {field, value, ...}} (the hash after the claim, params
-- included: the lookup gets them), next_due_ms the earliest lookup still scheduled
-- (0 if none), due_left how many due lookups it left (of other handlers, or beyond n),
-- dropped how many entries were not lookups to do (gone, not parked, unreadable).
-- due:find holds the parked (SUBMIT_UNKNOWN) tasks a lookup can settle, scored by when
-- the next lookup is due; the scripts that park a task put it there only when its start
-- recorded `find` (a handler that can look its job up, lua/start.lua). While a lookup
-- holds a task its entry is scored at the lease's expiry, so a lookup whose daemon died
-- comes due again by itself once the reaper has removed the lease.
-- Per due entry, at most 4 * n looked at (bounded work per call):
--   not SUBMIT_UNKNOWN, or gone -> the stray entry is removed
--   version, fence or lookups not integers -> quarantined, entry removed
--   leased (a lookup still running, renewed) -> rescored at its lease's expiry
--   a handler not in ARGV -> left for a daemon that serves it (counted in due_left)
--   else claimed: fence + 1, version + 1, owner, lease, lookups + 1, lookup_ms = now
--       (server time: the lookup's answer is about the vendor as it was after this)
-- Bad ARGV raise before anything is written.
-- Invariants: the status is not changed (a lookup is no transition; cancel, resolve and
-- the original submitter's late save still apply, and end the lookup's lease); every
-- claim increments the fence, so an older lookup's write becomes stale.

--- @include _int_arg
--- @include _int_field
--- @include _roles

daemon_only()
local n = int_arg(ARGV[1], 'n', 0, 1000)
local lease_ms = int_arg(ARGV[2], 'lease_ms', 1)
local owner = ARGV[3]
if owner == '' then error('asynctaskd: ARGV owner must not be empty') end
if #ARGV < 4 then error('asynctaskd: lookup needs at least one handler after ARGV[3]') end
local serves = {}
for i = 4, #ARGV do
  if ARGV[i] == '' then error('asynctaskd: ARGV handler must not be empty') end
  serves[ARGV[i]] = true
end
local due_key = P .. 'due:find'
local leases = P .. 'leases'
local reply = {0, 0, 0}
local got, left, dropped = 0, 0, 0
if n > 0 then
  local due = redis.call('ZRANGEBYSCORE', due_key, '-inf', NOW_S, 'LIMIT', '0', int_s(4 * n))
  for _, id in ipairs(due) do
    local tk = task_key(id)
    local t = redis.pcall('HMGET', tk, 'status', 'handler', 'fence', 'version', 'lookups')
    if type(t) ~= 'table' or t.err ~= nil then t = {'?'} end
    local status, handler = t[1], t[2]
    if status ~= 'SUBMIT_UNKNOWN' then
      if status == '?' then redis.call('ZADD', P .. 'quarantine', NOW_S, id) end
      redis.call('ZREM', due_key, id)
      dropped = dropped + 1
    elseif not (handler and int_field(t[3]) and int_field(t[4]) and int_field(t[5])) then
      redis.call('ZADD', P .. 'quarantine', NOW_S, id)  -- unreadable: park it for an operator
      redis.call('ZREM', due_key, id)
      dropped = dropped + 1
    else
      local lease = redis.call('ZSCORE', leases, id)
      if lease then
        redis.call('ZADD', due_key, int_s(tonumber(lease) + 1), id)
        dropped = dropped + 1
      elseif not serves[handler] or got >= n then
        left = left + 1
      else
        local fence, v = (tonumber(t[3]) or 0) + 1, (tonumber(t[4]) or 0) + 1
        local until_ms = int_s(NOW + lease_ms)
        redis.call('HSET', tk, 'fence', int_s(fence), 'version', int_s(v), 'updated_ms', NOW_S,
                   'owner', owner, 'lookups', int_s((tonumber(t[5]) or 0) + 1),
                   'lookup_ms', NOW_S)
        redis.call('ZADD', leases, until_ms, id)
        redis.call('ZADD', due_key, until_ms, id)
        got = got + 1
        reply[#reply + 1] = {id, fence, v, redis.call('HGETALL', tk)}
      end
    end
  end
end
-- the earliest lookup not taken now (ours are scored at their lease's expiry)
local head = redis.call('ZRANGE', due_key, 0, 0, 'WITHSCORES')
if head[1] then reply[1] = tonumber(head[2]) end
reply[2], reply[3] = left, dropped
return reply
