"""The demo handler with `find`, for the crash runs (tests/chaos): the fake vendor's job of
a task, found by the `ref` its submit sent (the task id).

The fake vendor (asynctaskd.devtools.fakevendor) lists every job on ``GET /_jobs``, with
its ``ref`` and ``created_at``. `lag` hides jobs younger than that many seconds, as a
vendor whose listing lags behind its creates would; `find_visible_after` must cover it
plus the submit's own time. Every lookup is appended to `log` (one line: task id and what
it found), so a run can count its lookups across daemons that were killed.
"""

from __future__ import annotations

import os
import time
from typing import Any

from asynctaskd.devtools.demo import DemoHandler
from asynctaskd.errors import RetryableError
from asynctaskd.handlers import HandlerContext, Submitted

__all__ = ["FindableDemo", "make_handler"]


class FindableDemo(DemoHandler):
    def __init__(
        self, key: str, base_url: str, *, lag: float, visible_after: float, log: str = ""
    ) -> None:
        super().__init__(key, base_url)
        self.lag = lag
        self.find_visible_after = visible_after
        self.log = log

    async def find(self, params: Any, ctx: HandlerContext) -> Submitted | None:
        reply = await ctx.fetch("GET", f"{self.base_url}/_jobs")
        if reply.status != 200:
            raise RetryableError(f"find: vendor error {reply.status}", code=f"HTTP_{reply.status}")
        listed_before = time.time() - self.lag
        found = None
        for job in reply.json():
            if job.get("ref") == ctx.task_id and float(job["created_at"]) <= listed_before:
                found = Submitted(str(job["id"]))
                break
        if self.log:
            line = f"{ctx.task_id} {found.external_id if found else '-'}\n".encode()
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        return found


def make_handler(options: dict[str, Any]) -> FindableDemo:
    """Options: base_url, key, lag and visible_after (seconds), log (a file path)."""
    return FindableDemo(
        str(options.get("key", "demo")),
        str(options["base_url"]),
        lag=float(options.get("lag", 0.0)),
        visible_after=float(options.get("visible_after", 2.0)),
        log=str(options.get("log", "")),
    )
