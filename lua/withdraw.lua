-- withdraw: take back a submit's start mark, and its lease, when the vendor was not called.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix (leases, due sets, indexes, counts)
-- KEYS[2] task     hash    <ns>:{s<N>}:task:<id>
-- ARGV[1] task_id
-- ARGV[2] fence            fence the worker received from claim
-- ARGV[3] token            the token its start carried (start's ARGV[5])
-- ARGV[4] delay_ms         when the task is due again, from now, integer >= 0
-- ARGV[5..] field, value   pairs to write, as save takes them (error_code, error_message)
--
-- Returns {1, new_version, final_status} taken back, or one of
--   {-1} NOT_FOUND  {-2} STALE_FENCE  {-4} NO_LEASE
--   {-7} ILLEGAL    the task is neither SUBMITTING nor SUBMIT_UNKNOWN under this fence
--   {-8} STARTED    marked started under this fence by another start (another token)
-- For a worker whose start was refused a durability gate, or whose reply was lost (the
-- connection dropped, the master died): it knows it did not call the vendor, but not
-- whether its mark is in Redis. A task SUBMITTING under this fence goes back to
-- PENDING_SUBMIT, as save would take it there (CANCELED if a cancel was requested,
-- TRACKING_TIMED_OUT past the deadline), if it holds no mark or this start's mark, leased
-- or not (the reaper may have parked it in SUBMIT_UNKNOWN meanwhile). The version is not
-- checked: the reply that carried it may be the one that was lost.
-- Invariant: a mark is taken back only by the start that made it, so a fence handed out
-- twice (a claim lost with a failed-over master, then claimed again) cannot take back the
-- mark of a submit that may have reached the vendor. A rejected withdraw writes nothing;
-- it raises before writing as save does.

--- @include _int_arg
--- @include _roles
--- @include _save

daemon_only()
local fence, token = ARGV[2], ARGV[3]
if KEYS[2] ~= P .. 'task:' .. ARGV[1] then
  error('asynctaskd: KEYS[2] is not the key of task ' .. ARGV[1])
end
if token == '' then error('asynctaskd: withdraw needs the token of the start') end
int_arg(ARGV[4], 'delay_ms', 0, 316224000000)
local t = redis.call('HMGET', KEYS[2], 'status', 'fence', 'version', 'started_fence',
                     'started_by')
if not t[1] then return {-1} end
if t[2] ~= fence then return {-2} end
if t[1] ~= 'SUBMITTING' and t[1] ~= 'SUBMIT_UNKNOWN' then return {-7} end
if t[4] == fence and t[5] ~= token then return {-8} end
-- save's own checks and writes, at the version the task has now
local A = {ARGV[1], fence, t[3], 'PENDING_SUBMIT', ARGV[4]}
for i = 5, #ARGV do A[#A + 1] = ARGV[i] end
return save_one(2, A, 0, #A)
