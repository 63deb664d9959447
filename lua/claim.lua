-- claim: lease up to n due tasks of one phase to a worker, each with a new fence.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix; the script uses, under it:
--                          due:<phase> ready:<phase> held:<dim> lanes capholds inflight:<scope>
--                          admission paused leases deadlines counts idx:<status> events
--                          quarantine settings task:<id>
-- ARGV[1] phase            'submit' or 'query'
-- ARGV[2] n                how many tasks at most, integer 0..1000 (0: only report due times)
-- ARGV[3] lease_ms         lease length, integer > 0
-- ARGV[4] owner            worker id, recorded in the task, not empty
-- ARGV[5] promote_limit    how many newly due tasks to move into the ready set at most
-- ARGV[6..] lane, tokens   token grants the worker took with `take` for rate lanes of this
--                          phase ('<phase>|<provider>|<account>'), integer 0..100000 each
--
-- Returns {next_due_ms, ready_left, dropped, lanes, intake, task, task, ...} where
--   lanes is {lane, used, waiting, ...} for every rate lane of this phase that has tasks
--   waiting in this shard or was granted tokens (used: tokens spent; give back the rest),
--   intake is {taken, task_id, reason, ...}: how many producer requests the claim took in
--   (submit phase: up to 256, or up to n when it may take them straight (n >= 32, nothing
--   ready), before anything else, lua/_intake.lua) and the creates it
--   dropped because they were not what the create script writes,
--   and each task is {task_id, fence, version, {field, value, ...}} (the hash after the claim,
--   without params in the query phase).
-- next_due_ms is the earliest due time still waiting in this phase (0 if none), ready_left
-- how many due tasks (and, submit phase, requests not yet taken in) are still waiting to
-- be claimed, dropped how many entries were not claimable
-- (gone, timed out, canceled, set aside by admission, or quarantined because unreadable:
-- not a hash, unknown status, missing deadline or handler, a counter HINCRBY refuses).
-- Admission (_schedule): a task held back by a pause or a full cap moves to that held set;
-- a task in a rate lane is claimed only against a grant, else it waits in its lane. Grants
-- are served first, from the lanes' held sets in ready order. At most 1000 tasks are set
-- aside per call, so the work is bounded and a blocked group never stalls the others.
-- Bad ARGV or settings raise before anything is written (the intake too); a task it
-- cannot read is quarantined, never a reason to raise.
-- Invariants: a task is claimed only if its status belongs to the phase, it is not
-- leased, and its deadline has not passed; a past deadline times the task out here
-- instead (no vendor call after the deadline); a canceled PENDING_SUBMIT task becomes
-- CANCELED here; every claim increments the fence, so older holders become stale; a
-- submit claim adds the task to the in-flight set of every cap it falls under (listed in
-- its `slots` field), and a rate-lane claim spends exactly one granted token.

--- @include _emit
--- @include _int_arg
--- @include _int_field
--- @include _intake
--- @include _move
--- @include _roles
--- @include _schedule
--- @include _settings
--- @include _statuses

daemon_only()
admission_helpers()
local phase = ARGV[1]
if phase ~= 'submit' and phase ~= 'query' then
  error("asynctaskd: ARGV phase must be 'submit' or 'query', got " .. tostring(phase))
