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

-- include: _defer
-- _defer: index and counter writes a batched call sends once per key (an include).
--
-- A call that moves many tasks (a claim, save_many) writes the same few keys for each of
-- them: its lease in `leases`, its deadline in `deadlines`, its status in `idx:<status>`
-- and `counts`, its due time in `due:<phase>`. Each write is a command, and each command
-- a script runs costs Redis far more than the Lua around it. Such a call turns deferral on
-- with defer_on(); z_add, z_rem and h_incr then only note the write, and flush() sends,
-- for each key, one ZADD of every member added, one ZREM of every member removed and one
-- HINCRBY per counter field. Without defer_on() they write at once (every other script).
--
-- The result is the keyspace the writes in order would have left: for a key and member
-- the last write wins (a ZADD then a ZREM of the same member is a ZREM), and the deltas
-- of a counter add up. A script that defers must flush() before it reads any of these
-- keys and before it returns, and must write them only through these helpers meanwhile.
-- Their replies (added or removed counts, the new counter) are not given: no caller uses
-- them.

local DEFER = nil  -- nil: write at once; else {key = {member = score or false}}
local COUNTS = nil  -- {key = {field = delta}}

local function defer_on()
  DEFER, COUNTS = {}, {}
end

local function deferred(key)
  local z = DEFER[key]
  if not z then
    z = {}
    DEFER[key] = z
  end
  return z
end

-- score: text, as ZADD takes it (int_s, NOW_S, due_score)
local function z_add(key, score, member)
  if DEFER then deferred(key)[member] = score else redis.call('ZADD', key, score, member) end
end

local function z_rem(key, member)
  if DEFER then deferred(key)[member] = false else redis.call('ZREM', key, member) end
end

-- by: an integer (a number)
local function h_incr(key, field, by)
  if not DEFER then
    redis.call('HINCRBY', key, field, int_s(by))
    return
  end
  local c = COUNTS[key]
  if not c then
    c = {}
    COUNTS[key] = c
  end
  c[field] = (c[field] or 0) + by
end

-- Send what was noted, and start noting afresh (deferral stays on).
local function flush()
  if not DEFER then return end
  for key, members in pairs(DEFER) do
    local adds, rems = {}, {}
    for member, score in pairs(members) do
      if score then
        adds[#adds + 1] = score
        adds[#adds + 1] = member
      else
        rems[#rems + 1] = member
      end
    end
    -- at most 1,000 members a command: unpack() puts every argument on Lua's C stack
    for i = 1, #adds, 2000 do
      redis.call('ZADD', key, unpack(adds, i, math.min(i + 1999, #adds)))
    end
    for i = 1, #rems, 1000 do
      redis.call('ZREM', key, unpack(rems, i, math.min(i + 999, #rems)))
    end
  end
  for key, fields in pairs(COUNTS) do
    for field, by in pairs(fields) do redis.call('HINCRBY', key, field, int_s(by)) end
  end
  DEFER, COUNTS = {}, {}
end

-- include: _unschedule
-- _unschedule: taking a task out of every due, ready and held set (an include).

--- @include _defer

local function unschedule(id)
  local held = redis.call('HGET', P .. 'task:' .. id, 'held')
  if held then
    redis.call('ZREM', P .. 'held:' .. held, id)
    redis.call('HDEL', P .. 'task:' .. id, 'held')
  end
  z_rem(P .. 'due:submit', id)  -- deferred in a call that defers (lua/_defer.lua)
  z_rem(P .. 'due:query', id)
  redis.call('ZREM', P .. 'ready:submit', id)
  redis.call('ZREM', P .. 'ready:query', id)
end

-- script: quarantine
-- quarantine: take a task whose stored data cannot be read out of circulation.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix
-- KEYS[2] task     hash    <ns>:{s<N>}:task:<id>
-- ARGV[1] task_id
-- ARGV[2] reason           short text for the operator
--
-- Returns {1} quarantined, or {-1} NOT_FOUND.
-- The task leaves the due sets (due:find too), the lease index and the deadline index, keeps its status
-- (and so its counter), and is listed in <prefix>quarantine for an operator. Nothing else
-- of the hash is touched but its owner (gone with the lease), so what was corrupt can still
-- be inspected. KEYS[2] must be the
-- key of task_id (else an error, nothing written).

--- @include _roles
--- @include _unschedule

daemon_only()
local tk = KEYS[2]
local id = ARGV[1]
if KEYS[2] ~= P .. 'task:' .. id then
  error('asynctaskd: KEYS[2] is not the key of task ' .. id)
end
if redis.call('EXISTS', tk) == 0 then
  redis.call('ZREM', P .. 'quarantine', id)
  unschedule(id)
  redis.call('ZREM', P .. 'due:find', id)
  redis.call('ZREM', P .. 'leases', id)
  redis.call('ZREM', P .. 'deadlines', id)
  return {-1}
end
unschedule(id)
redis.call('ZREM', P .. 'due:find', id)
redis.call('ZREM', P .. 'leases', id)
redis.call('ZREM', P .. 'deadlines', id)
redis.call('ZADD', P .. 'quarantine', NOW, id)
-- the lease goes with its owner: start and save read a lease from the owner field
redis.call('HSET', tk, 'quarantined', ARGV[2])
redis.call('HDEL', tk, 'owner')
return {1}
