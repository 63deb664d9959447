"""The commands that run on a client (`_client_command`): a task's submit, get, cancel,
wait, watch, list, resolve and requeue, inline or here; pause, resume, purge and
`scripts load`; the operator's groups, limits, tokens and stats through `operator`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Final

import msgspec

from asynctaskd.errors import TaskNotFound
from asynctaskd.model import Status

from .common import (
    EXIT_FAILED,
    EXIT_REFUSED,
    EXIT_TIMED_OUT,
    _connection,
    _duration,
    _empty_namespace,
    _out,
    _parse_json,
    _print_task,
    _say,
    _task_dict,
)
from .operator import _group, _limits, _stats, _token

_CANCEL_SAYS: Final = {
    "canceled": "canceled",
    "finished": "it finished before the cancel was carried out: nothing was canceled",
    "requested": "cancel requested: the worker holding the task cancels it at its next save",
    "pending": "cancel requested: no daemon has taken the request in yet; it will be done "
    "when one runs",
}


def _cancel_outcome(client: Any, task_id: str, tenant: str | None, wait_s: float) -> str:
    """What became of a cancel request within `wait_s`: a daemon carries it out
    (docs/security.md: producers may only ask): 'canceled', 'finished' (it ended otherwise
    first), 'requested' (a worker holds the task and was told) or 'pending' (no daemon has
    taken the request in)."""
    deadline = time.monotonic() + wait_s
    while True:
        task = client.get(task_id, tenant=tenant)
        if task is None or task.status is Status.CANCELED:
            return "canceled"
        if task.status.is_terminal:
            return "finished"
        if task.cancel_requested:
            return "requested"
        if time.monotonic() >= deadline:
            return "pending"
        time.sleep(0.05)


def _client_command(args: argparse.Namespace) -> int:
    from asynctaskd.client import Client

    url, namespace, shards = _connection(args)
    where = (url, namespace)
    with Client.from_url(url, namespace=namespace, shards=shards) as client:
        cmd = args.command
        if cmd == "submit":
            raw = args.params
            text = Path(raw[1:]).read_text() if raw.startswith("@") else raw
            params = _parse_json(text, "params")
            task = client.submit(
                args.handler,
                params,
                tracking_timeout=_duration(args.timeout, "--timeout"),
                tenant=args.tenant,
                account=args.account,
                priority=args.priority,
                dedup_key=args.dedup_key,
                dedup="content" if args.dedup_by_content else None,
                delay=_duration(args.delay, "--delay") if args.delay else None,
                strict=not args.no_strict,
                route_key=args.route_key,
            )
            if args.json:
                _print_task(task, True)
            else:
                _out(task.id)
            return 0
        if cmd == "scripts":
            count = client.load_scripts()
            _out(f"loaded {count} scripts")
            return 0
        if cmd == "get":
            found = client.get(args.task_id, tenant=args.tenant, internals=True)
            if found is None:
                hint = _empty_namespace(client, where)
                raise TaskNotFound(f"no task {args.task_id}" + (f" ({hint})" if hint else ""))
            _print_task(found, args.json, internals=True)
            return 0
        if cmd == "cancel":
            wait_s = 0.0 if args.wait in ("0", "0s") else _duration(args.wait, "--wait")
            done = client.cancel(args.task_id, tenant=args.tenant)
            outcome = _cancel_outcome(client, args.task_id, args.tenant, wait_s) if done else None
            if args.json:
                _out(json.dumps({"task_id": args.task_id, "canceled": done, "outcome": outcome}))
            else:
                _out(_CANCEL_SAYS[outcome] if outcome else "already finished; nothing to cancel")
            return 0 if done else EXIT_REFUSED
        if cmd == "wait":
            timeout = _duration(args.timeout, "--timeout")
            task = client.wait(args.task_id, timeout, tenant=args.tenant)
            _print_task(task, args.json)
            if not (task.status.is_terminal or task.status is Status.SUBMIT_UNKNOWN):
                _say(f"asynctaskd: timed out after {args.timeout}: {task.status.value} still")
                return EXIT_TIMED_OUT
            return 0 if task.status is Status.SUCCEEDED else EXIT_FAILED
        if cmd == "watch":
            return _watch(client, args)
        if cmd == "list":
            page = client.list(
                status=args.status,
                handler=args.handler,
                tenant=args.tenant,
                limit=args.limit,
                cursor=args.cursor,
            )
            if args.json:
                _out(
                    json.dumps(
                        {"tasks": [_task_dict(t) for t in page.tasks], "cursor": page.cursor}
                    )
                )
            else:
                _out(f"{'id':<28}{'status':<20}{'handler':<21}{'tenant':<13}error")
                for t in page.tasks:
                    err = t.error.code if t.error and t.status is not Status.SUCCEEDED else ""
                    _out(f"{t.id:<28}{t.status.value:<20}{t.handler:<21}{t.tenant or '-':<13}{err}")
                if page.cursor:
                    _out(f"more: --cursor {page.cursor}")
            if not page.tasks and not args.cursor and (hint := _empty_namespace(client, where)):
                _say(f"asynctaskd: warning: {hint}")
            return 0
        if cmd in ("stats", "top"):
            return _stats(client, args, where)
        if cmd in ("pause", "resume"):
            who = {k: getattr(args, k) for k in ("handler", "provider", "tenant", "account")}
            if cmd == "pause":
                changed: bool | int = client.pause(**who, note=args.note)
                text = "paused" if changed else "already paused"
            else:
                changed = client.resume(**who)
                text = f"resumed; {changed} held task(s) back in line"
            _out(json.dumps({"command": cmd, "result": changed}) if args.json else text)
            return 0
        if cmd in ("resolve", "requeue"):
            if cmd == "resolve":
                query = _parse_json(args.query, "--query values") if args.query else None
                task = client.resolve(
                    args.task_id,
                    args.as_,
                    external_id=args.external_id,
                    query=query,
                    message=args.message,
                )
            else:
                task = client.requeue(args.task_id)
            _print_task(task, args.json)
            return 0
        if cmd == "group":
            return _group(client, args)
        if cmd == "token":
            return _token(client, args, namespace)
        if cmd == "limits":
            return _limits(client, args)
        if cmd == "purge":
            n = client.purge(
                _duration(args.older_than, "--older-than"), archive=args.archive, limit=args.limit
            )
            _out(f"purged {n} task(s)")
            return 0
    raise AssertionError(f"unhandled command {args.command}")


def _event_line(event: Any) -> str:
    at = time.strftime("%H:%M:%S", time.localtime(event.at)) if event.at else "--:--:--"
    parts = [at, f"{event.status.value:<18}"]
    if event.progress is not None:
        parts.append(f"{event.progress:.0%}")
    parts += [text for text in (event.stage, event.message) if text]
    return "  ".join(parts).rstrip()


def _watch(client: Any, args: argparse.Namespace) -> int:
    """Stream a task's changes until it settles; exit as `wait` does."""
    last = None
    try:
        for event in client.watch(args.task_id, tenant=args.tenant):
            last = event
            _out(json.dumps(msgspec.to_builtins(event)) if args.json else _event_line(event))
            sys.stdout.flush()
    except KeyboardInterrupt:
        return 130
    if last is None:
        raise TaskNotFound(f"no task {args.task_id}")
    return 0 if last.status is Status.SUCCEEDED else EXIT_FAILED
