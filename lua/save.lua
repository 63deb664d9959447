-- save: write a worker's outcome for one task if its fence and version still hold.
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix (leases, due sets, indexes, counts)
-- KEYS[2] task     hash    <ns>:{s<N>}:task:<id>
-- ARGV[1] task_id
-- ARGV[2] fence            fence the worker received from claim
-- ARGV[3] version          version the worker last read
-- ARGV[4] status           the status the outcome asks for
-- ARGV[5] delay_ms         next due time from now for a non-terminal status, integer
--                          from 0 to 316224000000 (10 years)
-- ARGV[6..] field, value   pairs to write; only handle, external_id, result, error_code,
--                          error_message, progress, stage, message, consecutive_errors,
--                          poll_count, throttles; an empty value deletes the field; a field given
--                          twice takes its last value
--
-- Returns {1, new_version, final_status} saved, or one of
--   {-1} NOT_FOUND  {-2} STALE_FENCE  {-3} WRONG_VERSION  {-4} NO_LEASE
--   {-7} ILLEGAL    the lifecycle does not allow this worker transition
-- Rules, in order:
--   * The fence must be current and the task leased, except the late save of the
--     original submitter: a task parked in SUBMIT_UNKNOWN by the reaper whose started
--     fence is this fence accepts SUBMITTED, FAILED or PENDING_SUBMIT (the handle is
--     never lost; no other submit attempt can have happened under the same fence).
--   * A terminal outcome wins over a cancel that arrived during the call. Otherwise a
--     merged cancel turns PENDING_SUBMIT into CANCELED and makes SUBMITTED/RUNNING due
--     at once, so a worker calls the vendor's cancel and saves CANCELED.
--   * A non-terminal outcome after the deadline becomes TRACKING_TIMED_OUT (data kept).
-- Raises before writing on bad ARGV (KEYS[2] must be the key of task_id), a bad setting
-- it uses (events_maxlen for its event; retention_ms and expiry_grace_ms too when the
-- task finishes), or a task whose version or deadline_ms is not an integer or that has
-- no handler.
-- Invariant: a rejected save writes nothing; a saved one releases the lease.

--- @include _roles
--- @include _save

daemon_only()
return save_one(2, ARGV, 0, #ARGV)
