-- _start: one task's start, shared by start and start_many (not a script itself).
--
-- start_one(k, A, o, n) is the start of the task whose key is KEYS[k], given A[o + 1] ..
-- A[o + n] as start's ARGV (start.lua states the contract). It returns start's reply, and
-- raises on bad arguments or a corrupt hash, before anything is written.

--- @include _guards
--- @include _int_arg
--- @include _int_field

local function start_one(k, A, o, n)
  local tk = KEYS[k]
  if n < 4 or n > 6 then error('asynctaskd: start takes 4 to 6 arguments, got ' .. n) end
  local id, fence = A[o + 1], A[o + 2]
  if KEYS[k] ~= P .. 'task:' .. id then
    error('asynctaskd: KEYS[' .. k .. '] is not the key of task ' .. id)
  end
  if A[o + 4] ~= '0' and A[o + 4] ~= '1' then
    error("asynctaskd: ARGV idempotent must be '0' or '1', got " .. tostring(A[o + 4]))
  end
  local visible = n == 6 and int_arg(A[o + 6], 'find_visible_ms', 0, 316224000000)
  -- owner: a task is leased exactly while its hash has an owner (every script that adds or
  -- removes a lease entry writes or deletes the field with it), so no lease index lookup
  local t = redis.call('HMGET', tk, 'status', 'fence', 'version', 'deadline_ms',
                       'cancel_requested', 'cancel_version', 'started_fence', 'submit_attempts',
                       'owner')
  if not t[1] then return {-1} end
  if t[2] ~= fence then return {-2} end
  if not t[9] then return {-4} end
  if not version_holds(t[3], t[6], A[o + 3]) then return {-3} end
  if t[1] ~= 'SUBMITTING' or (tonumber(t[4]) or 0) <= NOW then return {-7} end
  if t[7] == fence then return {-8} end
  if t[5] == '1' then return {-6, tonumber(t[3])} end
  -- the marks, submit_attempts + 1 and the version bump (as _move's bump): one HSET
  if not int_field(t[3]) then
    error('asynctaskd: task ' .. id .. ' field version is corrupt: ' .. tostring(t[3]))
  end
  if not int_field(t[8]) then
    error('asynctaskd: task ' .. id .. ' field submit_attempts is corrupt: ' .. tostring(t[8]))
  end
  -- int_field vouched for both: `+ 1` reads the text once (tonumber reads it twice)
  local v = (t[3] or 0) + 1
  local token = n >= 5 and A[o + 5] or ''
  local attempts = int_s((t[8] or 0) + 1)
  if visible then
    -- a handler that can look its vendor job up: whoever parks the task schedules lookups
    redis.call('HSET', tk, 'started_fence', fence, 'started_by', token,
               'idempotent', A[o + 4],
               'submit_attempts', attempts, 'version', int_s(v),
               'updated_ms', NOW_S, 'find', fence .. ':' .. NOW_S .. ':' .. int_s(visible))
  else
    redis.call('HSET', tk, 'started_fence', fence, 'started_by', token,
               'idempotent', A[o + 4],
               'submit_attempts', attempts, 'version', int_s(v),
               'updated_ms', NOW_S)
  end
  return {1, v}
end
