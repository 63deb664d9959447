-- start: mark that the vendor submit call is about to start under this fence.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix (leases)
-- KEYS[2] task     hash    <ns>:{s<N>}:task:<id>
-- ARGV[1] task_id
-- ARGV[2] fence            fence the worker received from claim
-- ARGV[3] version          version the worker last read
-- ARGV[4] idempotent       '1' if the handler's vendor dedups on the idempotency key,
--                          else '0'
-- ARGV[5] token            optional: unique to this start, recorded as started_by; with it
--                          (and only with it) withdraw can take the mark back
-- ARGV[6] find_visible_ms  optional (after a token): the handler can look its vendor job
--                          up (docs/protocol.md, section 7), and a job this submit creates
--                          is visible to that lookup within this many ms of the mark,
--                          integer 0..316224000000. Recorded with the mark as the `find`
--                          field, '<fence>:<mark ms>:<visible ms>': a task parked in
--                          SUBMIT_UNKNOWN under this fence is then due for a lookup.
--
-- Returns {1, new_version} marked, or one of
--   {-1} NOT_FOUND  {-2} STALE_FENCE  {-3} WRONG_VERSION  {-4} NO_LEASE
--   {-6, version} CANCEL_REQUESTED  a cancel arrived: do not call the vendor, save CANCELED
--   {-7} ILLEGAL    the task is not SUBMITTING, or its deadline has passed
--   {-8} STARTED    already marked under this fence: one vendor call per claim
-- Raises before writing on bad ARGV (KEYS[2] must be the key of task_id) or a task whose
-- version or submit_attempts is not an integer.
-- Invariants: a rejected mark writes nothing. Once marked, a lease that expires in
-- SUBMITTING parks the task in SUBMIT_UNKNOWN (or requeues it if idempotent) instead of
-- resubmitting it; the caller must make this write durable before calling the vendor.
-- A fence is no identity after a failover (a claim the old master acknowledged and lost
-- is handed out again with the same fence and version); the token is.

--- @include _roles
--- @include _start

daemon_only()
return start_one(2, ARGV, 0, #ARGV)
