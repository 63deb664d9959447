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
