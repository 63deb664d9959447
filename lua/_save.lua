-- _save: one task's save, shared by save and save_many (not a script itself).
--
-- The scripts that need it include it (--- @include _save). save_one(k, A, o, n)
-- is the save of the task whose key is KEYS[k], given A[o + 1] .. A[o + n] as save's ARGV
-- (save.lua states the contract). It returns save's reply, and raises on bad arguments or
-- a corrupt hash or a bad setting it uses, before anything is written.

--- @include _defer
--- @include _emit
--- @include _guards
--- @include _int_arg
--- @include _int_field
--- @include _move
--- @include _schedule
--- @include _settings
--- @include _statuses
--- @include _wake

-- The longest delay a save accepts: 10 years, as the client's longest delay. NOW + delay_ms
-- then stays an integer that a double holds exactly and int_s writes as digits; a larger
-- one would be written as a float ("1e+17"), which no reader takes for a due time.
local MAX_DELAY_MS = 316224000000

local WRITABLE = {handle = true, external_id = true, result = true, error_code = true,
  error_message = true, progress = true, stage = true, message = true,
  consecutive_errors = true, poll_count = true, throttles = true}
-- What a RUNNING event carries of the hash.
local SHOWN = {'progress', 'stage', 'message'}

local function save_one(k, A, o, n)
  local tk = KEYS[k]
  local id, fence, want = A[o + 1], A[o + 2], A[o + 4]
  if n < 5 then error('asynctaskd: save takes at least 5 arguments, got ' .. n) end
  if KEYS[k] ~= P .. 'task:' .. id then
    error('asynctaskd: KEYS[' .. k .. '] is not the key of task ' .. id)
  end
  if not KNOWN[want] then error('asynctaskd: ARGV status is not a status: ' .. tostring(want)) end
  local delay_ms = int_arg(A[o + 5], 'delay_ms', 0, MAX_DELAY_MS)
  if n % 2 ~= 1 then error('asynctaskd: save takes field, value pairs after ARGV[5]') end
  local first, stop = o + 6, o + n
  for i = first, stop, 2 do
    if not WRITABLE[A[i]] then error('asynctaskd: save may not write field ' .. A[i]) end
  end

  local last = {}  -- each field written: the index of its last pair
  for i = first, stop, 2 do last[A[i]] = i end
  -- owner: the task is leased exactly while it has one (no lease index lookup). The rest
  -- only where the save can use it (each field HMGET looks for costs Redis a scan of the
  -- hash): the progress, stage and message a RUNNING save does not write (its event
  -- carries them), and slots and dedup where the save asks to finish the task (or may, by
  -- a cancel), so finishing reads nothing again. A task that times out meanwhile, rare,
  -- has finish() read those two itself.
  local read = {'HMGET', tk, 'status', 'fence', 'version', 'cancel_requested',
                'cancel_version', 'deadline_ms', 'started_fence', 'handler', 'priority', 'owner'}
  if want == 'RUNNING' then
    for _, name in ipairs(SHOWN) do
      if not last[name] then read[#read + 1] = name end
    end
  end
  local finishing = TERMINAL[want] or want == 'PENDING_SUBMIT'
  if finishing then
    read[#read + 1] = 'slots'
    read[#read + 1] = 'dedup'
  end
  local t = redis.call(unpack(read))
  local slots, dedup = nil, nil  -- false: read, and absent; nil: not read
  if finishing then slots, dedup = t[#t - 1], t[#t] end
  local old = t[1]
  if not old then return {-1} end
  -- the late save of the original submitter: its fence is the started mark's, even when a
  -- lookup (lua/lookup.lua) holds the parked task under a newer fence meanwhile
  local late = old == 'SUBMIT_UNKNOWN' and t[7] == fence
               and (want == 'SUBMITTED' or want == 'FAILED' or want == 'PENDING_SUBMIT')
  if t[2] ~= fence and not late then return {-2} end
  if not late then
    if not t[10] then return {-4} end
    if not version_holds(t[3], t[5], A[o + 3]) then return {-3} end
  end
  -- a worker parks only its own submit (SUBMIT_UNKNOWN -> SUBMIT_UNKNOWN is reconcile's)
  if not legal(old, want, 'W') or (want == 'SUBMIT_UNKNOWN' and old ~= 'SUBMITTING') then
    return {-7}
  end

  local final = want
  local cancel = t[4] == '1'
  if cancel and not TERMINAL[want] then
    if want == 'PENDING_SUBMIT' then final = 'CANCELED' end
    if want == 'SUBMITTED' or want == 'RUNNING' then delay_ms = 0 end
  end
  local deadline = tonumber(t[6])
  if not TERMINAL[final] and final ~= 'SUBMIT_UNKNOWN' and (deadline or 0) <= NOW then
    final = 'TRACKING_TIMED_OUT'
  end

  -- The version bump (as _move's bump), the fields, updated_ms, due_ms, and the
  -- removal of owner, started_fence, started_by and emptied fields: one HSET and one HDEL.
  -- Each call a script makes costs Redis far more than the command itself; saves run for
  -- every task several times, so they are batched here.
  if not int_field(t[3]) then
    error('asynctaskd: task ' .. id .. ' field version is corrupt: ' .. tostring(t[3]))
  end
  if not t[8] then
    error('asynctaskd: task ' .. id .. ' field handler is corrupt: ' .. tostring(t[8]))
  end
  if not deadline or deadline % 1 ~= 0 then
    error('asynctaskd: task ' .. id .. ' field deadline_ms is corrupt: ' .. tostring(t[6]))
  end
  local v = (t[3] or 0) + 1  -- int_field vouched for it: `+ 1` reads it once
  -- the two commands' arguments, counted as they are added (ns, nd): tables made at a
  -- size that holds a usual save's, so they need not grow
  local sets = {'HSET', tk, 'version', int_s(v), 'updated_ms', NOW_S,
                false, false, false, false, false, false, false, false, false, false}
  local dels = {'HDEL', tk, 'owner', false, false, false, false, false}
  local ns, nd = 6, 3
  if final ~= old then  -- the status too (move_status below is told it is written)
    sets[ns + 1], sets[ns + 2], ns = 'status', final, ns + 2
  end
  for i = first, stop, 2 do
    if last[A[i]] == i then
      if A[i + 1] == '' then
        dels[nd + 1], nd = A[i], nd + 1
      else
        sets[ns + 1], sets[ns + 2], ns = A[i], A[i + 1], ns + 2
      end
    end
  end
  local terminal = TERMINAL[final]
  if old == 'SUBMITTING' or old == 'SUBMIT_UNKNOWN' or terminal then
    dels[nd + 1], dels[nd + 2], nd = 'started_fence', 'started_by', nd + 2
    -- the lookup record goes with the lookups (a record left by a submit that was not
    -- parked names an old fence, which no park matches: the hot path does not delete it)
    if old == 'SUBMIT_UNKNOWN' then
      dels[nd + 1], dels[nd + 2], dels[nd + 3], nd = 'find', 'lookups', 'lookup_ms', nd + 3
    end
  end
  if terminal then  -- what finish() would write and delete: here, in the same two calls
    sets[ns + 1], sets[ns + 2], ns = 'finished_ms', NOW_S, ns + 2
    dels[nd + 1], nd = 'due_ms', nd + 1
  elseif final == 'SUBMIT_UNKNOWN' then
    dels[nd + 1], nd = 'due_ms', nd + 1
  else
    -- what schedule() below returns
    sets[ns + 1], sets[ns + 2], ns = 'due_ms', int_s(NOW + delay_ms), ns + 2
  end
  -- the settings this save uses (its event; its finish), checked before its first write
  if terminal then settings() elseif final ~= old or final == 'RUNNING' then settings(true) end
  redis.call(unpack(sets, 1, ns))
  redis.call(unpack(dels, 1, nd))
  local handler = t[8]
  z_rem(P .. 'leases', id)
  if terminal then
    -- A leased task waits in no due, ready or held set (the claim took it out, and nothing
    -- schedules a leased task): finishing it need not look there. A late save's task is
    -- not leased.
    finish(tk, id, old, final, handler, true, {slots = slots, dedup = dedup,
                                               unscheduled = not late})
  else
    if final ~= old then move_status(tk, id, old, final, handler, true, slots) end
    if final == 'SUBMIT_UNKNOWN' then
      z_rem(P .. 'deadlines', id)
      -- a handler that can look its job up (its start recorded `find` under this fence)
      local f = redis.call('HGET', tk, 'find')
      if f and string.match(f, '^(%d+):') == fence then
        redis.call('ZADD', P .. 'due:find', NOW_S, id)
      end
    else
      -- priority 0, the usual one, without reading text as a number
      schedule(id, PHASE[final], NOW + delay_ms, t[9] == '0' and 0 or tonumber(t[9]) or 0)
      if old == 'SUBMIT_UNKNOWN' then
        z_add(P .. 'deadlines', int_s(deadline), id)
        redis.call('ZREM', P .. 'due:find', id)
      end
      if delay_ms == 0 then wake() end
    end
  end
  local extra = nil
  if final == 'RUNNING' then
    -- the hash's progress, stage and message now: as written above, else as read (after
    -- owner, in SHOWN's order: a save that ends RUNNING asked for RUNNING)
    extra = {}
    local at = 10
    for _, name in ipairs(SHOWN) do
      local value
      if last[name] then
        value = A[last[name] + 1] ~= '' and A[last[name] + 1]
      else
        at = at + 1
        value = t[at]
      end
      if value then extra[#extra + 1] = name; extra[#extra + 1] = value end
    end
  end
  if final ~= old or extra then emit(id, final, v, extra) end
  return {1, v, final}
end
