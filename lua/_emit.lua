-- _emit: appending to the events stream (an include).

--- @include _settings

-- version: the task's version, a number or its text; extra: more field, value pairs
local function emit(id, status, version, extra)
  if not EVENTS_MAXLEN then settings(true) end
  if type(version) == 'number' then version = int_s(version) end
  if not extra then  -- the usual event: no table to build and unpack
    redis.call('XADD', P .. 'events', 'MAXLEN', '~', EVENTS_MAXLEN, '*',
               'task', id, 'status', status, 'version', version)
    return
  end
  local args = {'XADD', P .. 'events', 'MAXLEN', '~', EVENTS_MAXLEN, '*',
                'task', id, 'status', status, 'version', version}
  for i = 1, #extra do args[#args + 1] = extra[i] end
  redis.call(unpack(args))
end
