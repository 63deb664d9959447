"""The `asynctaskd` command: run the daemon, develop locally, inspect and repair tasks.

Exit codes: 0 ok, 1 not found / failed / refused, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from .config import LimitConfig, load_config
from .errors import AsyncTaskdError, ConfigError, IllegalTransition, InvalidTask, TaskNotFound
from .model import Status, Task
from .routing import POLICIES, Group, MemberSpec

__all__ = ["main"]

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
  asynctaskd submit ocr '{"text": "hi"}'          a group: one member is picked, once

Reads use --url/--namespace, or [redis] from --config, or $ASYNCTASKD_URL.
"""


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
        sp.add_argument("--namespace", help="key namespace (default atd)")
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

    sp = sub.add_parser("check-config", help="validate a config file and print it, secrets masked")
    sp.add_argument("--config", type=Path, required=True)
    js(sp)

    sp = sub.add_parser("submit", help="create a task")
    conn(sp)
    js(sp)
    sp.add_argument("handler")
    sp.add_argument("params", help="JSON params, or @file.json")
    sp.add_argument("--timeout", default="1h", help="tracking timeout, e.g. 30m (default 1h)")
    sp.add_argument("--tenant")
    sp.add_argument("--account")
    sp.add_argument("--priority", type=int, default=0)
    sp.add_argument("--dedup-key")
    sp.add_argument("--delay", default=None, help="start no earlier than this from now, e.g. 5m")
    sp.add_argument("--no-strict", action="store_true", help="skip the live-handler check")
    sp.add_argument("--route-key", help="business key for a consistent_hash handler group")

    for name, helptext in (
        ("get", "show a task"),
        ("cancel", "cancel a task"),
        ("wait", "wait until a task is terminal or SUBMIT_UNKNOWN"),
    ):
        sp = sub.add_parser(name, help=helptext)
        conn(sp)
        js(sp)
        sp.add_argument("task_id")
        sp.add_argument(
            "--tenant", help="the task's tenant: another tenant's task is reported as not found"
        )
        if name == "wait":
            sp.add_argument("--timeout", default="60s")
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
    sp.add_argument("--status", choices=[s.value for s in Status])
    sp.add_argument("--handler")
    sp.add_argument("--tenant", help="only this tenant's tasks")
    sp.add_argument("--limit", type=int, default=50)
    sp.add_argument("--cursor")

    for name, helptext in (
        ("stats", "counts by status and handler, live daemons"),
        ("top", "a live view of stats (Ctrl-C to quit)"),
    ):
        sp = sub.add_parser(name, help=helptext)
        conn(sp)
        js(sp)
        if name == "top":
            sp.add_argument("--interval", type=float, default=1.0)

    sp = sub.add_parser("resolve", help="settle a SUBMIT_UNKNOWN task (operators)")
    conn(sp)
    js(sp)
    sp.add_argument("task_id")
    sp.add_argument(
        "--as",
        dest="as_",
        required=True,
        choices=["SUBMITTED", "PENDING_SUBMIT", "FAILED", "CANCELED"],
        help="SUBMITTED (with --external-id) if the vendor has the job; "
        "PENDING_SUBMIT to resubmit knowingly",
    )
    sp.add_argument("--external-id")
    sp.add_argument("--query", help="JSON object the handler's query needs besides the id")
    sp.add_argument("--message", default="")

    for name, helptext in (
        ("pause", "hold back new vendor submits for a handler, provider, tenant or account"),
        ("resume", "lift a pause; held tasks go back in their original order"),
    ):
        sp = sub.add_parser(name, help=helptext)
        conn(sp)
        js(sp)
        who = sp.add_mutually_exclusive_group(required=True)
        for kind in ("handler", "provider", "tenant", "account"):
            who.add_argument(f"--{kind}", metavar="NAME")
        if name == "pause":
            sp.add_argument("--note", default="", help="who and why, shown in stats")

    sp = sub.add_parser("requeue", help="run a FAILED or TRACKING_TIMED_OUT task again")
    conn(sp)
    js(sp)
    sp.add_argument("task_id")

    sp = sub.add_parser("group", help="define, list or delete handler groups (routing)")
    gsub = sp.add_subparsers(dest="group_command", metavar="ACTION", required=True)
    gp = gsub.add_parser("set", help="define or replace a group")
    conn(gp)
    js(gp)
    gp.add_argument("name")
    gp.add_argument("--policy", required=True, choices=list(POLICIES))
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
    gp.add_argument("name")

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
    lp.add_argument("--query-burst", type=int)
    lp.add_argument("--max-in-flight", type=int, help="tasks SUBMITTING..RUNNING at once")
    lp.add_argument("--quota", type=int, help="tenant: submits accepted per --quota-period")
    lp.add_argument("--quota-period", help="e.g. 1d (default), 1h")
    lp.add_argument("--note", help="who and why, for other operators")
    lp = lsub.add_parser("clear", help="delete one scope's limits")
    conn(lp)
    js(lp)
    lp.add_argument("scope", help="provider:<p>, account:<p>/<a>, tenant:<t> or tenant:*")

    sp = sub.add_parser("scripts", help="load this version's Lua scripts into Redis (operators)")
    ssub = sp.add_subparsers(dest="scripts_command", metavar="ACTION", required=True)
    lp = ssub.add_parser(
        "load", help="load every script: producers may use but not load them (docs/security.md)"
    )
    conn(lp)

    sp = sub.add_parser("purge", help="delete terminal tasks older than a duration")
    conn(sp)
    sp.add_argument("--older-than", required=True, help="e.g. 7d")
    sp.add_argument("--archive", type=Path, help="append purged tasks to this JSON-lines file")
    sp.add_argument("--limit", type=int, default=10_000)
    return p


