local LEGAL = ' FAILED>PENDING_SUBMIT#O PENDING_SUBMIT>CANCELED#C PENDING_SUBMIT>CANCELED#O PENDING_SUBMIT>CANCELED#W PENDING_SUBMIT>SUBMITTING#W PENDING_SUBMIT>TRACKING_TIMED_OUT#R PENDING_SUBMIT>TRACKING_TIMED_OUT#W RUNNING>CANCELED#W RUNNING>FAILED#R RUNNING>FAILED#W RUNNING>PENDING_SUBMIT#W RUNNING>RUNNING#R RUNNING>RUNNING#W RUNNING>SUCCEEDED#W RUNNING>TRACKING_TIMED_OUT#R RUNNING>TRACKING_TIMED_OUT#W SUBMITTED>CANCELED#W SUBMITTED>FAILED#R SUBMITTED>FAILED#W SUBMITTED>PENDING_SUBMIT#W SUBMITTED>RUNNING#W SUBMITTED>SUBMITTED#R SUBMITTED>SUBMITTED#W SUBMITTED>SUCCEEDED#W SUBMITTED>TRACKING_TIMED_OUT#R SUBMITTED>TRACKING_TIMED_OUT#W SUBMITTING>CANCELED#R SUBMITTING>CANCELED#W SUBMITTING>FAILED#W SUBMITTING>PENDING_SUBMIT#R SUBMITTING>PENDING_SUBMIT#W SUBMITTING>SUBMITTED#W SUBMITTING>SUBMIT_UNKNOWN#R SUBMITTING>SUBMIT_UNKNOWN#W SUBMITTING>TRACKING_TIMED_OUT#R SUBMITTING>TRACKING_TIMED_OUT#W SUBMIT_UNKNOWN>CANCELED#C SUBMIT_UNKNOWN>CANCELED#O SUBMIT_UNKNOWN>CANCELED#W SUBMIT_UNKNOWN>FAILED#O SUBMIT_UNKNOWN>FAILED#W SUBMIT_UNKNOWN>PENDING_SUBMIT#O SUBMIT_UNKNOWN>PENDING_SUBMIT#W SUBMIT_UNKNOWN>SUBMITTED#O SUBMIT_UNKNOWN>SUBMITTED#W SUBMIT_UNKNOWN>SUBMIT_UNKNOWN#W SUBMIT_UNKNOWN>TRACKING_TIMED_OUT#W TRACKING_TIMED_OUT>PENDING_SUBMIT#O '
-- _core: what every script starts with (an include the loader always puts first).
--
-- Every script receives KEYS[1] = "<ns>:{s<N>}:", the shard prefix. Keys of that shard
-- are built from it here, so they all share the {s<N>} hash tag and one cluster slot.
-- The loader puts LEGAL, the transition table generated from asynctaskd/model.py, before
-- this, and after it the includes a script declares with `--- @include <name>` lines
-- (docs/protocol.md, Calling the scripts): each helper is a closure Lua builds again on
-- every call, so a script carries only those it uses.

local P = KEYS[1]
local TIME_ = redis.call('TIME')
local NOW = tonumber(TIME_[1]) * 1000 + math.floor(tonumber(TIME_[2]) / 1000)
-- Redis 7.0 turns a Lua number argument of redis.call into text with printf's "%.17g",
-- which costs ~5,000 instructions for a 13-digit time: ~10% of a save. So integers go to
-- Redis as strings: NOW_S is NOW as text (no printf: the seconds, then the microseconds
-- zero-padded to 6 digits, cut to milliseconds), and int_s() makes any other integer
-- of a double's exact range text with '%d', a fraction of that cost (anything else it
-- leaves a number).
local function ms_text(sec, usec) return sec .. string.sub('00000' .. usec, -6, -4) end
local NOW_S = ms_text(TIME_[1], TIME_[2])
local function int_s(n)
  if n == math.floor(n) and n > -9007199254740992 and n < 9007199254740992 then
    return string.format('%d', n)
  end
  return n
end
local function task_key(id) return P .. 'task:' .. id end

