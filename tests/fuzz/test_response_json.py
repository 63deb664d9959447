"""`response.json()` on the shared client: msgspec where it agrees with httpx, else httpx.

The client hands handlers responses whose `json()` decodes with msgspec and leaves to
httpx (the standard library's `json.loads`) what msgspec refuses. Whatever the body,
the value, or the exception type, must be the one httpx's own `json()` gives: generated
JSON documents (big integers, NaN and infinities, -0.0, lone surrogates, any text, deep
nesting), with a byte order mark, in UTF-16, or as invalid UTF-8, and arbitrary bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from asynctaskd.transport import _buffered, make_http_client

pytestmark = pytest.mark.anyio

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["utf-8", "ascii", "bom", "utf-16", "bytes", "deep"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "deep":
        depth = draw(st.integers(min_value=1, max_value=5000))
        return b"[" * depth + b"]" * depth
    text = json.dumps(draw(values), ensure_ascii=kind == "ascii")
    if kind == "utf-16":
        return text.encode("utf-16", "surrogatepass")
    raw = text.encode("utf-8", "surrogatepass")  # a lone surrogate: invalid UTF-8
    return b"\xef\xbb\xbf" + raw if kind == "bom" else raw


def outcome(decode: Any) -> tuple[str, str]:
    """A decode's value as repr (NaN, -0.0 and int versus float compare), or its error."""
    try:
        return ("value", repr(decode()))
    except Exception as exc:  # the type is what is compared
        return ("error", type(exc).__name__)


@settings(max_examples=400, deadline=None)
@given(body=bodies())
def test_json_gives_what_httpx_gives(body: bytes) -> None:
    ours = _buffered(200, [(b"Content-Type", b"application/json")], body, b"HTTP/1.1", b"OK")
    theirs = httpx.Response(200, content=body)
    assert outcome(ours.json) == outcome(theirs.json)


def test_json_keyword_arguments_go_to_httpx() -> None:
    body = b'{"a": 1.5, "b": [2, 3]}'
    ours = _buffered(200, [], body, b"HTTP/1.1", b"OK")
    assert ours.json(parse_float=str) == {"a": "1.5", "b": [2, 3]}
    assert ours.json() == {"a": 1.5, "b": [2, 3]}


async def raw_server(body: bytes) -> web.AppRunner:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/doc", answer)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with make_http_client() as http:
        yield http


@pytest.mark.parametrize(
    "body",
    [b'{"id": "job_1", "progress": 0.25, "n": 12345678901234567890}', b'{"x": NaN}', b"\xff"],
)
async def test_the_shared_client_answers_json_as_httpx_does(
    client: httpx.AsyncClient, body: bytes
) -> None:
    runner = await raw_server(body)
    try:
        port = runner.addresses[0][1]
        response = await client.get(f"http://127.0.0.1:{port}/doc")
        assert response.content == body
        assert outcome(response.json) == outcome(lambda: json.loads(body))
        if body.startswith(b'{"x"'):
            assert math.isnan(response.json()["x"])  # through httpx's fallback
    finally:
        await runner.cleanup()
