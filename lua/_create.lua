-- _create: one task's create, shared by create and create_many (not a script itself).
--
-- create_one(k, A, o, n) is the create whose keys are KEYS[k] (the task) and KEYS[k + 1]
-- (the dedup key), given A[o + 1] .. A[o + n] as create's ARGV (create.lua states the
-- contract). It returns create's reply, and raises on bad arguments before anything is
-- written. It writes only with commands that add (SETNX, RPUSH, LPUSH): a producer's ACL
-- user has no others (docs/security.md); a daemon takes the request in (lua/_intake.lua).

--- @include _int_arg
--- @include _statuses
--- @include _trace
--- @include _wake

-- The fields of a request or a task that a resend must match: what the producer chose.
local CONTENT = {'handler', 'provider', 'tenant', 'account', 'priority', 'timeout_ms',
                 'params', 'metadata', 'dedup'}

local function request_fields(packed)
  local ok, flat = pcall(cmsgpack.unpack, packed)
  local f = {}
  if ok and type(flat) == 'table' then
    for i = 1, #flat - 1, 2 do f[flat[i]] = flat[i + 1] end
  end
  return f
end

local function create_one(k, A, o, n)
  if n ~= 12 and n ~= 13 then error('asynctaskd: create takes 12 or 13 arguments, got ' .. n) end
  local tk = KEYS[k]
  local id = A[o + 1]
  local handler = A[o + 2]
  if KEYS[k] ~= P .. 'task:' .. id then
    error('asynctaskd: KEYS[' .. k .. '] is not the key of task ' .. id)
  end
  -- handler, provider, tenant, account: names as lua/_intake.lua takes them in
  -- (keys.HANDLER_KEY_RE, at most 64 characters); '' is none, except for the handler
  for i = 2, 5 do
    local v = A[o + i]
    if (v ~= '' or i == 2) and not (#v <= 64 and string.find(v, '^[%w_.:%-]+$')) then
      error('asynctaskd: ARGV ' .. ({'handler', 'provider', 'tenant', 'account'})[i - 1]
            .. ' must be 1-64 of [A-Za-z0-9_.:-], got ' .. v)
    end
  end
  local priority = int_arg(A[o + 6], 'priority', -100, 100)
  local delay_ms = int_arg(A[o + 7], 'delay_ms', 0, 316224000000)
  local not_before_ms = int_arg(A[o + 8], 'not_before_ms', 0, 9007199254740)
  local timeout_ms = int_arg(A[o + 9], 'timeout_ms', 1, 316224000000)
  local dedup_key = A[o + 12]
  local dedup = nil
  if dedup_key ~= '' then  -- without one, KEYS[k + 1] is neither read nor written
    dedup = #A[o + 4] .. ':' .. A[o + 4] .. ':' .. dedup_key
    if KEYS[k + 1] ~= P .. 'dedup:' .. dedup then
      error('asynctaskd: KEYS[' .. (k + 1) .. '] is not the dedup key of tenant '
            .. A[o + 4] .. ' and dedup_key ' .. dedup_key)
    end
  end
  local trace = n == 13 and A[o + 13] or ''
  if trace ~= '' and not trace_ok(trace) then
    error('asynctaskd: ARGV trace must be a W3C traceparent, then a space and its tracestate, '
          .. 'printable ASCII of at most 600 bytes')
  end
  local nk = P .. 'new:' .. id

  if dedup then
    local existing = redis.call('GET', KEYS[k + 1])
    if existing and existing ~= id then
      local st = redis.call('HGET', task_key(existing), 'status')
      if (st and not TERMINAL[st]) or (not st and redis.call('EXISTS', P .. 'new:' .. existing) == 1) then
        return {2, existing}
      end
      -- a task that ended frees its dedup key as it ends: this one was deleted by hand, or
      -- its request was dropped; only a daemon may free the key (the producer cannot)
      redis.call('RPUSH', P .. 'intake', 'd:' .. dedup)
      wake()
      return {-12, existing}
    end
  end

  -- A resend of the same create (a lost reply, a client that retries) is answered as the
  -- first one was; another create with this id is refused.
  local stored = nil
  local packed = redis.call('GET', nk)
  if packed then
    stored = request_fields(packed)
  elseif redis.call('EXISTS', tk) == 1 then
    local values = redis.call('HMGET', tk, 'created_ms', unpack(CONTENT))
    stored = {created_ms = values[1]}
    for i, name in ipairs(CONTENT) do stored[name] = values[i + 1] end
  end
  if stored then
    local wanted = {handler = handler, provider = A[o + 3], tenant = A[o + 4],
                    account = A[o + 5], priority = int_s(priority),
                    timeout_ms = int_s(timeout_ms), params = A[o + 10],
                    metadata = A[o + 11], dedup = dedup or ''}
    for _, name in ipairs(CONTENT) do
      if (stored[name] or '') ~= wanted[name] then return {-5} end
    end
    local created = tonumber(stored.created_ms) or 0
    return {1, 1, created, math.max(created + delay_ms, not_before_ms)}
  end

  local due_ms = NOW + delay_ms
  if not_before_ms > due_ms then due_ms = not_before_ms end
  local fields = {'id', id, 'handler', handler, 'status', 'PENDING_SUBMIT',
    'priority', int_s(priority), 'created_ms', NOW_S, 'updated_ms', NOW_S,
    'deadline_ms', int_s(NOW + timeout_ms), 'timeout_ms', int_s(timeout_ms),
    'due_ms', int_s(due_ms), 'version', '1', 'params', A[o + 10]}
  if A[o + 3] ~= '' then fields[#fields + 1] = 'provider'; fields[#fields + 1] = A[o + 3] end
  if A[o + 4] ~= '' then fields[#fields + 1] = 'tenant'; fields[#fields + 1] = A[o + 4] end
  if A[o + 5] ~= '' then fields[#fields + 1] = 'account'; fields[#fields + 1] = A[o + 5] end
  if A[o + 11] ~= '' then fields[#fields + 1] = 'metadata'; fields[#fields + 1] = A[o + 11] end
  if trace ~= '' then fields[#fields + 1] = 'trace'; fields[#fields + 1] = trace end
  if dedup then
    fields[#fields + 1] = 'dedup'; fields[#fields + 1] = dedup
    redis.call('SETNX', KEYS[k + 1], id)
  end
  redis.call('SETNX', nk, cmsgpack.pack(fields))
  redis.call('RPUSH', P .. 'intake', 'c:' .. id)
  wake()
  return {1, 1, NOW, due_ms}
end
