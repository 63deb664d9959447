"""What the mixins that send requests of their own (submit steps, find) take from
HttpHandler: its plan, and its two halves of sending one request."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .classify import _Classifying
from .plan import _Plan
from .templates import _Rendering

if TYPE_CHECKING:
    from asynctaskd.handlers import HandlerContext
    from asynctaskd.transport import Reply

    from .plan import _Request
    from .templates import _Vars


class _Exchanging(_Classifying, _Rendering):
    plan: _Plan

    if TYPE_CHECKING:  # HttpHandler's

        def _prepare(
            self, request: _Request, v: _Vars, what: str
        ) -> tuple[str, dict[str, str], bytes | None]: ...

        async def _send(
            self,
            ctx: HandlerContext,
            what: str,
            method: str,
            url: str,
            headers: dict[str, str],
            content: bytes | None,
        ) -> Reply: ...
