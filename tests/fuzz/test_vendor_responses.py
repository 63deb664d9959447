"""Vendor answers: whatever comes back, the HTTP handler ends in a defined outcome.

A loopback TCP server answers every request with bytes hypothesis chose: any status from
200 to 599 with any reason phrase, odd or missing Content-Type, Retry-After values (valid,
negative, huge, dates, garbage), framings that lie (short or long Content-Length, broken
chunks, no length, a garbled head), and bodies that are the expected documents with
missing or wrong-typed fields at the configured JSON pointers, any JSON, truncated JSON,
non-JSON, invalid UTF-8, JSON nested thousands deep, or megabytes of it. Many of them
echo the handler's credential back, as a vendor quoting the request does.

`HttpHandler.submit`, `query`, `cancel` and `finalize` are driven through the client the
worker hands to handlers (`make_http_client`). Each call must, within a bound:

- return its outcome (`Submitted`; `Running`, `Succeeded` or `Failed`; nothing for cancel;
  the result for finalize), or raise one of the classified errors the module documents
  (`RetryableError`, `NotSent`, `PermanentError`) with a code and a message naming the
  call, never any other exception;
- raise `NotSent` only when no byte of the request reached the server;
- give a Retry-After delay that is finite and not negative, or none;
- return outcomes the worker can store (JSON-encodable);
- never show the credential: not in an outcome, a message, a repr, a formatted traceback
  or a log line.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
import traceback
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asynctaskd.codec import encode_json
from asynctaskd.config import HandlerConfig
from asynctaskd.errors import HandlerError, NotSent, PermanentError, RetryableError
from asynctaskd.handlers import Failed, HandlerContext, Running, Submitted, Succeeded
from asynctaskd.http_handler import HttpHandler, build
from asynctaskd.transport import make_http_client

pytestmark = pytest.mark.anyio

SECRET: Final = "fuzz-secret-7Hq2Zx9Lw4Pk"
TOKEN_ENV: Final = "FUZZ_VENDOR_TOKEN"
READ_TIMEOUT: Final = 0.2
TOTAL_TIMEOUT: Final = 0.6
HANG: Final = 5.0  # a call still running after this long is a hang
CLASSIFIED: Final = (RetryableError, NotSent, PermanentError)
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# ---- the vendor: a raw socket that answers with whatever bytes the test chose ----------------


@dataclass
class Answer:
    """One HTTP answer, described loosely enough to be wrong in every way."""

    status: int = 200
    reason: bytes = b"OK"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b"{}"
    framing: str = "length"

    def wire(self) -> bytes:
        if self.framing == "garbled":
            return self.body
        version = b"HTTP/1.0" if self.framing == "http10" else b"HTTP/1.1"
        headers = [*self.headers, (b"Connection", b"close")]
        body = self.body
        n = len(body)
        if self.framing in ("length", "http10"):
            headers.append((b"Content-Length", b"%d" % n))
        elif self.framing == "short":  # promises more than it sends: a truncated answer
            headers.append((b"Content-Length", b"%d" % (n + 17)))
        elif self.framing == "long":  # promises less than it sends
            headers.append((b"Content-Length", b"%d" % (n // 2)))
        elif self.framing == "two-lengths":
            headers += [(b"Content-Length", b"%d" % n), (b"Content-Length", b"%d" % (n + 1))]
        elif self.framing == "bad-length":
            headers.append((b"Content-Length", b"12abc"))
        elif self.framing == "chunked":
            headers.append((b"Transfer-Encoding", b"chunked"))
            body = (b"%x\r\n%s\r\n" % (n, body) if n else b"") + b"0\r\n\r\n"
        elif self.framing == "bad-chunks":
            headers.append((b"Transfer-Encoding", b"chunked"))
            body = b"zz\r\n" + body + b"\r\n"
        # "close": no length at all, the body ends when the connection does.
        head = b"%s %d %s\r\n" % (version, self.status, self.reason)
        head += b"".join(k + b": " + v + b"\r\n" for k, v in headers)
        return head + b"\r\n" + body


class Vendor:
    """Answers every request on 127.0.0.1 with `answer`, then closes the connection."""

    def __init__(self) -> None:
        self.answer = Answer()
        self.requests: list[bytes] = []  # each request's head and body, as received
        self.stall = 0.0  # >0: send half the answer, then wait this long
        self.trickle = 0.0  # >0: send the answer a byte at a time, this far apart
        self.http: httpx.AsyncClient | None = None  # the client the handler is given
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            body = await reader.readexactly(int(length[1])) if length else b""
            self.requests.append(head + body)
            data = self.answer.wire()
            if self.trickle:
                for i in range(len(data)):
                    writer.write(data[i : i + 1])
                    await writer.drain()
                    await asyncio.sleep(self.trickle)
            elif self.stall:
                writer.write(data[: len(data) // 2])
                await writer.drain()
                await asyncio.sleep(self.stall)
            else:
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the client gave up or went away: its side is what is under test
        finally:
            self._writers.discard(writer)
            writer.close()


@pytest.fixture
async def vendor(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Vendor]:
    monkeypatch.setenv(TOKEN_ENV, SECRET)
    server = Vendor()
    await server.start()
    # One client for all of a test's examples, as the worker shares one (a new client
    # costs ~40 ms of TLS setup). Every answer closes its connection, so none is reused.
    async with make_http_client() as server.http:
        try:
            yield server
        finally:
            await server.stop()


# ---- strategies ---------------------------------------------------------------------------------

STATUSES = ("queued", "running", "done", "error", "canceled")

texts = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", *STATUSES, "job-1", "0"]),
    st.just(SECRET),
    st.builds(lambda a, b: f"{a}{SECRET}{b}", st.text(max_size=4), st.text(max_size=4)),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    texts,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=10,
)


def either(right: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The value the handler expects at a pointer, or anything else."""
    return st.one_of(right, json_values)


