-- _move: status moves with exact counters and indexes; finishing; versions (an include).

--- @include _defer
--- @include _schedule
--- @include _settings
--- @include _statuses
--- @include _unschedule

-- `slots`: the task's slots field when the caller read it (false: none), nil to read it here
local function release_slots(tk, id, slots)
  if slots == nil then slots = redis.call('HGET', tk, 'slots') end
  if not slots then return end
  redis.call('HDEL', tk, 'slots')
  for scope in string.gmatch(slots, '%S+') do
    redis.call('SREM', P .. 'inflight:' .. scope, id)
    unhold('cap:' .. scope, 'submit', 1)
  end
end

-- Move a task's status, keeping the per-status index and the per-handler counters exact.
-- `written`: the caller already wrote the new status in an HSET of its own; `slots`: as
-- release_slots.
local function move_status(tk, id, old, new, handler, written, slots)
  if not written then redis.call('HSET', tk, 'status', new) end
  if old == new then return end
  if old and INFLIGHT[old] and not INFLIGHT[new] then release_slots(tk, id, slots) end
  -- one counter per status and handler; a status's total is the size of its index
  local counts = P .. 'counts'
  if old then
    h_incr(counts, old .. '@' .. handler, -1)
    z_rem(P .. 'idx:' .. old, id)
  end
  h_incr(counts, new .. '@' .. handler, 1)
  z_add(P .. 'idx:' .. new, NOW_S, id)
end

-- Everything that happens when a task becomes terminal, in one place. `written`: the
-- caller (a save, in its own HSET and HDEL) already removed the lease, wrote the status
-- and finished_ms, and deleted owner, due_ms and started_fence. `known` (optional): what
-- the caller read of the hash, {slots = <field or false>, dedup = <field or false>,
-- unscheduled = true when the task is in no due, ready or held set}.
local function finish(tk, id, old, new, handler, written, known)
  move_status(tk, id, old, new, handler, written, known and known.slots)
  if not (known and known.unscheduled) then unschedule(id) end
  if old == 'SUBMIT_UNKNOWN' then redis.call('ZREM', P .. 'due:find', id) end
  if not written then
    -- only a leased task has an owner: a producer's cancel never touches the lease index
    if redis.call('HEXISTS', tk, 'owner') == 1 then z_rem(P .. 'leases', id) end
    redis.call('HSET', tk, 'finished_ms', NOW_S)
    redis.call('HDEL', tk, 'owner', 'due_ms', 'started_fence')
  end
  z_rem(P .. 'deadlines', id)
  local dedup = known and known.dedup
  if dedup == nil then dedup = redis.call('HGET', tk, 'dedup') end
  if dedup then
    local dk = P .. 'dedup:' .. dedup
    if redis.call('GET', dk) == id then redis.call('DEL', dk) end
  end
  -- purge deletes the hash at retention with exact counters; the expiry is the safety net
  if not EXPIRY_MS then settings() end
  redis.call('PEXPIRE', tk, EXPIRY_MS)
end

local function bump(tk)
  local v = redis.call('HINCRBY', tk, 'version', '1')
  redis.call('HSET', tk, 'updated_ms', NOW_S)
  return v
end
