"""From config to handler: `build` checks every template, pointer and header name of one
`type = "http"` entry and compiles its plan; each error names its key path and line."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn

import msgspec

from asynctaskd.config import HandlerConfig, line_of
from asynctaskd.downloads import host_pattern
from asynctaskd.errors import ConfigError

from .handler import HttpHandler
from .options import ErrorOptions, FilePart, HttpOptions, StepOptions, _dec_hook, _explain
from .plan import _FileSpec, _FindPlan, _Plan, _Request, _Step
from .templates import (
    _HEADER_NAME,
    _MISSING,
    _SECRET,
    _TASK,
    _check_scope,
    _parse_template,
    _Pointer,
    _Ref,
    _Template,
    _TemplateError,
)

_STEP_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


_PART_TEXT: Final = re.compile(r'[^"\\\x00-\x1f\x7f]+')  # no quote, backslash or control


class _Builder:
    def __init__(self, hc: HandlerConfig, index: int | None, text: str | None, source: str) -> None:
        self.hc = hc
        self.index = index
        self.text = text
        self.source = source
        self.steps: dict[str, frozenset[str]] = {}  # the steps a template may name, and keeps

    def fail(self, path: str, message: str) -> NoReturn:
        """Raise ConfigError for `path` (relative to the options table, e.g. "submit.url")."""
        if self.index is not None:
            key = f"handlers[{self.index}].options" + (f".{path}" if path else "")
            line = self._line(key)
            where = self.source + (f":{line}" if line is not None else "")
            raise ConfigError(f"{where}: {key}: {message}" if where else f"{key}: {message}")
        key = "options" + (f".{path}" if path else "")
        raise ConfigError(f"handler {self.hc.key!r}: {key}: {message}")

    def _line(self, key: str) -> int | None:
        if self.text is None:
            return None
        path = "$." + key
        while True:
            line = line_of(self.text, path)
            if line is not None:
                return line
            cut = max(path.rfind("."), path.rfind("["))
            if cut <= 1:
                return None
            path = path[:cut]

    def decode(self) -> HttpOptions:
        try:
            return msgspec.convert(self.hc.options, HttpOptions, dec_hook=_dec_hook)
        except msgspec.ValidationError as exc:
            path, message = _explain(str(exc))
            self.fail(path, message)

    def template(
        self, text: str, path: str, allowed: frozenset[str], handles: frozenset[str] = frozenset()
    ) -> _Template:
        try:
            template = _parse_template(text)
            for ref in template.refs():
                _check_scope(ref, allowed, handles, self.steps)
        except _TemplateError as exc:
            self.fail(path, str(exc))
        return template

    def pointer(self, text: str, path: str) -> _Pointer:
        try:
            return _Pointer(text)
        except ValueError as exc:
            self.fail(path, str(exc))

    def json(self, node: Any, path: str, allowed: frozenset[str], handles: frozenset[str]) -> Any:
        if isinstance(node, str):
            return self.template(node, path, allowed, handles)
        if isinstance(node, dict):
            return {k: self.json(c, f"{path}.{k}", allowed, handles) for k, c in node.items()}
        if isinstance(node, list):
            return [self.json(c, f"{path}[{i}]", allowed, handles) for i, c in enumerate(node)]
        return node

    def headers(
        self,
        headers: Mapping[str, str],
        path: str,
        allowed: frozenset[str],
        handles: frozenset[str] = frozenset(),
    ) -> tuple[tuple[str, _Template], ...]:
        out = []
        for name, value in headers.items():
            if not _HEADER_NAME.fullmatch(name):
                self.fail(f"{path}.{name}", f"{name!r} is not a valid header name")
            out.append((name, self.template(value, f"{path}.{name}", allowed, handles)))
        return tuple(out)

    def url(
        self, text: str, path: str, allowed: frozenset[str], handles: frozenset[str] = frozenset()
    ) -> _Template:
        template = self.template(text, path, allowed, handles)
        first = template.parts[0]
        absolute = isinstance(first, str) and first.startswith(("http://", "https://"))
        if not absolute and not (isinstance(first, _Ref) and first.kind == "base_url"):
            self.fail(
                path, f"expected an http(s):// URL or one starting with {{base_url}}, got {text!r}"
            )
        return template

    def request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: Any,
        path: str,
        scope: frozenset[str],
        base_headers: tuple[tuple[str, _Template], ...],
        handles: frozenset[str] = frozenset(),
    ) -> _Request:
        own = self.headers(headers, f"{path}.headers", (scope - {"base_url"}) | _SECRET, handles)
        names = {n.lower() for n, _ in own}
        merged = [(n, t) for n, t in base_headers if n.lower() not in names] + list(own)
        compiled_body: Any = _MISSING
        if body is not None:
            compiled_body = self.json(body, f"{path}.body", scope, handles)
            if "content-type" not in {n.lower() for n, _ in merged}:
                merged.append(("Content-Type", _Template(("application/json",), "")))
        return _Request(
            method, self.url(url, f"{path}.url", scope, handles), tuple(merged), compiled_body
        )

    def plan(self, o: HttpOptions) -> _Plan:
        base_url = self.template(o.base_url, "base_url", _SECRET)
        if o.base_url:
            first = base_url.parts[0]
            if isinstance(first, str) and not first.startswith(("http://", "https://")):
                self.fail("base_url", f"expected an http:// or https:// URL, got {o.base_url!r}")
        base_headers = self.headers(o.headers, "headers", _SECRET | _TASK)
        self.pointer(o.errors.code_pointer, "errors.code_pointer")
        for name in o.errors.reset_headers:
            if not _HEADER_NAME.fullmatch(name):
                self.fail("errors.reset_headers", f"{name!r} is not a header name")
        if o.submit.idempotency_header and not _HEADER_NAME.fullmatch(o.submit.idempotency_header):
            self.fail("submit.idempotency_header", "not a valid header name")
        submit_scope = _TASK | {"params", "base_url", "submit_attempt"}
        steps = tuple(
            self.step(step, f"submit.before[{i}]", submit_scope | {"steps"}, base_headers)
            for i, step in enumerate(o.submit.before)
        )
        submit = self.request(
            o.submit.method,
            o.submit.url,
            o.submit.headers,
            o.submit.body,
            "submit",
            submit_scope | {"steps"},
            base_headers,
        )
        self.steps = {}
        handles = frozenset(o.submit.handle)
        if "external_id" in handles:
            self.fail("submit.handle.external_id", "external_id is always kept; pick another name")
        query_scope = _TASK | {"external_id", "handle", "base_url"}
        q = o.query
        query = self.request(
            q.method, q.url, q.headers, q.body, "query", query_scope, base_headers, handles
        )
        cancel = None
        if o.cancel is not None:
            c = o.cancel
            cancel = self.request(
                c.method, c.url, c.headers, c.body, "cancel", query_scope, base_headers, handles
            )
        outcomes: dict[str, str] = {}
        for outcome in ("running", "succeeded", "failed"):
            for i, name in enumerate(getattr(q, outcome)):
                if name in outcomes:
                    self.fail(
                        f"query.{outcome}[{i}]",
                        f"{name!r} is already listed in query.{outcomes[name]}",
                    )
                outcomes[name] = outcome
        if not q.succeeded:
            self.fail("query.succeeded", "list at least one vendor status that means done")
        if q.resubmit and o.idempotent:
            self.fail(
                "query.resubmit",
                "an idempotent vendor dedups on the task's idempotency key, which a resubmit "
                "keeps: it would answer with the job that ended",
            )
        if "" in q.resubmit:
            self.fail("query.resubmit", "list failure codes, not empty strings")
        self._check_errors(o.errors)

        def optional(text: str | None, path: str) -> _Pointer | None:
            return None if text is None else self.pointer(text, path)

        result: _Pointer | tuple[tuple[str, _Pointer], ...]
        if isinstance(q.result, str):
            result = self.pointer(q.result, "query.result")
        else:
            result = tuple((k, self.pointer(p, f"query.result.{k}")) for k, p in q.result.items())
        files: tuple[_Pointer, ...] = ()
        hosts: list[str] = []
        download = put = None
        finalize_headers: tuple[tuple[str, _Template], ...] = ()
        if (f := o.finalize) is not None:
            if (f.dir is None) == (f.put is None):
                self.fail("finalize", "set exactly one of dir (a local directory) or put (a URL)")
            if f.dir is not None and not f.dir.startswith("/"):
                self.fail("finalize.dir", f"expected an absolute path, got {f.dir!r}")
            if not f.files:
                self.fail("finalize.files", "list at least one JSON pointer into the result")
            files = tuple(self.pointer(p, f"finalize.files[{i}]") for i, p in enumerate(f.files))
            if f.download is not None:
                download = self.url(f.download, "finalize.download", _TASK | {"base_url", "value"})
            for i, entry in enumerate(f.hosts):
                try:
                    hosts.append(host_pattern(entry))
                except ValueError as exc:
                    self.fail(f"finalize.hosts[{i}]", str(exc))
            if f.put is not None:
                put = self.url(f.put, "finalize.put", _TASK | {"name"})
            finalize_headers = self.headers(
                f.headers, "finalize.headers", _TASK | _SECRET | {"name"}
            )
        find = None
        if (fo := o.find) is not None:
            find = _FindPlan(
                request=self.request(
                    fo.method, fo.url, fo.headers, fo.body, "find", submit_scope, base_headers
                ),
                items=self.pointer(fo.items, "find.items"),
                match=self.pointer(fo.match, "find.match"),
                equals=self.template(fo.equals, "find.equals", submit_scope - {"base_url"}),
                id=self.pointer(fo.id, "find.id"),
                handle=tuple(
                    (k, self.pointer(p, f"find.handle.{k}")) for k, p in fo.handle.items()
                ),
                more=optional(fo.more, "find.more"),
                cursor=optional(fo.cursor, "find.cursor"),
                next_url=None
                if fo.next_url is None
                else self.url(fo.next_url, "find.next_url", _TASK | {"base_url", "value"}),
                next=optional(fo.next, "find.next"),
            )
            if (fo.next_url is None) != (fo.cursor is None):
                self.fail("find", "set both next_url and cursor (a paged listing), or neither")
            if fo.next is not None and (fo.more or fo.cursor or fo.next_url):
                self.fail("find.next", "a next-page URL replaces more, cursor and next_url")
            if set(fo.handle) != handles:
                self.fail(
                    "find.handle", f"name the same fields as submit.handle: {sorted(handles)}"
                )
        uses_base = any(
            ref.kind == "base_url"
            for request in (
                submit,
                query,
                cancel,
                find.request if find else None,
                *(s.request for s in steps),
            )
            if request is not None
            for ref in request.url.refs()
        ) or (download is not None and any(r.kind == "base_url" for r in download.refs()))
        if uses_base and not o.base_url:
            self.fail("base_url", "the URLs use {base_url}: set it")
        return _Plan(
            options=o,
            base_url=base_url,
            base_headers=base_headers,
            submit=submit,
            submit_id=self.pointer(o.submit.id, "submit.id"),
            submit_handle=tuple(
                (k, self.pointer(p, f"submit.handle.{k}")) for k, p in o.submit.handle.items()
            ),
            query=query,
            status=self.pointer(q.status, "query.status"),
            outcomes=outcomes,
            progress=optional(q.progress, "query.progress"),
            progress_total=optional(q.progress_total, "query.progress_total"),
            stage=optional(q.stage, "query.stage"),
            message=optional(q.message, "query.message"),
            result=result,
            error_code=optional(q.error_code, "query.error_code"),
            error_message=optional(q.error_message, "query.error_message"),
            gone=optional(q.gone, "query.gone"),
            cancel=cancel,
            finalize_files=files,
            finalize_download=download,
            finalize_hosts=tuple(hosts),
            finalize_put=put,
            finalize_headers=finalize_headers,
            find=find,
            steps=steps,
        )

    def step(
        self,
        o: StepOptions,
        path: str,
        scope: frozenset[str],
        base_headers: tuple[tuple[str, _Template], ...],
    ) -> _Step:
        """One `submit.before` step compiled; its keeps become nameable by what follows."""
        if not _STEP_NAME.fullmatch(o.name):
            self.fail(f"{path}.name", f"expected a name of letters, digits and _, got {o.name!r}")
        if o.name in self.steps:
            self.fail(f"{path}.name", f"a step {o.name!r} comes earlier; names must differ")
        if o.body is not None and o.multipart is not None:
            self.fail(path, "set body (JSON) or multipart, not both")
        request = self.request(o.method, o.url, o.headers, o.body, path, scope, base_headers)
        multipart = None
        if o.multipart is not None:
            if not o.multipart:
                self.fail(f"{path}.multipart", "name at least one field")
            multipart = tuple(
                (name, self.part(name, field, f"{path}.multipart.{name}", scope))
                for name, field in o.multipart.items()
            )
        keep = tuple((k, self.pointer(p, f"{path}.keep.{k}")) for k, p in o.keep.items())
        self.steps[o.name] = frozenset(o.keep)
        return _Step(o.name, request, multipart, keep)

    def part(
        self, name: str, field: str | FilePart, path: str, scope: frozenset[str]
    ) -> _Template | _FileSpec:
        if not _PART_TEXT.fullmatch(name):
            self.fail(path, f"{name!r} cannot be a multipart field name (quotes, controls)")
        if isinstance(field, str):
            return self.template(field, path, scope)
        if not _PART_TEXT.fullmatch(field.filename):
            self.fail(f"{path}.filename", f"{field.filename!r}: no quotes or control characters")
        if not _PART_TEXT.fullmatch(field.content_type) or not field.content_type.isascii():
            self.fail(f"{path}.content_type", f"{field.content_type!r} is not a media type")
        if (field.content is None) == (field.jsonl is None):
            self.fail(path, "set content (text) or jsonl (a list, one JSON value a line)")
        content = jsonl = None
        if field.content is not None:
            content = self.template(field.content, f"{path}.content", scope)
        if field.jsonl is not None:
            jsonl = self.template(field.jsonl, f"{path}.jsonl", scope)
            if jsonl.whole is None:
                self.fail(f"{path}.jsonl", "expected exactly one placeholder, as in {params.x}")
        return _FileSpec(field.filename, content, jsonl, field.content_type)

    def _check_errors(self, errors: ErrorOptions) -> None:
        both = set(errors.permanent or ()) & set(errors.retryable)
        if both:
            self.fail("errors", f"{sorted(both)} are listed as both permanent and retryable")


def build(
    hc: HandlerConfig, *, index: int | None = None, text: str | None = None, source: str = ""
) -> HttpHandler:
    """Build the handler for one `type = "http"` entry; ConfigError names the bad key.

    `index` (the entry's position in `handlers`), `text` (the TOML source) and `source`
    (its file name) make messages read `config.toml:14: handlers[1].options.submit.url: ...`.
    """
    builder = _Builder(hc, index, text, source)
    options = builder.decode()
    plan = builder.plan(options)
    limit = options.max_connections or hc.concurrency
    return HttpHandler(
        hc.key,
        plan,
        max_connections=limit,
        proxy=hc.proxy,
        max_response_bytes=hc.max_response_bytes,
    )


def builders(
    configs: Sequence[HandlerConfig],
    path: str | os.PathLike[str] | None = None,
    *,
    text: str | None = None,
    source: str | None = None,
) -> dict[str, Callable[[HandlerConfig], HttpHandler]]:
    """The `builders` argument of `load_handlers`: {"http": ...}, with errors naming lines.

    Pass the config file's `path` (read again, for line numbers) or its `text` and `source`.
    """
    if text is None and path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            text = None
    if source is None:
        source = str(path) if path is not None else ("<config>" if text is not None else "")

    def build_one(hc: HandlerConfig) -> HttpHandler:
        index = next((i for i, c in enumerate(configs) if c is hc), None)
        if index is None:
            index = next((i for i, c in enumerate(configs) if c == hc), None)
        return build(hc, index=index, text=text, source=source)

    return {"http": build_one}
