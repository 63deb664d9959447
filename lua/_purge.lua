-- _purge: delete terminal tasks that finished before a cutoff (not a script itself).
--
-- purge_terminal(older_than_ms, limit) is the body of purge (an operator's) and expire
-- (the daemons' retention): it walks the terminal status indexes oldest first, deletes at
-- most `limit` tasks that finished at least older_than_ms ago, keeps the counters exact,
-- and returns {count, task_id, ...}. A hash that already expired (its safety-net expiry is
-- retention plus a grace period) still leaves its index entry; its per-handler counter
-- cannot be known then and is left as it is.

local function purge_terminal(older_than_ms, limit)
  local cutoff = NOW - older_than_ms
  local counts = P .. 'counts'
  local out = {0}
  for _, status in ipairs({'SUCCEEDED', 'FAILED', 'CANCELED', 'TRACKING_TIMED_OUT'}) do
    if out[1] >= limit then break end
    local idx = P .. 'idx:' .. status
    local ids = redis.call('ZRANGEBYSCORE', idx, '-inf', cutoff, 'LIMIT', 0, limit - out[1])
    for _, id in ipairs(ids) do
      local tk = task_key(id)
      local t = redis.call('HMGET', tk, 'status', 'handler')
      if t[1] == nil or t[1] == false or t[1] == status then
        redis.call('ZREM', idx, id)
        if t[2] then redis.call('HINCRBY', counts, status .. '@' .. t[2], -1) end
        redis.call('DEL', tk)
        out[1] = out[1] + 1
        out[#out + 1] = id
      else
        redis.call('ZREM', idx, id)  -- stale entry: the task moved on (requeued)
      end
    end
  end
  return out
end
