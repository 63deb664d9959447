-- claim: lease up to n due tasks of one phase to a worker, each with a new fence.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix; the script uses, under it:
--                          due:<phase> ready:<phase> leases deadlines counts idx:<status>
--                          events quarantine settings task:<id>
-- ARGV[1] phase            'submit' or 'query'
-- ARGV[2] n                how many tasks at most, integer 0..1000 (0: only report due times)
-- ARGV[3] lease_ms         lease length, integer > 0
-- ARGV[4] owner            worker id, recorded in the task
-- ARGV[5] promote_limit    how many newly due tasks to move into the ready set at most
--
-- Also reads <prefix>paused (HASH of 'handler:<k>', 'provider:<p>', 'tenant:<t>',
-- 'account:<a>') and writes <prefix>held:<dim> (ZSET, ready score) for paused tasks.
--
-- Returns {next_due_ms, ready_left, dropped, task, task, ...} where each task is
--   {task_id, fence, version, {field, value, ...}}  (the whole hash after the claim)
-- next_due_ms is the earliest due time still waiting in this phase (0 if none), ready_left
-- how many due tasks are still ready, dropped how many entries were not claimable
-- (gone, timed out, canceled, held back by a pause, or quarantined because unreadable:
-- not a hash, unknown status, missing deadline or handler, non-integer version or fence).
-- Invariants: a task is claimed only if its status belongs to the phase, it is not
-- leased, and its deadline has not passed; a past deadline times the task out here
-- instead (no vendor call after the deadline); a canceled PENDING_SUBMIT task becomes
-- CANCELED here; every claim increments the fence, so older holders become stale.

local phase = ARGV[1]
if phase ~= 'submit' and phase ~= 'query' then
  error("asynctaskd: ARGV phase must be 'submit' or 'query', got " .. tostring(phase))
end
local n = int_arg(ARGV[2], 'n', 0, 1000)
local lease_ms = int_arg(ARGV[3], 'lease_ms', 1)
local owner = ARGV[4]
local promote_limit = int_arg(ARGV[5], 'promote_limit', 0, 100000)
local due_key = P .. 'due:' .. phase
local ready_key = P .. 'ready:' .. phase
local leases = P .. 'leases'
local quarantine = P .. 'quarantine'

-- Promote newly due tasks, bounded, into the priority-ordered ready set.
if promote_limit > 0 then
  local due = redis.call('ZRANGEBYSCORE', due_key, '-inf', NOW, 'WITHSCORES', 'LIMIT', 0,
                         promote_limit)
  for i = 1, #due, 2 do
    local id = due[i]
    local pr = redis.pcall('HGET', task_key(id), 'priority')
    pr = type(pr) == 'string' and tonumber(pr) or 0
    if pr ~= pr or pr < -100 or pr > 100 then pr = 0 end  -- pr ~= pr: NaN
    redis.call('ZADD', ready_key, (100 - pr) * PRIO_SPAN + tonumber(due[i + 1]), id)
    redis.call('ZREM', due_key, id)
  end
end

local reply = {0, 0, 0}
local dropped = 0
-- Pauses hold back new vendor submits only. A paused task is set aside in the held set
-- of the first paused dimension it matches, keeping its ready score, so it neither
-- blocks the tasks behind it nor loses its place; resume puts it back. At most
-- `hold_budget` tasks are set aside per call: the work stays bounded.
local paused = nil
if phase == 'submit' and redis.call('EXISTS', P .. 'paused') == 1 then
  paused = redis.call('HGETALL', P .. 'paused')
end
local hold_budget = 1000
local function paused_dim(t)
  -- t: handler, provider, tenant, account
  local dims = {'handler:' .. t[1], 'provider:' .. (t[2] or t[1])}
  if t[3] then dims[#dims + 1] = 'tenant:' .. t[3] end
  if t[4] then dims[#dims + 1] = 'account:' .. t[4] end
  for _, d in ipairs(dims) do
    for i = 1, #paused, 2 do
      if paused[i] == d then return d end
    end
  end
  return nil
end
local want = (phase == 'submit') and {PENDING_SUBMIT = true} or {SUBMITTED = true, RUNNING = true}
local got = 0
while got < n do
  local popped = redis.call('ZPOPMIN', ready_key)
  if #popped == 0 then break end
  local id = popped[1]
  local held_dim = nil
  if paused and hold_budget > 0 then
    held_dim = paused_dim(redis.call('HMGET', task_key(id), 'handler', 'provider', 'tenant',
                                     'account'))
  end
  local tk = task_key(id)
  -- pcall: a key of another type (WRONGTYPE) must not abort the whole claim
  local t = redis.pcall('HMGET', tk, 'status', 'deadline_ms', 'cancel_requested', 'handler',
                        'version', 'fence')
  local corrupt = type(t) ~= 'table' or t.err ~= nil
  if corrupt then t = {} end
  local status, deadline_ms, handler = t[1], tonumber(t[2]), t[4]
  -- counters the script increments must be integers, or HINCRBY would fail half-way
  if not corrupt and status and (not int_field(t[5]) or not int_field(t[6])) then
    corrupt = true
  end
  if corrupt then
    redis.call('ZADD', quarantine, NOW, id)     -- unreadable: park it for an operator
    dropped = dropped + 1
  elseif not status then
    dropped = dropped + 1                       -- hash gone: nothing to do
  elseif not KNOWN[status] or not deadline_ms or not handler then
    redis.call('ZADD', quarantine, NOW, id)     -- unreadable: park it for an operator
    dropped = dropped + 1
  elseif not want[status] or redis.call('ZSCORE', leases, id) then
    dropped = dropped + 1                       -- index disagreed with the hash: the sweep repairs
  elseif deadline_ms <= NOW then
    local v = bump(tk)
    finish(tk, id, status, 'TRACKING_TIMED_OUT', handler)
    emit(id, 'TRACKING_TIMED_OUT', v)
    dropped = dropped + 1
  elseif phase == 'submit' and t[3] == '1' then
    local v = bump(tk)
    finish(tk, id, status, 'CANCELED', handler)
    emit(id, 'CANCELED', v)
    dropped = dropped + 1
  elseif held_dim then
    redis.call('ZADD', P .. 'held:' .. held_dim, popped[2], id)
    redis.call('HSET', tk, 'held', held_dim)
    hold_budget = hold_budget - 1
    dropped = dropped + 1
  elseif paused and hold_budget <= 0 then
    redis.call('ZADD', ready_key, popped[2], id)  -- budget spent: leave it for the next call
    break
  else
    local fence = redis.call('HINCRBY', tk, 'fence', 1)
    local v = bump(tk)
    redis.call('HSET', tk, 'owner', owner)
    if phase == 'submit' then
      move_status(tk, id, status, 'SUBMITTING', handler)
      redis.call('HDEL', tk, 'started_fence')
      emit(id, 'SUBMITTING', v)
    end
    redis.call('ZADD', leases, NOW + lease_ms, id)
    got = got + 1
    reply[#reply + 1] = {id, fence, v, redis.call('HGETALL', tk)}
  end
end

local first = redis.call('ZRANGE', due_key, 0, 0, 'WITHSCORES')
if #first > 0 then reply[1] = tonumber(first[2]) end
reply[2] = redis.call('ZCARD', ready_key)
reply[3] = dropped
return reply
