"""Credentials: `{env:..}`, `{file:..}` and `{credential:..}` read on first use and kept, and
masked (`***`) in error messages, httpx's log lines and values read from a vendor's answer."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

_EXCERPT_CHARS: Final = 200
_MASK: Final = "***"
_MIN_SECRET_CHARS: Final = 4  # shorter values are not redacted (they would mangle messages)


class _SecretMissing(Exception):
    pass


class _UrlLogFilter(logging.Filter):
    """Masks credentials in the records of httpx's logger.

    httpx logs every request at INFO: the URL (credentials in `base_url`) and the answer's
    status line, whose reason phrase is the vendor's to write (one may quote the token).
    """

    def __init__(self) -> None:
        super().__init__()
        self.secrets: tuple[str, ...] = ()

    def protect(self, secret: str) -> None:
        if len(secret) >= _MIN_SECRET_CHARS and secret not in self.secrets:
            self.secrets = tuple(sorted({*self.secrets, secret}, key=len, reverse=True))
            logger = logging.getLogger("httpx")
            if self not in logger.filters:
                logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = message
        for secret in self.secrets:
            masked = masked.replace(secret, _MASK)
        if masked != message:
            record.msg, record.args = masked, None
        return True


_URL_LOG_FILTER: Final = _UrlLogFilter()


class _Secrets:
    """Credential values, read on first use and kept; `redact` masks every one seen."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, str], str] = {}
        self._known: tuple[str, ...] = ()

    def get(self, kind: str, arg: str) -> str:
        value = self._values.get((kind, arg))
        if value is None:
            value = _read_secret(kind, arg)
            self._values[(kind, arg)] = value
            if len(value) >= _MIN_SECRET_CHARS:
                self._known = tuple(sorted({*self._known, value}, key=len, reverse=True))
            _URL_LOG_FILTER.protect(value)
        return value

    def preload(self, refs: Iterable[tuple[str, str]]) -> None:
        """Read every credential the handler's templates name, so that `redact` masks them
        even in text from a call that never sent them (a vendor's file host echoing one a
        query sent earlier in another process). A credential that cannot be read now is
        skipped: the call that needs it says so."""
        for kind, arg in refs:
            if (kind, arg) not in self._values:
                with contextlib.suppress(Exception):
                    self.get(kind, arg)

    def redact(self, text: str) -> str:
        for secret in self._known:
            if secret in text:
                text = text.replace(secret, _MASK)
        return text

    def scrub(self, doc: Any, raw: bytes) -> Any:
        """`doc`, decoded from `raw`, with every secret masked in its strings and keys.

        A vendor that quotes the request (an echoed header, a "bad token ..." message) would
        otherwise put the credential into handles, results and messages, and so into Redis.
        Only a body holding a secret as is, or any JSON escape that could spell one, is walked.
        """
        if not self._known or (
            b"\\" not in raw and not any(s.encode() in raw for s in self._known)
        ):
            return doc
        root = [doc]
        stack: list[tuple[Any, Any]] = [(root, 0)]
        while stack:  # iterative: answers may be nested as deep as the decoder allows
            parent, key = stack.pop()
            value = parent[key]
            if isinstance(value, str):
                parent[key] = self.redact(value)
            elif isinstance(value, list):
                stack.extend((value, i) for i in range(len(value)))
            elif isinstance(value, dict):
                items = [(self.redact(k), v) for k, v in value.items()]
                value.clear()
                value.update(items)
                stack.extend((value, k) for k in value)
        return root[0]


def _read_secret(kind: str, arg: str) -> str:
    if kind == "env":
        value = os.environ.get(arg)
        if value is None:
            raise _SecretMissing(f"environment variable {arg} is not set")
        return value
    if kind == "credential":
        directory = os.environ.get("CREDENTIALS_DIRECTORY")
        if not directory:
            raise _SecretMissing(
                f"credential {arg}: $CREDENTIALS_DIRECTORY is not set (systemd LoadCredential=)"
            )
        path = Path(directory) / arg
    else:
        path = Path(arg)
    try:
        return path.read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise _SecretMissing(f"cannot read {kind} {arg}: {reason}") from None


class _Redacting:
    """HttpHandler's messages with its credentials masked: an exception, a vendor's body."""

    _secrets: _Secrets
    _secret_refs: tuple[tuple[str, str], ...]

    def _explain(self, exc: BaseException) -> str:
        self._secrets.preload(self._secret_refs)
        return self._secrets.redact(f"{type(exc).__name__}: {exc}".rstrip(": "))

    def _excerpt(self, content: bytes) -> str:
        # Redact before cutting, so no secret is left half-visible at the edge.
        self._secrets.preload(self._secret_refs)
        text = self._secrets.redact(content[:4096].decode("utf-8", "replace"))
        cut = text[:_EXCERPT_CHARS]
        return repr(cut + ("..." if len(text) > _EXCERPT_CHARS or len(content) > 4096 else ""))