numbers = st.one_of(
    st.integers(-5, 200),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, 1e308, -1e308, 5e-324, 2**64]),
)


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of the strategies, picked in proportion to its weight."""
    return st.sampled_from([s for w, s in choices for _ in range(w)]).flatmap(lambda s: s)


extras = {
    "region": json_values,
    "progress": either(numbers),
    "total": either(numbers),
    "stage": either(texts),
    "message": either(texts),
    "output": json_values,
    "error": either(st.fixed_dictionaries({}, optional={"code": texts, "message": texts})),
    "files": json_values,
}
# What a vendor that keeps to its API sends: the id and the status where they belong.
good_documents = st.fixed_dictionaries(
    {"id": st.text(min_size=1, max_size=12) | st.integers(), "status": st.sampled_from(STATUSES)},
    optional=extras,
)
# Anything goes, field by field.
documents = st.fixed_dictionaries(
    {},
    optional={
        "id": either(st.one_of(st.text(min_size=1, max_size=12), st.integers())),
        "status": either(st.sampled_from(STATUSES)),
        **extras,
    },
)


def nested(depth: int, shape: str) -> bytes:
    if shape == "list":
        return b"[" * depth + b"]" * depth
    return b'{"status":' * depth + b'"done"' + b"}" * depth


def huge(megabytes: int, shape: str) -> bytes:
    n = megabytes * 1024 * 1024
    if shape == "string":
        return b'{"id":"j","status":"done","output":"' + b"x" * n + b'"}'
    items = b",".join([b"1234567"] * (n // 8))
    return b'{"id":"j","status":"done","output":[' + items + b"]}"


encode = msgspec.json.encode
bodies = weighted(
    (8, good_documents.map(encode)),
    (3, documents.map(encode)),
    (1, json_values.map(encode)),
    (1, st.tuples(documents.map(encode), st.integers(0, 60)).map(lambda t: t[0][: t[1]])),
    (1, st.binary(max_size=64)),
    (
        2,
        st.sampled_from(
            [
                b"",
                b"null",
                b"NaN",
                b'{"id": 1e400, "status": 1e400}',
                b'{"id": ' + b"9" * 500 + b"}",
                b'{"id": "\xff\xfe", "status": "do\xc3ne"}',
                b'\xef\xbb\xbf{"id": "j", "status": "done"}',
                b'{"id": "j", "status": "\\ud800"}',
                b'{"status": "done", "status": "error", "id": "a", "id": 7}',
                b"<html><body>Bad gateway</body></html>",
                f"<html>you sent Authorization: Bearer {SECRET}</html>".encode(),
                f'{{"error": "bad token {SECRET}"}}'.encode(),
            ]
        ),
    ),
    (
        1,
        st.tuples(st.integers(500, 20_000), st.sampled_from(["list", "dict"])).map(
            lambda t: nested(*t)
        ),
    ),
    (
        1,
        st.tuples(st.integers(1, 3), st.sampled_from(["string", "array"])).map(lambda t: huge(*t)),
    ),
)
header_text = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=30
).map(lambda s: s.encode("latin-1"))
content_types = st.one_of(
    st.none(),
    st.sampled_from(
        [
            b"application/json",
            b"application/json; charset=utf-16",
            b"text/html",
            b"text/plain; charset=utf-8",
            b"application/octet-stream",
            b"multipart/form-data; boundary=x",
            b"",
            b";;;garbage/",
            SECRET.encode(),
        ]
    ),
    header_text,
)
retry_afters = st.one_of(
    st.none(),
    st.sampled_from(
        [
            b"0",
            b"1",
            b"2.5",
            b"-5",
            b"-0",
            b"99999999999999999999",
            b"1" * 400,
            b"1e9",
            b"inf",
            b"nan",
            b"soon",
            b"",
            b"Wed, 21 Oct 2015 07:28:00 GMT",
            b"Fri, 31 Dec 9999 23:59:59 GMT",
            b"Mon, 01 Jan 0001 00:00:00 GMT",
            b"Thu, 01 Jan 1970 00:00:00 +9999",
            time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30)).encode(),
            SECRET.encode(),
        ]
    ),
    header_text,
)
extra_headers = st.lists(
    st.tuples(
        st.sampled_from(
            [
                b"X-Request-Id",
                b"Content-Encoding",
                b"Location",
                b"Set-Cookie",
                b"Content-Type",
                b"Retry-After",
                b"X-Echo",
            ]
        ),
        st.one_of(
            header_text,
            st.sampled_from([b"gzip", b"br", b"identity", b"zstd"]),
            st.just(SECRET.encode()),
        ),
    ),
    max_size=3,
)
reasons = st.one_of(
    st.sampled_from([b"OK", b"", b"Too Many Requests", b"Internal Server Error"]),
    st.just(b"token " + SECRET.encode()),
    header_text,
)
FRAMINGS = (
    "length",
    "close",
    "chunked",
    "short",
    "long",
    "two-lengths",
    "bad-length",
    "bad-chunks",
    "http10",
    "garbled",
)


@st.composite
def answers(draw: st.DrawFn) -> Answer:
    framing = draw(st.sampled_from(["length"] * 12 + ["close", "chunked"] * 3 + list(FRAMINGS)))
    if framing == "garbled":
        junk = draw(st.one_of(st.binary(max_size=80), bodies))
        prefix = draw(st.sampled_from([b"", b"HTTP/1.1 ", b"HTTP/1.1 200 OK\r\n", b"HTTP/9 2"]))
        return Answer(body=prefix + junk, framing=framing)
    status = draw(
        weighted(
            (6, st.sampled_from([200, 201, 202])),
            (2, st.integers(200, 599)),
            (2, st.sampled_from([204, 304, 400, 404, 408, 409, 422, 429, 500, 502, 503])),
        )
    )
    headers: list[tuple[bytes, bytes]] = []
    content_type = draw(content_types)
    if content_type is not None:
        headers.append((b"Content-Type", content_type))
    retry_after = draw(retry_afters)
    if retry_after is not None:
        headers.append((b"Retry-After", retry_after))
    headers += draw(extra_headers)
    return Answer(status, draw(reasons), headers, draw(bodies), framing)


def base_options(
    *,
    unknown: str = "running",
    permanent: list[int] | None = None,
    retryable: list[int] | tuple[()] = (),
    result: str | dict[str, str] = "/output",
    idempotent: bool = False,
    progress_scale: float | None = None,
) -> dict[str, Any]:
    """The fuzzed handler's options (base_url is filled in by `handler_for`)."""
    query: dict[str, Any] = {
        "url": "{base_url}/jobs/{external_id}?region={handle.region?}",
        "status": "/status",
        "running": ["queued", "running"],
        "succeeded": ["done"],
        "failed": ["error", "canceled"],
        "unknown": unknown,
        "progress": "/progress",
        "stage": "/stage",
        "message": "/message",
        "result": result,
        "error_code": "/error/code",
        "error_message": "/error/message",
    }
    if progress_scale is not None:
        query["progress_total"] = "/total"
        query["progress_scale"] = progress_scale
    return {
        "idempotent": idempotent,
        "headers": {"Authorization": "Bearer {env:" + TOKEN_ENV + "}"},
        "timeouts": {"connect": "1s", "read": f"{READ_TIMEOUT}s", "total": f"{TOTAL_TIMEOUT}s"},
        "submit": {
            "url": "{base_url}/jobs",
            "body": {"input": "{params}"},
            "id": "/id",
            "handle": {"region": "/region"},
        },
        "query": query,
        "cancel": {"url": "{base_url}/jobs/{external_id}/cancel"},
        "errors": {"permanent": permanent, "retryable": list(retryable)},
    }


