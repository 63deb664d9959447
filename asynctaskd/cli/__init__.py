"""The `asynctaskd` command: run the daemon, develop locally, inspect and repair tasks.

Exit codes (also in `asynctaskd --help`): 0 ok; 1 failed (Redis unreachable, or `wait` /
`watch` saw the task end without succeeding); 2 usage, configuration or input error; 3 not
found; 4 refused (not possible now: the task's state, a quota, a permission); 5 timed out
(`wait --timeout`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from asynctaskd.config import LimitConfig, load_config
from asynctaskd.errors import (
    AsyncTaskdError,
    ConfigError,
    IllegalTransition,
    InvalidTask,
    NotPermitted,
    QuotaExceeded,
    TaskNotFound,
    UnknownHandler,
)
from asynctaskd.model import Status, Task
from asynctaskd.routing import POLICIES, Group, MemberSpec

__all__ = ["EXIT_FAILED", "EXIT_NOT_FOUND", "EXIT_REFUSED", "EXIT_TIMED_OUT", "main"]

EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_NOT_FOUND: Final = 3
EXIT_REFUSED: Final = 4
EXIT_TIMED_OUT: Final = 5
DEFAULT_URL: Final = "redis://127.0.0.1:6379/0"
# A Task's fields only a worker's or operator's read fills in (`get` shows them); other
# reads leave them at defaults, so their --json leaves them out rather than invent them.
_INTERNALS: Final = ("fence", "owner", "started_fence", "reclaims", "idempotent")

EPILOG = """\
examples:
  asynctaskd dev --demo 200                      embedded Valkey + fake vendor + demo tasks
  asynctaskd run --config /etc/asynctaskd/config.toml
  asynctaskd check-config --config config.toml   validate, print the effective config
  asynctaskd submit demo '{"text": "hi"}' --timeout 10m
  asynctaskd get 01J... --json
  asynctaskd list --status SUBMIT_UNKNOWN
  asynctaskd resolve 01J... --as SUBMITTED --external-id job_42
  asynctaskd stats
  asynctaskd pause --tenant t1 --note "over budget"   hold back new submits; resume to undo
  asynctaskd limits set --provider openai --submit-rate 50 --max-in-flight 500
  asynctaskd limits set --tenant '*' --quota 10000 --quota-period 1d
  asynctaskd group set ocr --policy weighted --member ocr:a=3 --member ocr:b
  asynctaskd web --config config.toml            the HTTP API of [web] (docs/api.md)
  asynctaskd token create --role producer --tenant t1 --note "billing app"
  asynctaskd submit ocr '{"text": "hi"}'          a group: one member is picked, once

Reads use --url/--namespace, or [redis] from --config, or $ASYNCTASKD_URL.

