-- _settings: the shard's settings, read and checked before the first write (an include).
--
-- Settings (docs/protocol.md section 9). A script calls settings() before its first
-- write, so a bad value raises before anything is written, never from emit() or finish()
-- half-way: settings() reads and checks all three in one HMGET (a script that may finish
-- a task), settings(true) only events_maxlen in one HGET (one that may write an event
-- but finishes no task: most saves). Absent fields take their defaults, kept as text.
local EVENTS_MAXLEN, EXPIRY_MS = nil, nil
local function settings(events_only)
  if EXPIRY_MS or (events_only and EVENTS_MAXLEN) then return end
  local s, m
  if events_only then
    m = redis.call('HGET', P .. 'settings', 'events_maxlen')
  else
    s = redis.call('HMGET', P .. 'settings', 'retention_ms', 'expiry_grace_ms', 'events_maxlen')
    m = s[3]
  end
  local n = m and tonumber(m)
  if m and not (n and n % 1 == 0 and n >= 1 and n <= 1000000000) then
    error('asynctaskd: settings events_maxlen must be an integer from 1 to 1000000000, got ' .. m)
  end
  EVENTS_MAXLEN = n and int_s(n) or '100000'
  if events_only then return end
  local r, g = tonumber(s[1] or 604800000), tonumber(s[2] or 86400000)
  if not (r and r % 1 == 0 and r >= 1 and r <= 316224000000) then
    error('asynctaskd: settings retention_ms must be an integer from 1 to 316224000000, got '
          .. s[1])
  end
  if not (g and g % 1 == 0 and g >= 0 and g <= 316224000000) then
    error('asynctaskd: settings expiry_grace_ms must be an integer from 0 to 316224000000, got '
          .. s[2])
  end
  EXPIRY_MS = (s[1] or s[2]) and int_s(r + g) or '691200000'
end
