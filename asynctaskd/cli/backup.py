"""`asynctaskd backup` and `asynctaskd restore` (asynctaskd.backup does them)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from redis.exceptions import RedisError

from asynctaskd.config import load_config
from asynctaskd.errors import InvalidTask

from .common import (
    EXIT_FAILED,
    EXIT_REFUSED,
    EXIT_TIMED_OUT,
    _duration,
    _out,
    _say,
    _shown_url,
)


def _backup(args: argparse.Namespace) -> int:
    from asynctaskd.backup import BackupFailed, BackupRefused, BackupTimedOut, backup

    source, namespace = args.source, args.namespace
    if args.config:
        config = load_config(args.config)
        url = config.redis.url
        if url == "embedded":
            url = f"embedded://{Path(config.redis.data_dir).resolve()}"
        source = source or url
        namespace = namespace or config.redis.namespace
    if not source:
        raise InvalidTask("give --from URL (embedded:///<data_dir>), or --config")
    timeout = _duration(args.timeout, "--timeout")
    say = _say if not args.json else (lambda _: None)
    try:
        report = backup(source, args.target, namespace or "atd", timeout=timeout, say=say)
    except BackupRefused as exc:
        _say(f"asynctaskd: refused: {exc}; nothing was written")
        return EXIT_REFUSED
    except BackupTimedOut as exc:
        _say(f"asynctaskd: backup timed out: {exc}")
        return EXIT_TIMED_OUT
    except BackupFailed as exc:
        _say(f"asynctaskd: backup failed: {exc}")
        return EXIT_FAILED
    except RedisError as exc:
        _say(f"asynctaskd: backup failed ({_shown_url(source)}): {type(exc).__name__}: {exc}")
        return EXIT_FAILED
    except OSError as exc:  # a full disk, a directory it may not write
        _say(f"asynctaskd: backup failed: {exc}")
        return EXIT_FAILED
    m = report.manifest
    if args.json:
        _out(json.dumps({"directory": str(report.directory), **m}))
    else:
        _out(f"{report.directory}: {m['bytes']} bytes, {m['keys']} key(s), as of {m['created_at']}")
        tasks = ", ".join(f"{s} {n}" for s, n in m["tasks"].items()) or "none"
        _out(f"tasks ({m['namespace']}): {tasks}")
    return 0


def _restore(args: argparse.Namespace) -> int:
    from asynctaskd.backup import BackupFailed, BackupRefused, restore

    data_dir = args.data_dir
    if data_dir is None and args.config:
        config = load_config(args.config)
        if config.redis.url != "embedded":
            raise InvalidTask(
                f"{args.config}: [redis] url is not 'embedded': restore lays out an embedded "
                "data dir (for another Redis, load the backup's dump.rdb with its own tools)"
            )
        data_dir = Path(config.redis.data_dir)
    if data_dir is None:
        raise InvalidTask("give --data-dir (the daemon's redis.data_dir), or --config")
    try:
        report = restore(args.source, data_dir.resolve(), force=args.force)
    except BackupRefused as exc:
        _say(f"asynctaskd: refused: {exc}; nothing was written")
        return EXIT_REFUSED
    except (BackupFailed, OSError) as exc:
        _say(f"asynctaskd: restore failed: {exc}")
        return EXIT_FAILED
    m = report.manifest
    if args.json:
        _out(
            json.dumps(
                {
                    "data_dir": str(report.data_dir),
                    "replaced": str(report.replaced) if report.replaced else None,
                    **m,
                }
            )
        )
    else:
        _out(f"{report.data_dir}: restored {m['keys']} key(s) as of {m['created_at']}")
        tasks = ", ".join(f"{s} {n}" for s, n in m["tasks"].items()) or "none"
        _out(f"tasks ({m['namespace']}): {tasks}")
        if report.replaced:
            _out(f"the data that was there is in {report.replaced} (delete it when done)")
        _out("start the daemon: its embedded server loads the restored data")
    return 0
