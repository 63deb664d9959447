"""`find`: the vendor's listing read to settle a task parked in SUBMIT_UNKNOWN (docs/protocol.md
section 7): the job whose `match` value equals `equals` is the one this task's submit made."""

from __future__ import annotations

from typing import Any

from asynctaskd.downloads import origin_of
from asynctaskd.errors import RetryableError
from asynctaskd.handlers import HandlerContext, Submitted

from .exchange import _Exchanging
from .options import HttpOptions
from .templates import _MISSING, _as_text, _Vars


class _Finding(_Exchanging):
    """HttpHandler's find(), set as `find` only with a find section."""

    options: HttpOptions
    _base_origin: tuple[str, str, int | None] | None

    async def _find(self, params: Any, ctx: HandlerContext) -> Submitted | None:
        """List the vendor's jobs; the one whose `match` value equals `equals` is ours."""
        plan = self.plan.find
        assert plan is not None  # find is only set with a find section
        # submit_attempt is the parked submit's: the lookup runs after its start counted it
        v = _Vars(
            ctx.task_id, ctx.idempotency_key, params=params, submit_attempt=ctx.submit_attempt
        )
        url, headers, content = self._prepare(plan.request, v, "find")
        want = self._render_text(plan.equals, v)
        options = self.options.find
        assert options is not None
        for page in range(1, options.max_pages + 1):
            response = await self._send(ctx, "find", plan.request.method, url, headers, content)
            self._check_status(response, "find")
            doc = self._decode(response, "find")
            items = plan.items.get(doc)
            if not isinstance(items, list):
                found = "nothing" if items is _MISSING else type(items).__name__
                raise RetryableError(
                    f"find: expected a list of jobs at {plan.items.text or '/'}, found "
                    f"{found}; body: {self._excerpt(response.content)}",
                    code="VENDOR_GARBAGE",
                )
            job = self._our_job(items, want)
            if job is not None:
                return job
            if plan.next is not None:
                following = plan.next.get(doc)
                if following is _MISSING or following is None:
                    return None  # the last page: the vendor has no job of ours
                url = self._next_page(following)
                continue
            if plan.more is None or plan.more.get(doc) is not True:
                return None  # the whole listing was read: the vendor has no job of ours
            cursor = plan.cursor.get(doc) if plan.cursor is not None else _MISSING
            if plan.next_url is None or cursor is _MISSING or cursor is None:
                break
            if page < options.max_pages:
                v.value = cursor
                url = self._render_text(plan.next_url, v, url=True)
        raise RetryableError(
            "find: the job is not on the listing's pages read, and the vendor says there is "
            "more: it may be further back (no resubmit on a listing read in part)",
            code="FIND_INCOMPLETE",
        )

    def _next_page(self, url: Any) -> str:
        """The answer's next-page URL, if it is on base_url's origin (our headers, with the
        credentials, go with it); anything else is an error, never requested."""
        if isinstance(url, str) and origin_of(url) == self._base_origin:
            return url
        raise RetryableError(
            f"find: the listing's next page is not a URL on base_url's origin: "
            f"{_as_text(url)[:80]!r} (not requested)",
            code="FIND_REFUSED",
        )

    def _our_job(self, items: list[Any], want: str) -> Submitted | None:
        plan = self.plan.find
        assert plan is not None
        for item in items:
            value = plan.match.get(item)
            if value is _MISSING or _as_text(value) != want:
                continue
            raw = plan.id.get(item)
            if isinstance(raw, int) and not isinstance(raw, bool):
                raw = str(raw)
            if not isinstance(raw, str) or not raw:
                raise RetryableError(
                    f"find: our job is listed without an id at {plan.id.text or '/'}",
                    code="VENDOR_GARBAGE",
                )
            handle = {}
            for name, pointer in plan.handle:
                got = pointer.get(item)
                handle[name] = None if got is _MISSING else got
            return Submitted(raw, handle)
        return None
