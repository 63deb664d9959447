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
