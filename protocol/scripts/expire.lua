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

-- include: _purge
-- _purge: delete terminal tasks that finished before a cutoff (not a script itself).
--
-- purge_terminal(older_than_ms, limit) is the body of purge (an operator's) and expire
-- (the daemons' retention): it walks the terminal status indexes oldest first, deletes at
-- most `limit` tasks that finished at least older_than_ms ago, keeps the counters exact,
-- and returns {count, task_id, ...}. A hash that already expired (its safety-net expiry is
-- retention plus a grace period) still leaves its index entry; its per-handler counter
-- cannot be known then and is left as it is.

local function purge_terminal(older_than_ms, limit)
  local cutoff = NOW - older_than_ms
  local counts = P .. 'counts'
  local out = {0}
  for _, status in ipairs({'SUCCEEDED', 'FAILED', 'CANCELED', 'TRACKING_TIMED_OUT'}) do
    if out[1] >= limit then break end
    local idx = P .. 'idx:' .. status
    local ids = redis.call('ZRANGEBYSCORE', idx, '-inf', cutoff, 'LIMIT', 0, limit - out[1])
    for _, id in ipairs(ids) do
      local tk = task_key(id)
      local t = redis.call('HMGET', tk, 'status', 'handler')
      if t[1] == nil or t[1] == false or t[1] == status then
        redis.call('ZREM', idx, id)
        if t[2] then redis.call('HINCRBY', counts, status .. '@' .. t[2], -1) end
        redis.call('DEL', tk)
        out[1] = out[1] + 1
        out[#out + 1] = id
      else
        redis.call('ZREM', idx, id)  -- stale entry: the task moved on (requeued)
      end
    end
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

-- script: expire
-- expire: the daemons delete terminal tasks past retention, bounded.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix
-- ARGV[1] older_than_ms    the retention: tasks that finished at least this long ago,
--                          integer >= 0
-- ARGV[2] limit            how many tasks at most, integer 1..10000
--
-- Returns {count, task_id, task_id, ...} of the tasks deleted.
-- What purge does for an operator (lua/_purge.lua), for the daemons' reaper: a daemon
-- may not run purge, an operator's script.

--- @include _int_arg
--- @include _purge
--- @include _roles

daemon_only()
local older_than_ms = int_arg(ARGV[1], 'older_than_ms', 0)
local limit = int_arg(ARGV[2], 'limit', 1, 10000)
return purge_terminal(older_than_ms, limit)