end
local n = int_arg(ARGV[2], 'n', 0, 1000)
local lease_ms = int_arg(ARGV[3], 'lease_ms', 1)
local owner = ARGV[4]
if owner == '' then error('asynctaskd: ARGV owner must not be empty') end
local promote_limit = int_arg(ARGV[5], 'promote_limit', 0, 100000)
if #ARGV % 2 ~= 1 then error('asynctaskd: claim takes lane, tokens pairs after ARGV[5]') end
local grants, granted = {}, {}
for i = 6, #ARGV, 2 do
  local lane = ARGV[i]
  if string.sub(lane, 1, #phase + 1) ~= phase .. '|' then
    error('asynctaskd: ARGV lane must start with ' .. phase .. '|, got ' .. tostring(lane))
  end
  grants[lane] = (grants[lane] or 0) + int_arg(ARGV[i + 1], 'tokens', 0, 100000)
  granted[#granted + 1] = lane
end
settings()  -- the last check: nothing is written before this line
local used = {}
local due_key = P .. 'due:' .. phase
local ready_key = P .. 'ready:' .. phase
local leases = P .. 'leases'
local quarantine = P .. 'quarantine'

-- Producers' requests first, so that a task created just now can be claimed by this call.
local reply = {0, 0, 0, {}, {0}}
local fresh = nil
if phase == 'submit' then
  -- Without limits, pauses or grants (tasks waiting in rate lanes go first, as in the long
  -- way), and with nothing ready, up to n new tasks due now may be claimed straight from
  -- their requests (_intake). A backlog (something ready) is taken in the long way only:
  -- the claim could not take the new tasks anyway.
  local most = 0
  if n > 0 and #granted == 0 and not admission_on() and not paused_on()
     and redis.call('ZCARD', ready_key) == 0 then
    most = n
  end
  -- A claim with room for FRESH_ROOM tasks or more takes in only as many requests as it
  -- can take: all of them go straight, and the next claim finds the ready set empty again,
  -- so a backlog of requests is claimed the short way too (the long way costs Redis about
  -- a tenth more per task). Priority then orders the n requests a claim takes in, not the
  -- 256 it would take in otherwise; a claim with little room (a busy daemon, where
  -- priority matters most) still takes in 256 first and orders them all.
  local take = 256
  if most >= FRESH_ROOM then take = math.min(256, most) end
  local taken, rejected
  taken, rejected, fresh = ingest(take, false, most)
  reply[5] = {taken, unpack(rejected)}
end

-- Promote newly due tasks, bounded, to where they wait (the ready set or a held set).
if promote_limit > 0 then
  local due = redis.call('ZRANGEBYSCORE', due_key, '-inf', NOW_S, 'WITHSCORES', 'LIMIT', '0',
                         int_s(promote_limit))
  for i = 1, #due, 2 do
    local id = due[i]
    local pr = redis.pcall('HGET', task_key(id), 'priority')
    pr = type(pr) == 'string' and tonumber(pr) or 0
    if pr ~= pr or pr < -100 or pr > 100 then pr = 0 end  -- pr ~= pr: NaN
    redis.call('ZREM', due_key, id)
    place(id, phase, (100 - pr) * PRIO_SPAN + tonumber(due[i + 1]))
  end
end

local dropped = 0
local hold_budget = 1000
local want = (phase == 'submit') and {PENDING_SUBMIT = true} or {SUBMITTED = true, RUNNING = true}
local got = 0

-- The fields a claim decides on. A task's provider, tenant and account matter only to
-- limits, or to a pause of submits: without either, they are left out (each field a task
-- lacks costs HMGET a scan of the whole hash, and most tasks have none of the three).
-- started_fence is read so that a claim deletes it only where a start left one.
local READ = {'status', 'deadline_ms', 'cancel_requested', 'handler', 'version', 'fence',
              'held', 'submit_attempts', 'reclaims', 'started_fence'}
if admission_on() or (phase == 'submit' and paused_on()) then
  READ[11], READ[12], READ[13] = 'provider', 'tenant', 'account'
end

-- Look at one popped entry: claim it, set it aside, or drop it. `from` is the held
-- dimension it was popped from (nil: the ready set). Returns false when the hold budget
-- is spent and the entry went back where it came from.
local function consider(id, score, from)
  local tk = task_key(id)
  -- pcall: a key of another type (WRONGTYPE) must not abort the whole claim
  local t = redis.pcall('HMGET', tk, unpack(READ))
  local corrupt = type(t) ~= 'table' or t.err ~= nil
  if corrupt then t = {} end
  local status, deadline_ms, handler = t[1], tonumber(t[2]), t[4]
  -- counters this script, start and reap increment must be integers HINCRBY takes, or
  -- they would fail half-way: such a task is quarantined here, before anyone holds it
  if not corrupt and status and not (int_field(t[5]) and int_field(t[6])
                                     and int_field(t[8]) and int_field(t[9])) then
    corrupt = true
  end
  if from and not corrupt and t[7] ~= from then
    dropped = dropped + 1                       -- stale entry of a held set: ignore it
    return true
  end
  if corrupt then
    redis.call('ZADD', quarantine, NOW_S, id)   -- unreadable: park it for an operator
    dropped = dropped + 1
  elseif not status then
    dropped = dropped + 1                       -- hash gone: nothing to do
  elseif not KNOWN[status] or not deadline_ms or not handler then
    redis.call('ZADD', quarantine, NOW_S, id)   -- unreadable: park it for an operator
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
  else
    if t[7] then redis.call('HDEL', tk, 'held') end
    local dim, g = blocker(phase, {handler, t[11] or false, t[12] or false, t[13] or false})
    local lane = g and g.lane
    if not dim and lane and (grants[lane] or 0) <= 0 then dim = 'rate:' .. lane end
    if dim then
      if hold_budget <= 0 then
        -- budget spent: leave it where it was for the next call
        if from then hold(id, from, score) else redis.call('ZADD', ready_key, score, id) end
        return false
      end
      hold(id, dim, score)
      hold_budget = hold_budget - 1
      dropped = dropped + 1
      return true
    end
    if lane then
      grants[lane] = grants[lane] - 1
      used[lane] = (used[lane] or 0) + 1
    end
    -- HINCRBY fence and version (bump()), and a submit's new status, as one write:
    -- int_field vouched for both counters
    local fence, v = (tonumber(t[6]) or 0) + 1, (tonumber(t[5]) or 0) + 1
    if phase == 'submit' then
      redis.call('HSET', tk, 'fence', int_s(fence), 'version', int_s(v), 'updated_ms', NOW_S,
                 'owner', owner, 'status', 'SUBMITTING')
      move_status(tk, id, status, 'SUBMITTING', handler, true)
      if t[10] then redis.call('HDEL', tk, 'started_fence') end
      if g and #g.caps > 0 then
        local slots = {}
        for _, c in ipairs(g.caps) do
          redis.call('SADD', P .. 'inflight:' .. c[1], id)
          slots[#slots + 1] = c[1]
        end
        redis.call('HSET', tk, 'slots', table.concat(slots, ' '))
      end
      emit(id, 'SUBMITTING', v)
    else
      redis.call('HSET', tk, 'fence', int_s(fence), 'version', int_s(v), 'updated_ms', NOW_S,
                 'owner', owner)
    end
    redis.call('ZADD', leases, int_s(NOW + lease_ms), id)
    got = got + 1
    local hash = redis.call('HGETALL', tk)
    if phase == 'query' then
      -- params are for the submit call only: a poll need not carry (a prompt's) kilobytes
      for i = 1, #hash, 2 do
        if hash[i] == 'params' then
          local n = #hash
          hash[i], hash[i + 1] = hash[n - 1], hash[n]
          hash[n], hash[n - 1] = nil, nil
          break
        end
      end
    end
    reply[#reply + 1] = {id, fence, v, hash}
  end
  return true
end

-- Fresh tasks, when nothing waits before them (no limits: no grants or holds either).
if fresh then
  for _, c in ipairs(take_fresh(fresh, n, owner, int_s(NOW + lease_ms))) do
    reply[#reply + 1] = c
    got = got + 1
  end
end

-- Grants first: they were taken for tasks already waiting in their lanes.
for _, lane in ipairs(granted) do
  local dim = 'rate:' .. lane
  while got < n and grants[lane] > 0 do
    local popped = redis.call('ZPOPMIN', P .. 'held:' .. dim)
    if #popped == 0 then break end
    if not consider(popped[1], popped[2], dim) then break end
  end
end
-- The ready set: as many as are still wanted in one pop (nothing below adds to it, so
-- this takes them in the same order as one pop at a time). When the hold budget runs out,
-- consider() puts its entry back, and the rest of the pop goes back too.
local spent = false
while got < n and not spent do
  local popped = redis.call('ZPOPMIN', ready_key, int_s(n - got))
  if #popped == 0 then break end
  for i = 1, #popped, 2 do
    if not consider(popped[i], popped[i + 1], nil) then
      for j = i + 2, #popped, 2 do redis.call('ZADD', ready_key, popped[j + 1], popped[j]) end
      spent = true
      break
    end
  end
end

-- Report the rate lanes of this phase: tokens used, tasks waiting.
local lanes = {}
for _, lane in ipairs(granted) do lanes[lane] = true end
-- No admission table: no rate lanes to report (sync_limits moves back what waited in
-- lanes when the limits go), so a deployment without limits pays nothing here.
if admission_on() then
  for _, lane in ipairs(redis.call('SMEMBERS', P .. 'lanes')) do
    if string.sub(lane, 1, #phase + 1) == phase .. '|' then lanes[lane] = true end
  end
end
for lane in pairs(lanes) do
  local waiting = redis.call('ZCARD', P .. 'held:rate:' .. lane)
  if waiting == 0 then redis.call('SREM', P .. 'lanes', lane) end
  local r = reply[4]
  r[#r + 1] = lane
  r[#r + 1] = used[lane] or 0
  r[#r + 1] = waiting
end

local first = redis.call('ZRANGE', due_key, '0', '0', 'WITHSCORES')
if #first > 0 then reply[1] = tonumber(first[2]) end
reply[2] = redis.call('ZCARD', ready_key)
if phase == 'submit' then reply[2] = reply[2] + redis.call('LLEN', P .. 'intake') end
reply[3] = dropped
return reply
