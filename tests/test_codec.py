"""Reading a task hash (codec.decode_task): every value it accepts, and what it names when
a value is corrupt (docs/protocol.md section 4). The fuzz tests in tests/fuzz feed it
random garbage through a real Redis; these pin the exact reading."""

from __future__ import annotations

import pytest

from asynctaskd.codec import decode_flat_task, decode_task, pairs_to_dict
from asynctaskd.errors import CorruptTask
from asynctaskd.model import Status, Task, TaskError

TID = "01JDXQ4V7W8Y9Z0A1B2C3D4E5F-3"

# Every field of docs/protocol.md section 4 that decode_task reads, each set.
FULL: dict[bytes, bytes] = {
    b"id": TID.encode(),
    b"handler": b"ocr",
    b"status": b"RUNNING",
    b"params": b'{"page":1}',
    b"metadata": b'{"who":"me"}',
    b"tenant": b"t1",
    b"account": b"acct",
    b"provider": b"vendor-x",
    b"priority": b"5",
    b"external_id": b"job-9",
    b"handle": b'{"external_id":"job-9","query":{"id":"job-9"}}',
    b"result": b"[1,2]",
    b"error_code": b"boom",
    b"error_message": b"it broke",
    b"progress": b"0.25",
    b"stage": b"scan",
    b"message": b"halfway",
    b"created_ms": b"1700000000000",
    b"updated_ms": b"1700000001500",
    b"deadline_ms": b"1700003600000",
    b"due_ms": b"1700000002000",
    b"finished_ms": b"1700000009000",
    b"version": b"7",
    b"submit_attempts": b"1",
    b"poll_count": b"3",
    b"consecutive_errors": b"2",
    b"cancel_requested": b"1",
    b"dedup": b"2:t1:order-42",
    b"fence": b"4",
    b"owner": b"host-1",
    b"started_fence": b"4",
    b"reclaims": b"1",
    b"idempotent": b"1",
}

# Fields whose value must parse, and text that parses as none of an integer, a number or
# JSON.
PARSED = (
    b"handle",
    b"created_ms",
    b"deadline_ms",
    b"progress",
    b"updated_ms",
    b"due_ms",
    b"finished_ms",
    b"params",
    b"metadata",
    b"result",
    b"priority",
    b"version",
    b"submit_attempts",
    b"poll_count",
    b"consecutive_errors",
    b"fence",
    b"started_fence",
    b"reclaims",
)
GARBAGE = b"{x"


def test_a_full_hash_reads_as_every_field_says() -> None:
    assert decode_task(FULL, TID) == Task(
        id=TID,
        handler="ocr",
        status=Status.RUNNING,
        params={"page": 1},
        metadata={"who": "me"},
        tenant="t1",
        account="acct",
        provider="vendor-x",
        priority=5,
        external_id="job-9",
        handle={"external_id": "job-9", "query": {"id": "job-9"}},
        result=[1, 2],
        error=TaskError("boom", "it broke"),
        progress=0.25,
        stage="scan",
        message="halfway",
        created_at=1_700_000_000.0,
        updated_at=1_700_000_001.5,
        deadline_at=1_700_003_600.0,
        due_at=1_700_000_002.0,
        finished_at=1_700_000_009.0,
        version=7,
        submit_attempts=1,
        poll_count=3,
        consecutive_errors=2,
        cancel_requested=True,
        dedup_key="order-42",
        fence=4,
        owner="host-1",
        started_fence=4,
        reclaims=1,
        idempotent=True,
    )


def test_a_minimal_hash_takes_the_defaults() -> None:
    minimal = {
        b"id": TID.encode(),
        b"handler": b"ocr",
        b"status": b"PENDING_SUBMIT",
        b"created_ms": b"1700000000000",
        b"deadline_ms": b"1700003600000",
    }
    assert decode_task(minimal) == Task(
        id=TID,
        handler="ocr",
        status=Status.PENDING_SUBMIT,
        provider="ocr",  # no provider: the handler's key
        created_at=1_700_000_000.0,
        updated_at=1_700_000_000.0,  # never updated: created
        deadline_at=1_700_003_600.0,
    )
    # An empty value to parse reads as an absent one; a negative time as none; flags only
    # as "1".
    empty = dict.fromkeys(PARSED, b"") | minimal
    assert decode_task(empty) == decode_task(minimal)
    odd = minimal | {
        b"due_ms": b"-1",
        b"finished_ms": b"-1",
        b"updated_ms": b"0",
        b"cancel_requested": b"true",
        b"idempotent": b"yes",
        b"error_code": b"",
    }
    task = decode_task(odd)
    assert (task.due_at, task.finished_at, task.updated_at) == (None, None, 1_700_000_000.0)
    assert not task.cancel_requested and not task.idempotent
    assert task.error == TaskError("", "")  # an error code, even empty, is an error


