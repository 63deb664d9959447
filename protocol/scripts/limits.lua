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

-- script: limits
-- limits: change the stored admission limits, a bounded chunk per call, and keep the
-- token-bucket table in step.
--
-- KEYS[1] prefix   string  <ns>:{adm}:  admission prefix; the script uses, under it:
--                          limits (HASH scope -> JSON), rates (HASH bucket -> '<rate> <burst>'),
--                          version (STRING, bumped on every change)
-- ARGV[1] mode             'set', 'config' or 'prune'
-- ARGV[2..] scope, json    at most 1000 pairs. scope is 'provider:<p>', 'account:<p>/<a>',
--                          'tenant:<t>', 'tenant:*' or 'handler:<key>'; json is the limit as
--                          asynctaskd.admission writes it: an object with "source" ('runtime',
--                          'config' or 'handler') and "buckets" (bucket name -> '<rate>
--                          <burst>', each name '<submit|query|quota>:<scope>'), or '' to delete
--   set:    write (or delete) each listed scope (operators only).
--   config: (daemons and operators) write each listed scope of a config file, except where a 'runtime' entry holds
--           it (set at runtime, it wins until cleared); deletes nothing (json '' is an error).
--   prune:  (daemons and operators) delete each listed scope whose stored entry's source is 'config' (its config
--           file no longer lists it); json must be ''.
-- A config file's whole [[limits]] list goes as 'config' calls, then 'prune' calls for the
-- stored config entries it no longer lists: a limit both lists keep is never missing.
--
-- Returns {version, changed, kept, ...}: the version after the call, how many scopes
-- changed, and the scopes a runtime entry kept (mode config).
-- Every pair, and the version key (INCRed last), are checked before anything is written.
-- Invariants: rates holds the buckets of every stored entry: a change of a scope replaces
-- that scope's buckets in the same call, so the buckets the take script reads match the
-- stored limits; version moves only when something changed; a call's work is bounded by
-- its own pairs, whatever the number of stored limits.

--- @include _int_field
--- @include _roles

local mode = ARGV[1]
if mode ~= 'set' and mode ~= 'config' and mode ~= 'prune' then
  error("asynctaskd: ARGV mode must be 'set', 'config' or 'prune', got " .. tostring(mode))
end
-- runtime limits are an operator's; a daemon writes those of its config file
if mode == 'set' then operator_only() else daemon_only() end
if #ARGV % 2 ~= 1 then error('asynctaskd: limits takes scope, json pairs after ARGV[1]') end
if #ARGV > 1 + 2000 then error('asynctaskd: limits takes at most 1000 pairs per call') end
local limits, rates = P .. 'limits', P .. 'rates'
local PHASES = {submit = true, query = true, quota = true}

local function source_of(json)
  local ok, v = pcall(cjson.decode, json)
  if ok and type(v) == 'table' then return v.source end
  return nil
end

-- Check every pair before writing anything: a malformed call changes nothing.
local decoded = {}
for i = 2, #ARGV, 2 do
  local scope, json = ARGV[i], ARGV[i + 1]
  if not string.find(scope, '^%a+:.+') then
    error('asynctaskd: ARGV scope must look like tenant:<name>, got ' .. tostring(scope))
  end
  if json == '' then
    if mode == 'config' then error('asynctaskd: mode config cannot delete ' .. scope) end
  else
    if mode == 'prune' then error('asynctaskd: mode prune only deletes; json for ' .. scope) end
    local ok, v = pcall(cjson.decode, json)
    if not ok or type(v) ~= 'table' or type(v.buckets) ~= 'table' then
      error('asynctaskd: ARGV json for ' .. scope .. ' is not a limit object')
    end
    for name, spec in pairs(v.buckets) do
      local phase = type(name) == 'string' and string.match(name, '^(%a+):')
      if not (phase and PHASES[phase] and string.sub(name, #phase + 2) == scope)
         or type(spec) ~= 'string' then
        error('asynctaskd: ARGV json for ' .. scope .. ' names bucket ' .. tostring(name)
              .. ', not <submit|query|quota>:' .. scope)
      end
    end
    decoded[i] = v
  end
end

-- A scope's buckets are named after it, so replacing them touches no other scope's.
local function replace(scope, json, v)
  redis.call('HDEL', rates, 'submit:' .. scope, 'query:' .. scope, 'quota:' .. scope)
  if json == '' then
    redis.call('HDEL', limits, scope)
    return
  end
  redis.call('HSET', limits, scope, json)
  for name, spec in pairs(v.buckets) do redis.call('HSET', rates, name, spec) end
end

-- The version is INCRed after the writes below: one INCR refuses must fail here.
local version = redis.call('GET', P .. 'version')
if version and not int_field(version) then
  error('asynctaskd: ' .. P .. 'version is not an integer: ' .. version)
end
version = tonumber(version) or 0

local changed, kept = 0, {}
for i = 2, #ARGV, 2 do
  local scope, json = ARGV[i], ARGV[i + 1]
  local old = redis.call('HGET', limits, scope)
  if mode == 'config' and old and source_of(old) == 'runtime' then
    kept[#kept + 1] = scope
  elseif mode == 'prune' then
    if old and source_of(old) == 'config' then
      replace(scope, '', nil)
      changed = changed + 1
    end
  elseif old ~= (json ~= '' and json or false) then
    replace(scope, json, decoded[i])
    changed = changed + 1
  end
end

if changed > 0 then version = redis.call('INCR', P .. 'version') end
local out = {version, changed}
for _, s in ipairs(kept) do out[#out + 1] = s end
return out
