"""What every command shares: the exit codes, the connection options (--url, --namespace,
--shards, [redis] of --config, $ASYNCTASKD_URL), durations and JSON from the command
line, and printing: answers on stdout, notes for the person at the terminal on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Final

import msgspec

from asynctaskd.config import load_config
from asynctaskd.errors import InvalidTask
from asynctaskd.model import Task

EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_NOT_FOUND: Final = 3
EXIT_REFUSED: Final = 4
EXIT_TIMED_OUT: Final = 5
DEFAULT_URL: Final = "redis://127.0.0.1:6379/0"
# A Task's fields only a worker's or operator's read fills in (`get` shows them); other
# reads leave them at defaults, so their --json leaves them out rather than invent them.
_INTERNALS: Final = ("fence", "owner", "started_fence", "reclaims", "idempotent")


def _duration(text: str, what: str) -> float:
    from asynctaskd.config import Duration

    try:
        try:
            value: object = float(text)  # plain seconds, e.g. "90"
        except ValueError:
            value = text  # a duration with a unit, e.g. "5m"
        return float(Duration.parse(value))
    except ValueError as exc:
        raise InvalidTask(f"{what}: {exc}") from None


def _connection(args: argparse.Namespace) -> tuple[str, str, int]:
    url, namespace, shards = None, None, 1
    if getattr(args, "config", None):
        config = load_config(args.config)
        url, namespace, shards = config.redis.url, config.redis.namespace, config.redis.shards
        if url == "embedded":  # the daemon's own server, through its socket
            url = f"embedded://{Path(config.redis.data_dir).resolve()}"
    url = args.url or url or os.environ.get("ASYNCTASKD_URL")
    if not url:
        url = DEFAULT_URL
        _say(f"asynctaskd: no --url, --config or $ASYNCTASKD_URL: using {DEFAULT_URL}")
    if getattr(args, "shards", None) is not None:
        if not 1 <= args.shards <= 1024:
            raise InvalidTask(f"--shards must be between 1 and 1024, got {args.shards}")
        shards = args.shards
    return url, args.namespace or namespace or "atd", shards


def _task_dict(task: Task, internals: bool = False) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(task)
    if not internals:
        for name in _INTERNALS:
            del data[name]
    return data


def _print_task(task: Task, as_json: bool, internals: bool = False) -> None:
    if as_json:
        print(json.dumps(_task_dict(task, internals)))  # noqa: T201 - CLI output
        return
    d = _task_dict(task, internals)
    width = max(len(k) for k in d)
    for k, v in d.items():
        if v in (None, "", 0, False) and k not in ("status", "version"):
            continue
        if k.endswith("_at") and isinstance(v, float):
            v = f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(v))} ({v:.3f})"
        elif not isinstance(v, str):
            v = json.dumps(v)
        print(f"{k:<{width}}  {v}")  # noqa: T201 - CLI output


def _out(value: Any) -> None:
    print(value)  # noqa: T201 - CLI output


def _say(text: str) -> None:
    """A note for the person at the terminal, on stderr (stdout stays the answer)."""
    print(text, file=sys.stderr)  # noqa: T201 - CLI output


def _shown_url(url: str) -> str:
    """`url` without its password."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def _empty_namespace(client: Any, where: tuple[str, str], stats: Any = None) -> str:
    """A hint when the namespace holds nothing at all (a wrong URL, database or namespace
    reads as zeros), else ''."""
    s = stats if stats is not None else client.stats()
    if any(s.by_status.values()) or s.daemons or s.requests:
        return ""
    url, namespace = where
    return (
        f"namespace {namespace!r} at {_shown_url(url)} holds no tasks and no "
        "daemon has registered there: check --url (and its database number) and --namespace"
    )


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidTask(f"{what} are not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidTask(f"{what} nest too deeply (JSON arrays and objects)") from None
