-- sync_limits: swap a shard's staged admission table in whole, and lift holds that no
-- longer apply.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix; the script uses, under it:
--                          admission (HASH), admission_version (STRING), admission_next and
--                          admission_sync (the build, stage_limits), capholds, lanes,
--                          held:<dim>, inflight:<scope>, ready:<phase>, task:<id>
-- ARGV[1] version          integer >= 0, the version of <ns>:{adm}:version the staged table
--                          is from
-- ARGV[2] limit            how many held tasks to move back at most, integer 1..10000
-- ARGV[3] token            '' to only lift holds, else the token the table was staged with
-- ARGV[4] size             integer >= 0: how many fields the staged table has (0 with '')
--
-- Returns {applied, moved, remaining}: applied 1 when the staged table replaced the shard's
-- (the version is newer than the shard's); 0 when nothing was replaced (token '', or the
-- shard already has this version or a newer one); -1 when the version is newer but the
-- staged table is not whole (the build is not this token's any more, or it does not have
-- exactly size fields): the shard keeps its table.
-- moved how many held tasks went back to wait where they belong now; remaining how many
-- still wait in holds that no longer apply (call again, with token '', while it is > 0).
-- Lifted: a rate lane no longer limited (all its tasks), a cap no longer configured (all),
-- and a cap with room (as many as it has room for: later room comes with each release).
-- Cap holds are sampled, at most 100 per call, so the work stays bounded with any number
-- of tenants; daemons call this every few seconds, so every hold is looked at in time.
-- Invariants: admission is replaced whole, by a RENAME of the complete staged table (a DEL
-- for an empty one), or not at all, so a claim never finds a shard without its limits; the
-- caller's build is gone after the call, whatever it answers; another build is left alone.

--- @include _int_arg
--- @include _roles
--- @include _schedule

daemon_only()
local version = int_arg(ARGV[1], 'version', 0)
local limit = int_arg(ARGV[2], 'limit', 1, 10000)
local token = ARGV[3]
if #token > 64 or string.find(token, '[^%w_.-]') then
  error('asynctaskd: ARGV token must be empty or 1-64 of [A-Za-z0-9_.-], got '
        .. tostring(token))
end
local size = int_arg(ARGV[4], 'size', 0)

local applied = 0
if token ~= '' then
  local next_, owner = P .. 'admission_next', P .. 'admission_sync'
  local ours = redis.call('GET', owner) == token
  local stored = tonumber(redis.call('GET', P .. 'admission_version')) or -1
  if version <= stored then
    applied = 0
  elseif not ours then
    applied = -1
  elseif size == 0 then  -- an empty table: nothing was staged (no HLEN, no RENAME needed)
    applied = redis.call('EXISTS', next_) == 0 and 1 or -1
    if applied == 1 then redis.call('DEL', P .. 'admission') end
  elseif redis.call('HLEN', next_) ~= size then
    applied = -1
  else
    redis.call('RENAME', next_, P .. 'admission')
    redis.call('PERSIST', P .. 'admission')  -- the staged table expires; the copy must not
    applied = 1
  end
  if applied == 1 then redis.call('SET', P .. 'admission_version', version) end
  if ours then redis.call('DEL', next_, owner) end
end

-- Look up only what the holds need: the table may have any number of entries.
local function entry(field) return redis.call('HGET', P .. 'admission', field) end

local moved, remaining = 0, 0
for _, lane in ipairs(redis.call('SMEMBERS', P .. 'lanes')) do
  local phase, provider, account = string.match(lane, '^(%a+)|([^|]+)|([^|]*)$')
  local dim = 'rate:' .. lane
  if not phase then
    redis.call('SREM', P .. 'lanes', lane)
  elseif not entry('rate:' .. phase .. ':provider:' .. provider)
         and not entry('rate:' .. phase .. ':account:' .. provider .. '/' .. account) then
    moved = moved + unhold(dim, phase, limit - moved)
    remaining = remaining + redis.call('ZCARD', P .. 'held:' .. dim)
  end
  if redis.call('ZCARD', P .. 'held:' .. dim) == 0 then redis.call('SREM', P .. 'lanes', lane) end
end
for _, dim in ipairs(redis.call('SRANDMEMBER', P .. 'capholds', 100)) do
  local scope = string.sub(dim, 5)
  local cap = tonumber(entry(dim))
  if not cap and string.find(scope, '^tenant:') then cap = tonumber(entry('cap:tenant:*')) end
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
