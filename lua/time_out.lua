-- time_out: move tasks whose deadline passed while nobody held them to TRACKING_TIMED_OUT.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix
-- ARGV[1] limit            how many deadline entries to look at, integer 1..10000
--
-- Returns {count, task_id, task_id, ..., intake}: the tasks timed out, then what the intake
-- did, as a claim reports it: {taken, task_id, reason, ...} (requests taken in, and the
-- creates dropped because they were not what the create script writes).
-- First it takes in up to 1000 producer requests (lua/_intake.lua), as a submit claim does,
-- so that they are carried out even while every worker is busy; it wakes a daemon for
-- those that are due.
-- Covers tasks that were never claimed (paused, throttled, no worker running). A task
-- whose lease is live is left to its holder (its save clamps to the deadline) and is
-- looked at again when that lease expires, so leased tasks never block the sweep.
-- Parked (SUBMIT_UNKNOWN), terminal and vanished tasks leave the deadline index; a task
-- whose version is not an integer is quarantined instead of breaking the sweep. Bad ARGV
-- or settings raise before anything is written (the intake too).

--- @include _emit
--- @include _int_arg
--- @include _int_field
--- @include _intake
--- @include _move
--- @include _roles
--- @include _settings
--- @include _statuses

daemon_only()
local limit = int_arg(ARGV[1], 'limit', 1, 10000)
settings()
local taken, rejected = ingest(1000, true)
local deadlines = P .. 'deadlines'
local leases = P .. 'leases'
local due = redis.call('ZRANGEBYSCORE', deadlines, '-inf', NOW, 'LIMIT', 0, limit)
local out = {0}
for _, id in ipairs(due) do
  local tk = task_key(id)
  local t = redis.pcall('HMGET', tk, 'status', 'deadline_ms', 'handler', 'version')
  if type(t) ~= 'table' or t.err ~= nil then t = {} end
  local status, deadline_ms = t[1], tonumber(t[2])
  if status and not int_field(t[4]) then
    redis.call('ZREM', deadlines, id)           -- unreadable: park it for an operator
    redis.call('ZADD', P .. 'quarantine', NOW, id)
  elseif not status or not PHASE[status] or not deadline_ms or not t[3] then
    redis.call('ZREM', deadlines, id)
  elseif deadline_ms > NOW then
    redis.call('ZADD', deadlines, deadline_ms, id)
  else
    local lease = redis.call('ZSCORE', leases, id)
    if lease and tonumber(lease) > NOW then
      redis.call('ZADD', deadlines, tonumber(lease) + 1, id)
    elseif lease then
      -- expired, not yet reaped: the reaper decides (a started submit must park instead)
      redis.call('ZADD', deadlines, NOW + 1000, id)
    else
      local v = bump(tk)
      finish(tk, id, status, 'TRACKING_TIMED_OUT', t[3])
      emit(id, 'TRACKING_TIMED_OUT', v)
      out[1] = out[1] + 1
      out[#out + 1] = id
    end
  end
end
out[#out + 1] = {taken, unpack(rejected)}
return out
