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

-- script: quota
-- quota: count one submit against its tenant's quota, or refuse it.
--
-- KEYS[1] prefix   string  <ns>:{adm}:  admission prefix; the script uses, under it:
--                          rates (HASH: 'quota:tenant:<t>' -> '<rate> <burst>', the quota
--                          as the limits script stores it: burst = quota, rate = quota per
--                          period; 'quota:tenant:*' applies to every tenant without one),
--                          quota:<period_ms>:<tenant>:<window> (a counter per window),
--                          quota_windows (SET of the counters' names after 'quota:')
-- ARGV[1] tenant           the tenant's name
--
-- Returns {1, 0} counted, {0, wait_ms} refused (the tenant is at its quota; wait_ms is how
-- long until one more submit fits), or {2, 0} when no quota applies to the tenant.
-- A quota of q per period p is a sliding-window count: windows of length p from the epoch,
-- in server time; the submits of the last p are estimated as the current window's count
-- plus the previous window's count times the share of it still within the last p. A
-- submit is counted when that estimate plus one is at most q.
-- Invariants: writes only INCR and SADD, so a producer (whose ACL user has no other write)
-- can make a count larger, never smaller; daemons delete counters of windows that have
-- ended (asynctaskd.admission). Nothing is written for a refused submit.

local tenant = ARGV[1]
if type(tenant) ~= 'string' or not string.find(tenant, '^[%w_.:%-]+$') or #tenant > 64 then
  error('asynctaskd: ARGV tenant must be a tenant name, got ' .. tostring(tenant))
end
local conf = redis.call('HMGET', P .. 'rates', 'quota:tenant:' .. tenant, 'quota:tenant:*')
local spec = conf[1] or conf[2]
if not spec then return {2, 0} end
local rate, quota = string.match(spec, '^(%S+) (%S+)$')
rate, quota = tonumber(rate), tonumber(quota)
if not rate or rate <= 0 or not quota or quota < 1 then
  error('asynctaskd: rates entry for the quota of ' .. tenant .. ' is not "<rate> <burst>": '
        .. tostring(spec))
end
local period = math.floor(quota / rate * 1000 + 0.5)
if period < 1 then period = 1 end
local window = math.floor(NOW / period)
local name = int_s(period) .. ':' .. tenant .. ':'
local counts = redis.call('MGET', P .. 'quota:' .. name .. int_s(window),
                          P .. 'quota:' .. name .. int_s(window - 1))
local current, previous = tonumber(counts[1]) or 0, tonumber(counts[2]) or 0
local into = (NOW - window * period) / period  -- share of the current window gone by
if previous * (1 - into) + current + 1 <= quota then
  if redis.call('INCR', P .. 'quota:' .. name .. int_s(window)) == 1 then
    redis.call('SADD', P .. 'quota_windows', name .. int_s(window))
  end
  return {1, 0}
end
-- Refused: when will one more fit? Within this window if the previous one's share can
-- fall far enough, else in the next one, where this window is the previous.
local need
if current + 1 <= quota and previous > 0 then
  need = (1 - (quota - current - 1) / previous - into) * period
else
  need = (1 - into) * period
  if current > 0 then need = need + math.max(0, 1 - (quota - 1) / current) * period end
end
return {0, math.max(1, math.ceil(need))}
