"""`HttpHandler`: submit, query and cancel as configured; submit's steps, find and finalize
come from their own modules (`steps`, `find`, `finalize`), mixed in."""

from __future__ import annotations

import math
from typing import Any

import anyio
import httpx
import msgspec

from asynctaskd.downloads import origin_of
from asynctaskd.errors import NotSent, PermanentError, RetryableError
from asynctaskd.handlers import (
    Failed,
    HandlerContext,
    Resubmit,
    Running,
    Submitted,
    Succeeded,
)
from asynctaskd.transport import DEFAULT_MAX_RESPONSE_BYTES, Reply, fetcher_for, make_http_client

from .classify import _Classifying, _code_of
from .credentials import _SecretMissing, _Secrets
from .finalize import _Finalizing
from .find import _Finding
from .plan import _Plan, _Request
from .steps import _Stepping
from .templates import (
    _MISSING,
    _SECRET_REF,
    _as_text,
    _Missing,
    _Pointer,
    _Rendering,
    _ValueMissing,
    _ValueRefused,
    _Vars,
)


class HttpHandler(_Stepping, _Finding, _Finalizing, _Classifying, _Rendering):
    """A Handler driven by `HttpOptions`; build it with `build()` (checks every template).

    With per-handler limits (`max_connections`, or the handler's `concurrency`) it sends
    through its own client, created on first use inside the event loop and closed by
    `aclose()`; otherwise through the shared `ctx.http`.
    """

    def __init__(
        self,
        key: str,
        plan: _Plan,
        *,
        max_connections: int | None = None,
        proxy: str | None = None,
        max_response_bytes: int | None = None,
    ) -> None:
        self.key = key
        self.plan = plan
        self.options = plan.options
        self.idempotent_submit = plan.options.idempotent
        t = plan.options.timeouts
        self._timeout = httpx.Timeout(
            connect=float(t.connect), read=float(t.read), write=float(t.read), pool=float(t.connect)
        )
        self._total = float(t.total)
        self._max_connections = max_connections
        self._proxy = proxy
        self._max_response_bytes = max_response_bytes or DEFAULT_MAX_RESPONSE_BYTES
        self._http: httpx.AsyncClient | None = None
        self._secrets = _Secrets()
        # every {env:..}, {file:..} and {credential:..} the options name, for redaction
        self._secret_refs = tuple(
            dict.fromkeys(
                _SECRET_REF.findall(
                    msgspec.json.encode(plan.options, enc_hook=float).decode()  # Duration
                )
            )
        )
        self._base_url: str | None = None
        self._base_origin: tuple[str, str, int | None] | None = None
        self._download_home: tuple[str, str, int | None] | _Missing | None = _MISSING
        errors = plan.options.errors
        self._permanent = None if errors.permanent is None else frozenset(errors.permanent)
        self._retryable = frozenset(errors.retryable)
        self._reset_headers = tuple(h.lower() for h in errors.reset_headers)
        self._permanent_codes = frozenset(errors.permanent_codes)
        self._code_pointer = _Pointer(errors.code_pointer)
        self._resubmit = frozenset(plan.options.query.resubmit)
        idem = plan.options.submit.idempotency_header
        self._idempotency_header = idem if plan.options.idempotent and idem else ""
        if (f := plan.options.find) is not None:
            # Only a handler with a find section has find() (the worker looks it up), and
            # its window counts from the start mark: the submit call itself may take up to
            # timeouts.total before the vendor creates the job.
            self.find = self._find
            self.find_visible_after = float(f.visible_after) + self._total
            self.find_max_tries = f.max_tries
            self.find_give_up_after = float(f.give_up_after)

    def __repr__(self) -> str:
        return f"HttpHandler(key={self.key!r})"

    # --- Handler protocol ------------------------------------------------------------------

    async def submit(self, params: Any, ctx: HandlerContext) -> Submitted:
        """Send the steps before the create, if any (`steps`), then POST the job; the
        answer's id (and handle fields) become the task's handle."""
        v = _Vars(
            ctx.task_id, ctx.idempotency_key, params=params, submit_attempt=ctx.submit_attempt
        )
        if self.plan.steps:
            await self._run_steps(v, ctx)
        url, headers, content = self._prepare(self.plan.submit, v, "submit")
        if self._idempotency_header:
            headers[self._idempotency_header] = ctx.idempotency_key
        response = await self._send(ctx, "submit", self.plan.submit.method, url, headers, content)
        self._check_status(response, "submit")
        doc = self._decode(response, "submit")
        raw = self.plan.submit_id.get(doc)
        if isinstance(raw, str) and raw:
            external_id = raw
        elif isinstance(raw, int) and not isinstance(raw, bool):
            external_id = str(raw)
        else:
            found = "nothing" if raw is _MISSING else f"{type(raw).__name__} {raw!r}"[:80]
            raise RetryableError(
                f"submit: expected the job id (a string) at {self.plan.submit_id.text or '/'} "
                f"of the vendor's {response.status} answer, found {found}; the job may "
                f"exist; body: {self._excerpt(response.content)}",
                code="VENDOR_GARBAGE",
            )
        handle = {}
        for name, pointer in self.plan.submit_handle:
            value = pointer.get(doc)
            handle[name] = None if value is _MISSING else value
        return Submitted(external_id, handle)

    async def query(
        self, handle: dict[str, Any], ctx: HandlerContext
    ) -> Running | Succeeded | Failed | Resubmit:
        """GET the job and map its vendor status to Running, Succeeded, Failed, or
        Resubmit (a failure code listed in `query.resubmit`)."""
        plan = self.plan
        v = _Vars(
            ctx.task_id,
            ctx.idempotency_key,
            handle=handle,
            external_id=str(handle.get("external_id") or ""),
        )
        url, headers, content = self._prepare(plan.query, v, "query")
        response = await self._send(ctx, "query", plan.query.method, url, headers, content)
        self._check_status(response, "query")
        doc = self._decode(response, "query")
        raw = plan.status.get(doc)
        if isinstance(raw, str):
            status = raw
        elif isinstance(raw, int) and not isinstance(raw, bool):
            status = str(raw)
        else:
            found = "nothing" if raw is _MISSING else f"{type(raw).__name__} {raw!r}"[:80]
            raise RetryableError(
                f"query: expected the vendor status (a string) at {plan.status.text or '/'}, "
                f"found {found}; body: {self._excerpt(response.content)}",
                code="VENDOR_GARBAGE",
            )
        outcome = plan.outcomes.get(status) or plan.options.query.unknown
        if outcome == "succeeded":
            if plan.gone is not None and plan.gone.get(doc) is True:
                return Failed(
                    "RESULT_REMOVED",
                    f"the vendor reports the job {status!r}, but deleted its output before "
                    "it was read (a poll after the vendor's retention window)",
                )
            return Succeeded(self._result(doc))
        if outcome == "failed":
            code = _text_at(plan.error_code, doc) or status
            if status not in plan.outcomes:
                code = "UNKNOWN_STATUS"
            message = _text_at(plan.error_message, doc) or f"vendor status {status!r}"
            if code in self._resubmit:
                after = plan.options.query.resubmit_after
                return Resubmit(
                    code=code[:200],
                    message=self._secrets.redact(message),
                    after=None if after is None else float(after),
                )
            partial = self._result(doc) if plan.options.query.failed_result else None
            if isinstance(partial, dict) and not any(v is not None for v in partial.values()):
                partial = None  # nothing was made
            return Failed(code[:200], self._secrets.redact(message), partial)
        if outcome == "error":
            raise RetryableError(
                f"query: vendor status {status!r} is not in running, succeeded or failed",
                code="UNKNOWN_STATUS",
            )
        note = _text_at(plan.message, doc)
        return Running(
            progress=self._progress(doc),
            stage=_text_at(plan.stage, doc) or status,
            message=None if note is None else self._secrets.redact(note),
        )

    async def cancel(self, handle: dict[str, Any], ctx: HandlerContext) -> None:
        """Send the configured cancel request (best effort: errors are raised for the log)."""
        request = self.plan.cancel
        if request is None:
            return
        v = _Vars(
            ctx.task_id,
            ctx.idempotency_key,
            handle=handle,
            external_id=str(handle.get("external_id") or ""),
        )
        url, headers, content = self._prepare(request, v, "cancel")
        response = await self._send(ctx, "cancel", request.method, url, headers, content)
        self._check_status(response, "cancel")

    async def aclose(self) -> None:
        """Close the handler's own client, if it made one."""
        client, self._http = self._http, None
        if client is not None:
            await client.aclose()

    # --- requests ----------------------------------------------------------------------------

    def _client(self, ctx: HandlerContext) -> httpx.AsyncClient:
        if self._max_connections is None:
            return ctx.http
        if self._http is None:
            # Created here, inside the running loop; the transport binds to it on first use.
            self._http = make_http_client(
                max_connections=self._max_connections,
                timeout=self._timeout,
                proxy=self._proxy,
                max_response_bytes=self._max_response_bytes,
            )
        return self._http

    def _base(self) -> str:
        if self._base_url is None:
            self._base_url = self._render_text(self.plan.base_url, _Vars("", ""))
            self._base_origin = origin_of(self._base_url)
        return self._base_url

    def _prepare(
        self, request: _Request, v: _Vars, what: str
    ) -> tuple[str, dict[str, str], bytes | None]:
        try:
            v.base_url = self._base()
            url = self._render_text(request.url, v, url=True)
            headers = self._render_headers(request.headers, v)
            content = None
            if request.body is not _MISSING:
                content = msgspec.json.encode(self._render_json(request.body, v))
        except _SecretMissing as exc:
            message = f"{what}: {exc}"
            if what == "submit":
                raise NotSent(message, code="CREDENTIAL_MISSING") from None
            raise RetryableError(message, code="CREDENTIAL_MISSING") from None
        except _ValueMissing as exc:
            source = "the task params" if exc.ref.kind == "params" else "the task's handle"
            raise PermanentError(
                f"{what}: {exc.ref.text} has no value in {source}", code="MISSING_VALUE"
            ) from None
        except _ValueRefused as exc:
            # Producer input (or a vendor's id): it would be refused on every attempt.
            raise PermanentError(f"{what}: {exc}; nothing was sent", code="UNSAFE_VALUE") from None
        return url, headers, content

    async def _send(
        self,
        ctx: HandlerContext,
        what: str,
        method: str,
        url: str,
        headers: dict[str, str],
        content: bytes | None,
    ) -> Reply:
        fetch = fetcher_for(self._client(ctx))
        try:
            # A bare cancel scope: cheaper than fail_after, which wraps one.
            with anyio.CancelScope(deadline=anyio.current_time() + self._total):
                return await fetch(
                    method, url, headers=headers, content=content, timeout=self._timeout
                )
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise NotSent(f"{what}: never sent: {self._explain(exc)}", code=_code_of(exc)) from None
        except (httpx.LocalProtocolError, httpx.InvalidURL, ValueError) as exc:
            # Refused before anything was written: a URL or header the templates made
            # unusable (the client checks a request whole before sending any of it).
            raise PermanentError(
                f"{what}: cannot build the request: {self._explain(exc)}", code="INVALID_REQUEST"
            ) from None
        except httpx.UnsupportedProtocol as exc:
            raise PermanentError(
                f"{what}: unusable URL: {self._explain(exc)}", code="INVALID_REQUEST"
            ) from None
        except httpx.HTTPError as exc:
            raise RetryableError(
                f"{what}: {self._explain(exc)}; the request may have reached the vendor",
                code=_code_of(exc),
            ) from None
        except Exception as exc:
            # A transport that fails in a way httpx does not name: ambiguous, as the worker
            # would treat it anyway, but with credentials masked in the message.
            raise RetryableError(
                f"{what}: {self._explain(exc)}; the request may have reached the vendor",
                code="TRANSPORT_FAILURE",
            ) from None
        # Only the scope's own deadline ends up here (an outer cancellation propagates).
        raise RetryableError(
            f"{what}: no complete answer within {self._total:g}s (timeouts.total); "
            "the request may have reached the vendor",
            code="TOTAL_TIMEOUT",
        )

    # --- reading answers ---------------------------------------------------------------------

    def _result(self, doc: Any) -> Any:
        result = self.plan.result
        if isinstance(result, _Pointer):
            value = result.get(doc)
            return None if value is _MISSING else value
        out = {}
        for name, pointer in result:
            value = pointer.get(doc)
            out[name] = None if value is _MISSING else value
        return out

    def _progress(self, doc: Any) -> float | None:
        plan = self.plan
        if plan.progress is None:
            return None
        value = _number(plan.progress.get(doc))
        if value is None:
            return None
        if plan.progress_total is not None:
            total = _number(plan.progress_total.get(doc))
            if not total:
                return None
            value /= total
        return value / plan.options.query.progress_scale


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _text_at(pointer: _Pointer | None, doc: Any) -> str | None:
    if pointer is None:
        return None
    value = pointer.get(doc)
    if value is _MISSING or value is None:
        return None
    return _as_text(value)
