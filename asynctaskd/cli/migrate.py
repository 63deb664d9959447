"""`asynctaskd migrate`: copy a namespace to another Redis (asynctaskd.migrate does it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from redis.exceptions import RedisError

from asynctaskd.config import load_config
from asynctaskd.errors import InvalidTask

from .common import EXIT_FAILED, EXIT_REFUSED, _out, _say, _shown_url


def _migrate(args: argparse.Namespace) -> int:
    from asynctaskd.migrate import MigrationFailed, MigrationRefused, migrate

    target, namespace, shards = args.target, args.namespace, args.shards
    if args.config:
        config = load_config(args.config)
        url = config.redis.url
        if url == "embedded":
            url = f"embedded://{Path(config.redis.data_dir).resolve()}"
        target = target or url
        namespace = namespace or config.redis.namespace
        shards = shards if shards is not None else config.redis.shards
    if not target:
        raise InvalidTask("give --to URL, or --config with the target's [redis] url")
    if shards is not None and not 1 <= shards <= 1024:
        raise InvalidTask(f"--shards must be between 1 and 1024, got {shards}")
    if not 1 <= args.count <= 100_000:
        raise InvalidTask(f"--count must be between 1 and 100000, got {args.count}")
    namespace = namespace or "atd"
    source = args.source
    if source == target:
        raise InvalidTask("--from and --to name the same Redis")
    where = f"{_shown_url(source)} -> {_shown_url(target)}, namespace {namespace!r}"
    try:
        report = migrate(
            source,
            target,
            namespace,
            target_shards=shards,
            force=args.force,
            dry_run=args.dry_run,
            count=args.count,
            say=_say if not args.json else lambda _: None,
        )
    except MigrationRefused as exc:
        _say(f"asynctaskd: refused: {exc}; nothing was copied")
        return EXIT_REFUSED
    except MigrationFailed as exc:
        _say(f"asynctaskd: migrate failed: {exc}")
        return EXIT_FAILED
    except RedisError as exc:
        _say(f"asynctaskd: migrate failed ({where}): {type(exc).__name__}: {exc}")
        return EXIT_FAILED
    if args.json:
        _out(
            json.dumps(
                {
                    "dry_run": args.dry_run,
                    "keys": report.keys,
                    "by_type": dict(sorted(report.by_type.items())),
                    "tasks": report.by_status,
                    "shards": report.source_shards,
                    "vanished": report.vanished,
                    "verified": report.verified,
                    "method": report.method,
                    "warnings": report.warnings,
                    "problems": report.problems,
                }
            )
        )
    else:
        verb = "would copy" if args.dry_run else "copied"
        _out(f"{where}: {verb} {report.keys} key(s), {report.source_shards} shard(s)")
        for kind, n in sorted(report.by_type.items()):
            _out(f"  {kind:<8} {n}")
        tasks = ", ".join(f"{s} {n}" for s, n in report.by_status.items()) or "none"
        _out(f"tasks: {tasks}")
        if report.vanished:
            _out(f"{report.vanished} key(s) expired during the copy (TTLs ran out)")
        if report.method == "logical":
            _out("copied key by key (the target cannot read the source's DUMP format)")
        if report.verified:
            _out("verified: keys per type and every shard's counts match on both sides")
        for problem in report.problems:
            _say(f"asynctaskd: would be refused: {problem}")
    if args.dry_run and report.problems:
        return EXIT_REFUSED
    return 0
