-- pause: hold back new vendor submits for one dimension on one shard.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix (paused)
-- ARGV[1] dimension        'handler:<k>', 'provider:<p>', 'tenant:<t>' or 'account:<a>'
-- ARGV[2] note             who and why, for operators ('' for none)
--
-- Returns {1} paused now, or {2} ACCEPTED (it already was; the first note is kept).
-- Invariants: only the submit phase is held back; tasks already submitted keep being
-- queried, and held tasks still time out and can be canceled (the sweep and cancel
-- act on them as on any task nobody holds).

--- @include _roles

operator_only()
local dim = ARGV[1]
if not string.find(dim, '^[a-z]+:') then
  error('asynctaskd: ARGV dimension must look like tenant:<name>, got ' .. tostring(dim))
end
local added = redis.call('HSETNX', P .. 'paused', dim, cjson.encode({at = NOW, note = ARGV[2]}))
return {added == 1 and 1 or 2}
