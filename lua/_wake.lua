-- _wake: waking idle daemons (an include).
--
-- The wake list holds at most one element, and daemons pop it only between scripts: a
-- second wake in one script call would change nothing (a create_many of 32 would push 32).
-- LLEN, not LTRIM, keeps it at one: a producer may push but not trim.
local WOKEN = false
local function wake()
  if WOKEN then return end
  WOKEN = true
  if redis.call('LLEN', P .. 'wake') == 0 then redis.call('LPUSH', P .. 'wake', '1') end
end
