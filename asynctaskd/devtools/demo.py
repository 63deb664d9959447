"""A demo handler for the fake vendor: the shape of a real hand-written integration."""

from __future__ import annotations

from typing import Any

from asynctaskd.errors import PermanentError, RetryableError
from asynctaskd.handlers import Failed, HandlerContext, Running, Submitted, Succeeded
from asynctaskd.transport import Reply

__all__ = ["DemoHandler", "make_handler"]


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _raise_for(reply: Reply, what: str) -> None:
    """Classify a non-2xx answer: 429 throttles, 5xx retries, other 4xx fail for good."""
    status = reply.status
    if status < 400:
        return
    text = reply.text[:200]
    retry_after = reply.header("retry-after")
    if status == 429 or (status == 503 and retry_after is not None):
        raise RetryableError(
            f"{what}: throttled ({status})",
            code=f"HTTP_{status}",
            retry_after=_retry_after(retry_after),
            throttled=True,
        )
    if status >= 500:
        raise RetryableError(f"{what}: vendor error {status}: {text}", code=f"HTTP_{status}")
    raise PermanentError(f"{what}: vendor refused {status}: {text}", code=f"HTTP_{status}")


class DemoHandler:
    """Talks to `asynctaskd.devtools.fakevendor`: POST /v1/jobs, GET /v1/jobs/{id}.

    Its calls go through `ctx.fetch` (the fast API), or with ``client="http"`` through
    the stock `ctx.http` (httpx), for comparing the two.
    """

    def __init__(
        self, key: str, base_url: str, *, idempotent: bool = False, client: str = "fetch"
    ) -> None:
        self.key = key
        self.base_url = base_url.rstrip("/")
        self.idempotent_submit = idempotent
        self.via_httpx = client == "http"

    async def _call(
        self,
        ctx: HandlerContext,
        method: str,
        url: str,
        *,
        json: Any = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        if not self.via_httpx:
            return await ctx.fetch(method, url, json=json, headers=headers)
        response = await ctx.http.request(method, url, json=json, headers=headers)
        return Reply(response.status_code, response.headers.raw, response.content)

    async def submit(self, params: Any, ctx: HandlerContext) -> Submitted:
        headers = {"Idempotency-Key": ctx.idempotency_key} if self.idempotent_submit else None
        reply = await self._call(
            ctx,
            "POST",
            f"{self.base_url}/v1/jobs",
            json={"input": params, "ref": ctx.task_id},
            headers=headers,
        )
        _raise_for(reply, "submit")
        try:
            job_id = reply.json()["id"]
        except (ValueError, KeyError, TypeError) as exc:
            raise RetryableError(f"submit: unreadable answer {reply.text[:200]!r}") from exc
        return Submitted(str(job_id))

    async def query(
        self, handle: dict[str, Any], ctx: HandlerContext
    ) -> Running | Succeeded | Failed:
        url = f"{self.base_url}/v1/jobs/{handle['external_id']}"
        # ctx.fetch awaited here, not through _call: one coroutine fewer on every poll
        reply = await (self._call(ctx, "GET", url) if self.via_httpx else ctx.fetch("GET", url))
        _raise_for(reply, "query")
        try:
            job = reply.json()
            status = job["status"]
        except (ValueError, KeyError, TypeError) as exc:
            raise RetryableError(f"query: unreadable answer {reply.text[:200]!r}") from exc
        if status == "succeeded":
            return Succeeded(job.get("result"))
        if status == "failed":
            error = job.get("error") or {}
            return Failed(str(error.get("code", "failed")), str(error.get("message", "")))
        if status == "canceled":
            return Failed("canceled_at_vendor", "the vendor job was canceled")
        return Running(progress=job.get("progress"), stage=status)

    async def cancel(self, handle: dict[str, Any], ctx: HandlerContext) -> None:
        await self._call(ctx, "POST", f"{self.base_url}/v1/jobs/{handle['external_id']}/cancel")


def make_handler(options: dict[str, Any]) -> DemoHandler:
    """Factory for `[[handlers]]`: options base_url (required), key, idempotent, and
    client ("fetch", the default, or "http")."""
    base_url = options.get("base_url")
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError("options.base_url must be the fake vendor's http:// URL")
    client = options.get("client", "fetch")
    if client not in ("fetch", "http"):
        raise ValueError('options.client must be "fetch" or "http"')
    return DemoHandler(
        str(options.get("key", "demo")),
        base_url,
        idempotent=bool(options.get("idempotent", False)),
        client=client,
    )
