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

-- script: stage_limits
-- stage_limits: build a shard's next admission table, one bounded chunk per call, for
-- sync_limits to swap in whole.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix; the script uses, under it:
--                          admission_next (HASH, the table being built), admission_sync
--                          (STRING, the token of the build that owns it), admission_version
-- ARGV[1] version          integer >= 0, the version of <ns>:{adm}:version the table is from
-- ARGV[2] token            the caller's id for this one build: 1-64 of [A-Za-z0-9_.-]
-- ARGV[3] lease_ms         integer 1..600000: the build stays the caller's this long after
--                          each of its calls
-- ARGV[4] first            '1' for a table's first chunk (starts the build), else '0'
-- ARGV[5..] field, value   at most 1000 pairs of the shard's table: 'cap:<scope>' -> this
--                          shard's share of the cap (integer >= 1), 'rate:<phase>:<scope>'
--                          -> '1', 'provider:<handler>' -> the handler's provider
--
-- Returns {state}: 1 the chunk is staged; 0 the shard already has this version or a newer
-- one (nothing written: stop); -1 nothing written, because another build owns the shard
-- (first chunk: try again later) or this build lost it (later chunks: its lease ran out).
-- Invariants: only the owner of admission_sync writes admission_next, and a first chunk
-- empties it, so a build never mixes with another's; both keys expire lease_ms after the
-- owner's last call, so the half-built table of a daemon that died goes away by itself.

--- @include _int_arg
--- @include _roles

daemon_only()
local version = int_arg(ARGV[1], 'version', 0)
local token = ARGV[2]
if #token < 1 or #token > 64 or string.find(token, '[^%w_.-]') then
  error('asynctaskd: ARGV token must be 1-64 of [A-Za-z0-9_.-], got ' .. tostring(token))
end
local lease_ms = int_arg(ARGV[3], 'lease_ms', 1, 600000)
local first = ARGV[4]
if first ~= '1' and first ~= '0' then
  error("asynctaskd: ARGV first must be '1' or '0', got " .. tostring(first))
end
if #ARGV % 2 ~= 0 then error('asynctaskd: stage_limits takes field, value pairs after ARGV[4]') end
if #ARGV > 4 + 2000 then error('asynctaskd: stage_limits takes at most 1000 pairs per call') end
for i = 5, #ARGV, 2 do
  local kind = string.match(ARGV[i], '^(%a+):.')
  local value = ARGV[i + 1]
  local ok = (kind == 'cap' and string.find(value, '^[1-9]%d*$') and #value <= 15)
             or (kind == 'rate' and value == '1')
             or (kind == 'provider' and value ~= '')
  if not ok then
    error('asynctaskd: ARGV pair ' .. tostring(ARGV[i]) .. ' = ' .. tostring(value)
          .. ' is not a shard table entry')
  end
end

local next_, owner = P .. 'admission_next', P .. 'admission_sync'
local holder = redis.call('GET', owner)
if first == '1' then
  local stored = tonumber(redis.call('GET', P .. 'admission_version')) or -1
  if version <= stored then return {0} end
  if holder then return {-1} end
  redis.call('DEL', next_)
  redis.call('SET', owner, token, 'PX', lease_ms)
elseif holder ~= token then
  return {-1}
else
  redis.call('PEXPIRE', owner, lease_ms)
end
-- 1000 pairs unpack to 2000 values, well inside what Lua's C stack allows (~8000).
if #ARGV > 4 then
  redis.call('HSET', next_, unpack(ARGV, 5))
  redis.call('PEXPIRE', next_, lease_ms)
end
return {1}