-- A script whose KEYS name a task and whose ARGV its id checks that they agree (or its
-- writes and its index entries would be about two different tasks), and raises
-- 'asynctaskd: task <id> field <field> is corrupt' for a task field it depends on that
-- is not what the scripts write, before anything is written. Both are written out where
-- needed: a helper function here would cost every script call a closure.

-- include: _defer
-- _defer: index and counter writes a batched call sends once per key (an include).
--
-- A call that moves many tasks (a claim, save_many) writes the same few keys for each of
-- them: its lease in `leases`, its deadline in `deadlines`, its status in `idx:<status>`
-- and `counts`, its due time in `due:<phase>`. Each write is a command, and each command
-- a script runs costs Redis far more than the Lua around it. Such a call turns deferral on
-- with defer_on(); z_add, z_rem and h_incr then only note the write, and flush() sends,
-- for each key, one ZADD of every member added, one ZREM of every member removed and one
-- HINCRBY per counter field. Without defer_on() they write at once (every other script).
--
-- The result is the keyspace the writes in order would have left: for a key and member
-- the last write wins (a ZADD then a ZREM of the same member is a ZREM), and the deltas
-- of a counter add up. A script that defers must flush() before it reads any of these
-- keys and before it returns, and must write them only through these helpers meanwhile.
-- Their replies (added or removed counts, the new counter) are not given: no caller uses
-- them.

local DEFER = nil  -- nil: write at once; else {key = {member = score or false}}
local COUNTS = nil  -- {key = {field = delta}}

local function defer_on()
  DEFER, COUNTS = {}, {}
end

local function deferred(key)
  local z = DEFER[key]
  if not z then
    z = {}
    DEFER[key] = z
  end
  return z
end

-- score: text, as ZADD takes it (int_s, NOW_S, due_score)
local function z_add(key, score, member)
  if DEFER then deferred(key)[member] = score else redis.call('ZADD', key, score, member) end
end

local function z_rem(key, member)
  if DEFER then deferred(key)[member] = false else redis.call('ZREM', key, member) end
end

-- by: an integer (a number)
local function h_incr(key, field, by)
  if not DEFER then
    redis.call('HINCRBY', key, field, int_s(by))
    return
  end
  local c = COUNTS[key]
  if not c then
    c = {}
    COUNTS[key] = c
  end
  c[field] = (c[field] or 0) + by
end

