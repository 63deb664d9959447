-- renew: extend many leases of one worker in one call.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix (leases, task:<id>)
-- ARGV[1] lease_ms         new lease length from server now, integer > 0
-- ARGV[2..] task_id, fence pairs
--
-- Returns {code, code, ...}, one per pair, in order: 1 renewed, or
--   -1 NOT_FOUND  -2 STALE_FENCE  -4 NO_LEASE
-- Invariants: only a holder whose fence is current can extend a lease; renewing writes
-- only the lease index, never the task hash, so it does not change the task's version.
-- A lease that expired but was not reaped yet is still the holder's: nobody else can
-- have claimed the task without changing its fence.

--- @include _int_arg
--- @include _roles

daemon_only()
local lease_ms = int_arg(ARGV[1], 'lease_ms', 1)
if #ARGV % 2 ~= 1 then error('asynctaskd: renew takes task_id, fence pairs after ARGV[1]') end
local leases = P .. 'leases'
local out = {}
for i = 2, #ARGV, 2 do
  local id = ARGV[i]
  local fence = redis.call('HGET', task_key(id), 'fence')
  if not fence then
    out[#out + 1] = -1
  elseif fence ~= ARGV[i + 1] then
    out[#out + 1] = -2
  elseif not redis.call('ZSCORE', leases, id) then
    out[#out + 1] = -4
  else
    redis.call('ZADD', leases, 'XX', NOW + lease_ms, id)
    out[#out + 1] = 1
  end
end
return out
