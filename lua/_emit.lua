-- _emit: appending to the events stream (an include).

--- @include _settings

local function emit(id, status, version, extra)
  if not EVENTS_MAXLEN then settings(true) end
  local args = {'XADD', P .. 'events', 'MAXLEN', '~', EVENTS_MAXLEN, '*',
                'task', id, 'status', status, 'version', int_s(version)}
  if extra then
    for i = 1, #extra do args[#args + 1] = extra[i] end
  end
  redis.call(unpack(args))
end
