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
