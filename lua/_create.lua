-- _create: one task's create, shared by create and create_many (not a script itself).
--
-- create_one(k, A, o, n) is the create whose keys are KEYS[k] (the task) and KEYS[k + 1]
-- (the dedup key), given A[o + 1] .. A[o + n] as create's ARGV (create.lua states the
-- contract). It returns create's reply, and raises on bad arguments before anything is
-- written.

local function create_one(k, A, o, n)
  if n < 12 then error('asynctaskd: create takes 12 arguments, got ' .. n) end
  local tk = KEYS[k]
  local id = A[o + 1]
  local handler = A[o + 2]
  if id == '' or handler == '' then
    error('asynctaskd: task id and handler must not be empty')
  end
  local priority = int_arg(A[o + 6], 'priority', -100, 100)
  local delay_ms = int_arg(A[o + 7], 'delay_ms', 0)
  local not_before_ms = int_arg(A[o + 8], 'not_before_ms', 0)
  local timeout_ms = int_arg(A[o + 9], 'timeout_ms', 1)
  local dedup_key = A[o + 12]

  if dedup_key ~= '' then
    local existing = redis.call('GET', KEYS[k + 1])
    if existing then
      local st = redis.call('HGET', task_key(existing), 'status')
      if st and not TERMINAL[st] then return {2, existing} end
    end
  end
  if redis.call('EXISTS', tk) == 1 then return {-5} end

  local due_ms = NOW + delay_ms
  if not_before_ms > due_ms then due_ms = not_before_ms end
  local deadline_ms = NOW + timeout_ms

  local deadline_s = int_s(deadline_ms)
  local fields = {'id', id, 'handler', handler, 'status', 'PENDING_SUBMIT',
    'priority', int_s(priority), 'created_ms', NOW_S, 'updated_ms', NOW_S,
    'deadline_ms', deadline_s, 'timeout_ms', int_s(timeout_ms), 'due_ms', int_s(due_ms),
    'version', '1', 'params', A[o + 10]}
  if A[o + 3] ~= '' then fields[#fields + 1] = 'provider'; fields[#fields + 1] = A[o + 3] end
  if A[o + 4] ~= '' then fields[#fields + 1] = 'tenant'; fields[#fields + 1] = A[o + 4] end
  if A[o + 5] ~= '' then fields[#fields + 1] = 'account'; fields[#fields + 1] = A[o + 5] end
  if A[o + 11] ~= '' then fields[#fields + 1] = 'metadata'; fields[#fields + 1] = A[o + 11] end
  if dedup_key ~= '' then
    local suffix = string.sub(KEYS[k + 1], #P + 7)  -- strip '<prefix>dedup:'
    fields[#fields + 1] = 'dedup'; fields[#fields + 1] = suffix
    redis.call('SET', KEYS[k + 1], id)
  end
  redis.call('HSET', tk, unpack(fields))
  move_status(tk, id, nil, 'PENDING_SUBMIT', handler)
  redis.call('ZADD', P .. 'deadlines', deadline_s, id)
  schedule(id, 'submit', due_ms, priority)
  wake()
  emit(id, 'PENDING_SUBMIT', 1)
  return {1, 1, NOW, due_ms}
end
