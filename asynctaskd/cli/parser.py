"""The command line: every command's arguments, its help and the examples (`EPILOG`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from asynctaskd.model import Status
from asynctaskd.routing import POLICIES

EPILOG = """\
examples:
  asynctaskd dev --demo 200                      embedded Valkey + fake vendor + demo tasks
  asynctaskd run --config /etc/asynctaskd/config.toml
  asynctaskd check-config --config config.toml   validate, print the effective config
  asynctaskd submit demo '{"text": "hi"}' --timeout 10m
  asynctaskd get 01J... --json
  asynctaskd watch 01J...                        each change until it settles (--json: lines)
  asynctaskd submit demo '{"text": "hi"}' --dedup-by-content   the same request: one task
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
  asynctaskd migrate --from embedded:///var/lib/asynctaskd --to redis://db:6379/0
                                                 copy a namespace to another Redis
  asynctaskd backup --config config.toml --to /var/backups/asynctaskd/2026-12-03
                                                 snapshot the data while the daemon runs
  asynctaskd restore --from /var/backups/asynctaskd/2026-12-03 --data-dir /var/lib/asynctaskd
  asynctaskd alerts --runbook-base https://git.example.com/ops/asynctaskd/blob/v1/docs/deploy.md
                                                 Prometheus rules, runbook links to your docs

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
    tp.add_argument("--rate", type=float, help="requests per second this token may make "
                    "(per web process; over it: 429 with Retry-After)")  # fmt: skip
    tp.add_argument("--burst", type=int, help="requests at once above the rate (default: "
                    "the rate, rounded up)")  # fmt: skip
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

    sp = sub.add_parser(
        "alerts",
        help="print this version's Prometheus alert rules, runbook links made full URLs",
        description="Print prometheus/alerts.yml as shipped with this version, each alert's "
        "runbook_url annotation built from --runbook-base: redirect it to your Prometheus "
        "rule file (docs/deploy.md, section 4).",
    )
    sp.add_argument(
        "--runbook-base",
        required=True,
        metavar="URL",
        help="the http(s) URL of docs/deploy.md where your team reads it; each alert "
        "appends #<its section>",
    )

    sp = sub.add_parser("purge", help="delete terminal tasks older than a duration")
    conn(sp)
    sp.add_argument("--older-than", required=True, help="e.g. 7d")
    sp.add_argument("--archive", type=Path, help="append purged tasks to this JSON-lines file")
    sp.add_argument(
        "--limit", type=int, default=10_000, help="at most this many tasks (default 10000)"
    )

    sp = sub.add_parser(
        "migrate",
        help="copy a namespace to another Redis or a Redis Cluster (daemons stopped)",
        description="Copy every key of a namespace from one Redis to another with DUMP and "
        "RESTORE, keeping TTLs; refuses while daemons are alive on the source, when the "
        "target already holds keys of the namespace, or when the target's shard count "
        "differs. Then checks the copy and prints a summary. docs/deploy.md, section 10.",
    )
    sp.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="URL",
        help="the Redis to copy from (embedded:///<data_dir> for the embedded one)",
    )
    sp.add_argument(
        "--to",
        dest="target",
        metavar="URL",
        help="the Redis to copy to (redis+cluster://... for a cluster; default: "
        "[redis] url of --config)",
    )
    sp.add_argument(
        "--config",
        type=Path,
        help="the config the daemons will run with on the target: its [redis] "
        "url, namespace and shards are checked",
    )
    sp.add_argument("--namespace", help="key namespace (default: from --config, or atd)")
    sp.add_argument(
        "--shards",
        type=int,
        help="the shard count the target's daemons will use (default: from "
        "--config); must equal the source's",
    )
    sp.add_argument(
        "--force",
        action="store_true",
        help="copy even while daemons are alive on the source (inconsistent copy)",
    )
    sp.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would be copied, and why it would be refused; write nothing",
    )
    sp.add_argument(
        "--count", type=int, default=200, help="keys per SCAN and per round trip (default 200)"
    )
    js(sp)

    sp = sub.add_parser(
        "backup",
        help="snapshot the Redis data to a directory, while the daemon runs",
        description="Have the server write an RDB snapshot (BGSAVE: consistent as of one "
        "instant, the daemon keeps running), copy it to a new directory with a "
        "manifest.json, and check the copy by loading it into a private server. The "
        "server must be on this machine. docs/deploy.md, section 10.",
    )
    sp.add_argument("--config", type=Path, help="the daemon's config ([redis] url, namespace)")
    sp.add_argument(
        "--from",
        dest="source",
        metavar="URL",
        help="the server to back up (embedded:///<data_dir>; default: [redis] of --config)",
    )
    sp.add_argument("--namespace", help="whose tasks the manifest counts (default: from "
                    "--config, or atd)")  # fmt: skip
    sp.add_argument(
        "--to", dest="target", type=Path, required=True, metavar="DIR",
        help="a new (or empty) directory for the backup",
    )  # fmt: skip
    sp.add_argument("--timeout", default="10m", help="how long the snapshot may take (default 10m)")
    js(sp)

    sp = sub.add_parser(
        "restore",
        help="lay a backup out in an embedded data dir (daemon stopped)",
        description="Put the snapshot of a backup into <data_dir>/valkey as the base of a "
        "fresh AOF, which the embedded server loads at the daemon's next start. Refuses "
        "while a daemon holds the data dir, and when it holds data (unless --force, "
        "which moves that aside). docs/deploy.md, section 10.",
    )
    sp.add_argument(
        "--from", dest="source", type=Path, required=True, metavar="DIR",
        help="the backup's directory (from asynctaskd backup)",
    )  # fmt: skip
    sp.add_argument(
        "--data-dir", type=Path, help="the daemon's redis.data_dir (default: from --config)"
    )
    sp.add_argument("--config", type=Path, help="the daemon's config (for redis.data_dir)")
    sp.add_argument(
        "--force",
        action="store_true",
        help="restore over existing data, moved aside to valkey/before-restore-<time>",
    )
    js(sp)
    return p
