-- _emit: appending to the events stream (an include).

--- @include _settings

local NO_FIELDS = {}

-- version: the task's version, a number or its text; extra: more field, value pairs.
-- One call, no table of its arguments built per event.
local function emit(id, status, version, extra)
  if not EVENTS_MAXLEN then settings(true) end
  if type(version) == 'number' then version = int_s(version) end
  redis.call('XADD', P .. 'events', 'MAXLEN', '~', EVENTS_MAXLEN, '*',
             'task', id, 'status', status, 'version', version, unpack(extra or NO_FIELDS))
end
