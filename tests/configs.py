"""The daemon config files the process tests start `asynctaskd run` (or `Daemon`) with.

One writer, sections as dicts: a test states only what it changes. Defaults are the fast
settings every such test wants (short error delays, a 200 ms reaper, no metrics
listener) and one demo handler on the fake vendor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.servers import Pki

FAST_RETRY: Mapping[str, Any] = {
    "poll_interval": "100ms",
    "first_error_delay": "50ms",
    "max_error_delay": "500ms",
}


def demo_handler(vendor_url: str, key: str = "demo", **options: Any) -> dict[str, Any]:
    """A `[[handlers]]` entry: the demo handler talking to the fake vendor at `vendor_url`."""
    return {
        "key": key,
        "type": "python",
        "factory": "asynctaskd.devtools.demo:make_handler",
        "options": {"base_url": vendor_url, "key": key, **options},
    }


def _toml(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)  # strings, numbers and booleans are spelled alike in TOML


def _table(header: str, values: Mapping[str, Any]) -> str:
    return "\n".join([header, *(f"{k} = {_toml(v)}" for k, v in values.items())])


def daemon_toml(
    url: str,
    vendor_url: str,
    *,
    redis: Mapping[str, Any] | None = None,
    worker: Mapping[str, Any] | None = None,
    retry: Mapping[str, Any] = FAST_RETRY,
    reaper: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    log: Mapping[str, Any] | None = None,
    handlers: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """A whole config file; empty sections are left out (their defaults apply)."""
    sections = {
        "redis": {"url": url, **(redis or {})},
        "worker": worker or {},
        "retry": retry,
        "reaper": {"interval": "200ms"} if reaper is None else reaper,
        "metrics": {"enabled": False} if metrics is None else metrics,
        "log": log or {},
    }
    tables = [_table(f"[{name}]", values) for name, values in sections.items() if values]
    entries = handlers if handlers is not None else [demo_handler(vendor_url)]
    tables += [_table("[[handlers]]", entry) for entry in entries]
    return "\n".join(tables) + "\n"


def tls_daemon_toml(url: str, pki: Pki, vendor_url: str, **redis: str) -> str:
    """A daemon config with the client side of `pki` in its [redis] TLS keys."""
    tls = {"tls_ca": str(pki.ca), "tls_cert": str(pki.client_cert), "tls_key": str(pki.client_key)}
    return daemon_toml(
        url,
        vendor_url,
        redis={**tls, **redis},
        worker={"lease": "2s"},
        retry={"poll_interval": "50ms"},
    )


def write_daemon_config(path: Path, url: str, vendor_url: str, **sections: Any) -> Path:
    """`daemon_toml` written to `path`; returns `path`."""
    path.write_text(daemon_toml(url, vendor_url, **sections))
    return path
