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

-- script: take
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
