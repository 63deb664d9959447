"""The catalog: each entry breaks one rule in one line, and names the tests that must notice.

`old` must occur exactly once in `path` (tests/test_mutation_catalog.py checks that on
every run of the suite), and `new` is what replaces it. `tests` are pytest node ids (a file,
or a file::test); the runner stops at the first failure, so list the sharpest test first.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    rule: str  # the rule the mutant breaks, as a reader of the catalog would say it
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    # The tests run on redis-server only unless the rule is reached on valkey-server alone
    # (redis-server 7.0 has no WAITAOF, for one).
    all_servers: bool = False


SCRIPTS = "tests/lua/test_scripts.py"
LUA_ADMISSION = "tests/lua/test_admission.py"
# the state machine and the differential test of claims that meet new requests
STATE_MACHINE = "tests/property/test_state_machine.py"
FRESH_DIFF = "tests/property/test_fresh_differential.py"
FRESH_PROPERTIES = (
    f"{STATE_MACHINE}::test_every_transition_and_reply_code_is_predicted",
    f"{FRESH_DIFF}::test_fresh_claims_end_as_the_long_way",
)
RECONCILE = "tests/lua/test_reconcile.py"


def t(file: str, *names: str) -> tuple[str, ...]:
    return tuple(f"{file}::{n}" for n in names) if names else (file,)


STRAIGHT = "tests/lua/test_straight_claim.py"

MUTANTS: tuple[Mutant, ...] = (
    # --- deferred index writes: one command per key per call, the same keyspace -----------
    Mutant(
        "deferred-removal-forgotten",
        "a deferred ZREM after a deferred ZADD of the same member leaves the member out",
        "lua/_defer.lua",
        "  if DEFER then deferred(key)[member] = false else redis.call('ZREM', key, member) end",
        "  if DEFER then deferred(key)[member] = nil else redis.call('ZREM', key, member) end",
        (
            "tests/lua/test_defer.py::test_deferred_writes_leave_the_keyspace_the_writes_in_order_leave",
            "tests/lua/test_many.py::test_save_many_replies_and_writes_exactly_what_each_save_would",
        ),
    ),
    Mutant(
        "deferred-counters-lost",
        "the deferred counter deltas of a call are written when it flushes",
        "lua/_defer.lua",
        "    for field, by in pairs(fields) do redis.call('HINCRBY', key, field, int_s(by)) end",
        "    for field, by in pairs({}) do redis.call('HINCRBY', key, field, int_s(by)) end",
        (
            "tests/lua/test_defer.py::test_deferred_writes_leave_the_keyspace_the_writes_in_order_leave",
            "tests/lua/test_defer.py::test_a_batch_of_polls_writes_each_index_once",
        ),
    ),
    # --- fewer commands per task: leases read from the owner, claims straight from due ----
    Mutant(
        "start-without-a-lease",
        "a start after the lease is gone is refused (NO_LEASE): the owner field is the lease",
        "lua/_start.lua",
        "  if not t[9] then return {-4} end",
        "  if false then return {-4} end",
        (
            f"{SCRIPTS}::test_corrupt_task_is_quarantined_and_does_not_block_others",
            f"{STATE_MACHINE}::test_every_transition_and_reply_code_is_predicted",
        ),
    ),
    Mutant(
        "quarantine-keeps-the-owner",
        "a quarantined task loses its lease and its owner together (the owner is the lease)",
        "lua/quarantine.lua",
        "redis.call('HDEL', tk, 'owner')",
        "redis.call('HDEL', tk, 'quarantined-owner')",
        t(SCRIPTS, "test_corrupt_task_is_quarantined_and_does_not_block_others"),
    ),
    Mutant(
        "straight-claims-out-of-order",
        "tasks claimed straight from the due set come in ready order (priority, due, id)",
        "lua/claim.lua",
        "    ready_order(ids, score)",
        "    -- (left in due order)",
        t(STRAIGHT, "test_due_tasks_claimed_straight_come_in_ready_order"),
    ),
    Mutant(
        "straight-claims-ignore-the-ready-set",
        "due tasks claimed straight still come after ready tasks of a higher priority",
        "lua/claim.lua",
        "    if not whole and n > 0 then",
        "    if false then",
        t(STRAIGHT, "test_tasks_already_ready_go_first_by_priority"),
    ),
    Mutant(
        "due-priority-read-back",
        "a due task's priority rides in its due score: promoting it reads nothing of the task",
        "lua/_schedule.lua",
        "  if k >= 1 and k <= 201 then return due, 101 - k end",
        "  if false then return due, 101 - k end",
        t(STRAIGHT, "test_a_due_tasks_priority_rides_in_its_score_so_promoting_it_reads_nothing"),
    ),
    Mutant(
        "finishing-save-searches-every-set",
        "a save that finishes a leased task does not look for it in the due, ready and held "
        "sets (a leased task is in none): the lifecycle's command count says so",
        "lua/_save.lua",
        "unscheduled = not late})",
        "unscheduled = false})",
        t(STRAIGHT, "test_each_step_of_a_lifecycle_costs_the_commands_it_needs_and_no_more"),
    ),
    # --- settling parked tasks by asking the vendor ----------------------------------------
    Mutant(
        "lookup-none-too-early-resubmits",
        "a lookup that finds no job before the job would be listed asks again later, never "
        "resubmits (a listing may lag behind the vendor's creates)",
        "lua/reconcile.lua",
        "elseif outcome == 'none' and looked - started >= visible then",
        "elseif outcome == 'none' then",
        (
            *t(RECONCILE, "test_none_too_early_asks_again_when_the_job_would_be_listed"),
            "tests/test_reconcile_http.py::"
            "test_a_lost_create_is_found_and_a_lagging_listing_never_resubmits",
        ),
    ),
    Mutant(
        "late-save-refused-during-a-lookup",
        "the original submitter's late save lands while a lookup holds the parked task",
        "lua/_save.lua",
        "  if t[2] ~= fence and not late then return {-2} end",
        "  if t[2] ~= fence then return {-2} end",
        t(RECONCILE, "test_the_original_submitters_late_save_wins_over_a_lookup_in_flight"),
    ),
    Mutant(
        "release-parks-without-a-lookup",
        "a task parked by a drain's release is due for a lookup when its handler can find",
        "lua/release.lua",
        "      if t[8] and string.match(t[8], '^(%d+):') == t[2] then",
        "      if false then",
        t(RECONCILE, "test_parking_schedules_a_lookup_only_for_a_handler_that_can_find"),
    ),
    # --- fences, leases, versions -----------------------------------------------------------
    Mutant(
        "save-ignores-the-fence",
        "a save under a fence that is not the task's is refused (STALE_FENCE)",
        "lua/_save.lua",
        "  if t[2] ~= fence and not late then return {-2} end",
        "  if false then return {-2} end",
        t(
            SCRIPTS,
            "test_stale_fence_after_reclaim_changes_nothing",
            "test_forged_fence_is_refused",
        ),
    ),
    Mutant(
        "save-ignores-the-version",
        "a save whose read version no longer holds is refused (VERSION_CONFLICT)",
        "lua/_save.lua",
        "    if not version_holds(t[3], t[5], A[o + 3]) then return {-3} end",
        "    if false then return {-3} end",
        t(SCRIPTS, "test_wrong_version_is_refused"),
    ),
    Mutant(
        "save-without-a-lease",
        "a save after the lease is gone is refused (NO_LEASE)",
        "lua/_save.lua",
        "    if not t[10] then return {-4} end",
        "    if false then return {-4} end",
        t(SCRIPTS, "test_no_lease_after_reap_in_query_phase"),
    ),
    Mutant(
        "cancel-not-merged-at-save",
        "a cancel bumps a leased task's version once, and the holder's save still lands",
        "lua/_guards.lua",
        "  return cancel_version ~= false and cancel_version ~= nil and current == cancel_version",
        "  return false and cancel_version ~= nil and current == cancel_version",
        (
            *t(SCRIPTS, "test_cancel_during_query_lease_is_merged_at_next_save"),
            "tests/property/test_state_machine.py::test_every_transition_and_reply_code_is_predicted",
        ),
    ),
    Mutant(
        "save-drops-the-cancel-request",
        "a save that leaves a canceled task unfinished makes it CANCELED or due now",
        "lua/_save.lua",
        "  local cancel = t[4] == '1'",
        "  local cancel = false",
        t(SCRIPTS, "test_cancel_during_query_lease_is_merged_at_next_save"),
    ),
    Mutant(
        "backlog-taken-in-whole",
        "a claim with room for 32 or more takes in only the requests it can take straight",
        "lua/claim.lua",
        "  if most >= FRESH_ROOM then take = math.min(256, most) end",
        "",
        (
            "tests/lua/test_fresh_claim.py"
            "::test_a_claim_with_room_takes_in_only_what_it_takes_so_a_backlog_goes_straight",
        ),
    ),
    Mutant(
        "busy-claim-orders-only-what-it-takes",
        "a claim with little room still takes in 256 requests, so priority orders them all",
        "lua/claim.lua",
        "  if most >= FRESH_ROOM then take = math.min(256, most) end",
        "  if most > 0 then take = math.min(256, most) end",
        (
            "tests/lua/test_fresh_claim.py"
            "::test_a_claim_with_little_room_takes_in_256_and_orders_them_all",
        ),
    ),
    Mutant(
        "fresh-tasks-jump-the-queue",
        "a claim takes new requests straight in only when nothing waits in the ready set",
        "lua/_intake.lua",
        "  if n > 0 and (ready_empty or redis.call('ZCARD', P .. 'ready:submit') == 0) then",
        "  if n > 0 then",
        (
            "tests/lua/test_fresh_claim.py"
            "::test_a_task_that_falls_due_in_the_same_claim_goes_before_new_ones",
            *FRESH_PROPERTIES,
        ),
    ),
    Mutant(
        "fresh-before-due",
        "only a new task due now is claimed straight from its request; one due later waits",
        "lua/_intake.lua",
        "  if FRESH and #fresh < FRESH_MOST and due <= NOW and deadline > NOW then",
        "  if FRESH and #fresh < FRESH_MOST and deadline > NOW then",
        FRESH_PROPERTIES,  # tests/lua/test_fresh_claim.py lets it through
    ),
    Mutant(
        "fresh-order-ignores-due-time",
        "new tasks of one priority are claimed straight in due-time order, as the ready set "
        "gives them, whatever their ids",
        "lua/_intake.lua",
        "    FRESH_SCORE[id] = (100 - priority) * PRIO_SPAN + due",
        "    FRESH_SCORE[id] = (100 - priority) * PRIO_SPAN",
        FRESH_PROPERTIES,  # tests/lua/test_fresh_claim.py lets it through
    ),
    Mutant(
        "fresh-ties-reversed",
        "new tasks of one ready score are claimed in id byte order, as the ready set gives",
        "lua/_schedule.lua",
        "      return x < y",
        "      return x > y",
        (
            "tests/lua/test_fresh_claim.py::test_ties_go_by_id_in_byte_order_as_in_the_ready_set",
            *FRESH_PROPERTIES,
        ),
    ),
    Mutant(
        "forged-trace-taken-in",
        "a request's trace context is checked where a daemon takes it in, like every field "
        "a producer writes",
        "lua/_intake.lua",
        "  if f.trace and not trace_ok(f.trace) then",
        "  if false then",
        t(SCRIPTS, "test_a_forged_create_request_is_dropped_whole"),
    ),
    Mutant(
        "oversized-trace-stored",
        "a trace context is at most 600 printable bytes",
        "lua/_trace.lua",
        "  return type(v) == 'string' and #v <= 600 and string.find(v, TRACE_HEAD) ~= nil",
        "  return type(v) == 'string' and string.find(v, TRACE_HEAD) ~= nil",
        t(SCRIPTS, "test_a_forged_create_request_is_dropped_whole"),
    ),
    Mutant(
        "fresh-cancel-lost",
        "a cancel taken in with its create cancels the task before any claim",
        "lua/_intake.lua",
        "  if FRESH and FRESH[id] then settle_fresh(id) end",
        "  if false then settle_fresh(id) end",
        (
            "tests/lua/test_fresh_claim.py::test_a_cancel_taken_in_with_its_create_wins",
            *FRESH_PROPERTIES,
        ),
    ),
    Mutant(
        "illegal-transitions-allowed",
        "a worker write must be a legal transition of the model",
        "lua/_guards.lua",
        "  return string.find(LEGAL, ' ' .. old .. '>' .. new .. '#' .. actor .. ' ', 1, true) ~= nil",
        "  return true",
        t(SCRIPTS, "test_illegal_worker_transitions_are_refused"),
    ),
    Mutant(
        "int-field-takes-minus-zero",
        "a stored counter is an integer as Redis writes one: no '-0', no leading zeros",
        "lua/_int_field.lua",
        "    return b >= 48 and b <= 57 and ((a >= 49 and a <= 57) or (a == 45 and b ~= 48))",
        "    return b >= 48 and b <= 57 and ((a >= 49 and a <= 57) or a == 45)",
        t(SCRIPTS, "test_int_field_takes_exactly_the_counters_redis_writes"),
    ),
    Mutant(
        "ready-order-trusts-the-input",
        "tasks claimed together go in ready order (priority, due time, id), however they came",
        "lua/_schedule.lua",
        "      if before(ids[i], ids[i - 1]) then",
        "      if false then",
        t("tests/lua/test_fresh_claim.py") + t(STRAIGHT),
    ),
    Mutant(
        "renew-ignores-the-fence",
        "a stale holder cannot renew the new holder's lease",
        "lua/renew.lua",
        "  elseif fence ~= ARGV[i + 1] then",
        "  elseif false then",
        t(SCRIPTS, "test_stale_fence_after_reclaim_changes_nothing"),
    ),
    Mutant(
        "renew-after-the-lease-expired",
        "a reaped lease is not renewed (NO_LEASE)",
        "lua/renew.lua",
        "  elseif not redis.call('ZSCORE', leases, id) then",
        "  elseif false then",
        t(SCRIPTS, "test_no_lease_after_reap_in_query_phase"),
    ),
    Mutant(
        "claim-keeps-the-fence",
        "every claim takes a new fence, so older holders become stale",
        "lua/claim.lua",
        "    local fence, v = (h.fence or 0) + 1, (h.version or 0) + 1",
        "    local fence, v = (h.fence or 0) + 0, (h.version or 0) + 1",
        t(
            SCRIPTS,
            "test_claim_leases_with_a_new_fence",
            "test_stale_fence_after_reclaim_changes_nothing",
        ),
    ),
    # --- start once ---------------------------------------------------------------------------
    Mutant(
        "second-start-under-one-fence",
        "one fence starts the vendor submit at most once (ALREADY_STARTED)",
        "lua/_start.lua",
        "  if t[7] == fence then return {-8} end",
        "  if false then return {-8} end",
        (
            *t(SCRIPTS, "test_one_fence_starts_the_vendor_submit_once"),
            "tests/property/test_state_machine.py::test_every_transition_and_reply_code_is_predicted",
        ),
    ),
    Mutant(
        "start-after-a-cancel",
        "a submit canceled before its start is never sent",
        "lua/_start.lua",
        "  if t[5] == '1' then return {-6, tonumber(t[3])} end",
        "  if false then return {-6, tonumber(t[3])} end",
        t(SCRIPTS, "test_cancel_during_submit_lease_stops_the_vendor_call"),
    ),
    Mutant(
        "start-past-the-deadline",
        "no submit starts after the task's deadline",
        "lua/_start.lua",
        "  if t[1] ~= 'SUBMITTING' or (tonumber(t[4]) or 0) <= NOW then return {-7} end",
        "  if t[1] ~= 'SUBMITTING' then return {-7} end",
        t(SCRIPTS, "test_start_refused_after_deadline"),
    ),
    Mutant(
        "start-does-not-count-attempts",
        "each start counts one vendor submit attempt",
        "lua/_start.lua",
        "  local attempts = int_s((t[8] or 0) + 1)",
        "  local attempts = int_s((t[8] or 0) + 0)",
        t(SCRIPTS, "test_full_lifecycle_and_terminal_bookkeeping"),
    ),
    # --- the reaper -----------------------------------------------------------------------------
    Mutant(
        "reap-resubmits-a-started-submit",
        "a lease lost after the start parks the task in SUBMIT_UNKNOWN, never a resubmit",
        "lua/reap.lua",
        "    local started = status == 'SUBMITTING' and t[3] and t[3] == t[2]",
        "    local started = false",
        (
            *t(SCRIPTS, "test_reap_started_submit_parks_in_submit_unknown"),
            "tests/property/test_state_machine.py::test_every_transition_and_reply_code_is_predicted",
        ),
    ),
    Mutant(
        "reap-treats-every-handler-as-idempotent",
        "only an idempotent handler's started submit goes back to PENDING_SUBMIT",
        "lua/reap.lua",
        "      if t[4] == '1' and not late then",
        "      if not late then",
        t(SCRIPTS, "test_reap_started_submit_parks_in_submit_unknown"),
    ),
    Mutant(
        "reap-never-fails-a-flapping-task",
        "a task that loses its query lease too often fails (RECLAIM_LIMIT)",
        "lua/reap.lua",
        "      if reclaims > max_reclaims then",
        "      if false then",
        t(SCRIPTS, "test_reap_query_lease_makes_task_due_and_counts_reclaims"),
    ),
    # --- cancel ---------------------------------------------------------------------------------
    Mutant(
        "cancel-of-a-pending-task-waits",
        "a cancel of a task nobody holds finishes it at once",
        "lua/_intake.lua",
        "  local unheld = status == 'PENDING_SUBMIT' or status == 'SUBMIT_UNKNOWN'",
        "  local unheld = status == 'SUBMIT_UNKNOWN'",
        (
            *t(SCRIPTS, "test_cancel_of_a_pending_task_is_carried_out_when_a_daemon_takes_it_in"),
            "tests/property/test_state_machine.py::test_every_transition_and_reply_code_is_predicted",
        ),
    ),
    Mutant(
        "cancel-of-an-idle-poll-waits-for-the-poll",
        "a cancel makes an idle SUBMITTED/RUNNING task due now, so it stops promptly",
        "lua/_intake.lua",
        "  if (status == 'SUBMITTED' or status == 'RUNNING') and not t[6] then",
        "  if false then",
        t(SCRIPTS, "test_cancel_idle_submitted_task_makes_it_due_now"),
    ),
    Mutant(
        "cancel-reopens-a-finished-task",
        "a terminal task stays as it finished, whatever cancel arrives",
        "lua/_intake.lua",
        "  if not status or not KNOWN[status] or TERMINAL[status] or not t[3] or not int_field(t[5])",
        "  if not status or not KNOWN[status] or not t[3] or not int_field(t[5])",
        t(SCRIPTS, "test_a_cancel_that_arrives_after_the_task_finished_changes_nothing"),
    ),
    # --- deadlines ------------------------------------------------------------------------------
    Mutant(
        "save-ignores-the-deadline",
        "a save past the deadline ends the task TRACKING_TIMED_OUT",
        "lua/_save.lua",
        "  if not TERMINAL[final] and final ~= 'SUBMIT_UNKNOWN' and (deadline or 0) <= NOW then",
        "  if false then",
        ("tests/lua/test_scripts.py", "tests/property/test_state_machine.py"),
    ),
    Mutant(
        "time-out-sweep-reschedules-everything",
        "the deadline sweep times out tasks past their deadline, claimed or not",
        "lua/time_out.lua",
        "  elseif deadline_ms > NOW then",
        "  elseif true then",
        t(SCRIPTS, "test_time_out_sweep_covers_never_claimed_tasks"),
    ),
    # --- create, dedup, intake ------------------------------------------------------------------
    Mutant(
        "dedup-ignores-the-live-task",
        "a dedup key names one live task: a second submit returns it",
        "lua/_create.lua",
        "      if (st and not TERMINAL[st]) or (not st and redis.call('EXISTS', P .. 'new:' .. existing) == 1) then",
        "      if false then",
        t(SCRIPTS, "test_create_dedup_returns_the_live_task"),
    ),
    Mutant(
        "create-resend-is-a-conflict",
        "a create resent with the same id and content returns the stored task",
        "lua/_create.lua",
        "      if (stored[name] or '') ~= wanted[name] then return {-5} end",
        "      if true then return {-5} end",
        t(
            "tests/test_client.py",
            "test_a_create_whose_reply_was_lost_and_resent_by_redis_py_makes_one_task",
        ),
    ),
    Mutant(
        "intake-takes-a-forged-request",
        "a request must be exactly what create writes: a new task, version 1",
        "lua/_intake.lua",
        "  if f.id ~= id or f.status ~= 'PENDING_SUBMIT' or f.version ~= '1' then",
        "  if false then",
        t(SCRIPTS, "test_a_forged_create_request_is_dropped_whole"),
    ),
    # --- roles ----------------------------------------------------------------------------------
    Mutant(
        "daemon-scripts-open-to-producers",
        "daemon scripts ask Redis for the daemon role before writing",
        "lua/_roles.lua",
        "local function daemon_only() redis.call('HDEL', P .. 'role:daemon', '') end",
        "local function daemon_only() end",
        t(
            "tests/test_acl.py",
            "test_daemon_scripts_refuse_producers_and_operator_scripts_refuse_daemons",
        ),
    ),
    Mutant(
        "operator-scripts-open-to-daemons",
        "operator scripts ask Redis for the operator role before writing",
        "lua/_roles.lua",
        "local function operator_only() redis.call('HDEL', P .. 'role:operator', '') end",
        "local function operator_only() end",
        t(
            "tests/test_acl.py",
            "test_daemon_scripts_refuse_producers_and_operator_scripts_refuse_daemons",
        ),
    ),
    # --- admission: buckets and caps ------------------------------------------------------------
    Mutant(
        "bucket-refills-past-its-burst",
        "a token bucket never holds more than its burst",
        "lua/take.lua",
        "    tokens = math.min(burst, tokens + math.max(0, NOW - ms) * rate / 1000)",
        "    tokens = tokens + math.max(0, NOW - ms) * rate / 1000",
        t(LUA_ADMISSION),
    ),
    Mutant(
        "bucket-refills-ten-times-too-fast",
        "a bucket refills at its rate per second",
        "lua/take.lua",
        "    tokens = math.min(burst, tokens + math.max(0, NOW - ms) * rate / 1000)",
        "    tokens = math.min(burst, tokens + math.max(0, NOW - ms) * rate / 100)",
        t(LUA_ADMISSION),
    ),
    Mutant(
        "bucket-grants-a-fraction",
        "only whole tokens are granted",
        "lua/take.lua",
        "    for _, b in ipairs(bs) do granted = math.min(granted, math.floor(b[4])) end",
        "    for _, b in ipairs(bs) do granted = math.min(granted, math.ceil(b[4])) end",
        t(LUA_ADMISSION),
    ),
    # (A refund without its math.min is no mutant: every load caps the tokens at the
    # burst, and a bucket over its burst gets a negative PEXPIRE and starts full again.)
    Mutant(
        "refund-gives-nothing-back",
        "unused grants go back to the bucket",
        "lua/take.lua",
        "      b[4] = math.min(b[3], b[4] + count)",
        "      b[4] = math.min(b[3], b[4])",
        t(LUA_ADMISSION, "test_refund_gives_tokens_back_but_not_above_the_burst"),
    ),
    Mutant(
        "caps-never-full",
        "an in-flight cap holds tasks back once it is full",
        "lua/_schedule.lua",
        "    if n < cap then return false end",
        "    if true then return false end",
        t(LUA_ADMISSION, "test_a_full_cap_holds_tasks_and_a_finish_lets_the_next_one_in"),
    ),
    # --- the client and the worker --------------------------------------------------------------
    Mutant(
        "client-shows-other-tenants-tasks",
        "a client bound to a tenant sees none of another tenant's tasks",
        "asynctaskd/client/tasks.py",
        "    return None if tenant is not None and task.tenant != tenant else task",
        "    return task",
        t("tests/test_client.py", "test_tenants_cannot_see_each_others_tasks"),
    ),
    Mutant(
        "list-cursor-ignores-its-filters",
        "a list cursor is valid only with the filters it was made for",
        "asynctaskd/cursors.py",
        "    if not hmac.compare_digest(token[1 + _KEY_ID : _CLEAR - _IV], _filter_tag(key, filters)):",
        "    if False:",
        ("tests/test_cursors.py",),
    ),
    Mutant(
        "every-transport-error-is-never-sent",
        "only errors raised before any byte left count as never sent (resubmit-safe)",
        "asynctaskd/retry.py",
        "_NEVER_SENT: Final = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, NotSent)",
        "_NEVER_SENT: Final = (httpx.TransportError, NotSent)",
        t("tests/test_retry.py", "test_only_errors_raised_before_any_byte_left_are_never_sent"),
    ),
    Mutant(
        "wait-gate-always-satisfied",
        "a submit starts only after the replicas acknowledged its start mark (WAIT)",
        "asynctaskd/store/batcher.py",
        "        return int(reply) >= self.replicas",
        "        return True",
        ("tests/test_store_pipeline.py::test_a_gated_call_is_durable_only_when_the_gate_is_met",),
    ),
    Mutant(
        "waitaof-gate-always-satisfied",
        "a submit starts only after its start mark is fsynced or replicated (WAITAOF)",
        "asynctaskd/store/batcher.py",
        "            return int(reply[0]) >= self.local and int(reply[1]) >= self.replicas",
        "            return True",
        ("tests/test_store_pipeline.py::test_a_gated_call_is_durable_only_when_the_gate_is_met",),
        all_servers=True,
    ),
    Mutant(
        "poll-saved-in-a-claim-round-slept-through",
        "a poll saved while the claim loop is in a round wakes the loop in time",
        "asynctaskd/worker/claiming.py",
        "        next_due = min(next_due, self.due_hint)",
        "        next_due = next_due",
        t("tests/test_worker.py", "test_a_poll_saved_during_a_claim_round_is_not_slept_through"),
    ),
    Mutant(
        "vendor-delays-uncapped",
        "a vendor's Retry-After is capped at max_error_delay and the deadline",
        "asynctaskd/worker/outcomes.py",
        "        return clamp_delay(delay, now, task.deadline_at, cap=most)",
        "        return delay",
        (
            "tests/test_outcomes.py::test_query_failures",
            *t(
                "tests/test_http_handler.py",
                "test_a_huge_retry_after_is_clamped_and_the_task_stays_readable",
            ),
        ),
    ),
    Mutant(
        "throttles-never-back-off",
        "each vendor throttle in a row waits longer than the last",
        "asynctaskd/worker/outcomes.py",
        "            # jitter, up to max_error_delay), or what the vendor asked for if longer.\n            throttles = task.throttles + 1",
        "            # jitter, up to max_error_delay), or what the vendor asked for if longer.\n            throttles = 1",
        (
            "tests/test_outcomes.py::test_query_failures",
            *t(
                "tests/test_http_handler.py",
                "test_throttles_in_a_row_wait_longer_each_time_and_a_success_resets_them",
            ),
        ),
    ),
    Mutant(
        "full-claim-rounds-linger",
        "a claim round that filled its batch claims again at once",
        "asynctaskd/worker/core.py",
        "            if found.got and not found.more and self.claim_linger:",
        "            if found.got and self.claim_linger:",
        t("tests/test_worker.py", "test_full_claim_rounds_claim_again_at_once"),
    ),
    # --- vendor data ----------------------------------------------------------------------------
    Mutant(
        "pool-disconnect-claimed-never-sent",
        "a connection lost after the request was written is ambiguous, never 'never sent'",
        "asynctaskd/http1/protocol.py",
        '        self._fail(httpx.RemoteProtocolError(f"Server disconnected {message}.", request=request))',
        '        self._fail(httpx.ConnectError(f"Server disconnected {message}.", request=request))',
        t(
            "tests/test_transport.py",
            "test_server_reads_request_then_closes_is_ambiguous_and_not_resent",
        ),
    ),
    Mutant(
        "refused-tunnel-is-ambiguous",
        "a proxy that refuses the CONNECT tunnel means the vendor saw nothing (never sent)",
        "asynctaskd/transport/pool.py",
        "        except httpx.ProxyError as exc:",
        "        except ZeroDivisionError as exc:",
        t("tests/test_proxy.py", "test_a_refused_tunnel_is_never_sent"),
    ),
    Mutant(
        "response-body-unbounded",
        "a response body is cut off once it grows past max_response_bytes",
        "asynctaskd/http1/protocol.py",
        "        if limit is not None and self._received > limit:",
        "        if False:",
        t("tests/test_proxy.py", "test_a_body_over_max_response_bytes_fails_unread"),
    ),
    Mutant(
        "finalize-downloads-from-any-host",
        "finalize downloads only from hosts the handler declares",
        "asynctaskd/downloads.py",
        "        if not (host == also or host in self._exact or host.endswith(self._suffixes)):",
        "        if not (True or host in self._exact or host.endswith(self._suffixes)):",
        t("tests/test_http_handler.py", "test_finalize_downloads_only_from_declared_public_hosts"),
    ),
    Mutant(
        "finalize-connects-to-private-addresses",
        "finalize refuses names that resolve to private, loopback or link-local addresses",
        "asynctaskd/downloads.py",
        '            why = non_public(entry["host"])',
        "            why = None",
        t(
            "tests/test_http_handler.py",
            "test_finalize_refuses_a_declared_name_that_resolves_to_a_private_address",
        ),
    ),
    Mutant(
        "lost-submit-step-parks",
        "a step before the create whose answer is lost runs the submit again, never parks",
        "asynctaskd/http_handler/steps.py",
        "                if exc.throttled or isinstance(exc, NotSent):",
        "                if True:",
        t(
            "tests/test_http_handler_vendors.py",
            "test_a_lost_upload_is_sent_again_and_never_parks_the_task",
            "test_a_step_answer_without_what_it_keeps_is_sent_again",
        ),
    ),
    Mutant(
        "find-follows-a-next-page-anywhere",
        "a listing's next-page URL is followed only on base_url's origin (credentials)",
        "asynctaskd/http_handler/find.py",
        "        if isinstance(url, str) and origin_of(url) == self._base_origin:",
        "        if isinstance(url, str):",
        t(
            "tests/test_http_handler_vendors.py",
            "test_a_next_page_on_another_origin_is_never_requested",
        ),
    ),
    Mutant(
        "resubmits-unbounded",
        "a job that did nothing is submitted again only within retry.max_submit_retries",
        "asynctaskd/worker/outcomes.py",
        "        if task.submit_attempts > retry.max_submit_retries:",
        "        if False:",
        (
            "tests/test_outcomes.py::test_query_results",
            *t("tests/test_http_handler_vendors.py", "test_resubmits_stop_at_max_submit_retries"),
        ),
    ),
    Mutant(
        "dot-segments-reach-the-url",
        "a placeholder value of '.' or '..' never climbs the vendor's path",
        "asynctaskd/http_handler/templates.py",
        '                if ("." in text or not text.isprintable()) and _UNSAFE_IN_URL.search(text):',
        "                if False:",
        t(
            "tests/test_http_handler.py",
            "test_a_url_value_with_a_dot_segment_or_control_character_is_never_sent",
        ),
    ),
    Mutant(
        "lane-batch-answered-at-its-first-reply",
        "a batch on a lane is answered once every reply it sent for has come, in order",
        "asynctaskd/connection/lane.py",
        "                if len(replies) < self.expected:",
        "                if len(replies) < 1:",
        t("tests/test_lane.py", "test_a_batch_gets_the_replies_of_the_pool_path_in_order"),
    ),
)
