-- _prelude: shared helpers prepended to every script by the loader (not a script itself).
--
-- Every script receives KEYS[1] = "<ns>:{s<N>}:", the shard prefix. Keys of that shard
-- are built from it here, so they all share the {s<N>} hash tag and one cluster slot.
-- The loader puts LEGAL, the transition table generated from asynctaskd/model.py, before this.

local P = KEYS[1]
local TIME_ = redis.call('TIME')
local NOW = tonumber(TIME_[1]) * 1000 + math.floor(tonumber(TIME_[2]) / 1000)
local PRIO_SPAN = 4398046511104 -- 2^42 ms: ready score = (100 - priority) * 2^42 + due_ms

local TERMINAL = {SUCCEEDED = true, FAILED = true, CANCELED = true, TRACKING_TIMED_OUT = true}
local PHASE = {PENDING_SUBMIT = 'submit', SUBMITTING = 'submit', SUBMITTED = 'query',
               RUNNING = 'query'}
local KNOWN = {PENDING_SUBMIT = true, SUBMITTING = true, SUBMITTED = true, RUNNING = true,
               SUCCEEDED = true, FAILED = true, CANCELED = true, TRACKING_TIMED_OUT = true,
               SUBMIT_UNKNOWN = true}

local function key(name) return P .. name end
local function task_key(id) return P .. 'task:' .. id end

local function setting(name, default)
  local v = redis.call('HGET', P .. 'settings', name)
  if v then return tonumber(v) end
  return default
end

local function int_arg(v, name, lo, hi)
  local n = tonumber(v)
  if not n or n ~= math.floor(n) or (lo and n < lo) or (hi and n > hi) then
    error('asynctaskd: ARGV ' .. name .. ' must be an integer'
          .. (lo and (' >= ' .. lo) or '') .. (hi and (' <= ' .. hi) or '')
          .. ', got ' .. tostring(v))
  end
  return n
end

-- A stored counter HINCRBY can use: absent (false) or the text of an integer.
local function int_field(v)
  if not v then return true end
  local n = tonumber(v)
  return n ~= nil and n == math.floor(n) and string.find(v, '^%-?%d+$') ~= nil
end

local function unschedule(id)
  local held = redis.call('HGET', P .. 'task:' .. id, 'held')
  if held then
    redis.call('ZREM', P .. 'held:' .. held, id)
    redis.call('HDEL', P .. 'task:' .. id, 'held')
  end
  redis.call('ZREM', P .. 'due:submit', id)
  redis.call('ZREM', P .. 'due:query', id)
  redis.call('ZREM', P .. 'ready:submit', id)
  redis.call('ZREM', P .. 'ready:query', id)
end

local function schedule(id, phase, due_ms, priority)
  if due_ms <= NOW then
    redis.call('ZADD', P .. 'ready:' .. phase, (100 - priority) * PRIO_SPAN + due_ms, id)
  else
    redis.call('ZADD', P .. 'due:' .. phase, due_ms, id)
  end
  return due_ms
end

local function wake()
  redis.call('LPUSH', P .. 'wake', '1')
  redis.call('LTRIM', P .. 'wake', 0, 0)
end

local EVENTS_MAXLEN = nil
local function emit(id, status, version, extra)
  if not EVENTS_MAXLEN then EVENTS_MAXLEN = setting('events_maxlen', 100000) end
  local maxlen = EVENTS_MAXLEN
  local args = {'XADD', P .. 'events', 'MAXLEN', '~', maxlen, '*',
                'task', id, 'status', status, 'version', version}
  if extra then
    for i = 1, #extra do args[#args + 1] = extra[i] end
  end
  redis.call(unpack(args))
end

-- Move a task's status, keeping the per-status index and counters exact.
local function move_status(tk, id, old, new, handler)
  redis.call('HSET', tk, 'status', new)
  if old == new then return end
  local counts = P .. 'counts'
  if old then
    redis.call('HINCRBY', counts, old, -1)
    redis.call('HINCRBY', counts, old .. '@' .. handler, -1)
    redis.call('ZREM', P .. 'idx:' .. old, id)
  end
  redis.call('HINCRBY', counts, new, 1)
  redis.call('HINCRBY', counts, new .. '@' .. handler, 1)
  redis.call('ZADD', P .. 'idx:' .. new, NOW, id)
end

-- Everything that happens when a task becomes terminal, in one place.
local function finish(tk, id, old, new, handler)
  move_status(tk, id, old, new, handler)
  unschedule(id)
  redis.call('ZREM', P .. 'leases', id)
  redis.call('ZREM', P .. 'deadlines', id)
  redis.call('HSET', tk, 'finished_ms', NOW)
  redis.call('HDEL', tk, 'owner', 'due_ms', 'started_fence')
  local dedup = redis.call('HGET', tk, 'dedup')
  if dedup then
    local dk = P .. 'dedup:' .. dedup
    if redis.call('GET', dk) == id then redis.call('DEL', dk) end
  end
  -- purge deletes the hash at retention with exact counters; the expiry is the safety net
  local retention_ms = setting('retention_ms', 604800000)
  local grace_ms = setting('expiry_grace_ms', 86400000)
  redis.call('PEXPIRE', tk, retention_ms + grace_ms)
end

local function bump(tk)
  local v = redis.call('HINCRBY', tk, 'version', 1)
  redis.call('HSET', tk, 'updated_ms', NOW)
  return v
end

local function legal(old, new, actor)
  return string.find(LEGAL, ' ' .. old .. '>' .. new .. '#' .. actor .. ' ', 1, true) ~= nil
end

-- The fence-and-version check every worker write makes. The version the worker read must
-- still hold, except that a cancel request (the one write others make to a leased task)
-- is merged: it bumps the version once and records that version as cancel_version.
local function version_holds(current, cancel_version, read)
  if current == read then return true end
  return cancel_version ~= false and cancel_version ~= nil and current == cancel_version
         and tonumber(current) == tonumber(read) + 1
end