RESULTS: Final[list[str | dict[str, str]]] = ["/output", "", {"out": "/output", "all": ""}]


@st.composite
def handler_options(draw: st.DrawFn) -> dict[str, Any]:
    """The choices that change how answers are classified."""
    permanent = draw(st.none() | st.lists(st.integers(300, 599), max_size=3))
    retryable = draw(st.lists(st.integers(300, 599), max_size=3))
    return base_options(
        unknown=draw(st.sampled_from(["running", "error", "failed"])),
        permanent=permanent,
        retryable=[s for s in retryable if s not in (permanent or ())],
        result=draw(st.sampled_from(RESULTS)),
        idempotent=draw(st.booleans()),
        progress_scale=draw(st.none() | st.sampled_from([1.0, 100.0, 1e-300])),
    )


# ---- driving the handler and judging what it did -----------------------------------------------


def handler_for(options: dict[str, Any], vendor: Vendor) -> HttpHandler:
    options = {**options, "base_url": vendor.url}
    return build(HandlerConfig(key="fuzz", type="http", options=options))


def ctx_for(http: Any) -> HandlerContext:
    return HandlerContext(
        task_id="task-1",
        idempotency_key="task-1",
        handler="fuzz",
        tenant="",
        account="",
        provider="fuzz",
        submit_attempt=1,
        poll_count=0,
        deadline_at=time.time() + 60,
        cancel_requested=False,
        http=http,
        logger=logging.LoggerAdapter(logging.getLogger("test.fuzz.vendor"), {}),
    )


