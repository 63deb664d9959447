-- take: take tokens from the admission token buckets, or give unused ones back.
--
-- KEYS[1] prefix   string  <ns>:{adm}:  admission prefix; the script uses, under it:
--                          rates (HASH bucket name -> '<tokens per second> <burst>')
--                          bucket:<name> (HASH tokens, ms: one bucket's state)
-- ARGV[1] mode             'take' or 'refund'
-- ARGV[2..] lane, count    count integer 0..100000. A lane names its buckets:
--                          '<phase>|<provider>|<account>' -> '<phase>:provider:<provider>'
--                          and, when account is not empty, '<phase>:account:<provider>/<account>';
--                          'quota|<tenant>' -> 'quota:tenant:<tenant>', whose rate falls
--                          back to that of 'quota:tenant:*' (the default for every tenant)
--
-- Returns {granted, wait_ms, granted, wait_ms, ...}, one pair per lane, in order:
--   take:   granted = the most tokens, up to count, that every bucket of the lane can give
--           now (each bucket loses exactly that many); wait_ms = how long until the next
--           token when granted < count, else 0.
--   refund: granted = count, given back to every bucket of the lane (never above burst).
-- A bucket with no rate configured does not limit; a lane with none grants count.
-- Raises before anything is written on a malformed pair or a rates entry that is not
-- '<rate> <burst>' (rate > 0, burst >= 1) for any lane of the call.
-- Invariants: time is the server's; a bucket never holds more than its burst or fewer
-- than 0 tokens; a bucket's state expires once it would be full again, so idle tenants
-- leave no keys behind. Several daemons share the buckets; a worker takes for a batch,
-- claims, and refunds what the claim did not use (the claim lives in another slot).

--- @include _int_arg
--- @include _roles

daemon_only()
local mode = ARGV[1]
if mode ~= 'take' and mode ~= 'refund' then
  error("asynctaskd: ARGV mode must be 'take' or 'refund', got " .. tostring(mode))
end
if #ARGV % 2 ~= 1 then error('asynctaskd: take takes lane, count pairs after ARGV[1]') end

local function buckets_of(lane)
  local phase, provider, account = string.match(lane, '^(%a+)|([^|]+)|([^|]*)$')
  if phase == 'submit' or phase == 'query' then
    local b = {{phase .. ':provider:' .. provider}}
    if account ~= '' then b[2] = {phase .. ':account:' .. provider .. '/' .. account} end
    return b
  end
  local tenant = string.match(lane, '^quota|([^|]+)$')
  if tenant then return {{'quota:tenant:' .. tenant, 'quota:tenant:*'}} end
  error('asynctaskd: ARGV lane must look like submit|<provider>|<account> or '
        .. 'quota|<tenant>, got ' .. tostring(lane))
end

-- Load a bucket: {name, rate per ms, burst, tokens now} or nil when it has no rate.
local function load(names)
  local conf = redis.call('HMGET', P .. 'rates', unpack(names))
  local spec = conf[1] or conf[2]
  if not spec then return nil end
  local rate, burst = string.match(spec, '^(%S+) (%S+)$')
  rate, burst = tonumber(rate), tonumber(burst)
  if not rate or rate <= 0 or not burst or burst < 1 then
    error('asynctaskd: rates entry for ' .. names[1] .. ' is not "<rate> <burst>": ' .. spec)
  end
  local state = redis.call('HMGET', P .. 'bucket:' .. names[1], 'tokens', 'ms')
  local tokens, ms = tonumber(state[1]), tonumber(state[2])
  if not tokens or not ms then
    tokens = burst
  else
    tokens = math.min(burst, tokens + math.max(0, NOW - ms) * rate / 1000)
  end
  return {names[1], rate / 1000, burst, math.max(0, tokens)}
end

local function store(b)
  local bk = P .. 'bucket:' .. b[1]
  redis.call('HSET', bk, 'tokens', string.format('%.6f', b[4]), 'ms', NOW)
  redis.call('PEXPIRE', bk, math.ceil((b[3] - b[4]) / b[2]) + 1000)
end

-- Check every pair, and load (and so check) every bucket's rates entry, before writing
-- anything: a malformed call or a bad rates entry changes no bucket. Lanes that share a
-- bucket share its loaded state, so a later lane sees what an earlier one took.
local counts, lanes = {}, {}
for i = 2, #ARGV, 2 do
  counts[#counts + 1] = int_arg(ARGV[i + 1], 'count', 0, 100000)
  lanes[#lanes + 1] = buckets_of(ARGV[i])
end
local loaded, per_lane = {}, {}
for j = 1, #lanes do
  local bs = {}
  for _, names in ipairs(lanes[j]) do
    local b = loaded[names[1]]
    if b == nil then
      b = load(names) or false
      loaded[names[1]] = b
    end
    if b then bs[#bs + 1] = b end
  end
  per_lane[j] = bs
end

local out = {}
for j = 1, #lanes do
  local count = counts[j]
  local bs = per_lane[j]
  local granted, wait_ms = count, 0
  if mode == 'take' then
    for _, b in ipairs(bs) do granted = math.min(granted, math.floor(b[4])) end
    for _, b in ipairs(bs) do
      b[4] = b[4] - granted
      if granted < count and b[4] < 1 then
        wait_ms = math.max(wait_ms, math.ceil((1 - b[4]) / b[2]))
      end
      store(b)
    end
  else
    for _, b in ipairs(bs) do
      b[4] = math.min(b[3], b[4] + count)
      store(b)
    end
  end
  out[#out + 1] = granted
  out[#out + 1] = wait_ms
end
return out
