"""`submit.before`: requests the submit sends before the create, each feeding the next
(OpenAI's batch input file uploaded with multipart, then the batch created with its id).

A step is not the vendor job: what it makes (an uploaded file) costs no job and starts
none. So a step whose answer is lost (timeout, reset, 5xx, an answer without what `keep`
reads) raises `NotSent`: the worker runs the whole submit again, steps included, and at
worst the vendor keeps an unused copy of what the step sent. Only the create itself can
leave the task in SUBMIT_UNKNOWN. A step's 4xx fails the task as a create's would; a
throttled step is a throttled submit.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from asynctaskd.errors import NotSent, PermanentError, RetryableError
from asynctaskd.handlers import HandlerContext
from asynctaskd.transport import Reply

from .exchange import _Exchanging
from .plan import _FileSpec, _Step
from .templates import _MISSING, _Vars


class _Stepping(_Exchanging):
    """HttpHandler's submit steps (`submit.before`)."""

    async def _run_steps(self, v: _Vars, ctx: HandlerContext) -> None:
        """Send each step in order; what each keeps lands in `v.steps` for the next."""
        kept: dict[str, dict[str, Any]] = {}
        for step in self.plan.steps:
            v.steps = kept
            what = f"submit step {step.name}"
            url, headers, content = self._prepare(step.request, v, what)
            if step.multipart is not None:
                content, headers["Content-Type"] = self._multipart(step, v, what)
            try:
                response = await self._send(ctx, what, step.request.method, url, headers, content)
                self._check_status(response, what)
                kept[step.name] = self._kept(step, self._decode(response, what), response, what)
            except RetryableError as exc:
                if exc.throttled or isinstance(exc, NotSent):
                    raise
                raise NotSent(
                    f"{exc}; this step comes before the create, so no job exists yet: the "
                    "submit runs again from its first step",
                    code=exc.code,
                    retry_after=exc.retry_after,
                ) from None
        v.steps = kept

    def _kept(self, step: _Step, doc: Any, response: Reply, what: str) -> dict[str, Any]:
        out = {}
        for key, pointer in step.keep:
            value = pointer.get(doc)
            if value is _MISSING or value is None:
                raise RetryableError(
                    f"{what}: expected {key} at {pointer.text or '/'} of the vendor's "
                    f"{response.status} answer, found nothing; body: "
                    f"{self._excerpt(response.content)}",
                    code="VENDOR_GARBAGE",
                )
            out[key] = value
        return out

    def _multipart(self, step: _Step, v: _Vars, what: str) -> tuple[bytes, str]:
        """The multipart/form-data body of a step, and its Content-Type."""
        assert step.multipart is not None
        parts: list[tuple[str, _FileSpec | None, bytes]] = []
        for name, field in step.multipart:
            if isinstance(field, _FileSpec):
                parts.append((name, field, self._file_bytes(field, v, what)))
            else:
                parts.append((name, None, self._render_text(field, v).encode()))
        boundary = secrets.token_hex(16)
        while any(boundary.encode() in data for _, _, data in parts):  # never, in practice
            boundary = secrets.token_hex(16)
        out = bytearray()
        for name, spec, data in parts:
            out += f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"'.encode()
            if spec is not None:
                out += f'; filename="{spec.filename}"\r\nContent-Type: {spec.content_type}'.encode()
            out += b"\r\n\r\n" + data + b"\r\n"
        out += f"--{boundary}--\r\n".encode()
        return bytes(out), f"multipart/form-data; boundary={boundary}"

    def _file_bytes(self, spec: _FileSpec, v: _Vars, what: str) -> bytes:
        if spec.content is not None:
            return self._render_text(spec.content, v).encode()
        assert spec.jsonl is not None and spec.jsonl.whole is not None
        value = self._value(spec.jsonl.whole, v)
        if not isinstance(value, list) or not value:
            found = "nothing" if value is _MISSING else f"{type(value).__name__}"
            raise PermanentError(
                f"{what}: {spec.jsonl.source} must be a non-empty list (one JSON value per "
                f"line of {spec.filename}), found {found}; nothing was sent",
                code="INVALID_PARAMS",
            )
        return b"".join(msgspec.json.encode(item) + b"\n" for item in value)
