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

-- include: _create
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

-- script: create
-- create: store a producer's request for a new task; a daemon takes it in (lua/_intake.lua).
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix; every key below shares its tag
--                          (the script also writes new:<id>, intake and wake under it)
-- KEYS[2] task     hash    <ns>:{s<N>}:task:<id> (read only: a resend finds it here)
-- KEYS[3] dedup    string  <ns>:{s<N>}:dedup:<len(tenant)>:<tenant>:<dedup_key>, or
--                          <ns>:{s<N>}:dedup:- when the task has no dedup key
-- ARGV[1] task_id          ULID, with -<N> appended on shard N > 0
-- ARGV[2] handler          handler key, 1-64 of [A-Za-z0-9_.:-]
-- ARGV[3] provider         admission provider, a name as handler ('' = the provider the
--                          admission table names for the handler, else the handler key)
-- ARGV[4] tenant           a name as handler, '' for none
-- ARGV[5] account          a name as handler, '' for none
-- ARGV[6] priority         integer -100..100, higher first
-- ARGV[7] delay_ms         integer >= 0, due this long after server now
-- ARGV[8] not_before_ms    epoch ms, 0 for none; due = max(now + delay_ms, not_before_ms)
-- ARGV[9] timeout_ms       tracking timeout, integer > 0; deadline = created + timeout
-- ARGV[10] params          JSON text
-- ARGV[11] metadata        JSON text, '' for none
-- ARGV[12] dedup_key       '' for none; else KEYS[3] must be the dedup key of ARGV[4] and this
-- ARGV[13] trace           optional, '' for none: the caller's W3C traceparent, then a space
--                          and its tracestate if any (lua/_trace.lua); not part of the
--                          content a resend must match
--
-- Returns {1, version, created_ms, due_ms} created (a resend of the same create, same id
-- and content, gets the first one's reply: whatever a client retries, one task), or
--   {2, existing_id}  ACCEPTED (deduped): a live task with the same tenant and dedup key exists
--   {-5}              EXISTS: the task id is taken by a create with other content
--   {-12, existing_id} DEDUP_STALE: the dedup key names a task that no longer exists; a
--                     daemon frees the key when it next takes in requests: try again
-- Raises before writing on bad ARGV (KEYS[2] must be the key of task_id).
-- Writes only with commands that add to nothing that exists (SETNX new:<id> and the dedup
-- key, RPUSH intake, LPUSH wake), so a producer's ACL user needs no other write command.
-- Until a daemon takes the request in, the task is read from new:<id> (docs/protocol.md);
-- the status index, counters, deadline index and due set get it at that moment.

--- @include _create

return create_one(2, ARGV, 0, #ARGV)
