-- _unschedule: taking a task out of every due, ready and held set (an include).

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
