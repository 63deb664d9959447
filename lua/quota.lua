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
