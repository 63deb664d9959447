-- _statuses: status sets as tables (an include).

local TERMINAL = {SUCCEEDED = true, FAILED = true, CANCELED = true, TRACKING_TIMED_OUT = true}
local PHASE = {PENDING_SUBMIT = 'submit', SUBMITTING = 'submit', SUBMITTED = 'query',
               RUNNING = 'query'}
local KNOWN = {PENDING_SUBMIT = true, SUBMITTING = true, SUBMITTED = true, RUNNING = true,
               SUCCEEDED = true, FAILED = true, CANCELED = true, TRACKING_TIMED_OUT = true,
               SUBMIT_UNKNOWN = true}
-- The statuses in which a task holds an in-flight slot (admission caps).
local INFLIGHT = {SUBMITTING = true, SUBMITTED = true, RUNNING = true, SUBMIT_UNKNOWN = true}
