"""A demo handler for the fake vendor: the shape of a real hand-written integration."""

from __future__ import annotations

from typing import Any

import httpx

from asynctaskd.errors import PermanentError, RetryableError
from asynctaskd.handlers import Failed, HandlerContext, Running, Submitted, Succeeded

__all__ = ["DemoHandler", "make_handler"]


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _raise_for(response: httpx.Response, what: str) -> None:
    """Classify a non-2xx answer: 429 throttles, 5xx retries, other 4xx fail for good."""
    status = response.status_code
    if status < 400:
        return
    text = response.text[:200]
    if status == 429 or (status == 503 and "retry-after" in response.headers):
        raise RetryableError(
            f"{what}: throttled ({status})",
            code=f"HTTP_{status}",
            retry_after=_retry_after(response),
            throttled=True,
        )
    if status >= 500:
        raise RetryableError(f"{what}: vendor error {status}: {text}", code=f"HTTP_{status}")
    raise PermanentError(f"{what}: vendor refused {status}: {text}", code=f"HTTP_{status}")


class DemoHandler:
    """Talks to `asynctaskd.devtools.fakevendor`: POST /v1/jobs, GET /v1/jobs/{id}."""

    def __init__(self, key: str, base_url: str, *, idempotent: bool = False) -> None:
        self.key = key
        self.base_url = base_url.rstrip("/")
        self.idempotent_submit = idempotent

    async def submit(self, params: Any, ctx: HandlerContext) -> Submitted:
        headers = {"Idempotency-Key": ctx.idempotency_key} if self.idempotent_submit else {}
        response = await ctx.http.post(
            f"{self.base_url}/v1/jobs", json={"input": params, "ref": ctx.task_id}, headers=headers
        )
        _raise_for(response, "submit")
        try:
            job_id = response.json()["id"]
        except (ValueError, KeyError, TypeError) as exc:
            raise RetryableError(f"submit: unreadable answer {response.text[:200]!r}") from exc
        return Submitted(str(job_id))

    async def query(
        self, handle: dict[str, Any], ctx: HandlerContext
    ) -> Running | Succeeded | Failed:
        response = await ctx.http.get(f"{self.base_url}/v1/jobs/{handle['external_id']}")
        _raise_for(response, "query")
        try:
            job = response.json()
            status = job["status"]
        except (ValueError, KeyError, TypeError) as exc:
            raise RetryableError(f"query: unreadable answer {response.text[:200]!r}") from exc
        if status == "succeeded":
            return Succeeded(job.get("result"))
        if status == "failed":
            error = job.get("error") or {}
            return Failed(str(error.get("code", "failed")), str(error.get("message", "")))
        if status == "canceled":
            return Failed("canceled_at_vendor", "the vendor job was canceled")
        return Running(progress=job.get("progress"), stage=status)

    async def cancel(self, handle: dict[str, Any], ctx: HandlerContext) -> None:
        await ctx.http.post(f"{self.base_url}/v1/jobs/{handle['external_id']}/cancel")


def make_handler(options: dict[str, Any]) -> DemoHandler:
    """Factory for `[[handlers]]`: options base_url (required), key, idempotent."""
    base_url = options.get("base_url")
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError("options.base_url must be the fake vendor's http:// URL")
    return DemoHandler(
        str(options.get("key", "demo")), base_url, idempotent=bool(options.get("idempotent", False))
    )
