"""The ACL users of docs/security.md, created exactly as that page gives them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import redis.exceptions

ROOT = Path(__file__).resolve().parent.parent
SECURITY = ROOT / "docs" / "security.md"
# Redis 7.0 does not know these two; the page says to drop them there.
UNKNOWN_TO_7_0 = ("+client|setinfo", "+waitaof")
USERS = ("asynctaskd", "asynctaskd-producer", "asynctaskd-operator")


def acl_rules(name: str, password: str) -> list[str]:
    """The rules of `ACL SETUSER <name>` on docs/security.md, with `password`."""
    line = re.search(rf"^ACL SETUSER {re.escape(name)} (.+)$", SECURITY.read_text(), re.M)
    assert line is not None, f"docs/security.md has no ACL SETUSER {name} line"
    return [f">{password}" if r.startswith(">") else r for r in line[1].split()]


def _unknown(exc: redis.exceptions.ResponseError) -> str | None:
    unknown = re.search(r"'(\+[a-z|]+)'", str(exc))
    return unknown[1] if unknown is not None and unknown[1] in UNKNOWN_TO_7_0 else None


async def create_user(admin: Any, name: str, password: str) -> None:
    """Create the user on an asyncio admin connection."""
    rules = acl_rules(name, password)
    while True:
        try:
            await admin.execute_command("ACL", "SETUSER", name, *rules)
            return
        except redis.exceptions.ResponseError as exc:
            unknown = _unknown(exc)
            if unknown is None:
                raise
            rules.remove(unknown)


def create_user_sync(admin: Any, name: str, password: str) -> None:
    """Create the user on a blocking admin connection."""
    rules = acl_rules(name, password)
    while True:
        try:
            admin.execute_command("ACL", "SETUSER", name, *rules)
            return
        except redis.exceptions.ResponseError as exc:
            unknown = _unknown(exc)
            if unknown is None:
                raise
            rules.remove(unknown)


def user_url(url: str, name: str, password: str) -> str:
    return url.replace("redis://", f"redis://{name}:{password}@", 1)