exit codes: 0 ok; 1 failed (Redis unreachable, or wait/watch saw the task end without
succeeding); 2 usage, configuration or input error; 3 not found; 4 refused (not possible
now: the task's state, a quota, a permission); 5 timed out (wait --timeout).
"""


def _status(text: str) -> Status:
    try:
        return Status(text.upper())
    except ValueError:
        names = ", ".join(s.value for s in Status)
        raise argparse.ArgumentTypeError(f"{text!r} is not a status; one of {names}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asynctaskd",
        description="Submit vendor jobs once, track them to the end, from Redis.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def conn(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", type=Path, help="config file (for [redis] url and namespace)")
        sp.add_argument("--url", help="Redis URL (default: from --config or $ASYNCTASKD_URL)")
        sp.add_argument("--namespace", help="key namespace (default: from --config, or atd)")
        sp.add_argument(
            "--shards", type=int, help="shards the daemons use (default: from --config, or 1)"
        )

    def js(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--json", action="store_true", help="print JSON instead of text")

    sp = sub.add_parser("run", help="run the daemon (systemd ExecStart)")
    sp.add_argument("--config", type=Path, required=True, help="path to config.toml")

    sp = sub.add_parser("dev", help="embedded Valkey + fake vendor + daemon, for trying it out")
    sp.add_argument("--demo", type=int, default=0, metavar="N", help="submit N demo tasks")
    sp.add_argument(
        "--data-dir", default=".asynctaskd", help="where the embedded Valkey keeps data"
    )
    sp.add_argument("--polls", type=int, default=3, help="fake vendor: polls until a job is done")
    sp.add_argument("--keep-running", action="store_true", help="stay up after the demo finishes")

    sp = sub.add_parser("web", help="serve the HTTP API of [web] (docs/api.md)")
    sp.add_argument("--config", type=Path, required=True, help="path to config.toml")

    sp = sub.add_parser("token", help="create, list or revoke HTTP API tokens (runtime)")
    tsub = sp.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    tp = tsub.add_parser("create", help="make a token; its secret is shown once")
    conn(tp)
    js(tp)
    tp.add_argument(
        "--role", required=True, choices=("producer", "viewer", "operator"),
        help="producer: submit, read, watch, cancel; viewer: read, watch; operator: all",
    )  # fmt: skip
    tp.add_argument("--tenant", help="the tenant a producer or viewer token is bound to")
    tp.add_argument("--note", default="", help="who or what the token is for")
    tp = tsub.add_parser("list", help="every token (ids, roles, tenants; never secrets)")
    conn(tp)
    js(tp)
    tp = tsub.add_parser("revoke", help="revoke a token by id (within [web] token_cache)")
    conn(tp)
    tp.add_argument("token_id", help="the id `token list` shows")

    sp = sub.add_parser("check-config", help="validate a config file and print it, secrets masked")
    sp.add_argument("--config", type=Path, required=True, help="path to config.toml")
    js(sp)

    sp = sub.add_parser("submit", help="create a task")
    conn(sp)
    js(sp)
    sp.add_argument("handler", help="the handler key (or handler group) that runs the task")
    sp.add_argument("params", help="JSON params, or @file.json")
    sp.add_argument("--timeout", default="1h", help="tracking timeout, e.g. 30m (default 1h)")
    sp.add_argument("--tenant", help="the tenant the task belongs to (quotas, caps, reads)")
    sp.add_argument("--account", help="the vendor account to use (its limits apply)")
    sp.add_argument("--priority", type=int, default=0, help="-100..100, higher first (default 0)")
    dedup = sp.add_mutually_exclusive_group()
    dedup.add_argument(
        "--dedup-key", help="a live task of the tenant with this key is returned instead"
    )
    dedup.add_argument(
        "--dedup-by-content",
        action="store_true",
        help="the key is a hash of handler and params: the same request is one task",
    )
    sp.add_argument("--delay", default=None, help="start no earlier than this from now, e.g. 5m")
    sp.add_argument("--no-strict", action="store_true", help="skip the live-handler check")
    sp.add_argument("--route-key", help="business key for a consistent_hash handler group")

    for name, helptext in (
        ("get", "show a task"),
        ("cancel", "cancel a task"),
        ("wait", "wait until a task is terminal or SUBMIT_UNKNOWN"),
        ("watch", "print a task's changes as they happen, until it settles"),
    ):
        sp = sub.add_parser(name, help=helptext)
        conn(sp)
        if name == "watch":
            sp.add_argument("--json", action="store_true", help="one JSON object per change")
        else:
            js(sp)
        sp.add_argument("task_id", help="the task's id, as submit printed it")
        sp.add_argument(
            "--tenant", help="the task's tenant: another tenant's task is reported as not found"
        )
        if name == "wait":
            sp.add_argument(
                "--timeout", default="60s", help="give up after this long, e.g. 10m (exit 5)"
            )
        if name == "cancel":
            sp.add_argument(
                "--wait",
                default="2s",
                help="how long to wait for a daemon to carry the cancel out (default 2s; 0: "
                "only ask for it)",
            )

    sp = sub.add_parser("list", help="list tasks by status, handler or tenant")
    conn(sp)
    js(sp)
    sp.add_argument(
        "--status", type=_status, metavar="STATUS", help="only tasks in this status, e.g. failed"
    )
    sp.add_argument("--handler", help="only this handler's tasks")
    sp.add_argument("--tenant", help="only this tenant's tasks")
    sp.add_argument("--limit", type=int, default=50, help="tasks per page (default 50)")
    sp.add_argument("--cursor", help="continue where the previous page said")

    for name, helptext in (
        ("stats", "counts by status and handler, live daemons"),
        ("top", "a live view of stats (Ctrl-C to quit)"),
    ):
        sp = sub.add_parser(name, help=helptext)
        conn(sp)
        js(sp)
        if name == "top":
            sp.add_argument(
                "--interval", type=float, default=1.0, help="seconds between views (default 1)"
            )

    sp = sub.add_parser("resolve", help="settle a SUBMIT_UNKNOWN task (operators)")
    conn(sp)
    js(sp)
    sp.add_argument("task_id", help="a task in SUBMIT_UNKNOWN")
    sp.add_argument(
        "--as",
        dest="as_",
        required=True,
        choices=["SUBMITTED", "PENDING_SUBMIT", "FAILED", "CANCELED"],
        help="SUBMITTED (with --external-id) if the vendor has the job; "
        "PENDING_SUBMIT to resubmit knowingly",
    )
    sp.add_argument("--external-id", help="with --as SUBMITTED: the vendor's job id")
    sp.add_argument("--query", help="JSON object the handler's query needs besides the id")
    sp.add_argument("--message", default="", help="why, stored with the task")

    for name, helptext in (
        ("pause", "hold back new vendor submits for a handler, provider, tenant or account"),
        ("resume", "lift a pause; held tasks go back in their original order"),
    ):
        sp = sub.add_parser(name, help=helptext)
        conn(sp)
        js(sp)
        who = sp.add_mutually_exclusive_group(required=True)
        for kind in ("handler", "provider", "tenant", "account"):
            who.add_argument(f"--{kind}", metavar="NAME", help=f"the {kind} to {name}")
        if name == "pause":
            sp.add_argument("--note", default="", help="who and why, shown in stats")

    sp = sub.add_parser("requeue", help="run a FAILED or TRACKING_TIMED_OUT task again")
    conn(sp)
    js(sp)
    sp.add_argument("task_id", help="a FAILED or TRACKING_TIMED_OUT task")

    sp = sub.add_parser("group", help="define, list or delete handler groups (routing)")
    gsub = sp.add_subparsers(dest="group_command", metavar="ACTION", required=True)
    gp = gsub.add_parser("set", help="define or replace a group")
    conn(gp)
    js(gp)
    gp.add_argument("name", help="the group's name: submits name it as their handler")
    gp.add_argument(
        "--policy", required=True, choices=list(POLICIES), help="how a member is picked"
    )
    gp.add_argument(
        "--member",
        action="append",
        required=True,
        metavar="HANDLER[=WEIGHT]",
        help="a member handler key, with an optional positive integer weight; repeat",
    )
    gp = gsub.add_parser("list", help="show every group")
    conn(gp)
    js(gp)
    gp = gsub.add_parser("delete", help="remove a group")
    conn(gp)
    js(gp)
    gp.add_argument("name", help="the group to remove")

    sp = sub.add_parser("limits", help="show, set or clear admission limits (runtime)")
    lsub = sp.add_subparsers(dest="limits_command", metavar="ACTION")
    lp = lsub.add_parser("show", help="every stored limit (the default action)")
    for parser in (sp, lp):
        conn(parser)
        js(parser)
    lp = lsub.add_parser("set", help="set one scope's limits; wins over the config file")
    conn(lp)
    js(lp)
    lp.add_argument("--provider", help="a provider (all its handlers and accounts)")
    lp.add_argument("--account", help="with --provider: one vendor account")
    lp.add_argument("--tenant", help="a tenant, or '*' for every tenant without its own")
    lp.add_argument("--submit-rate", type=float, help="vendor submits per second")
    lp.add_argument("--submit-burst", type=int, help="submits allowed at once (default: rate)")
    lp.add_argument("--query-rate", type=float, help="vendor status queries per second")
    lp.add_argument("--query-burst", type=int, help="queries allowed at once (default: rate)")
    lp.add_argument("--max-in-flight", type=int, help="tasks SUBMITTING..RUNNING at once")
    lp.add_argument("--quota", type=int, help="tenant: submits accepted per --quota-period")
    lp.add_argument("--quota-period", help="e.g. 1d (default), 1h")
    lp.add_argument("--note", help="who and why, for other operators")
    lp = lsub.add_parser("clear", help="delete one scope's limits")
    conn(lp)
    js(lp)
    lp.add_argument("scope", help="provider:<p>, account:<p>/<a>, tenant:<t> or tenant:*")

    sp = sub.add_parser("scripts", help="load or export this version's Lua scripts")
    ssub = sp.add_subparsers(dest="scripts_command", metavar="ACTION", required=True)
    lp = ssub.add_parser(
        "load", help="load every script: producers may use but not load them (docs/security.md)"
    )
    conn(lp)
    lp = ssub.add_parser(
        "export",
        help="write each script as Redis runs it, and manifest.json with every SHA, to DIR "
        "(for producers in other languages: docs/protocol.md, section 7)",
    )
    lp.add_argument("dir", type=Path, help="the directory to write (created if missing)")

    sp = sub.add_parser("purge", help="delete terminal tasks older than a duration")
    conn(sp)
    sp.add_argument("--older-than", required=True, help="e.g. 7d")
    sp.add_argument("--archive", type=Path, help="append purged tasks to this JSON-lines file")
    sp.add_argument(
        "--limit", type=int, default=10_000, help="at most this many tasks (default 10000)"
    )
    return p


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


def _token(client: Any, args: argparse.Namespace, namespace: str) -> int:
    """`asynctaskd token ...`: records in `<ns>:web:tokens` (asynctaskd.web.tokens)."""
    from asynctaskd.web.tokens import TokenRecord, mint, tokens_key

    key = tokens_key(namespace)
    if args.token_command == "create":
        try:
            token, record = mint(args.role, args.tenant, args.note)
        except ValueError as exc:
            raise InvalidTask(str(exc)) from None
        client.redis.hset(key, record.id, msgspec.json.encode(record))
        if args.json:
            _out(json.dumps({"id": record.id, "token": token, "role": record.role,
                             "tenant": record.tenant or None}))  # fmt: skip
        else:
            _out(token)
            bound = f", tenant {record.tenant}" if record.tenant else ""
            _say(f"asynctaskd: token {record.id} ({record.role}{bound}): shown only now")
        return 0
    if args.token_command == "list":
        records = sorted(
            # HGETALL, not HVALS: the operator's ACL user (docs/security.md) allows it.
            (
                msgspec.json.decode(raw, type=TokenRecord)
                for raw in client.redis.hgetall(key).values()
            ),
            key=lambda r: r.created_at,
        )
        if args.json:
            _out(json.dumps([{k: v for k, v in msgspec.to_builtins(r).items() if k != "sha256"}
                             for r in records]))  # fmt: skip
        else:
            _out(f"{'id':<18}{'role':<10}{'tenant':<20}{'created':<22}note")
            for r in records:
                made = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(r.created_at))
                _out(f"{r.id:<18}{r.role:<10}{r.tenant or '-':<20}{made:<22}{r.note}")
        return 0
    if not client.redis.hdel(key, args.token_id):
        raise TaskNotFound(f"no token {args.token_id} in namespace {namespace!r}")
    _out(f"revoked {args.token_id}")
    return 0


def _member(text: str) -> MemberSpec:
    handler, eq, weight = text.partition("=")
    if not eq:
        return handler
    try:
        return handler, int(weight)
    except ValueError:
        raise InvalidTask(f"--member {text!r}: the weight after '=' must be an integer") from None


def _group_dict(group: Group) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(group)
    return data


def _group_line(name: str, group: Group) -> str:
    members = " ".join(f"{m.handler}={m.weight}" for m in group.members)
    return f"{name:<20} {group.policy:<16} {members}"


def _group(client: Any, args: argparse.Namespace) -> int:
    action = args.group_command
    if action == "set":
        group = client.set_group(args.name, args.policy, [_member(m) for m in args.member])
        _out(json.dumps({args.name: _group_dict(group)}) if args.json
             else _group_line(args.name, group))  # fmt: skip
        return 0
    if action == "list":
        groups: dict[str, Group] = client.groups()
        if args.json:
            _out(json.dumps({name: _group_dict(g) for name, g in groups.items()}))
        else:
            for name, g in groups.items():
                _out(_group_line(name, g))
        return 0
    if action == "delete":
        deleted = client.delete_group(args.name)
        if args.json:
            _out(json.dumps({"name": args.name, "deleted": deleted}))
        else:
            _out(f"deleted group {args.name}" if deleted else f"no group {args.name}")
        return 0 if deleted else EXIT_NOT_FOUND
    raise AssertionError(f"unhandled group action {action}")


_LIMIT_OPTIONS = tuple(f.name for f in msgspec.structs.fields(LimitConfig))


def _plain(value: Any) -> Any:
    return msgspec.to_builtins(value, enc_hook=float)  # Duration is a float


def _limit_line(entry: Any) -> str:
    limit = _plain(entry.limit)
    shown = " ".join(
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in limit.items()
        if k not in ("provider", "account", "tenant", "note")
        and v not in (None, "")
        and not (k == "quota_period" and limit.get("quota") is None)
    )
    note = f"  # {entry.limit.note}" if entry.limit.note else ""
    return f"{entry.scope:<28} {entry.source:<8} {shown}{note}"


def _limits(client: Any, args: argparse.Namespace) -> int:
    action = args.limits_command or "show"
    if action == "show":
        entries = client.limits()
        if args.json:
            _out(json.dumps({s: _plain(e) for s, e in entries.items()}))
        elif not entries:
            _out("no limits set")
        else:
            _out(f"{'scope':<28} {'source':<8} limits")
            for entry in entries.values():
                _out(_limit_line(entry))
        return 0
    if action == "set":
        options = {k: getattr(args, k) for k in _LIMIT_OPTIONS if getattr(args, k) is not None}
        entry = client.set_limit(**options)
        _out(json.dumps(_plain(entry)) if args.json else _limit_line(entry))
        return 0
    if action == "clear":
        cleared = client.clear_limit(args.scope)
        if args.json:
            _out(json.dumps({"scope": args.scope, "cleared": cleared}))
        else:
            _out(f"cleared {args.scope}" if cleared else f"no limits for {args.scope}")
        return 0 if cleared else EXIT_NOT_FOUND
    raise AssertionError(f"unhandled limits action {action}")


_RISK = ("at_risk", "unknown")  # a crash of Redis can lose a started mark, or nobody knows


def _durability(daemon: dict[str, Any]) -> str:
    """What a daemon's heartbeat says about its durability gate (none from older versions)."""
    report = daemon.get("durability")
    if not isinstance(report, dict):
        return "gate=? marks=?"
    return f"gate={report.get('mode')} marks={report.get('marks')}"


def _stats(client: Any, args: argparse.Namespace, where: tuple[str, str]) -> int:
    warned: list[str] = []

    def render() -> str:
        s = client.stats()
        hint = _empty_namespace(client, where, s)
        if hint and not warned:
            warned.append(hint)
            _say(f"asynctaskd: warning: {hint}")
        if args.json:
            return json.dumps({**msgspec.to_builtins(s), "paused": client.paused()})
        lines = ["status               count"]
        lines += [f"{st.value:<20} {s.by_status.get(st, 0):>6}" for st in Status]
        if s.by_handler:
            width = max(len("handler"), *(len(h) for h in s.by_handler)) + 2
            lines.append("")
            lines.append(f"{'handler':<{width}}" + " ".join(st.value for st in Status))
            for h, counts in sorted(s.by_handler.items()):
                cells = " ".join(f"{counts.get(st, 0):>{len(st.value)}}" for st in Status)
                lines.append(f"{h:<{width}}{cells}")
        paused = client.paused()
        if paused:
            lines.append("")
            lines.append("paused (new submits held back):")
            lines += [f"  {d}  {info.get('note', '')}" for d, info in sorted(paused.items())]
        lines.append("")
        lines.append(f"live daemons: {len(s.daemons)}")
        for d in s.daemons:
            lines.append(
                f"  {d.get('id')}  inflight={d.get('inflight')} "
                f"handlers={','.join(d.get('handlers', []))} {_durability(d)}"
            )
            report = d.get("durability")
            if isinstance(report, dict) and (report.get("held") or report.get("marks") in _RISK):
                lines.append(f"    durability: {report.get('detail')}")
        return "\n".join(lines)

    if args.command == "stats":
        _out(render())
        return 0
    # On a terminal each view replaces the last; piped, views follow each other (JSON: one
    # object per line), with no terminal control codes.
    clear = "\x1b[2J\x1b[H" if sys.stdout.isatty() and not args.json else ""
    gap = "" if clear or args.json else "\n"
    try:
        while True:
            sys.stdout.write(clear + render() + "\n" + gap)
            sys.stdout.flush()
            time.sleep(max(0.2, args.interval))
    except KeyboardInterrupt:
        return 0


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


def _export_scripts(directory: Path) -> int:
    """Each script's full source (what EVALSHA runs) as <name>.lua, and manifest.json:
    {"protocol": 1, "scripts": {name: {"sha1", "keys", "argv"}}}, for loading with SCRIPT
    LOAD from any language (the SHA is the SHA-1 of the file's bytes)."""
    from asynctaskd.keys import PROTOCOL_VERSION
    from asynctaskd.scripts import load_scripts

    try:
        directory.mkdir(parents=True, exist_ok=True)
        manifest: dict[str, Any] = {"protocol": PROTOCOL_VERSION, "scripts": {}}
        for name, script in sorted(load_scripts().items()):
            (directory / f"{name}.lua").write_bytes(script.source.encode())
            manifest["scripts"][name] = {
                "sha1": script.sha,
                "keys": list(script.keys),
                "argv": script.argv_count,
                "variadic": script.variadic,
            }
        (directory / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    except OSError as exc:
        raise InvalidTask(f"cannot write the scripts to {directory}: {exc}") from None
    _out(f"wrote {len(manifest['scripts'])} scripts and manifest.json to {directory}")
    return 0


def _exit_during_startup(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            # Until the daemon's own handlers are installed, SIGTERM means "exit cleanly":
            # nothing has been claimed yet, so there is nothing to drain.
            signal.signal(signal.SIGTERM, _exit_during_startup)
            from asynctaskd.daemon import serve
            from asynctaskd.logs import setup_logging

            config = load_config(args.config)
            setup_logging(config.log.level, config.log.format)
            serve(config, args.config)
            return 0
        if args.command == "dev":
            from asynctaskd.devtools.dev import run_dev

            return run_dev(args)
        if args.command == "web":
            from asynctaskd.logs import setup_logging
            from asynctaskd.web import run_web

            config = load_config(args.config)
            setup_logging(config.log.level, config.log.format)
            run_web(config)
            return 0
        if args.command == "check-config":
            config = load_config(args.config)
            if config.redis.url == "embedded":
                from asynctaskd.embedded import require_valkey_binary

                require_valkey_binary("redis.url = 'embedded'")
            from asynctaskd import http_handler
            from asynctaskd.handlers import load_handlers

            handlers = load_handlers(
                list(config.handlers),
                builders=http_handler.builders(config.handlers, args.config),
            )
            effective = config.redacted()
            if args.json:
                _out(json.dumps(effective))
            else:
                _out(
                    f"{args.config}: OK, {len(handlers)} handler(s): {', '.join(sorted(handlers))}"
                )
                _out(json.dumps(effective, indent=2))
            return 0
        if args.command == "scripts" and args.scripts_command == "export":
            return _export_scripts(args.dir)
        code = _client_command(args)
        sys.stdout.flush()  # here, where a reader that went away is handled below
        return code
    except BrokenPipeError:
        # The reader went away (`| head`): nothing more to say. Point stdout at /dev/null so
        # the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except ConfigError as exc:
        _say(f"asynctaskd: config error: {exc}")
        return EXIT_USAGE
    except UnknownHandler as exc:
        _say(f"asynctaskd: {str(exc).replace('submit with strict=False', 'pass --no-strict')}")
        return EXIT_USAGE
    except InvalidTask as exc:
        _say(f"asynctaskd: invalid input: {exc}")
        return EXIT_USAGE
    except TaskNotFound as exc:
        _say(f"asynctaskd: {exc}")
        return EXIT_NOT_FOUND
    except (IllegalTransition, QuotaExceeded, NotPermitted) as exc:
        _say(f"asynctaskd: refused: {exc}")
        return EXIT_REFUSED
    except AsyncTaskdError as exc:
        _say(f"asynctaskd: {type(exc).__name__}: {exc}")
        return EXIT_FAILED
