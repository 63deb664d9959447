"""Console sessions: a random id in an HttpOnly, SameSite=Strict cookie, the session kept
in Redis under the id's SHA-256 (a copy of Redis holds no usable cookie).

A session stores the id of the token that logged in and that token's hash, never the
token: each request reads the token record again (through the web process's token
cache), so revoking the token ends its sessions within `[web] token_cache`. Each session
has a random CSRF token; every request that changes something must send it back in the
`X-CSRF-Token` header (checked in `web.common._auth`). SameSite=Strict alone would leave
older browsers and same-site subdomains able to forge requests; the header cannot be
sent by a form or a cross-origin page without the JSON API's CORS consent, which this
server never gives. Sessions live in Redis so that several web processes behind a
balancer share them.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Any, Final

import msgspec

from asynctaskd.web.tokens import TokenRecord

__all__ = ["COOKIE", "CSRF_HEADER", "Session", "Sessions"]

COOKIE: Final = "atd_console"
CSRF_HEADER: Final = "X-CSRF-Token"
SESSION_TTL_S: Final = 12 * 3600  # a working day; log in again after it
_ID_BYTES: Final = 32


class Session(msgspec.Struct, frozen=True, kw_only=True):
    """What Redis keeps of a session."""

    token_id: str
    sha256: str  # the token's hash when it logged in: a token re-made under the id fails
    csrf: str
    cursor_seed: str  # seals the task browser's cursors (they name positions, not tasks)
    created_at: float


class Sessions:
    """Create, read and end sessions in `<ns>:web:session:<sha256 of the id>`."""

    def __init__(self, redis: Any, namespace: str, ttl: int = SESSION_TTL_S) -> None:
        self._redis = redis
        self._prefix = f"{namespace}:web:session:"
        self.ttl = ttl

    def _key(self, session_id: str) -> str:
        return self._prefix + hashlib.sha256(session_id.encode()).hexdigest()

    async def create(self, record: TokenRecord) -> tuple[str, Session]:
        session_id = secrets.token_urlsafe(_ID_BYTES)
        session = Session(
            token_id=record.id,
            sha256=record.sha256,
            csrf=secrets.token_urlsafe(_ID_BYTES),
            cursor_seed=secrets.token_urlsafe(_ID_BYTES),
            created_at=time.time(),
        )
        await self._redis.set(self._key(session_id), msgspec.json.encode(session), ex=self.ttl)
        return session_id, session

    async def load(self, session_id: str) -> Session | None:
        if not 20 <= len(session_id) <= 100:
            return None  # not one of ours: no Redis read for garbage
        raw = await self._redis.get(self._key(session_id))
        if raw is None:
            return None
        try:
            return msgspec.json.decode(raw, type=Session)
        except msgspec.DecodeError:
            return None

    async def end(self, session_id: str) -> None:
        await self._redis.delete(self._key(session_id))
