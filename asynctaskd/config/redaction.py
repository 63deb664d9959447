"""What `Config.redacted` (`asynctaskd check-config`) masks: URL passwords, and options
and query parameters whose names look secret."""

from __future__ import annotations

import re
from typing import Any, Final
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

__all__: list[str] = []

_SECRET_NAME: Final = re.compile(r"token|secret|password|key|authorization", re.IGNORECASE)
_MASK: Final = "***"
_USERINFO_PASSWORD: Final = re.compile(r"(://[^:/@]*:)[^/]*@")


# ---- redaction for check-config ----


def _mask_url(url: str) -> str:
    """Mask the password and secret-looking query parameters in a URL.

    Sentinel URLs (`redis+sentinel://user:pw@host1:26379,host2:26379/service`) have one
    user info for all their hosts, masked like any other; a URL too malformed to split
    still loses whatever sits between `user:` and `@`.
    """
    try:
        parts = urlsplit(url)
        has_password = parts.password is not None
    except ValueError:
        return _USERINFO_PASSWORD.sub(rf"\g<1>{_MASK}@", url)
    if has_password:
        userinfo, _, host = parts.netloc.rpartition("@")
        parts = parts._replace(netloc=f"{userinfo.partition(':')[0]}:{_MASK}@{host}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(_SECRET_NAME.search(name) for name, _ in query):
        masked = [(n, _MASK if _SECRET_NAME.search(n) else v) for n, v in query]
        parts = parts._replace(query=urlencode(masked, safe="*"))
    return urlunsplit(parts)


def _mask_secrets(value: Any) -> Any:
    """Options with secret-looking keys masked, recursively; URLs lose their passwords."""
    if isinstance(value, dict):
        return {k: _MASK if _SECRET_NAME.search(k) else _mask_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask_secrets(v) for v in value]
    if isinstance(value, str) and "://" in value:
        return _mask_url(value)
    return value
