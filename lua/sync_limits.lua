-- sync_limits: give one shard its copy of the admission limits and lift holds that no
-- longer apply.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix; the script uses, under it:
--                          admission (HASH), admission_version (STRING), capholds, lanes,
--                          held:<dim>, inflight:<scope>, ready:<phase>, task:<id>
-- ARGV[1] version          integer >= 0, the version of <ns>:{adm}:version the table is from
-- ARGV[2] limit            how many held tasks to move back at most, integer 1..10000
-- ARGV[3..] field, value   the shard's whole admission table: 'cap:<scope>' -> this shard's
--                          share of the cap, 'rate:<phase>:<scope>' -> '1'
--
-- Returns {applied, moved, remaining}: applied 1 when the table was replaced (the version
-- is newer than the shard's), else 0 and ARGV[3..] is ignored; moved how many held tasks
-- went back to wait where they belong now; remaining how many still wait in holds that no
-- longer apply (call again while it is > 0).
-- Lifted: a rate lane no longer limited (all its tasks), a cap no longer configured (all),
-- and a cap with room (as many as it has room for: later room comes with each release).
-- Cap holds are sampled, at most 100 per call, so the work stays bounded with any number
-- of tenants; daemons call this every few seconds, so every hold is looked at in time.

daemon_only()
local version = int_arg(ARGV[1], 'version', 0)
local limit = int_arg(ARGV[2], 'limit', 1, 10000)
if #ARGV % 2 ~= 0 then error('asynctaskd: sync_limits takes field, value pairs after ARGV[2]') end

local applied = 0
local stored = tonumber(redis.call('GET', P .. 'admission_version')) or -1
if version > stored then
  redis.call('DEL', P .. 'admission')
  if #ARGV > 2 then redis.call('HSET', P .. 'admission', unpack(ARGV, 3)) end
  redis.call('SET', P .. 'admission_version', version)
  applied = 1
end

local table_ = {}
local flat = redis.call('HGETALL', P .. 'admission')
for i = 1, #flat, 2 do table_[flat[i]] = flat[i + 1] end

local moved, remaining = 0, 0
for _, lane in ipairs(redis.call('SMEMBERS', P .. 'lanes')) do
  local phase, provider, account = string.match(lane, '^(%a+)|([^|]+)|([^|]*)$')
  local dim = 'rate:' .. lane
  if not phase then
    redis.call('SREM', P .. 'lanes', lane)
  elseif not table_['rate:' .. phase .. ':provider:' .. provider]
         and not table_['rate:' .. phase .. ':account:' .. provider .. '/' .. account] then
    moved = moved + unhold(dim, phase, limit - moved)
    remaining = remaining + redis.call('ZCARD', P .. 'held:' .. dim)
  end
  if redis.call('ZCARD', P .. 'held:' .. dim) == 0 then redis.call('SREM', P .. 'lanes', lane) end
end
for _, dim in ipairs(redis.call('SRANDMEMBER', P .. 'capholds', 100)) do
  local scope = string.sub(dim, 5)
  local cap = tonumber(table_[dim])
  if not cap and string.find(scope, '^tenant:') then cap = tonumber(table_['cap:tenant:*']) end
  local room = limit - moved
  if cap then
    room = math.min(room, cap - redis.call('SCARD', P .. 'inflight:' .. scope))
  end
  if room > 0 then moved = moved + unhold(dim, 'submit', room) end
  local left = redis.call('ZCARD', P .. 'held:' .. dim)
  if left == 0 then
    redis.call('SREM', P .. 'capholds', dim)
  elseif not cap then
    remaining = remaining + left
  end
end
return {applied, moved, remaining}
