"""Client inputs: a task is created and reads back equal, or InvalidTask and nothing written.

Hypothesis throws params, metadata and options at `Client.submit(..., strict=False)`:
JSON-like and non-JSON data (bytes, sets, objects, NaN, deep nesting, strings with lone
surrogates), tenant/account/provider/handler strings, priorities of every type, timeouts
and delays including NaN, infinities, negatives, integers too large for a float and
timedeltas, naive and aware `not_before` datetimes, dedup keys. Either the task is created
and `get()` returns exactly what `submit()` returned (params and metadata equal to the
input as JSON), or an `InvalidTask` subclass is raised and DBSIZE is unchanged. Any other
exception is a bug.

The tests at the end are regression tests for two bugs this fuzzing found, both fixed
(docs/reliability.md section 6): a lone surrogate in a string raised UnicodeEncodeError,
an integer too large for a float in a time argument raised OverflowError.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from redis import Redis

from asynctaskd import Client
from asynctaskd.errors import InvalidTask

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# Integers for time arguments reach beyond float range: float() of an int from about
# 2**1024 up raises OverflowError (1.8e308); the edges on both sides are drawn as well.
HUGE = 10**400
FLOAT_EDGE = 2**1024 - 2**970  # the smallest int float() refuses
huge_ints = st.integers(-HUGE, HUGE) | st.sampled_from(
    [FLOAT_EDGE - 1, FLOAT_EDGE, -FLOAT_EDGE, 10**308, 10**309, HUGE, -HUGE]
)


@st.composite
def texts(draw: st.DrawFn, max_size: int) -> str:
    """Any text; now and then with a lone surrogate (not encodable as UTF-8) put in."""
    text = draw(st.text(max_size=max_size))
    if draw(st.integers(0, 3)) == 3:
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.characters(categories=["Cs"])) + text[at:]
    return text


def json_trees(text: Callable[[int], st.SearchStrategy[str]]) -> st.SearchStrategy[Any]:
    """JSON-like data (lists, tuples, dicts) whose strings and keys come from `text`."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-(2**100), 2**100)
        | st.floats(allow_nan=False, allow_infinity=False)
        | text(30)
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.tuples(inner, inner)
            | st.dictionaries(text(10), inner, max_size=4)
        ),
        max_leaves=12,
    )


json_like = json_trees(lambda n: st.text(max_size=n))  # valid JSON data
any_json_like = json_trees(texts)  # lone surrogates too


class Opaque:
    """A custom object: not JSON data."""


not_json = st.one_of(
    st.binary(max_size=8),
    st.sets(st.integers(), max_size=3),
    st.just(Opaque()),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.dictionaries(st.integers(), st.integers(), min_size=1, max_size=2),
    st.just(dt.datetime(2024, 1, 1)),
    st.builds(lambda: iter([1, 2])),
)


def nested(depth: int) -> Any:
    out: Any = 0
    for _ in range(depth):
        out = [out]
    return out


payloads = st.one_of(
    any_json_like,
    any_json_like.flatmap(lambda v: st.sampled_from([[v, x] for x in (b"x", {1, 2}, math.nan)])),
    not_json,
    st.integers(60, 70).map(nested),
    st.integers(100, 300).map(lambda n: "x" * (n * 1024)),  # around the 256 KiB limit
)
names = st.one_of(
    st.none(),
    texts(70),
    st.from_regex(r"[A-Za-z0-9_.:\-]{1,64}", fullmatch=True),
    st.sampled_from(["", "t1", "a b", "x" * 64, "x" * 65, "é", "{s0}", "a:b", "\x00", "\ud800"]),
    st.integers(),
)
seconds = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    huge_ints,
    st.timedeltas(),
    st.booleans(),
    texts(5),
    st.sampled_from([0, 0.0, -0.0, 1e-9, 1e-3, 86400 * 3660, 86400 * 3670, 10**12]),
)
moments = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    huge_ints,
    st.datetimes(timezones=st.none() | st.timezones()),
    st.sampled_from([0, 1.7e9, 1.7e12, 4e9]),
)
options = st.fixed_dictionaries(
    {},
    optional={
        "tenant": names,
        "account": names,
        "provider": names,
        "priority": st.one_of(st.integers(-200, 200), st.floats(), st.booleans(), st.none()),
        "dedup_key": st.one_of(st.none(), texts(220), st.integers()),
        "metadata": payloads,
        "not_before": moments,
        "delay": st.none() | seconds,
    },
)


TEN_YEARS = dt.timedelta(days=3650)
SOON_MIN, SOON_MAX = dt.datetime(2000, 1, 1), dt.datetime(2030, 1, 1)
valid_names = st.from_regex(r"[A-Za-z0-9_.:\-]{1,64}", fullmatch=True)
valid_options = st.fixed_dictionaries(
    {},
    optional={
        "tenant": st.none() | valid_names,
        "account": st.none() | valid_names,
        "provider": st.none() | valid_names,
        "priority": st.integers(-100, 100),
        "dedup_key": st.none() | st.text(min_size=1, max_size=200),
        "metadata": json_like,
        "not_before": st.none()
        | st.floats(0, 2e9)
        | st.datetimes(SOON_MIN, SOON_MAX, timezones=st.timezones()),
        "delay": st.none() | st.floats(0, 1e6) | st.timedeltas(dt.timedelta(0), TEN_YEARS),
    },
)
# One option (or the timeout) replaced by anything at all.
wild_override = st.none() | st.one_of(
    st.tuples(st.sampled_from(["tenant", "account", "provider"]), names),
    st.tuples(st.just("priority"), st.integers(-200, 200) | st.floats() | st.booleans()),
    st.tuples(st.just("dedup_key"), st.none() | texts(220) | st.integers()),
    st.tuples(st.just("metadata"), payloads),
    st.tuples(st.just("not_before"), moments),
    st.tuples(st.just("delay"), seconds),
    st.tuples(st.just("tracking_timeout"), seconds),
)


