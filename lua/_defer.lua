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
