-- _many: one operation run for several tasks of one shard (not a script itself).
--
-- run_many(one, name) is the body of a <name> script: KEYS[2..] are the task keys, and
-- ARGV is, for each task in KEYS order, n then that task's n arguments. It checks that
-- layout first (a malformed one fails the whole call before anything is written), then
-- calls one(task_key, ARGV, offset, n) for each task in order, where ARGV[offset + 1] is
-- that task's first argument. Each runs under pcall: a task whose operation raised gets
-- the error as an error reply in its place, and the others are unaffected. Returns the
-- replies in KEYS order.

local function run_many(one, name)
  local count = #KEYS - 1
  local at, starts, sizes = 1, {}, {}
  for i = 1, count do
    local n = tonumber(ARGV[at])
    if not n or n ~= math.floor(n) or n < 0 or at + n > #ARGV then
      error('asynctaskd: ' .. name .. ' ARGV is not n, then n arguments, for each task key')
    end
    starts[i], sizes[i] = at, n
    at = at + 1 + n
  end
  if at ~= #ARGV + 1 then
    error('asynctaskd: ' .. name .. ' has ' .. count .. ' task keys and arguments for more')
  end
  local out = {}
  for i = 1, count do
    local ok, reply = pcall(one, KEYS[i + 1], ARGV, starts[i], sizes[i])
    if not ok then
      if type(reply) == 'table' then reply = reply.err end  -- a redis.call error
      reply = redis.error_reply(tostring(reply))
    end
    out[i] = reply
  end
  return out
end
