"""docs/api.md is the HTTP API's reference: a section for every route the server has
(none for a route it has not), the OpenAPI document's paths equal to the server's routes,
and every `error.code` the web package can answer with in the Errors table, under its
status."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
from aiohttp import web

import asynctaskd.web
from asynctaskd.client import AsyncClient
from asynctaskd.web import WebSettings, make_app
from asynctaskd.web.schemas import openapi

pytestmark = pytest.mark.anyio

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
WEB = Path(asynctaskd.web.__file__).parent
PREFIX = "/api/v1"
_HEADING = re.compile(r"^#{2,4} (.*)$", re.M)
_ROUTE = re.compile(r"`(GET|POST|PUT|DELETE|PATCH) (/[^`\s]*)`")
Route = tuple[str, str]


def documented_routes(text: str) -> list[Route]:
    """Every "`METHOD /path`" named in a heading of `text`, in order (repeats kept)."""
    return [m.groups() for h in _HEADING.findall(text) for m in _ROUTE.finditer(h)]


def served_routes(app: web.Application) -> set[Route]:
    """The app's routes as (method, path template), but the console's (docs/console.md:
    `/` and `/console/...`) and the HEAD aiohttp adds to a GET."""
    out: set[Route] = set()
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if route.method == "HEAD" or path == "/" or path.startswith("/console"):
            continue
        out.add((route.method, path))
    return out


def openapi_routes(document: dict[str, Any]) -> set[Route]:
    base = document["servers"][0]["url"]
    return {(m.upper(), base + p) for p, ops in document["paths"].items() for m in ops}


@pytest.fixture
async def app(redis_client: redis.asyncio.Redis) -> web.Application:
    return make_app(AsyncClient(redis_client, "atd"), WebSettings())


def _diff(served: set[Route], named: set[Route], where: str = "docs/api.md") -> str:
    return (f"served but not in {where}: {sorted(served - named)}; "
            f"in {where} but not served: {sorted(named - served)}")  # fmt: skip


async def test_every_route_has_a_section_and_every_section_a_route(app: web.Application) -> None:
    named = documented_routes(DOC.read_text(encoding="utf-8"))
    served = served_routes(app)
    assert len(served) > 20  # the router was read (not an empty set equal to another)
    assert len(named) == len(set(named)), f"a route has two sections: {sorted(named)}"
    assert set(named) == served, _diff(served, set(named))


async def test_the_openapi_document_describes_every_api_route(app: web.Application) -> None:
    api = {r for r in served_routes(app) if r[1].startswith(PREFIX + "/")}
    api.discard(("GET", f"{PREFIX}/openapi.json"))  # the document itself
    described = openapi_routes(openapi("0"))
    assert described == api, _diff(api, described, "the OpenAPI document")


def test_every_schema_reference_of_the_openapi_document_resolves() -> None:
    document = openapi("0")
    text = json.dumps(document)
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', text))
    assert {"Task", "SubmitBody", "BulkBody", "BulkResult"} <= refs
    missing = refs - set(document["components"]["schemas"])
    assert not missing, f"$ref to schemas the document does not define: {sorted(missing)}"


def raised_codes() -> dict[str, set[int | None]]:
    """Every `error.code` in the web package's source, with its statuses (None: decided
    at run time): ApiError(status, "code", ...), _error(status, "code", ...), and the
    `{status: "code"}.get(status, "default")` mapping of aiohttp's own errors."""
    codes: dict[str, set[int | None]] = {}
    for path in sorted(WEB.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            args = node.args
            if name in ("ApiError", "_error") and len(args) >= 2:
                status, code = args[0], args[1]
                if isinstance(code, ast.Constant) and isinstance(code.value, str):
                    known = status.value if isinstance(status, ast.Constant) else None
                    codes.setdefault(code.value, set()).add(known)
            elif (
                name == "get"
                and isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Dict)
            ):
                for key, value in zip(func.value.keys, func.value.values, strict=True):
                    assert isinstance(key, ast.Constant) and isinstance(value, ast.Constant)
                    codes.setdefault(value.value, set()).add(key.value)
                if len(args) == 2 and isinstance(args[1], ast.Constant):
                    codes.setdefault(args[1].value, set()).add(None)
    return codes


def errors_table(text: str) -> dict[str, set[int | None]]:
    """The Errors section's table: each code with its statuses (None for "4xx")."""
    section = text.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    table: dict[str, set[int | None]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not re.fullmatch(r"\d{3}|\dxx", cells[0]):
            continue
        status = int(cells[0]) if cells[0].isdigit() else None
        for code in re.findall(r"`([a-z_]+)`", cells[1]):
            table.setdefault(code, set()).add(status)
    return table


def test_every_error_code_is_in_the_errors_table_under_its_status() -> None:
    raised = raised_codes()
    assert {"unauthorized", "invalid", "no_route", "http_error", "internal"} <= set(raised)
    table = errors_table(DOC.read_text(encoding="utf-8"))
    assert set(raised) == set(table), (
        f"not in the table: {sorted(set(raised) - set(table))}; "
        f"in the table but never answered: {sorted(set(table) - set(raised))}"
    )
    for code, statuses in raised.items():
        known = {s for s in statuses if s is not None}
        if None in table[code]:  # "4xx": any client error
            assert all(400 <= s < 500 for s in known), (code, known)
        else:
            assert known == table[code], f"{code}: answered with {known}, table says {table[code]}"