def _duration(text: str, what: str) -> float:
    from .config import Duration

    try:
        try:
            value: object = float(text)  # plain seconds, e.g. "90"
        except ValueError:
            value = text  # a duration with a unit, e.g. "5m"
        return float(Duration.parse(value))
    except ValueError as exc:
        raise InvalidTask(f"{what}: {exc}") from None


def _connection(args: argparse.Namespace) -> tuple[str, str, int]:
    import os

    url, namespace, shards = None, None, 1
    if getattr(args, "config", None):
        config = load_config(args.config)
        url, namespace, shards = config.redis.url, config.redis.namespace, config.redis.shards
        if url == "embedded":
            raise ConfigError(
                f"{args.config}: redis.url is 'embedded'; pass --url to reach that server"
            )
    url = args.url or url or os.environ.get("ASYNCTASKD_URL") or "redis://127.0.0.1:6379/0"
    if getattr(args, "shards", None) is not None:
        if not 1 <= args.shards <= 1024:
            raise InvalidTask(f"--shards must be between 1 and 1024, got {args.shards}")
        shards = args.shards
    return url, args.namespace or namespace or "atd", shards


def _task_dict(task: Task) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(task)
    return data


def _print_task(task: Task, as_json: bool) -> None:
    if as_json:
        print(json.dumps(_task_dict(task)))  # noqa: T201 - CLI output
        return
    d = _task_dict(task)
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
    from .client import Client

    url, namespace, shards = _connection(args)
    with Client.from_url(url, namespace=namespace, shards=shards) as client:
        cmd = args.command
        if cmd == "submit":
            raw = args.params
            text = Path(raw[1:]).read_text() if raw.startswith("@") else raw
            try:
                params = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InvalidTask(f"params are not valid JSON: {exc}") from None
            task = client.submit(
                args.handler,
                params,
                tracking_timeout=_duration(args.timeout, "--timeout"),
                tenant=args.tenant,
                account=args.account,
                priority=args.priority,
                dedup_key=args.dedup_key,
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
                raise TaskNotFound(f"no task {args.task_id}")
            _print_task(found, args.json)
            return 0
        if cmd == "cancel":
            wait_s = 0.0 if args.wait in ("0", "0s") else _duration(args.wait, "--wait")
            done = client.cancel(args.task_id, tenant=args.tenant)
            outcome = _cancel_outcome(client, args.task_id, args.tenant, wait_s) if done else None
            if args.json:
                _out(json.dumps({"task_id": args.task_id, "canceled": done, "outcome": outcome}))
            else:
                _out(_CANCEL_SAYS[outcome] if outcome else "already finished; nothing to cancel")
            return 0 if done else 1
        if cmd == "wait":
            task = client.wait(
                args.task_id, _duration(args.timeout, "--timeout"), tenant=args.tenant
            )
            _print_task(task, args.json)
            return 0 if task.status is Status.SUCCEEDED else 1
        if cmd == "list":
            page = client.list(
                status=Status(args.status) if args.status else None,
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
                for t in page.tasks:
                    err = f" {t.error.code}" if t.error else ""
                    _out(f"{t.id}  {t.status.value:<18} {t.handler:<20} {t.tenant or '-':<12}{err}")
                if page.cursor:
                    _out(f"more: --cursor {page.cursor}")
            return 0
        if cmd in ("stats", "top"):
            return _stats(client, args)
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
                query = json.loads(args.query) if args.query else None
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
        if cmd == "limits":
            return _limits(client, args)
        if cmd == "purge":
            n = client.purge(
                _duration(args.older_than, "--older-than"), archive=args.archive, limit=args.limit
            )
            _out(f"purged {n} task(s)")
            return 0
    raise AssertionError(f"unhandled command {args.command}")


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
        return 0 if deleted else 1
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
        return 0 if cleared else 1
    raise AssertionError(f"unhandled limits action {action}")


_RISK = ("at_risk", "unknown")  # a crash of Redis can lose a started mark, or nobody knows


def _durability(daemon: dict[str, Any]) -> str:
    """What a daemon's heartbeat says about its durability gate (none from older versions)."""
    report = daemon.get("durability")
    if not isinstance(report, dict):
        return "gate=? marks=?"
    return f"gate={report.get('mode')} marks={report.get('marks')}"


def _stats(client: Any, args: argparse.Namespace) -> int:
    def render() -> str:
        s = client.stats()
        if args.json:
            return json.dumps({**msgspec.to_builtins(s), "paused": client.paused()})
        lines = ["status               count"]
        lines += [f"{st.value:<20} {s.by_status.get(st, 0):>6}" for st in Status]
        if s.by_handler:
            lines.append("")
            lines.append("handler              " + " ".join(f"{st.value[:9]:>9}" for st in Status))
            for h, counts in sorted(s.by_handler.items()):
                lines.append(f"{h:<20} " + " ".join(f"{counts.get(st, 0):>9}" for st in Status))
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
    try:
        while True:
            sys.stdout.write("\x1b[2J\x1b[H" + render() + "\n")
            sys.stdout.flush()
            time.sleep(max(0.2, args.interval))
    except KeyboardInterrupt:
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
            from .daemon import serve
            from .logs import setup_logging

            config = load_config(args.config)
            setup_logging(config.log.level, config.log.format)
            serve(config, args.config)
            return 0
        if args.command == "dev":
            from .devtools.dev import run_dev

            return run_dev(args)
        if args.command == "check-config":
            config = load_config(args.config)
            if config.redis.url == "embedded":
                from .embedded import require_valkey_binary

                require_valkey_binary("redis.url = 'embedded'")
            from . import http_handler
            from .handlers import load_handlers

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
        return _client_command(args)
    except ConfigError as exc:
        print(f"asynctaskd: config error: {exc}", file=sys.stderr)  # noqa: T201 - CLI output
        return 2
    except InvalidTask as exc:
        print(f"asynctaskd: invalid input: {exc}", file=sys.stderr)  # noqa: T201 - CLI output
        return 2
    except (TaskNotFound, IllegalTransition) as exc:
        print(f"asynctaskd: {exc}", file=sys.stderr)  # noqa: T201 - CLI output
        return 1
    except AsyncTaskdError as exc:
        print(f"asynctaskd: {type(exc).__name__}: {exc}", file=sys.stderr)  # noqa: T201
        return 1