-- Send what was noted, and start noting afresh (deferral stays on).
local function flush()
  if not DEFER then return end
  for key, members in pairs(DEFER) do
    local adds, rems = {}, {}
    for member, score in pairs(members) do
      if score then
        adds[#adds + 1] = score
        adds[#adds + 1] = member
      else
        rems[#rems + 1] = member
      end
    end
    -- at most 1,000 members a command: unpack() puts every argument on Lua's C stack
    for i = 1, #adds, 2000 do
      redis.call('ZADD', key, unpack(adds, i, math.min(i + 1999, #adds)))
    end
    for i = 1, #rems, 1000 do
      redis.call('ZREM', key, unpack(rems, i, math.min(i + 999, #rems)))
    end
  end
  for key, fields in pairs(COUNTS) do
    for field, by in pairs(fields) do redis.call('HINCRBY', key, field, int_s(by)) end
  end
  DEFER, COUNTS = {}, {}
end

-- include: _settings
-- _settings: the shard's settings, read and checked before the first write (an include).
--
-- Settings (docs/protocol.md section 9). A script calls settings() before its first
-- write, so a bad value raises before anything is written, never from emit() or finish()
-- half-way: settings() reads and checks all three in one HMGET (a script that may finish
-- a task), settings(true) only events_maxlen in one HGET (one that may write an event
-- but finishes no task: most saves). Absent fields take their defaults, kept as text.
local EVENTS_MAXLEN, EXPIRY_MS = nil, nil
local function settings(events_only)
  if EXPIRY_MS or (events_only and EVENTS_MAXLEN) then return end
  local s, m
  if events_only then
    m = redis.call('HGET', P .. 'settings', 'events_maxlen')
  else
    s = redis.call('HMGET', P .. 'settings', 'retention_ms', 'expiry_grace_ms', 'events_maxlen')
    m = s[3]
  end
  local n = m and tonumber(m)
  if m and not (n and n % 1 == 0 and n >= 1 and n <= 1000000000) then
    error('asynctaskd: settings events_maxlen must be an integer from 1 to 1000000000, got ' .. m)
  end
  EVENTS_MAXLEN = n and int_s(n) or '100000'
  if events_only then return end
  local r, g = tonumber(s[1] or 604800000), tonumber(s[2] or 86400000)
  if not (r and r % 1 == 0 and r >= 1 and r <= 316224000000) then
    error('asynctaskd: settings retention_ms must be an integer from 1 to 316224000000, got '
          .. s[1])
  end
  if not (g and g % 1 == 0 and g >= 0 and g <= 316224000000) then
    error('asynctaskd: settings expiry_grace_ms must be an integer from 0 to 316224000000, got '
          .. s[2])
  end
  EXPIRY_MS = (s[1] or s[2]) and int_s(r + g) or '691200000'
end

-- include: _emit
-- _emit: appending to the events stream (an include).

--- @include _settings

local NO_FIELDS = {}

-- version: the task's version, a number or its text; extra: more field, value pairs.
-- One call, no table of its arguments built per event.
local function emit(id, status, version, extra)
  if not EVENTS_MAXLEN then settings(true) end
  if type(version) == 'number' then version = int_s(version) end
  redis.call('XADD', P .. 'events', 'MAXLEN', '~', EVENTS_MAXLEN, '*',
             'task', id, 'status', status, 'version', version, unpack(extra or NO_FIELDS))
end

-- include: _int_arg
-- _int_arg: checking an integer argument (an include).
--
-- An integer argument within [lo, hi] (hi: 2^53 - 1 if not given, so a double holds it
-- and what int_s writes back exactly; this also refuses inf). `n % 1 ~= 0` is true for a
-- fraction and for NaN. Other spellings Lua's tonumber reads as that integer ('1e3',
-- '0x10') are that integer: every script writes the number, never the argument's text.
local function int_arg(v, name, lo, hi)
  local n = tonumber(v)
  if not n or n % 1 ~= 0 or (lo and n < lo) or n > (hi or 9007199254740991) then
    error('asynctaskd: ARGV ' .. name .. ' must be an integer'
          .. (lo and (' >= ' .. lo) or '') .. ' <= ' .. (hi or '2^53 - 1')
          .. ', got ' .. tostring(v))
  end
  return n
end

-- include: _int_field
-- _int_field: checking a stored counter (an include).
--
-- A stored counter a script may increment: absent (false), or an integer as Redis itself
-- writes one (no leading zeros, no "-0") with at most 15 digits, so HINCRBY takes it and
-- Lua's doubles hold it and its successor exactly (claim and save add 1 in Lua).
-- Counters of one or two characters (fences, versions and attempts, mostly) are checked
-- by their bytes: a pattern costs Redis several times as much.
local function int_field(v)
  if not v then return true end
  if #v <= 2 then
    local a, b = string.byte(v, 1, 2)  -- 48-57: '0'-'9', 45: '-'
    if not b then return a ~= nil and a >= 48 and a <= 57 end
    return b >= 48 and b <= 57 and ((a >= 49 and a <= 57) or (a == 45 and b ~= 48))
  end
  local digits = string.match(v, '^%-?([1-9]%d*)$')
  return digits ~= nil and #digits <= 15
end

-- include: _statuses
-- _statuses: status sets as tables (an include).

local TERMINAL = {SUCCEEDED = true, FAILED = true, CANCELED = true, TRACKING_TIMED_OUT = true}
local PHASE = {PENDING_SUBMIT = 'submit', SUBMITTING = 'submit', SUBMITTED = 'query',
               RUNNING = 'query'}
local KNOWN = {PENDING_SUBMIT = true, SUBMITTING = true, SUBMITTED = true, RUNNING = true,
               SUCCEEDED = true, FAILED = true, CANCELED = true, TRACKING_TIMED_OUT = true,
               SUBMIT_UNKNOWN = true}
-- The statuses in which a task holds an in-flight slot (admission caps).
local INFLIGHT = {SUBMITTING = true, SUBMITTED = true, RUNNING = true, SUBMIT_UNKNOWN = true}

-- include: _wake
-- _wake: waking idle daemons (an include).
--
-- The wake list holds at most one element, and daemons pop it only between scripts: a
-- second wake in one script call would change nothing (a create_many of 32 would push 32).
-- LLEN, not LTRIM, keeps it at one: a producer may push but not trim.
local WOKEN = false
local function wake()
  if WOKEN then return end
  WOKEN = true
  if redis.call('LLEN', P .. 'wake') == 0 then redis.call('LPUSH', P .. 'wake', '1') end
end

-- include: _schedule
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

-- include: _unschedule
-- _unschedule: taking a task out of every due, ready and held set (an include).

--- @include _defer

local function unschedule(id)
  local held = redis.call('HGET', P .. 'task:' .. id, 'held')
  if held then
    redis.call('ZREM', P .. 'held:' .. held, id)
    redis.call('HDEL', P .. 'task:' .. id, 'held')
  end
  z_rem(P .. 'due:submit', id)  -- deferred in a call that defers (lua/_defer.lua)
  z_rem(P .. 'due:query', id)
  redis.call('ZREM', P .. 'ready:submit', id)
  redis.call('ZREM', P .. 'ready:query', id)
end

-- include: _move
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

-- include: _trace
-- _trace: the W3C trace context a producer stores on a task (an include).
--
-- `trace` is the caller's traceparent, then, after one space, its tracestate if it has
-- one (asynctaskd/tracing.py writes it). The daemon reads it only to parent its vendor
-- call spans, through OpenTelemetry's own parser, which ignores a malformed value; this
-- check keeps what a producer can store small and printable: the traceparent's shape
-- (version 00 is 55 characters), printable ASCII, at most 600 bytes (W3C lets tracestate
-- be cut to 512 characters).
local TRACE_HEAD = '^%x%x%-' .. string.rep('%x', 32) .. '%-' .. string.rep('%x', 16) .. '%-%x%x'
local function trace_ok(v)
  return type(v) == 'string' and #v <= 600 and string.find(v, TRACE_HEAD) ~= nil
         and string.find(v, '[^\32-\126]') == nil
end

-- include: _intake
-- _intake: producers' requests, carried out by a daemon (not a script itself).
--
-- A producer may not write a task (docs/security.md: its ACL user has no command that
-- changes an existing key). Its scripts leave requests instead, with commands that can
-- only add:
--   create  SETNX new:<id> = the task's first fields (a cmsgpack array: field, value,
--           ...), then RPUSH intake 'c:<id>'
--   cancel  RPUSH intake 'x:<id>'
--   create, finding a dedup key whose task is gone  RPUSH intake 'd:<dedup suffix>'
-- ingest(limit, wake_others) pops up to `limit` entries in order and carries each out as
-- a create or a cancel used to be carried out by the producer itself. Everything in a
-- request was written by a producer, so it is checked first; a request that is not
-- exactly what the create script writes is dropped, with its dedup key if it holds one.
-- Never raises: one bad entry must not stop the daemon's claims.
-- Returns the number of entries taken, a list {id, reason, ...} of dropped creates, and
-- (ingest(limit, false, most): a submit claim that may take up to `most` new tasks
-- straight in) the ids of the fresh tasks, left for the claim to take in or to settle.
--
-- Fresh tasks. A create that is due now, within its deadline, can go straight from the
-- request to SUBMITTING when the claim that takes it in wants it (one of its first
-- `most` such requests) and nothing waits in the ready set before it: writing it as
-- PENDING_SUBMIT in the ready set, then popping it, reading it back and moving it on
-- would cost Redis twice the commands for the same end state. Until the claim decides,
-- such a task is only FRESH[id] (its checked fields) and its deadline entry; a cancel of
-- it in the same call settles it first, and a `d:` entry for its dedup key leaves the key
-- (the task is live). settle_fresh writes it as every other new task: PENDING_SUBMIT,
-- counted, indexed, scheduled, with its event.

--- @include _defer
--- @include _emit
--- @include _int_field
--- @include _move
--- @include _schedule
--- @include _statuses
--- @include _trace
--- @include _unschedule
--- @include _wake

local REQUEST_FIELDS = {id = true, handler = true, status = true, priority = true,
  created_ms = true, updated_ms = true, deadline_ms = true, timeout_ms = true, due_ms = true,
  version = true, params = true, provider = false, tenant = false, account = false,
  metadata = false, dedup = false, trace = false}
local REQUIRED = 11  -- the fields above marked true (any other count takes the long check)
local MAX_MS = 999999999999999  -- 15 digits
local NAME_PATTERN = '^[%w_.:%-]+$'  -- keys.HANDLER_KEY_RE, at most 64 characters

local function name_ok(v) return type(v) == 'string' and #v <= 64 and string.find(v, NAME_PATTERN) end

-- The task's fields as a table, or nil and why not.
local function check_request(id, packed)
  local ok, flat = pcall(cmsgpack.unpack, packed)
  if not ok or type(flat) ~= 'table' or #flat % 2 ~= 0 or #flat > 34 then
    return nil, 'not a cmsgpack array of field, value pairs'
  end
  local f, required = {}, 0
  for i = 1, #flat, 2 do
    local name, value = flat[i], flat[i + 1]
    local known = REQUEST_FIELDS[name]
    if known == nil or f[name] ~= nil or type(value) ~= 'string' then
      return nil, 'unknown, repeated or non-text field ' .. tostring(name)
    end
    f[name] = value
    if known then required = required + 1 end
  end
  if required ~= REQUIRED then
    for name, needed in pairs(REQUEST_FIELDS) do
      if needed and f[name] == nil then return nil, 'missing ' .. name end
    end
  end
  if f.id ~= id or f.status ~= 'PENDING_SUBMIT' or f.version ~= '1' then
    return nil, 'id, status or version is not that of a new task'
  end
  if not name_ok(f.handler) or (f.provider and not name_ok(f.provider))
     or (f.tenant and not name_ok(f.tenant)) or (f.account and not name_ok(f.account)) then
    return nil, 'a handler, provider, tenant or account name is not valid'
  end
  if f.trace and not trace_ok(f.trace) then
    return nil, 'trace is not a W3C traceparent (and tracestate)'
  end
  -- the times, as create writes them: positive integers without leading zeros, at most 15
  -- digits (Lua's doubles hold them and their sums exactly), checked in one pattern.
  -- Text the patterns passed is a number: `+ 0` reads it (tonumber reads it twice).
  local times = f.created_ms .. ' ' .. f.deadline_ms .. ' ' .. f.timeout_ms .. ' ' .. f.due_ms
  if not string.find(times, '^[1-9]%d* [1-9]%d* [1-9]%d* [1-9]%d*$') then
    return nil, 'a time is not a positive integer'
  end
  local created, deadline = f.created_ms + 0, f.deadline_ms + 0
  local timeout, due = f.timeout_ms + 0, f.due_ms + 0
  if created > MAX_MS or deadline > MAX_MS or timeout > MAX_MS or due > MAX_MS then
    return nil, 'a time has more than 15 digits'
  end
  if f.updated_ms ~= f.created_ms or deadline ~= created + timeout or due < created then
    return nil, 'the times do not fit together'
  end
  if not string.find(f.priority, '^%-?%d+$') then
    return nil, 'priority is not an integer from -100 to 100'
  end
  local priority = f.priority + 0
  if priority < -100 or priority > 100 then
    return nil, 'priority is not an integer from -100 to 100'
  end
  if f.dedup then
    -- <len(tenant)>:<tenant>:<key>, the task's own tenant, and the key must name this task
    local tenant = f.tenant or ''
    if string.sub(f.dedup, 1, #(#tenant .. ':' .. tenant .. ':')) ~= #tenant .. ':' .. tenant .. ':'
       or redis.call('GET', P .. 'dedup:' .. f.dedup) ~= id then
      return nil, 'its dedup key does not name it'
    end
  end
  return f, nil, flat, due, deadline, priority
end

local FRESH = nil  -- id -> the fields of a fresh task (see above), when a claim asked
local FRESH_FLAT = nil  -- id -> its request's field, value pairs, as checked
local FRESH_SCORE = nil  -- id -> its ready score
local FRESH_MOST = 0  -- how many the claim may take: the ones after it are written at once
-- A claim with room for this many tasks or more, that may take new tasks straight, takes
-- in only as many requests as it can take (lua/claim.lua); one with less takes in 256.
local FRESH_ROOM = 32

-- `flat`: the request's field, value pairs as checked (each field once), when at hand
local function write_new(id, f, wake_others, flat)
  local tk = task_key(id)
  local fields = flat
  if not fields then
    fields = {}
    for name, value in pairs(f) do
      fields[#fields + 1] = name
      fields[#fields + 1] = value
    end
  end
  redis.call('HSET', tk, unpack(fields))  -- status PENDING_SUBMIT among them
  move_status(tk, id, nil, 'PENDING_SUBMIT', f.handler, true)
  local due_ms = tonumber(f.due_ms)
  schedule(id, 'submit', due_ms, tonumber(f.priority))
  if wake_others and due_ms <= NOW then wake() end
  emit(id, 'PENDING_SUBMIT', 1)
end

local function settle_fresh(id)
  local f = FRESH[id]
  FRESH[id] = nil
  write_new(id, f, false, FRESH_FLAT[id])
end

local function ingest_create(id, wake_others, fresh)
  local nk = P .. 'new:' .. id
  local packed = redis.call('GETDEL', nk)
  if not packed then return nil end  -- taken in already, or never stored
  local tk = task_key(id)
  local f, why, flat, due, deadline, priority = check_request(id, packed)
  if f and redis.call('EXISTS', tk) == 1 then f, why = nil, 'the task id is taken' end
  if not f then
    -- free the dedup key if it names this request, so the same key can be used again
    local ok, flat = pcall(cmsgpack.unpack, packed)
    if ok and type(flat) == 'table' then
      for i = 1, #flat - 1, 2 do
        if flat[i] == 'dedup' and type(flat[i + 1]) == 'string' then
          local dk = P .. 'dedup:' .. flat[i + 1]
          if redis.call('GET', dk) == id then redis.call('DEL', dk) end
        end
      end
    end
    return why
  end
  z_add(P .. 'deadlines', f.deadline_ms, id)
  if FRESH and #fresh < FRESH_MOST and due <= NOW and deadline > NOW then
    FRESH[id], FRESH_FLAT[id] = f, flat
    FRESH_SCORE[id] = (100 - priority) * PRIO_SPAN + due
    fresh[#fresh + 1] = id
    return nil
  end
  write_new(id, f, wake_others, flat)
  return nil
end

-- A cancel as the producer asked for it (its script checked the tenant): now if nobody
-- holds the task, else a flag the holder merges at its next write.
local function ingest_cancel(id)
  if FRESH and FRESH[id] then settle_fresh(id) end
  local tk = task_key(id)
  local t = redis.pcall('HMGET', tk, 'status', 'cancel_requested', 'handler', 'priority',
                        'version', 'owner')
  if type(t) ~= 'table' or t.err ~= nil then return end
  local status = t[1]
  local unheld = status == 'PENDING_SUBMIT' or status == 'SUBMIT_UNKNOWN'
  if not status or not KNOWN[status] or TERMINAL[status] or not t[3] or not int_field(t[5])
     or (t[2] == '1' and not unheld) then
    return
  end
  local v = bump(tk)
  if unheld then
    redis.call('HSET', tk, 'cancel_requested', '1')
    finish(tk, id, status, 'CANCELED', t[3])
    emit(id, 'CANCELED', v)
    return
  end
  redis.call('HSET', tk, 'cancel_requested', '1', 'cancel_version', v)
  -- an idle SUBMITTED/RUNNING task is due at once: the cancel does not wait for its poll
  if (status == 'SUBMITTED' or status == 'RUNNING') and not t[6] then
    unschedule(id)
    redis.call('HSET', tk, 'due_ms', schedule(id, 'query', NOW, tonumber(t[4]) or 0))
    wake()
  end
  emit(id, status, v, {'cancel_requested', '1'})
end

-- A dedup key whose task is gone (deleted by hand, or a dropped request): free it.
local function ingest_dedup(suffix)
  local dk = P .. 'dedup:' .. suffix
  local id = redis.call('GET', dk)
  if not id then return end
  if FRESH and FRESH[id] then return end  -- a new task, PENDING_SUBMIT: its key holds
  local st = redis.pcall('HGET', task_key(id), 'status')
  if type(st) == 'string' and not TERMINAL[st] then return end
  if redis.call('EXISTS', P .. 'new:' .. id) == 1 then return end
  redis.call('DEL', dk)
end

local function ingest(limit, wake_others, most)
  local fresh = {}
  if most and most > 0 then
    FRESH, FRESH_FLAT, FRESH_SCORE, FRESH_MOST = {}, {}, {}, most
  end
  local entries = redis.call('LPOP', P .. 'intake', limit)
  if not entries then return 0, {}, fresh end
  local dropped = {}
  for _, entry in ipairs(entries) do
    local kind, rest = string.sub(entry, 1, 2), string.sub(entry, 3)
    if kind == 'c:' then
      local why = ingest_create(rest, wake_others, fresh)
      if why then
        dropped[#dropped + 1] = rest
        dropped[#dropped + 1] = why
      end
    elseif kind == 'x:' then
      ingest_cancel(rest)
    elseif kind == 'd:' then
      ingest_dedup(rest)
    end
  end
  -- a fresh task settled by a later entry is no longer fresh
  local still = {}
  for _, id in ipairs(fresh) do
    if FRESH[id] then still[#still + 1] = id end
  end
  return #entries, dropped, still
end

-- After a submit claim's promotions, with `fresh` from ingest: when nothing waits in the
-- ready set, take up to n fresh tasks straight to SUBMITTING, in the order the ready set
-- would have given them (by ready score, ties by id in byte order), and settle the
-- others; else settle them all, behind what waits. A task taken so ends as the claim
-- leaves any task it takes: fence 1, version 2, leased by `owner` until `lease_until`,
-- counted and indexed as SUBMITTING, with the events of both versions. `ready_empty`: the
-- caller knows ready:submit is empty. Returns the claim replies {id, fence, version,
-- fields} of the tasks taken.
local function take_fresh(fresh, n, owner, lease_until, ready_empty)
  local out = {}
  if #fresh == 0 then return out end
  if n > 0 and (ready_empty or redis.call('ZCARD', P .. 'ready:submit') == 0) then
    ready_order(fresh, FRESH_SCORE)
  else
    n = 0
  end
  local leases = P .. 'leases'
  for _, id in ipairs(fresh) do
    if #out < n then
      local f, fields = FRESH[id], FRESH_FLAT[id]
      FRESH[id] = nil
      local tk = task_key(id)
      -- the request's pairs (each field once) as the claim leaves them: status, version
      -- and updated_ms replaced, fence and owner added
      local size = #fields
      for i = 1, size, 2 do
        local name = fields[i]
        if name == 'status' then
          fields[i + 1] = 'SUBMITTING'
        elseif name == 'version' then
          fields[i + 1] = '2'
        elseif name == 'updated_ms' then
          fields[i + 1] = NOW_S
        end
      end
      fields[size + 1], fields[size + 2], fields[size + 3], fields[size + 4] =
        'fence', '1', 'owner', owner
      redis.call('HSET', tk, unpack(fields))
      move_status(tk, id, nil, 'SUBMITTING', f.handler, true)
      emit(id, 'PENDING_SUBMIT', '1')
      emit(id, 'SUBMITTING', '2')
      z_add(leases, lease_until, id)
      out[#out + 1] = {id, 1, 2, fields}
    else
      settle_fresh(id)
    end
  end
  return out
end

-- include: _roles
-- _roles: the role guards of daemon and operator scripts (an include).
--
-- Roles (docs/security.md). Redis checks each command a script runs against the ACL user
-- that called the script, so a no-op write (HDEL of a field from a key that never exists)
-- to a key that only one role may write asks Redis whether the caller has that role.
-- Daemon and operator scripts call their guard first: a producer (or a daemon running an
-- operator script) gets NOPERM before anything is written.
local function daemon_only() redis.call('HDEL', P .. 'role:daemon', '') end
local function operator_only() redis.call('HDEL', P .. 'role:operator', '') end

-- script: claim
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
