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
