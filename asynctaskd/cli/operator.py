"""Operators' commands on a client: tokens of the HTTP API, handler groups, admission
limits, stats and `top`; and `scripts export`, which needs no Redis.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.parse
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec

from asynctaskd import __version__
from asynctaskd.config import LimitConfig
from asynctaskd.errors import InvalidTask, TaskNotFound
from asynctaskd.model import Status
from asynctaskd.routing import Group, MemberSpec

from .common import EXIT_NOT_FOUND, _empty_namespace, _out, _say


def _token(client: Any, args: argparse.Namespace, namespace: str) -> int:
    """`asynctaskd token ...`: records in `<ns>:web:tokens` (asynctaskd.web.tokens)."""
    from asynctaskd.web.tokens import TokenRecord, mint, tokens_key

    key = tokens_key(namespace)
    if args.token_command == "create":
        try:
            token, record = mint(args.role, args.tenant, args.note, rate=args.rate,
                                 burst=args.burst)  # fmt: skip
        except ValueError as exc:
            raise InvalidTask(str(exc)) from None
        client.redis.hset(key, record.id, msgspec.json.encode(record))
        if args.json:
            _out(json.dumps({"id": record.id, "token": token, "role": record.role,
                             "tenant": record.tenant or None, "rate": record.rate,
                             "burst": record.burst}))  # fmt: skip
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
            _out(f"{'id':<18}{'role':<10}{'tenant':<20}{'created':<22}{'rate/s':<12}note")
            for r in records:
                made = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(r.created_at))
                rate = "-" if r.rate is None else f"{r.rate:g}/{r.burst}"
                _out(f"{r.id:<18}{r.role:<10}{r.tenant or '-':<20}{made:<22}{rate:<12}{r.note}")
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
            return json.dumps(
                {
                    **msgspec.to_builtins(s),
                    "parked_for_operator": s.parked_for_operator,
                    "paused": client.paused(),
                }
            )
        lines = ["status               count"]
        for st in Status:
            line = f"{st.value:<20} {s.by_status.get(st, 0):>6}"
            if st is Status.SUBMIT_UNKNOWN and s.by_status.get(st, 0):
                line += (
                    f"  ({s.parked_for_lookup} waiting for a vendor lookup, "
                    f"{s.parked_for_operator} for an operator: asynctaskd resolve)"
                )
            lines.append(line)
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


def _export_scripts(directory: Path) -> int:
    """Each script's full source (what EVALSHA runs) as <name>.lua, manifest.json and
    SHA1SUMS (`scripts.export_files`), for loading with SCRIPT LOAD from any language."""
    from asynctaskd.keys import PROTOCOL_VERSION
    from asynctaskd.scripts import export_files

    files = export_files(PROTOCOL_VERSION)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            (directory / name).write_bytes(content)
    except OSError as exc:
        raise InvalidTask(f"cannot write the scripts to {directory}: {exc}") from None
    _out(f"wrote {len(files) - 2} scripts, manifest.json and SHA1SUMS to {directory}")
    return 0


# What `asynctaskd alerts` replaces in prometheus/alerts.yml (shipped in the package).
RUNBOOK_PLACEHOLDER = "${RUNBOOK_BASE}"
# A URL as it may stand in a double-quoted YAML string: no quote, backslash or space.
_URL_CHARS = re.compile(r"[A-Za-z0-9\-._~:/?\[\]@!$&'()*+,;=%]+")


def render_alerts(rules: str, runbook_base: str) -> str:
    """The alert rules with every runbook link made a full URL: `runbook_base` (where the
    team reads docs/deploy.md), then `#` and the alert's section."""
    parts = urllib.parse.urlsplit(runbook_base)
    if (
        parts.scheme not in ("http", "https")
        or not parts.netloc
        or parts.fragment
        or runbook_base.endswith("#")
        or not _URL_CHARS.fullmatch(runbook_base)
    ):
        raise InvalidTask(
            "--runbook-base must be the http(s) URL of docs/deploy.md as your team reads it, "
            "without a #fragment (each alert adds its section), e.g. "
            f"https://git.example.com/ops/asynctaskd/blob/v{__version__}/docs/deploy.md; "
            f"got {runbook_base!r:.120}"
        )
    return rules.replace(RUNBOOK_PLACEHOLDER, runbook_base)


def _alerts(runbook_base: str) -> int:
    """Print this version's alert rules, runbook links built from `runbook_base`."""
    rules = (resources.files("asynctaskd") / "prometheus" / "alerts.yml").read_text()
    head = f"# Generated by asynctaskd {__version__}: asynctaskd alerts --runbook-base URL\n"
    _out(head + render_alerts(rules, runbook_base).rstrip("\n"))
    return 0
