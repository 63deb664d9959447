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

--- @include _defer
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
-- Leases, deadlines, status indexes, counters and due sets are written once per key per
-- flush (lua/_defer.lua): after the intake, and at the end, before the due set is read.
defer_on()
local used = {}
local due_key = P .. 'due:' .. phase
local ready_key = P .. 'ready:' .. phase
local leases = P .. 'leases'
local lease_until = int_s(NOW + lease_ms)
local quarantine = P .. 'quarantine'

-- Whether the ready set is known to be empty: found so, and nothing added to it since
-- (READIED, lua/_schedule.lua); then the claim need not look at it again.
local ready_empty = false

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
    ready_empty = true
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
  flush()  -- promotion reads the due set
end

-- Promote newly due tasks, bounded, to where they wait (the ready set or a held set): the
-- first `promote_limit` of the due set by due time, taken out by one ZREM of up to 1000
-- members (a command in every release's ACL, unlike ZREMRANGEBYRANK).
-- When nothing can hold a task back (no limits, no pause of submits, no grants) and no new
-- task of this call waits to go straight (fresh), the claim takes its first n tasks in
-- ready order from the promoted ones and the head of the ready set together, without
-- writing the ones it takes to the ready set and popping them back: `direct`, in ready
-- order. Those it leaves go to the ready set in one ZADD. When the ready set is empty and
-- the call can take every promoted task, each one's hash is read once, whole, for both
-- its priority and the claim. Either way the same tasks are claimed, in the same order,
-- with the same fences, as the long way; a poll costs Redis a third fewer commands.
local direct = nil  -- the ids to consider first, in ready order
local direct_hash = {}  -- id -> its HGETALL, when read already
if promote_limit > 0 then
  -- due now: a due time up to NOW, whatever the priority in the score's fraction
  local due_now = '(' .. int_s(NOW + 1)
  local due = redis.call('ZRANGEBYSCORE', due_key, '-inf', due_now, 'WITHSCORES', 'LIMIT', '0',
                         int_s(promote_limit))
  local count = #due / 2
  local plain = false
  if count > 0 then
    local chunk = {}
    for i = 1, #due, 2 do
      chunk[#chunk + 1] = due[i]
      if #chunk == 1000 or i + 1 == #due then
        redis.call('ZREM', due_key, unpack(chunk))
        chunk = {}
      end
    end
    plain = #granted == 0 and not admission_on() and not (phase == 'submit' and paused_on())
            and not (fresh and #fresh > 0)
  end
  local whole = plain and count <= n
                and ((ready_empty and not READIED) or redis.call('ZCARD', ready_key) == 0)
  local ids, score, promoted = {}, {}, {}
  for i = 1, #due, 2 do
    local id = due[i]
    local due_ms, pr = due_fraction(due[i + 1] + 0)  -- a score's text: `+ 0` reads it once
    if pr then
      if whole then direct_hash[id] = redis.pcall('HGETALL', task_key(id)) end
    elseif whole then
      local flat = redis.pcall('HGETALL', task_key(id))
      direct_hash[id] = flat
      if type(flat) == 'table' and not flat.err then
        for j = 1, #flat, 2 do
          if flat[j] == 'priority' then pr = flat[j + 1]; break end
        end
      end
    else
      pr = redis.pcall('HGET', task_key(id), 'priority')
    end
    pr = tonumber(pr) or 0
    if pr ~= pr or pr < -100 or pr > 100 then pr = 0 end  -- pr ~= pr: NaN
    if plain then
      if not promoted[id] then ids[#ids + 1] = id end
      promoted[id] = true
      score[id] = (100 - pr) * PRIO_SPAN + due_ms
    else
      place(id, phase, (100 - pr) * PRIO_SPAN + due_ms)
    end
  end
  if plain then
    -- the head of the ready set joins them: the first n of both are the first n of all
    local in_ready = {}
    if not whole and n > 0 then
      local head = redis.call('ZRANGE', ready_key, '0', int_s(n - 1), 'WITHSCORES')
      for j = 1, #head, 2 do
        local id = head[j]
        in_ready[id] = true
        if not score[id] then
          ids[#ids + 1] = id
          score[id] = head[j + 1] + 0
        end
      end
    end
    ready_order(ids, score)
    direct = {}
    local back, out = {}, {}
    for k, id in ipairs(ids) do
      if k <= n then
        direct[#direct + 1] = id
        if in_ready[id] then out[#out + 1] = id end
      elseif promoted[id] then
        back[#back + 1] = int_s(score[id])
        back[#back + 1] = id
      end
    end
    for i = 1, #back, 1000 do
      redis.call('ZADD', ready_key, unpack(back, i, math.min(i + 999, #back)))
    end
    if #out > 0 then redis.call('ZREM', ready_key, unpack(out)) end
    if whole then ready_empty, READIED = true, false end
  end
end
-- from here on the ready set is known empty only if nothing was put there since it was seen so
ready_empty = ready_empty and not READIED

local dropped = 0
local hold_budget = 1000
local want = (phase == 'submit') and {PENDING_SUBMIT = true} or {SUBMITTED = true, RUNNING = true}
local got = 0

-- A task's provider, tenant and account matter only to limits, or to a pause of submits.
local gated = admission_on() or (phase == 'submit' and paused_on())
-- What a claim writes (and deletes) in the hash it takes, beside fence and version.
local CLAIMED = {updated_ms = NOW_S, owner = owner}
if phase == 'submit' then CLAIMED.status = 'SUBMITTING' end
-- The fields a claim decides on (the rest of the hash only goes back in the reply).
local DECIDES = {status = true, deadline_ms = true, cancel_requested = true, handler = true,
                 version = true, fence = true, held = true, submit_attempts = true,
                 reclaims = true, started_fence = true, owner = true, provider = true,
                 tenant = true, account = true}

-- The hash as the claim leaves it, made of `flat` as read before it (changed in place):
-- the claimed fields `set` written, `gone` left out (and, in the query phase, params:
-- they are for the submit call only, and a poll need not carry a prompt's kilobytes).
local function claimed_hash(flat, set, gone)
  local n, i = #flat, 1
  while i < n do
    local name = flat[i]
    if gone[name] or (name == 'params' and phase == 'query') then
      flat[i], flat[i + 1] = flat[n - 1], flat[n]  -- the last pair takes its place
      flat[n - 1], flat[n] = nil, nil
      n = n - 2
    else
      local value = set[name]
      if value then
        flat[i + 1] = value
        set[name] = nil
      end
      i = i + 2
    end
  end
  for name, value in pairs(set) do
    flat[n + 1], flat[n + 2] = name, value
    n = n + 2
  end
  return flat
end

-- Look at one popped entry: claim it, set it aside, or drop it. `from` is the held
-- dimension it was popped from (nil: the ready set); `flat`, the task's HGETALL when read
-- already. Returns false when the hold budget is spent and the entry went back where it
-- came from. The whole hash is read at once: the claim decides on a few fields and replies
-- with all of them.
local function consider(id, score, from, flat)
  local tk = task_key(id)
  -- pcall: a key of another type (WRONGTYPE) must not abort the whole claim
  if flat == nil then flat = redis.pcall('HGETALL', tk) end
  local corrupt = type(flat) ~= 'table' or flat.err ~= nil
  -- only the fields it decides on, in a table made at its final size
  local h = {status = false, deadline_ms = false, cancel_requested = false, handler = false,
             version = false, fence = false, held = false, submit_attempts = false,
             reclaims = false, started_fence = false, owner = false}
  if not corrupt then
    for i = 1, #flat, 2 do
      local name = flat[i]
      if DECIDES[name] then h[name] = flat[i + 1] end
    end
  end
  local status, deadline_ms, handler = h.status, tonumber(h.deadline_ms or ''), h.handler
  -- counters this script, start and reap increment must be integers HINCRBY takes, or
  -- they would fail half-way: such a task is quarantined here, before anyone holds it
  if not corrupt and status and not (int_field(h.version) and int_field(h.fence)
                                     and int_field(h.submit_attempts)
                                     and int_field(h.reclaims)) then
    corrupt = true
  end
  if from and not corrupt and h.held ~= from then
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
  elseif not want[status] or h.owner then
    -- leased (a task is leased exactly while it has an owner): the index disagreed with
    -- the hash, and the sweep repairs
    dropped = dropped + 1
  elseif deadline_ms <= NOW then
    local v = bump(tk)
    finish(tk, id, status, 'TRACKING_TIMED_OUT', handler)
    emit(id, 'TRACKING_TIMED_OUT', v)
    dropped = dropped + 1
  elseif phase == 'submit' and h.cancel_requested == '1' then
    local v = bump(tk)
    finish(tk, id, status, 'CANCELED', handler)
    emit(id, 'CANCELED', v)
    dropped = dropped + 1
  else
    local gone = {}
    if h.held then
      redis.call('HDEL', tk, 'held')
      gone.held = true
    end
    local dim, g = nil, nil
    if gated then
      dim, g = blocker(phase, {handler, h.provider or false, h.tenant or false,
                               h.account or false})
    end
    local lane = g and g.lane
    if not dim and lane and (grants[lane] or 0) <= 0 then dim = 'rate:' .. lane end
    if dim then
      if hold_budget <= 0 then
        -- budget spent: leave it where it was for the next call
        if from then
          hold(id, from, score)
        else
          redis.call('ZADD', ready_key, score, id)
          READIED = true
        end
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
    local fence, v = (h.fence or 0) + 1, (h.version or 0) + 1
    local set = {fence = int_s(fence), version = int_s(v)}
    for name, value in pairs(CLAIMED) do set[name] = value end
    if phase == 'submit' then
      redis.call('HSET', tk, 'fence', set.fence, 'version', set.version, 'updated_ms', NOW_S,
                 'owner', owner, 'status', 'SUBMITTING')
      move_status(tk, id, status, 'SUBMITTING', handler, true)
      if h.started_fence then
        redis.call('HDEL', tk, 'started_fence')
        gone.started_fence = true
      end
      if g and #g.caps > 0 then
        local slots = {}
        for _, c in ipairs(g.caps) do
          redis.call('SADD', P .. 'inflight:' .. c[1], id)
          slots[#slots + 1] = c[1]
        end
        set.slots = table.concat(slots, ' ')
        redis.call('HSET', tk, 'slots', set.slots)
      end
      emit(id, 'SUBMITTING', v)
    else
      redis.call('HSET', tk, 'fence', set.fence, 'version', set.version, 'updated_ms', NOW_S,
                 'owner', owner)
    end
    z_add(leases, lease_until, id)
    got = got + 1
    reply[#reply + 1] = {id, fence, v, claimed_hash(flat, set, gone)}
  end
  return true
end

-- The first n in ready order of the promoted tasks and the ready set's head (see above).
if direct then
  for _, id in ipairs(direct) do consider(id, 0, nil, direct_hash[id]) end
end

-- Fresh tasks, when nothing waits before them (no limits: no grants or holds either).
if fresh then
  for _, c in ipairs(take_fresh(fresh, n, owner, lease_until, ready_empty)) do
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
while got < n and not spent and not (ready_empty and not READIED) do
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

flush()
local first = redis.call('ZRANGE', due_key, '0', '0', 'WITHSCORES')
if #first > 0 then reply[1] = math.floor(tonumber(first[2])) end
reply[2] = (ready_empty and not READIED) and 0 or redis.call('ZCARD', ready_key)
if phase == 'submit' then reply[2] = reply[2] + redis.call('LLEN', P .. 'intake') end
reply[3] = dropped
return reply