def leaks(text: str) -> bool:
    return SECRET in text


def leaked_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Log lines of this example that show the credential (the fixture spans examples)."""
    lines = [r.getMessage() for r in caplog.records if leaks(r.getMessage())]
    caplog.clear()
    return lines


async def outcome_of(call: Awaitable[Any], what: str) -> Any:
    """What the call returned, or the HandlerError it raised; anything else propagates."""
    try:
        with anyio.fail_after(HANG):
            return await call
    except TimeoutError:
        pytest.fail(f"{what} hung for {HANG}s (timeouts.total is {TOTAL_TIMEOUT}s)")
    except HandlerError as exc:
        return exc


def check_error(exc: HandlerError, what: str, *, reached: bool) -> None:
    assert type(exc) in CLASSIFIED, f"{what} raised {type(exc).__name__}: {exc}"
    assert isinstance(exc.message, str) and exc.message.startswith(f"{what}:"), repr(exc)
    assert str(exc) == exc.message
    assert re.fullmatch(r"[A-Z][A-Z0-9_]*", exc.code), exc.code
    if isinstance(exc, RetryableError):
        assert isinstance(exc.throttled, bool)
    if exc.retry_after is not None:
        assert math.isfinite(exc.retry_after) and exc.retry_after >= 0, exc.retry_after
    if isinstance(exc, NotSent):
        assert not reached, f"NotSent, but the request reached the vendor: {exc}"
    shown = "".join(traceback.format_exception(exc)) + repr(exc) + exc.code
    assert not leaks(shown), f"the credential leaked from {what}: {shown}"


def check_outcome(value: Any, what: str, given: Any = None) -> None:
    """Storable, and no credential beyond any that was in what the call was handed."""
    encoded = encode_json(value).decode()  # the worker stores it: it must encode
    allowed = encode(given).decode().count(SECRET)
    for shown in (repr(value), encoded):
        assert shown.count(SECRET) <= allowed, f"the credential leaked from {what}: {shown[:400]}"


async def drive(
    vendor: Vendor, options: dict[str, Any], answer: Answer, what: str, given: Any = None
) -> Any:
    """Serve `answer`, make one call, check it; returns the outcome or the error raised."""
    vendor.answer = answer
    handler = handler_for(options, vendor)
    seen = len(vendor.requests)
    assert vendor.http is not None
    # httpx keeps the cookies answers set and sends them on; one example's Set-Cookie must
    # not decide the next one (see test_a_cookie_the_vendor_sets_does_not_break_the_client).
    vendor.http.cookies.clear()
    ctx = ctx_for(vendor.http)
    call: Awaitable[Any]
    if what == "submit":
        call = handler.submit({"doc": "a.pdf"}, ctx)
    elif what == "query":
        call = handler.query(given, ctx)
    elif what == "cancel":
        call = handler.cancel(given, ctx)
    else:
        call = handler.finalize(given, ctx)
    out = await outcome_of(call, what)
    reached = len(vendor.requests) > seen
    if reached and what != "finalize":  # downloads from elsewhere carry no credential
        assert b"Bearer " + SECRET.encode() in vendor.requests[-1], "the credential was not sent"
    if isinstance(out, HandlerError):
        check_error(out, what, reached=reached)
    else:
        check_outcome(out, what, given if what == "finalize" else None)
    return out


def tally(out: Any, what: str) -> None:
    """Count outcomes in hypothesis' statistics (--hypothesis-show-statistics)."""
    kind = type(out).__name__
    event(f"{what}: {kind} {out.code}" if isinstance(out, HandlerError) else f"{what}: {kind}")


