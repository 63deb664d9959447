"""JSON on the shared client: `response.json()` is httpx's own; `Reply.json()` (ctx.fetch)
decodes with msgspec and agrees with the standard library wherever both accept a document.

Generated JSON documents (big integers, NaN and infinities, -0.0, lone surrogates, any
text, deep nesting), with a byte order mark, in UTF-16, or as invalid UTF-8, and arbitrary
bytes: `Reply.json()` gives the standard library's value, or raises ValueError where
msgspec is stricter (NaN, Infinity, numbers beyond a double, a BOM, UTF-16).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from asynctaskd.transport import Reply, make_http_client

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
def test_reply_json_agrees_with_the_standard_library_or_refuses(body: bytes) -> None:
    ours = outcome(Reply(200, [], body).json)
    # The standard library's depth limit is the interpreter's recursion limit less the
    # frames of whoever calls it (pytest, hypothesis): raised here, so that it decodes
    # every depth this test builds and the comparison does not depend on the caller.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        theirs = outcome(lambda: json.loads(body))
    finally:
        sys.setrecursionlimit(limit)
    if ours[0] == "value":
        assert ours == theirs
    else:
        assert ours == ("error", "ValueError")


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
