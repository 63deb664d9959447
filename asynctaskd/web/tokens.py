"""Bearer tokens of the HTTP API: made, listed and revoked at runtime, stored hashed.

A token reads `atd_<id>_<secret>`. Redis keeps, in the hash `<ns>:web:tokens`, one field
per id whose value is a JSON record: the role, the tenant, a note, and the SHA-256 of the
secret, never the secret itself. So a copy of Redis lets nobody call the API, and the id
finds the record in one HGET without scanning. The secret is 32 random bytes: a fast hash
is enough, nothing can be guessed.

A token may carry a request rate (`rate` per second, `burst`): the web process keeps a
token bucket per token in its own memory (`RateLimiter`), so with several web processes
each allows the rate. Not the admission buckets of lua/take.lua: that script is the
daemon's (docs/security.md), and the web process connects as a producer.

Any process may create or revoke a token (`asynctaskd token ...`); the web process reads
records through a cache trusted for `[web] token_cache` seconds, so a new token works at
once (a miss is read from Redis) and a revoked one stops within that time, no restart.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import math
import re
import secrets
import time
from typing import Any, Final, Literal

import msgspec

from asynctaskd.keys import HANDLER_KEY_RE

__all__ = ["ROLES", "RateLimiter", "Role", "TokenCache", "TokenRecord", "mint", "tokens_key"]

Role = Literal["producer", "viewer", "operator"]
ROLES: Final[tuple[Role, ...]] = ("producer", "viewer", "operator")
_TOKEN_RE: Final = re.compile(r"atd_([0-9a-f]{16})_([A-Za-z0-9_-]{43})")


class TokenRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What Redis keeps of a token. `tenant` is "" for operators (they see every tenant)."""

    id: str
    role: Role
    tenant: str = ""
    note: str = ""
    sha256: str
    created_at: float
    rate: float | None = None  # requests per second, None: no limit of its own
    burst: int | None = None


def tokens_key(namespace: str) -> str:
    """The hash of every token record of a namespace."""
    return f"{namespace}:web:tokens"


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


_MAX_RATE: Final = 1_000_000.0


def mint(
    role: Role, tenant: str | None, note: str = "", *, rate: float | None = None,
    burst: int | None = None,
) -> tuple[str, TokenRecord]:  # fmt: skip
    """A new token and the record to store for it. Producers and viewers must be bound to
    a tenant (they may only see its tasks); operators must not be (they see all). With
    `rate`, at most that many requests per second (bursts of `burst`, default the rate
    rounded up) are answered; the others get 429."""
    if rate is not None and not (isinstance(rate, int | float) and 0 < rate <= _MAX_RATE):
        raise ValueError(f"rate must be a number of requests per second above 0, got {rate!r}")
    if burst is not None:
        if rate is None:
            raise ValueError("a burst needs a rate: give --rate too")
        if not isinstance(burst, int) or isinstance(burst, bool) or not 1 <= burst <= 1_000_000:
            raise ValueError(f"burst must be an integer from 1 to 1000000, got {burst!r}")
    if rate is not None and burst is None:
        burst = max(1, math.ceil(rate))
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if role == "operator" and tenant:
        raise ValueError("an operator token sees every tenant: give no --tenant")
    if role != "operator" and not tenant:
        raise ValueError(f"a {role} token must be bound to a tenant: give --tenant")
    if tenant and not HANDLER_KEY_RE.fullmatch(tenant):
        raise ValueError(
            f"tenant must be 1-64 characters from letters, digits, '_', '.', ':' and '-', "
            f"got {tenant!r}"
        )
    token_id, secret = secrets.token_hex(8), secrets.token_urlsafe(32)
    record = TokenRecord(
        id=token_id,
        role=role,
        tenant=tenant or "",
        note=note,
        sha256=_digest(secret),
        created_at=time.time(),
        rate=None if rate is None else float(rate),
        burst=burst,
    )
    return f"atd_{token_id}_{secret}", record


class TokenCache:
    """Resolves a presented token to its record, reading Redis at most once per id per
    `ttl` seconds (a missing id too, so garbage tokens cannot hammer Redis)."""

    def __init__(self, redis: Any, namespace: str, ttl: float) -> None:
        self._redis = redis
        self._key = tokens_key(namespace)
        self._ttl = ttl
        self._cache: dict[str, tuple[float, TokenRecord | None]] = {}
        # Reads in flight by id: a burst of requests with one token (thousands of event
        # streams opening) makes one HGET, not one each, nor a pool connection each.
        self._reading: dict[str, asyncio.Future[tuple[float, TokenRecord | None]]] = {}

    async def check(self, token: str) -> TokenRecord | None:
        """The token's record if the token is valid and not revoked, else None."""
        m = _TOKEN_RE.fullmatch(token)
        if m is None:
            return None
        token_id, secret = m[1], m[2]
        record = await self.record(token_id)
        if record is None or not hmac.compare_digest(record.sha256, _digest(secret)):
            return None
        return record

    async def record(self, token_id: str) -> TokenRecord | None:
        """The stored record of `token_id` (None: unknown or revoked), through the cache;
        a console session keeps only the id, and finds its token revoked here."""
        cached = self._cache.get(token_id)
        if cached is None or time.monotonic() - cached[0] >= self._ttl:
            reading = self._reading.get(token_id)
            if reading is None:
                reading = self._reading[token_id] = asyncio.ensure_future(self._read(token_id))
                reading.add_done_callback(functools.partial(self._done, token_id))
            cached = await asyncio.shield(reading)  # one caller leaving cancels no other's
        return cached[1]

    async def _read(self, token_id: str) -> tuple[float, TokenRecord | None]:
        now = time.monotonic()
        raw = await self._redis.hget(self._key, token_id)
        record = None
        if raw is not None:
            try:
                record = msgspec.json.decode(raw, type=TokenRecord)
            except msgspec.DecodeError:
                record = None  # written by something else: no valid token
        if len(self._cache) > 10_000:
            self._cache.clear()  # bounded: garbage ids cannot grow it forever
        self._cache[token_id] = (now, record)
        return now, record

    def _done(self, token_id: str, done: asyncio.Future[Any]) -> None:
        if self._reading.get(token_id) is done:
            del self._reading[token_id]
        if not done.cancelled():
            done.exception()  # seen, even if every caller stopped waiting for it


class RateLimiter:
    """A token bucket per token id, in this process: `take` answers 0 if the request may
    go on, else the seconds until it may."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}  # id -> (tokens, at)

    def take(self, record: TokenRecord) -> float:
        if record.rate is None:
            return 0.0
        burst = float(record.burst or max(1, math.ceil(record.rate)))
        now = time.monotonic()
        tokens, at = self._buckets.get(record.id, (burst, now))
        tokens = min(burst, tokens + (now - at) * record.rate)
        if tokens >= 1.0:
            self._buckets[record.id] = (tokens - 1.0, now)
            return 0.0
        self._buckets[record.id] = (tokens, now)
        return (1.0 - tokens) / record.rate
