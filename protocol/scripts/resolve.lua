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

-- include: _guards
-- _guards: the lifecycle and version checks of worker and operator writes (an include).

local function legal(old, new, actor)
  return string.find(LEGAL, ' ' .. old .. '>' .. new .. '#' .. actor .. ' ', 1, true) ~= nil
end

-- The fence-and-version check every worker write makes. The version the worker read must
-- still hold, except that a cancel request (the one write others make to a leased task)
-- is merged: it bumps the version once and records that version as cancel_version.
local function version_holds(current, cancel_version, read)
  if current == read then return true end
  return cancel_version ~= false and cancel_version ~= nil and current == cancel_version
         and tonumber(current) == (tonumber(read) or -2) + 1
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

-- script: resolve
-- resolve: an operator settles a SUBMIT_UNKNOWN task, or requeues a failed one.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix
-- KEYS[2] task     hash    <ns>:{s<N>}:task:<id>
-- ARGV[1] task_id
-- ARGV[2] target           SUBMITTED, PENDING_SUBMIT, FAILED or CANCELED (not a status:
--                          an error)
-- ARGV[3] external_id      for SUBMITTED: the vendor job id found at the vendor
-- ARGV[4] handle           for SUBMITTED: JSON handle {"external_id": ..., "query": {...}}
-- ARGV[5] message          operator's note, stored as error_message for FAILED/CANCELED
--
-- Returns {1, version, final_status} resolved, or one of
--   {-1} NOT_FOUND
--   {-7, status} ILLEGAL  the task is not in a status the operator may move to target
-- From SUBMIT_UNKNOWN: SUBMITTED (due for a query at once), PENDING_SUBMIT (a knowing
-- resubmit: the next claim changes the fence, so the old submitter's late save can no
-- longer land), FAILED or CANCELED. From FAILED or TRACKING_TIMED_OUT: PENDING_SUBMIT
-- (requeue: a new attempt with a fresh deadline of the original tracking timeout).
-- A knowing resubmit of a task whose cancel was requested ends CANCELED instead: the
-- producer asked for it to stop, and nothing new has reached the vendor.
-- Raises before writing on bad ARGV (KEYS[2] must be the key of task_id), bad settings,
-- or a task whose version is not an integer or that has no handler.

--- @include _emit
--- @include _guards
--- @include _int_field
--- @include _move
--- @include _roles
--- @include _schedule
--- @include _settings
--- @include _statuses
--- @include _wake

operator_only()
local tk = KEYS[2]
local id = ARGV[1]
local target = ARGV[2]
if KEYS[2] ~= P .. 'task:' .. id then
  error('asynctaskd: KEYS[2] is not the key of task ' .. id)
end
if not KNOWN[target] then error('asynctaskd: ARGV target is not a status: ' .. tostring(target)) end
local t = redis.call('HMGET', tk, 'status', 'handler', 'priority', 'deadline_ms', 'timeout_ms',
                     'cancel_requested', 'version')
local status, handler = t[1], t[2]
if not status then return {-1} end
if not legal(status, target, 'O') then return {-7, status} end
if target == 'SUBMITTED' and (ARGV[3] == '' or ARGV[4] == '') then
  error('asynctaskd: resolving as SUBMITTED needs the external id and the handle')
end
if not int_field(t[7]) then
  error('asynctaskd: task ' .. id .. ' field version is corrupt: ' .. tostring(t[7]))
end
if not handler then
  error('asynctaskd: task ' .. id .. ' field handler is corrupt: ' .. tostring(handler))
end
settings()

if target == 'PENDING_SUBMIT' and status == 'SUBMIT_UNKNOWN' and t[6] == '1' then
  target = 'CANCELED'
end
local v = bump(tk)
redis.call('HDEL', tk, 'started_fence', 'owner', 'find', 'lookups', 'lookup_ms')
redis.call('ZREM', P .. 'leases', id)
redis.call('ZREM', P .. 'due:find', id)  -- a lookup in flight gets NO_LEASE
if TERMINAL[status] then
  -- requeue: a fresh attempt; the hash was set to expire when it finished
  redis.call('PERSIST', tk)
  redis.call('HDEL', tk, 'finished_ms', 'error_code', 'error_message', 'result',
             'cancel_requested', 'cancel_version', 'consecutive_errors', 'reclaims',
             'throttles')
  local deadline_ms = NOW + (tonumber(t[5]) or 3600000)
  redis.call('HSET', tk, 'deadline_ms', deadline_ms)
  t[4] = deadline_ms
end
if TERMINAL[target] then
  redis.call('HSET', tk, 'error_code', 'RESOLVED_' .. target,
             'error_message', ARGV[5] ~= '' and ARGV[5] or 'resolved by an operator')
  finish(tk, id, status, target, handler)
else
  if target == 'SUBMITTED' then
    redis.call('HSET', tk, 'external_id', ARGV[3], 'handle', ARGV[4])
  end
  move_status(tk, id, status, target, handler)
  redis.call('ZADD', P .. 'deadlines', tonumber(t[4]) or NOW, id)
  redis.call('HSET', tk, 'due_ms', schedule(id, PHASE[target], NOW, tonumber(t[3]) or 0))
  wake()
end
emit(id, target, v, {'resolved', '1'})
return {1, v, target}
