-- lookup: lease up to n parked tasks whose vendor lookup is due, each with a new fence.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix; the script uses, under it:
--                          due:find leases quarantine task:<id>
-- ARGV[1] n                how many tasks at most, integer 0..1000 (0: only report)
-- ARGV[2] lease_ms         lease length, integer > 0
-- ARGV[3] owner            worker id, recorded in the task, not empty
-- ARGV[4..] handler        the handlers this daemon can look up (at least one)
--
-- Returns {next_due_ms, due_left, dropped, task, task, ...} where each task is
-- {task_id, fence, version, {field, value, ...}} (the hash after the claim, params
-- included: the lookup gets them), next_due_ms the earliest lookup still scheduled
-- (0 if none), due_left how many due lookups it left (of other handlers, or beyond n),
-- dropped how many entries were not lookups to do (gone, not parked, unreadable).
-- due:find holds the parked (SUBMIT_UNKNOWN) tasks a lookup can settle, scored by when
-- the next lookup is due; the scripts that park a task put it there only when its start
-- recorded `find` (a handler that can look its job up, lua/start.lua). While a lookup
-- holds a task its entry is scored at the lease's expiry, so a lookup whose daemon died
-- comes due again by itself once the reaper has removed the lease.
-- Per due entry, at most 4 * n looked at (bounded work per call):
--   not SUBMIT_UNKNOWN, or gone -> the stray entry is removed
--   version, fence or lookups not integers -> quarantined, entry removed
--   leased (a lookup still running, renewed) -> rescored at its lease's expiry
--   a handler not in ARGV -> left for a daemon that serves it (counted in due_left)
--   else claimed: fence + 1, version + 1, owner, lease, lookups + 1, lookup_ms = now
--       (server time: the lookup's answer is about the vendor as it was after this)
-- Bad ARGV raise before anything is written.
-- Invariants: the status is not changed (a lookup is no transition; cancel, resolve and
-- the original submitter's late save still apply, and end the lookup's lease); every
-- claim increments the fence, so an older lookup's write becomes stale.

--- @include _int_arg
--- @include _int_field
--- @include _roles

daemon_only()
local n = int_arg(ARGV[1], 'n', 0, 1000)
local lease_ms = int_arg(ARGV[2], 'lease_ms', 1)
local owner = ARGV[3]
if owner == '' then error('asynctaskd: ARGV owner must not be empty') end
if #ARGV < 4 then error('asynctaskd: lookup needs at least one handler after ARGV[3]') end
local serves = {}
for i = 4, #ARGV do
  if ARGV[i] == '' then error('asynctaskd: ARGV handler must not be empty') end
  serves[ARGV[i]] = true
end
local due_key = P .. 'due:find'
local leases = P .. 'leases'
local reply = {0, 0, 0}
local got, left, dropped = 0, 0, 0
if n > 0 then
  local due = redis.call('ZRANGEBYSCORE', due_key, '-inf', NOW_S, 'LIMIT', '0', int_s(4 * n))
  for _, id in ipairs(due) do
    local tk = task_key(id)
    local t = redis.pcall('HMGET', tk, 'status', 'handler', 'fence', 'version', 'lookups')
    if type(t) ~= 'table' or t.err ~= nil then t = {'?'} end
    local status, handler = t[1], t[2]
    if status ~= 'SUBMIT_UNKNOWN' then
      if status == '?' then redis.call('ZADD', P .. 'quarantine', NOW_S, id) end
      redis.call('ZREM', due_key, id)
      dropped = dropped + 1
    elseif not (handler and int_field(t[3]) and int_field(t[4]) and int_field(t[5])) then
      redis.call('ZADD', P .. 'quarantine', NOW_S, id)  -- unreadable: park it for an operator
      redis.call('ZREM', due_key, id)
      dropped = dropped + 1
    else
      local lease = redis.call('ZSCORE', leases, id)
      if lease then
        redis.call('ZADD', due_key, int_s(tonumber(lease) + 1), id)
        dropped = dropped + 1
      elseif not serves[handler] or got >= n then
        left = left + 1
      else
        local fence, v = (tonumber(t[3]) or 0) + 1, (tonumber(t[4]) or 0) + 1
        local until_ms = int_s(NOW + lease_ms)
        redis.call('HSET', tk, 'fence', int_s(fence), 'version', int_s(v), 'updated_ms', NOW_S,
                   'owner', owner, 'lookups', int_s((tonumber(t[5]) or 0) + 1),
                   'lookup_ms', NOW_S)
        redis.call('ZADD', leases, until_ms, id)
        redis.call('ZADD', due_key, until_ms, id)
        got = got + 1
        reply[#reply + 1] = {id, fence, v, redis.call('HGETALL', tk)}
      end
    end
  end
end
-- the earliest lookup not taken now (ours are scored at their lease's expiry)
local head = redis.call('ZRANGE', due_key, 0, 0, 'WITHSCORES')
if head[1] then reply[1] = tonumber(head[2]) end
reply[2], reply[3] = left, dropped
return reply
