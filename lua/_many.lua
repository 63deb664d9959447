-- _many: one operation run for several tasks of one shard (not a script itself).
--
-- run_many(one, name, per) is the body of a <name> script: KEYS[2..] are each task's `per`
-- keys in turn, and ARGV is, for each task in KEYS order, n then that task's n arguments.
-- It checks that layout first (a malformed one fails the whole call before anything is
-- written), then calls one(k, ARGV, offset, n) for each task in order, where KEYS[k] is
-- the task's first key and ARGV[offset + 1] its first argument. Each runs under pcall: a
-- task whose operation raised gets the error as an error reply in its place, and the
-- others are unaffected. Returns the replies in KEYS order.

local function run_many(one, name, per)
  local count = (#KEYS - 1) / per
  if count ~= math.floor(count) then
    error('asynctaskd: ' .. name .. ' takes ' .. per .. ' keys per task after the prefix')
  end
  local at, starts, sizes = 1, {}, {}
  for i = 1, count do
    local n = tonumber(ARGV[at])
    if not n or n ~= math.floor(n) or n < 0 or at + n > #ARGV then
      error('asynctaskd: ' .. name .. ' ARGV is not n, then n arguments, for each task')
    end
    starts[i], sizes[i] = at, n
    at = at + 1 + n
  end
  if at ~= #ARGV + 1 then
    error('asynctaskd: ' .. name .. ' has keys for ' .. count .. ' tasks and arguments for more')
  end
  local out = {}
  for i = 1, count do
    local ok, reply = pcall(one, 2 + (i - 1) * per, ARGV, starts[i], sizes[i])
    if not ok then
      if type(reply) == 'table' then reply = reply.err end  -- a redis.call error
      reply = redis.error_reply(tostring(reply))
    end
    out[i] = reply
  end
  return out
end
