-- release: give leases back without an outcome (drain, or claimed but not started).
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix
-- ARGV[1..] task_id, fence, version triples
--
-- Returns {code, code, ...}, one per triple, in order: 1 released (due at once), or
--   -1 NOT_FOUND  -2 STALE_FENCE  -3 WRONG_VERSION  -4 NO_LEASE
--   -8 STARTED    the submit call was marked started: only an outcome may be saved
-- Invariants: a released SUBMITTING task whose call never started goes back to
-- PENDING_SUBMIT; SUBMITTED/RUNNING stay and become due at once; the fence is kept, so
-- the next claim makes this holder stale. A rejected release writes nothing.

if #ARGV % 3 ~= 0 then error('asynctaskd: release takes task_id, fence, version triples') end
local leases = P .. 'leases'
local out = {}
local any = false
for i = 1, #ARGV, 3 do
  local id = ARGV[i]
  local tk = task_key(id)
  local t = redis.call('HMGET', tk, 'status', 'fence', 'version', 'cancel_version',
                       'started_fence', 'handler', 'priority')
  if not t[1] then
    out[#out + 1] = -1
  elseif t[2] ~= ARGV[i + 1] then
    out[#out + 1] = -2
  elseif not redis.call('ZSCORE', leases, id) then
    out[#out + 1] = -4
  elseif not version_holds(t[3], t[4], ARGV[i + 2]) then
    out[#out + 1] = -3
  elseif t[1] == 'SUBMITTING' and t[5] == t[2] then
    out[#out + 1] = -8
  elseif not PHASE[t[1]] then
    out[#out + 1] = -7
  else
    local v = bump(tk)
    redis.call('ZREM', leases, id)
    redis.call('HDEL', tk, 'owner')
    local status = t[1]
    if status == 'SUBMITTING' then
      status = 'PENDING_SUBMIT'
      move_status(tk, id, 'SUBMITTING', status, t[6])
      emit(id, status, v)
    end
    redis.call('HSET', tk, 'due_ms', schedule(id, PHASE[status], NOW, tonumber(t[7]) or 0))
    out[#out + 1] = 1
    any = true
  end
end
if any then wake() end
return out