@pytest.fixture
def client(redis_url: str) -> Iterator[Client]:
    c = Client.from_url(redis_url)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def raw(redis_url: str) -> Iterator[Redis]:
    r = Redis.from_url(redis_url)
    try:
        yield r
    finally:
        r.close()


def as_json(value: Any) -> Any:
    return msgspec.json.decode(msgspec.json.encode(value))


def _event(text: str) -> None:
    # hypothesis.event only exists inside a hypothesis test; the regression tests call us too
    with contextlib.suppress(InvalidArgument):
        event(text)


def submit_and_check(client: Client, raw: Redis, handler: Any, params: Any, **kw: Any) -> None:
    raw.flushdb()
    before = raw.dbsize()
    try:
        task = client.submit(handler, params, strict=False, **kw)
    except InvalidTask as exc:
        _event(f"refused: {type(exc).__name__}")
        message = str(exc)
        assert raw.dbsize() == before, "a refused submit left keys behind"
        assert message, "the error says what is wrong"
        return
    _event("created")
    back = client.get(task.id)
    assert back == task, "the stored task differs from what submit() returned"
    assert back.params == as_json(params)
    assert back.metadata == (None if kw.get("metadata") is None else as_json(kw["metadata"]))
    assert back.tenant == (kw.get("tenant") or "")
    assert back.priority == kw.get("priority", 0)


@FUZZ
@given(
    handler=st.one_of(st.just("demo"), names),
    params=payloads,
    timeout=seconds,
    opts=options,
)
def test_submit_creates_the_task_or_refuses_cleanly(
    client: Client, raw: Redis, handler: Any, params: Any, timeout: Any, opts: dict[str, Any]
) -> None:
    submit_and_check(client, raw, handler, params, tracking_timeout=timeout, **opts)


@FUZZ
@given(
    params=json_like,
    timeout=st.floats(0.001, 86400 * 3650) | st.timedeltas(dt.timedelta(milliseconds=1), TEN_YEARS),
    opts=valid_options,
    override=wild_override,
)
def test_mostly_valid_submits_read_back_equal(
    client: Client,
    raw: Redis,
    params: Any,
    timeout: Any,
    opts: dict[str, Any],
    override: tuple[str, Any] | None,
) -> None:
    kw = {"tracking_timeout": timeout, **opts}
    if kw.get("not_before") is not None:
        kw.pop("delay", None)
    if override is not None:
        kw[override[0]] = override[1]
    submit_and_check(client, raw, "demo", params, **kw)


@settings(FUZZ, max_examples=60)
@given(
    params=json_like,
    timeout=st.floats(0.001, 1e6),
    tenant=st.sampled_from([None, "t1", "t2"]),
    dedup=st.text(min_size=1, max_size=20),
)
def test_dedup_returns_the_live_task_of_the_same_tenant(
    client: Client, raw: Redis, params: Any, timeout: float, tenant: str | None, dedup: str
) -> None:
    raw.flushdb()
    first = client.submit("demo", params, tracking_timeout=timeout, tenant=tenant,
                          dedup_key=dedup, strict=False)  # fmt: skip
    again = client.submit("demo", {"other": 1}, tracking_timeout=timeout, tenant=tenant,
                          dedup_key=dedup, strict=False)  # fmt: skip
    assert again.id == first.id and again.params == as_json(params)
    other = "t3" if tenant != "t3" else "t4"
    third = client.submit("demo", {"other": 2}, tracking_timeout=timeout, tenant=other,
                          dedup_key=dedup, strict=False)  # fmt: skip
    assert third.id != first.id


# --- Regression tests for bugs found by this fuzzing (fixed; see the module docstring) ---


@pytest.mark.parametrize(
    "kw",
    [
        {"params": {"text": "\ud800"}},
        {"params": {"\udfff": 1}},
        {"params": {}, "metadata": ["\ud83d"]},
        {"params": {}, "dedup_key": "order-\ud800"},
    ],
    ids=["params-value", "params-key", "metadata", "dedup_key"],
)
def test_lone_surrogates_are_refused_with_invalid_task(
    client: Client, raw: Redis, kw: dict[str, Any]
) -> None:
    kw = dict(kw)  # the parameter dict is shared by every server's run
    params = kw.pop("params")
    submit_and_check(client, raw, "demo", params, tracking_timeout=60, **kw)


@pytest.mark.parametrize("arg", ["tracking_timeout", "delay", "not_before"])
def test_huge_integers_in_time_arguments_are_refused_with_invalid_task(
    client: Client, raw: Redis, arg: str
) -> None:
    kw: dict[str, Any] = {"tracking_timeout": 60, arg: 10**400}
    submit_and_check(client, raw, "demo", {}, **kw)
