-- limits: change the stored admission limits and rebuild the token-bucket table.
--
-- KEYS[1] prefix   string  <ns>:{adm}:  admission prefix; the script uses, under it:
--                          limits (HASH scope -> JSON), rates (HASH bucket -> '<rate> <burst>'),
--                          version (STRING, bumped on every change)
-- ARGV[1] mode             'set' or 'config'
-- ARGV[2..] scope, json    scope is 'provider:<p>', 'account:<p>/<a>', 'tenant:<t>' or
--                          'tenant:*'; json is the limit as asynctaskd.admission writes it:
--                          an object with "source" ('runtime' or 'config') and "buckets"
--                          (bucket name -> '<rate> <burst>'), or '' to delete (mode set)
--   set:    write (or delete) each listed scope (operators only).
--   config: (daemons and operators) the whole [[limits]] list of a config file: every stored entry whose source is
--           'config' and that is not listed is deleted; listed scopes are written, except
--           where a 'runtime' entry holds the scope (set at runtime, it wins until cleared).
--
-- Returns {version, changed, kept, ...}: the version after the call, how many scopes
-- changed, and the scopes a runtime entry kept.
-- Invariants: rates is always rebuilt from limits in the same call, so the buckets the
-- take script reads match the stored limits; version moves only when something changed.

local mode = ARGV[1]
if mode ~= 'set' and mode ~= 'config' then
  error("asynctaskd: ARGV mode must be 'set' or 'config', got " .. tostring(mode))
end
-- runtime limits are an operator's; a daemon writes those of its config file
if mode == 'set' then operator_only() else daemon_only() end
if #ARGV % 2 ~= 1 then error('asynctaskd: limits takes scope, json pairs after ARGV[1]') end
local limits = P .. 'limits'

local function source_of(json)
  local ok, v = pcall(cjson.decode, json)
  if ok and type(v) == 'table' then return v.source end
  return nil
end

-- Check every pair before writing anything: a malformed call changes nothing.
for i = 2, #ARGV, 2 do
  local scope, json = ARGV[i], ARGV[i + 1]
  if not string.find(scope, '^%a+:.+') then
    error('asynctaskd: ARGV scope must look like tenant:<name>, got ' .. tostring(scope))
  end
  if json == '' then
    if mode == 'config' then error('asynctaskd: mode config cannot delete ' .. scope) end
  else
    local ok, v = pcall(cjson.decode, json)
    if not ok or type(v) ~= 'table' or type(v.buckets) ~= 'table' then
      error('asynctaskd: ARGV json for ' .. scope .. ' is not a limit object')
    end
  end
end

local listed, changed, kept = {}, 0, {}
for i = 2, #ARGV, 2 do
  local scope, json = ARGV[i], ARGV[i + 1]
  listed[scope] = true
  local old = redis.call('HGET', limits, scope)
  if mode == 'config' and old and source_of(old) == 'runtime' then
    kept[#kept + 1] = scope
  elseif json == '' then
    changed = changed + redis.call('HDEL', limits, scope)
  elseif old ~= json then
    redis.call('HSET', limits, scope, json)
    changed = changed + 1
  end
end
if mode == 'config' then
  local all = redis.call('HGETALL', limits)
  for i = 1, #all, 2 do
    if not listed[all[i]] and source_of(all[i + 1]) == 'config' then
      redis.call('HDEL', limits, all[i])
      changed = changed + 1
    end
  end
end

local version = tonumber(redis.call('GET', P .. 'version')) or 0
if changed > 0 then
  redis.call('DEL', P .. 'rates')
  local all = redis.call('HGETALL', limits)
  for i = 2, #all, 2 do
    local ok, v = pcall(cjson.decode, all[i])
    if ok and type(v) == 'table' and type(v.buckets) == 'table' then
      for name, spec in pairs(v.buckets) do redis.call('HSET', P .. 'rates', name, spec) end
    end
  end
  version = redis.call('INCR', P .. 'version')
end
local out = {version, changed}
for _, s in ipairs(kept) do out[#out + 1] = s end
return out
