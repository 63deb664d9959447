"""Structured logs for journald: one JSON object (or logfmt line) per record."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Final

__all__ = ["setup_logging"]

# Fields handlers and the worker attach with `extra=`; printed when present.
_FIELDS: Final = ("task_id", "handler", "fence", "outcome", "phase", "shard", "daemon")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in _FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                out[name] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        parts = [
            f"ts={time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(record.created))}Z",
            f"level={record.levelname.lower()}",
            f"logger={record.name}",
            f"msg={_quote(record.getMessage())}",
        ]
        for name in _FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                parts.append(f"{name}={_quote(str(value))}")
        if record.exc_info:
            parts.append(f"exc={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


def _quote(value: str) -> str:
    if value and not any(c in value for c in ' "=\n\t'):
        return value
    return json.dumps(value)


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    """Configure the root logger once: stderr, the chosen format and level."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    elif fmt == "logfmt":
        handler.setFormatter(LogfmtFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # One INFO line per vendor request is noise at thousands of calls a second.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
