-- _schedule: where a due task waits: ready, due or held by admission (an include).

--- @include _defer
--- @include _statuses
--- @include _wake

local PRIO_SPAN = 4398046511104 -- 2^42 ms: ready score = (100 - priority) * 2^42 + due_ms

-- Sort ids in place as the ready set would order them: by score[id], ties by id byte by
-- byte. Lua's `<` follows the server's locale: for ids of digits and capital letters (what
-- the clients make: a ULID and its shard) every locale orders them as bytes; any other id
-- gets a key of digits and a-f (the score, then the id in hex), which every locale orders
-- as bytes too, at a cost.
local function ready_order(ids, score)
  local plain = true
  for _, id in ipairs(ids) do
    if not string.find(id, '^[0-9A-Z]+%-?[0-9]*$') then plain = false; break end
  end
  if plain then
    local function before(x, y)
      if score[x] ~= score[y] then return score[x] < score[y] end
      return x < y
    end
    -- often in order already (promoted in due order, requests in arrival order): then
    -- one look at each neighbour, not a sort
    for i = 2, #ids do
      if before(ids[i], ids[i - 1]) then
        table.sort(ids, before)
        return
      end
    end
  else
    local sort_key = {}
    for _, id in ipairs(ids) do
      sort_key[id] = string.format('%016d', score[id])
                     .. string.format(string.rep('%02x', #id), string.byte(id, 1, -1))
    end
    table.sort(ids, function(a, b) return sort_key[a] < sort_key[b] end)
  end
end

-- Admission (docs/architecture.md, Admission). A due task waits in the ready set of its
-- phase, or, when something holds it back, in the held set of that one thing: held:<dim>
-- (a ZSET with the ready score, so it keeps its place), with its `held` field naming <dim>:
--   handler:<k> provider:<p> tenant:<t> account:<a>   a pause (submit phase only)
--   cap:<scope>                                         an in-flight cap that is full
--   rate:<phase>|<provider>|<account>                   a token-bucket lane
-- <prefix>admission is this shard's copy of the limits ('cap:<scope>' -> the shard's share,
-- 'rate:<phase>:<scope>' -> '1'); when it and <prefix>paused are absent, none of this costs
-- anything. In-flight caps are sets of task ids, inflight:<scope>, taken by the claim into
-- SUBMITTING and given back in move_status whenever a task leaves SUBMITTING, SUBMITTED,
-- RUNNING and SUBMIT_UNKNOWN: every path, once, because SREM is idempotent.
local PAUSED = nil
local function paused_on()
  if PAUSED == nil then
    PAUSED = false
    if redis.call('EXISTS', P .. 'paused') == 1 then
      PAUSED = {}
      local flat = redis.call('HGETALL', P .. 'paused')
      for i = 1, #flat, 2 do PAUSED[flat[i]] = true end
    end
  end
  return PAUSED ~= false
end

local ADMISSION = nil
local function admission_on()
  if ADMISSION == nil then ADMISSION = redis.call('EXISTS', P .. 'admission') == 1 end
  return ADMISSION
end

-- The helpers below would be closures Lua builds again on every script call, and most
-- calls never need them (no limits, no pause, not a claim): they are built on first use.
-- Call admission_helpers() before blocker() or hold().
local paused_dim, gates, cap_full, provider_of, blocker, hold
local function admission_helpers()
  if blocker then return end
  local GATES, PROVIDER_OF = {}, {}

  function paused_dim(handler, provider, tenant, account)
    if not paused_on() then return nil end
    if PAUSED['handler:' .. handler] then return 'handler:' .. handler end
    if PAUSED['provider:' .. provider] then return 'provider:' .. provider end
    if tenant and PAUSED['tenant:' .. tenant] then return 'tenant:' .. tenant end
    if account and PAUSED['account:' .. account] then return 'account:' .. account end
    return nil
  end

  -- The limits that apply to a task in a phase:
  -- {lane = <rate lane or nil>, caps = {{scope, n}}}.
  function gates(phase, provider, tenant, account)
    if not admission_on() then return nil end
    local ck = phase .. '|' .. provider .. '|' .. (account or '') .. '|' .. (tenant or '')
    local g = GATES[ck]
    if g then return g end
    local acct = account and (provider .. '/' .. account) or '-'
    local f = redis.call('HMGET', P .. 'admission',
                         'rate:' .. phase .. ':provider:' .. provider,
                         'rate:' .. phase .. ':account:' .. acct, 'cap:provider:' .. provider,
                         'cap:account:' .. acct, 'cap:tenant:' .. (tenant or '-'), 'cap:tenant:*')
    g = {caps = {}}
    if f[1] or f[2] then g.lane = phase .. '|' .. provider .. '|' .. (account or '') end
    if phase == 'submit' then
      if f[3] then g.caps[#g.caps + 1] = {'provider:' .. provider, tonumber(f[3])} end
      if account and f[4] then g.caps[#g.caps + 1] = {'account:' .. acct, tonumber(f[4])} end
      local tc = tenant and (f[5] or f[6])
      if tc then g.caps[#g.caps + 1] = {'tenant:' .. tenant, tonumber(tc)} end
    end
    GATES[ck] = g
    return g
  end

  -- Whether an in-flight cap has no room. Self-healing: each look at a full cap checks a
  -- few members and drops ids whose task is gone or no longer in flight.
  function cap_full(scope, cap)
    local set = P .. 'inflight:' .. scope
    local n = redis.call('SCARD', set)
    if n < cap then return false end
    for _, m in ipairs(redis.call('SRANDMEMBER', set, 3)) do
      local st = redis.pcall('HGET', P .. 'task:' .. m, 'status')
      if type(st) ~= 'string' or not INFLIGHT[st] then
        redis.call('SREM', set, m)
        n = n - 1
      end
    end
    return n >= cap
  end

  -- The provider a task counts against: its own field, else its handler's provider as the
  -- admission table names it ('provider:<handler>'), else the handler key.
  function provider_of(handler, provider)
    if provider then return provider end
    if not admission_on() then return handler end
    local p = PROVIDER_OF[handler]
    if not p then
      p = redis.call('HGET', P .. 'admission', 'provider:' .. handler) or handler
      PROVIDER_OF[handler] = p
    end
    return p
  end

  -- What holds a due task back, as a held dimension, or nil; and its gates.
  -- t = {handler, provider, tenant, account} as read from the hash (false where absent).
  function blocker(phase, t)
    local handler, tenant, account = t[1], t[3] or nil, t[4] or nil
    local provider = provider_of(handler, t[2] or nil)
    if phase == 'submit' then
      local d = paused_dim(handler, provider, tenant, account)
      if d then return d, nil end
    end
    local g = gates(phase, provider, tenant, account)
    if not g then return nil, nil end
    for _, c in ipairs(g.caps) do
      if cap_full(c[1], c[2]) then return 'cap:' .. c[1], g end
    end
    return nil, g
  end

  function hold(id, dim, score)
    redis.call('ZADD', P .. 'held:' .. dim, int_s(score), id)
    redis.call('HSET', P .. 'task:' .. id, 'held', dim)
    if string.sub(dim, 1, 5) == 'rate:' then
      redis.call('SADD', P .. 'lanes', string.sub(dim, 6))
    elseif string.sub(dim, 1, 4) == 'cap:' then
      redis.call('SADD', P .. 'capholds', dim)
    end
  end
end

-- Whether this call put a task in a ready set (a claim that found its ready set empty
-- knows it still is, and need not look again).
local READIED = false

-- Put a due task where it waits: its held set if something holds it back (a rate lane
-- always: tokens are handed out by claim), else the ready set.
local function place(id, phase, score)
  local t = false
  if admission_on() or (phase == 'submit' and paused_on()) then
    admission_helpers()
    t = redis.pcall('HMGET', P .. 'task:' .. id, 'handler', 'provider', 'tenant', 'account')
  end
  if type(t) == 'table' and not t.err and t[1] then
    local dim, g = blocker(phase, t)
    if not dim and g and g.lane then dim = 'rate:' .. g.lane end
    if dim then
      hold(id, dim, score)
      return dim
    end
  end
  redis.call('ZADD', P .. 'ready:' .. phase, int_s(score), id)
  READIED = true
  return nil
end

-- A task due later waits in due:<phase>, scored by its due time plus its priority in the
-- fraction, (101 - priority) / 256 (exact in a double up to due times of year 3000), so
-- that the claim that promotes it need not read its priority back: due_fraction() reads
-- it, or says there is none (a score of an earlier release, a whole number).
local function due_score(due_ms, priority)
  if priority == 0 then return int_s(due_ms) .. '.39453125' end  -- 101 / 256, the usual one
  return int_s(due_ms) .. string.sub(string.format('%.8f', (101 - priority) / 256), 2)
end

local function due_fraction(score)
  local due = math.floor(score)
  local k = math.floor((score - due) * 256 + 0.5)
  if k >= 1 and k <= 201 then return due, 101 - k end
  return due, nil
end

local function schedule(id, phase, due_ms, priority)
  if not (priority >= -100 and priority <= 100) then priority = 0 end  -- also NaN
  if priority % 1 ~= 0 then priority = math.floor(priority) end
  if due_ms <= NOW then
    place(id, phase, (100 - priority) * PRIO_SPAN + due_ms)
  else
    z_add(P .. 'due:' .. phase, due_score(due_ms, priority), id)
  end
  return due_ms
end

-- Move held tasks of one dimension back to where they wait now (at most `limit`).
local function unhold(dim, phase, limit)
  if limit <= 0 then return 0 end
  local popped = redis.call('ZPOPMIN', P .. 'held:' .. dim, limit)
  local moved = 0
  for i = 1, #popped, 2 do
    local id = popped[i]
    local tk = P .. 'task:' .. id
    if redis.pcall('HGET', tk, 'held') == dim then
      redis.call('HDEL', tk, 'held')
      place(id, phase, tonumber(popped[i + 1]))
      moved = moved + 1
    end
  end
  if moved > 0 then wake() end
  return moved
end