handles = st.fixed_dictionaries(
    {"external_id": st.sampled_from(["job-1", "a/b?c", "ü"])}, optional={"region": json_values}
)


@FUZZ
@given(answer=answers(), options=handler_options())
async def test_submit_ends_in_a_defined_outcome(
    vendor: Vendor, answer: Answer, options: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.clear()
    out = await drive(vendor, options, answer, "submit")
    tally(out, "submit")
    if not isinstance(out, HandlerError):
        assert isinstance(out, Submitted), out
        assert isinstance(out.external_id, str) and out.external_id
        assert set(out.query) == {"region"}
    assert not leaked_lines(caplog)


@FUZZ
@given(answer=answers(), options=handler_options(), handle=handles)
async def test_query_ends_in_a_defined_outcome(
    vendor: Vendor,
    answer: Answer,
    options: dict[str, Any],
    handle: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.clear()
    out = await drive(vendor, options, answer, "query", handle)
    tally(out, "query")
    if isinstance(out, Running):
        # Any float: the worker keeps only finite values, clamped into 0..1.
        assert out.progress is None or isinstance(out.progress, float), out
        assert out.stage is None or isinstance(out.stage, str)
        assert out.message is None or isinstance(out.message, str)
    elif isinstance(out, Failed):
        assert isinstance(out.code, str) and out.code and len(out.code) <= 200, out
        assert isinstance(out.message, str)
    else:
        assert isinstance(out, Succeeded | HandlerError), out
    assert not leaked_lines(caplog)


@FUZZ
@given(answer=answers(), options=handler_options(), handle=handles)
async def test_cancel_ends_in_a_defined_outcome(
    vendor: Vendor,
    answer: Answer,
    options: dict[str, Any],
    handle: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.clear()
    out = await drive(vendor, options, answer, "cancel", handle)
    tally(out, "cancel")
    assert out is None or isinstance(out, HandlerError), out
    assert not leaked_lines(caplog)


VENDOR = "http://vendor.invalid"  # replaced by the fuzz server's URL in each example

file_values = st.one_of(
    st.builds(lambda name: f"{VENDOR}/files/{name}", st.text(max_size=8)),
    st.sampled_from(
        [
            f"{VENDOR}/files/a.png",
            f"{VENDOR}/files/{SECRET}.bin",
            f"{VENDOR}/files/x?token={SECRET}",
            "http://127.0.0.1:1/closed",
            "http://\x00/nul",
            "http://[::1/bad",
            "http://h:99999/port",
            "http://exa mple.com/space",
            "ftp://x/y",
            "http:///nohost",
            "https://127.0.0.1:1/tls",
            VENDOR.replace("http", "https") + "/tls",
        ]
    ),
    json_values,
)


@st.composite
def finalize_cases(draw: st.DrawFn) -> tuple[dict[str, Any], Any]:
    """Finalize options, and a result whose file values are the vendor's to choose."""
    files = draw(st.one_of(file_values, st.lists(file_values, max_size=3)))
    finalize: dict[str, Any] = {
        "files": ["/files", "/missing"],
        "attempts": 1,
        "timeout": "2s",
        "max_bytes": draw(st.sampled_from([1, 1024, 8 * 1024 * 1024])),
    }
    if draw(st.booleans()):
        finalize["put"] = VENDOR + "/store/{name}"
        finalize["headers"] = {"X-Store-Key": "{env:" + TOKEN_ENV + "}"}
    else:
        finalize["dir"] = "<dir>"
    if draw(st.booleans()):
        finalize["download"] = "{base_url}/files/{value}"
    # The fuzzed vendor is on loopback: allowed or not, declared or not.
    finalize["hosts"] = draw(st.sampled_from([[], ["127.0.0.1"], ["127.0.0.1", "localhost"]]))
    finalize["allow_private_addresses"] = draw(st.booleans())
    return finalize, {"files": files, "text": draw(texts)}


def substitute(value: Any, old: str, new: str) -> Any:
    return msgspec.json.decode(encode(value).replace(old.encode(), new.encode()))


@settings(FUZZ, max_examples=100)
@given(answer=answers(), options=handler_options(), case=finalize_cases())
async def test_finalize_ends_in_a_defined_outcome(
    vendor: Vendor,
    answer: Answer,
    options: dict[str, Any],
    case: tuple[dict[str, Any], Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.clear()
    finalize, result = substitute(substitute(case, VENDOR, vendor.url), "<dir>", str(tmp_path))
    seen = len(vendor.requests)
    out = await drive(vendor, {**options, "finalize": finalize}, answer, "finalize", result)
    tally(out, "finalize")
    if isinstance(out, PermanentError):
        # A URL finalize may not fetch, or a file id that would change the download URL's
        # path: refused for good, before any request of that copy.
        assert out.code in ("FINALIZE_REFUSED", "UNSAFE_VALUE"), repr(out)
        if not isinstance(result["files"], list):
            assert len(vendor.requests) == seen, "a refused download reached the vendor"
    elif isinstance(out, HandlerError):
        # A copy that failed leaves the task RUNNING: finalize is retried.
        assert isinstance(out, RetryableError) and not isinstance(out, NotSent), repr(out)
        assert out.code == "FINALIZE_FAILED", repr(out)
    assert not leaked_lines(caplog)


# ---- the bounds: a vendor that never finishes its answer ----------------------------------------


@pytest.mark.parametrize("what", ["submit", "query", "cancel"])
@pytest.mark.parametrize("mode", ["stall", "trickle"])
async def test_an_answer_that_never_completes_is_cut_off(
    vendor: Vendor, what: str, mode: str
) -> None:
    if mode == "stall":
        vendor.stall = 3.0  # half the answer, then nothing: the read timeout ends it
    else:
        vendor.trickle = 0.05  # a byte every 50 ms, each within the read timeout
    answer = Answer(body=encode({"id": "job-1", "status": "done", "output": "x" * 200}))
    started = time.monotonic()
    out = await drive(vendor, base_options(), answer, what, {"external_id": "job-1"})
    elapsed = time.monotonic() - started
    assert isinstance(out, RetryableError) and not isinstance(out, NotSent), out
    assert out.code == ("READ_TIMEOUT" if mode == "stall" else "TOTAL_TIMEOUT"), out
    assert "may have reached the vendor" in out.message
    assert elapsed < TOTAL_TIMEOUT + 1.0, elapsed


# ---- regressions: what this fuzzing found in http_handler.py (fixed there) ---------------------


@pytest.mark.parametrize("what", ["submit", "query"])
async def test_an_answer_nested_too_deeply_is_vendor_garbage(vendor: Vendor, what: str) -> None:
    """msgspec raises RecursionError (not DecodeError) past the recursion limit; it escaped."""
    answer = Answer(body=nested(100_000, "list"))
    out = await drive(vendor, base_options(), answer, what, {"external_id": "job-1"})
    assert isinstance(out, RetryableError) and out.code == "VENDOR_GARBAGE", out
    assert "nested too deeply" in out.message


def echoing(doc: dict[str, Any]) -> Answer:
    return Answer(body=encode(doc), headers=[(b"Content-Type", b"application/json")])


async def test_a_credential_echoed_in_an_answer_is_masked_everywhere(
    vendor: Vendor, caplog: pytest.LogCaptureFixture
) -> None:
    """Values read from answers went into ids, handles, results, codes and messages as is."""
    caplog.set_level(logging.DEBUG)
    quoted = f"bad token Bearer {SECRET}"
    escaped = encode({"id": "job-1", "region": "eu"}).replace(
        b'"eu"', b'"\\u0065u ' + SECRET.replace("-", "\\u002d").encode() + b'"'
    )
    handle = {"external_id": "job-1"}
    options = base_options(unknown="error")
    cases: list[tuple[str, Answer]] = [
        ("submit", echoing({"id": [quoted]})),  # garbage: "found list [...]" in the message
        ("submit", echoing({"id": quoted, "region": {quoted: quoted}})),
        ("submit", Answer(body=escaped)),  # JSON escapes spell the credential
        ("query", echoing({"status": quoted})),  # UNKNOWN_STATUS names the status
        ("query", echoing({"status": ["x", quoted]})),
        ("query", echoing({"status": "error", "error": {"code": quoted, "message": quoted}})),
        ("query", echoing({"status": "running", "stage": quoted, "message": quoted})),
        ("query", echoing({"status": "done", "output": {"text": quoted, quoted: [quoted]}})),
    ]
    outcomes = [await drive(vendor, options, answer, what, handle) for what, answer in cases]
    assert isinstance(outcomes[1], Submitted) and outcomes[1].external_id == "bad token Bearer ***"
    assert isinstance(outcomes[2], Submitted) and outcomes[2].query == {"region": "eu ***"}
    assert isinstance(outcomes[3], RetryableError) and outcomes[3].code == "UNKNOWN_STATUS"
    assert isinstance(outcomes[5], Failed) and outcomes[5].code == "bad token Bearer ***"
    assert isinstance(outcomes[7], Succeeded)
    assert outcomes[7].result == {
        "text": "bad token Bearer ***",
        "bad token Bearer ***": ["bad token Bearer ***"],
    }
    assert not leaked_lines(caplog)


async def test_a_credential_in_the_reason_phrase_stays_out_of_httpx_logs(
    vendor: Vendor, caplog: pytest.LogCaptureFixture
) -> None:
    """httpx logs the status line at INFO; only credentials in base_url were masked there.
    (The handler's calls take `ctx.fetch`'s direct path, which logs no line; a call it
    cannot take, here one with a dot segment, goes through httpx and its log line.)"""
    caplog.set_level(logging.INFO, logger="httpx")
    answer = Answer(reason=b"OK " + SECRET.encode(), body=b'{"id": "job-1"}')
    options = base_options()
    options["submit"] = {**options["submit"], "url": "{base_url}/./v1/jobs"}
    out = await drive(vendor, options, answer, "submit")
    assert isinstance(out, Submitted)
    assert any("HTTP Request: POST" in r.getMessage() for r in caplog.records)
    assert not leaked_lines(caplog)


async def test_finalize_with_an_unusable_file_url_is_retried(
    vendor: Vendor, tmp_path: Path
) -> None:
    """httpx.InvalidURL is no httpx.HTTPError: it escaped finalize unclassified. Such a URL
    is still a retried copy failure (whatever hosts are allowed), and never fetched."""
    finalize = {"files": ["/files"], "dir": str(tmp_path), "attempts": 1,
                "hosts": ["127.0.0.1"], "allow_private_addresses": True}  # fmt: skip
    options = {**base_options(), "finalize": finalize}
    seen = len(vendor.requests)
    for url in (f"{vendor.url}/files/\x1f", "http://\x00/nul"):
        out = await drive(vendor, options, Answer(), "finalize", {"files": url})
        assert isinstance(out, RetryableError) and out.code == "FINALIZE_FAILED", out
        assert "not a usable URL" in out.message
    assert len(vendor.requests) == seen


# ---- found by this fuzzing outside http_handler.py ----------------------------------------------


async def test_a_cookie_the_vendor_sets_does_not_break_the_client(vendor: Vendor) -> None:
    """The shared client used to keep httpx's cookie jar: a Set-Cookie value that is not
    ASCII made every later request to that host unbuildable, and each of those tasks failed
    for good (INVALID_REQUEST), whatever handler or account it belonged to. It keeps no
    cookies now."""
    assert vendor.http is not None
    vendor.answer = Answer(
        headers=[(b"Set-Cookie", "s=\xdd".encode("latin-1"))], body=b'{"id": "job-1"}'
    )
    handler = handler_for(base_options(), vendor)
    ctx = ctx_for(vendor.http)
    assert isinstance(await handler.submit({}, ctx), Submitted)
    assert isinstance(await handler.submit({}, ctx), Submitted)
    assert not vendor.http.cookies