@pytest.mark.parametrize("name", PARSED, ids=lambda n: n.decode())
def test_a_field_that_does_not_parse_is_named(name: bytes) -> None:
    with pytest.raises(CorruptTask) as caught:
        decode_task(FULL | {name: GARBAGE}, TID)
    assert caught.value.task_id == TID
    assert caught.value.reason.startswith(f"field {name.decode()} "), caught.value.reason


TEXT = [n for n in FULL if n not in PARSED and n not in (b"id", b"handler", b"status")]


@pytest.mark.parametrize("name", TEXT, ids=lambda n: n.decode())
def test_a_text_field_never_fails_to_parse(name: bytes) -> None:
    # Any bytes are text (invalid UTF-8 is replaced); id, handler and status are below.
    task = decode_task(FULL | {name: GARBAGE + b"\xff"}, TID)
    assert isinstance(task, Task)


def test_of_several_bad_fields_one_is_named_the_same_way_every_time() -> None:
    bad = FULL | dict.fromkeys(PARSED, GARBAGE)
    reasons = set()
    for _ in range(3):
        with pytest.raises(CorruptTask) as caught:
            decode_task(bad, TID)
        reasons.add(caught.value.reason)
    assert len(reasons) == 1 and reasons.pop().startswith("field handle ")


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({b"id": b"someone-else"}, "field id is 'someone-else'"),
        ({b"handler": b""}, "field handler is missing"),
        ({b"status": b"running"}, "field status is 'running', not a status"),
        ({b"status": b""}, "field status is '', not a status"),
        ({b"handle": b"[1]"}, "field handle is not a JSON object"),
        ({b"created_ms": b""}, "created_ms or deadline_ms is missing"),
        ({b"deadline_ms": b"-5"}, "created_ms or deadline_ms is missing"),
        ({b"progress": b"nan"}, "field progress is b'nan', not a finite number"),
        ({b"progress": b"-inf"}, "field progress is b'-inf', not a finite number"),
        ({b"priority": b"1.5"}, "field priority is b'1.5', not an integer"),
        ({b"st\xffage": b"x"}, "a field name is not UTF-8"),
    ],
)
def test_what_makes_a_hash_corrupt(changes: dict[bytes, bytes], reason: str) -> None:
    with pytest.raises(CorruptTask) as caught:
        decode_task(FULL | changes, TID)
    assert caught.value.reason == reason


def test_a_missing_status_is_corrupt() -> None:
    with pytest.raises(CorruptTask, match="field status is None, not a status"):
        decode_task({k: v for k, v in FULL.items() if k != b"status"}, TID)


def test_a_value_no_field_check_explains_is_still_corrupt_data() -> None:
    # A time too large for a float passes as an integer but cannot become seconds.
    with pytest.raises(CorruptTask, match=r"unreadable \(OverflowError"):
        decode_task(FULL | {b"due_ms": b"9" * 400}, TID)


def _flat(hash_: dict[bytes, bytes]) -> list[bytes]:
    return [part for pair in hash_.items() for part in pair]


@pytest.mark.parametrize(
    "hash_",
    [
        FULL,
        {b"id": TID.encode(), b"handler": b"ocr", b"status": b"SUBMITTED",
         b"created_ms": b"1700000000000", b"deadline_ms": b"1700003600000"},
        FULL | {b"timeout_ms": b"600000", b"started_by": b"tok-1", b"slots": b"cap:x"},
        FULL | {b"a field no script writes": b"x", "é".encode(): b"y"},
    ],
)  # fmt: skip
def test_a_claimed_flat_hash_reads_as_its_dict_does(hash_: dict[bytes, bytes]) -> None:
    # A claim's reply holds each hash as HGETALL's flat list (decode_flat_task).
    assert decode_flat_task(_flat(hash_), TID) == decode_task(hash_, TID)
    assert decode_flat_task(_flat(hash_), TID) == decode_task(pairs_to_dict(_flat(hash_)), TID)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({b"st\xffage": b"x"}, "a field name is not UTF-8"),
        ({b"handler": b""}, "field handler is missing"),
        ({b"fence": GARBAGE}, "field fence is b'{x', not an integer"),
        ({b"handle": GARBAGE}, None),
    ],
)
def test_a_flat_hash_is_corrupt_as_its_dict_is(
    changes: dict[bytes, bytes], reason: str | None
) -> None:
    with pytest.raises(CorruptTask) as flat:
        decode_flat_task(_flat(FULL | changes), TID)
    with pytest.raises(CorruptTask) as mapped:
        decode_task(FULL | changes, TID)
    assert flat.value.reason == mapped.value.reason
    if reason is not None:
        assert flat.value.reason == reason


def test_a_flat_hash_of_an_odd_count_is_refused() -> None:
    with pytest.raises(ValueError, match="shorter"):
        decode_flat_task([*_flat(FULL), b"lonely"], TID)
