"""Backup and restore of a deployment's Redis data (`asynctaskd backup`, `asynctaskd restore`).

A backup is an RDB snapshot taken by the server itself (`BGSAVE`: a fork, so a consistent
point in time while the daemon keeps running), copied to a directory of its own with a
`manifest.json`. Before it is called done, the copy is loaded by a private server on the
side: the manifest's key and task counts are those of the snapshot, and a file that does
not load is never reported as a backup.

Why RDB and not the AOF: the embedded server keeps an AOF (`appendonly yes`, multi-part
in `appendonlydir/`), whose newest part is appended to on every write. Copying it while
the daemon runs gives a prefix of that part, possibly ending half-way through a command,
and a manifest that may name a part which a concurrent rewrite has just deleted. The RDB
of a `BGSAVE` is written to a temporary file and renamed whole, so the file read is
complete and as of one instant. Restore turns it into the base of a fresh AOF
(`appendonly.aof.1.base.rdb` in `appendonlydir/`, the same layout a rewrite with
`aof-use-rdb-preamble` produces), which the embedded server loads at its next start and
appends to from then on.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import redis

from asynctaskd.connection import open_sync
from asynctaskd.keys import Keys

__all__ = [
    "BackupFailed",
    "BackupRefused",
    "BackupReport",
    "BackupTimedOut",
    "RestoreReport",
    "backup",
    "restore",
]

FORMAT: Final = "asynctaskd-backup/1"
MANIFEST: Final = "manifest.json"
RDB_NAME: Final = "dump.rdb"
# Inside the embedded server's dir (`<redis.data_dir>/valkey`): what Valkey's defaults
# (appenddirname, appendfilename) name, and what the daemon's lock is.
VALKEY_DIR: Final = "valkey"
AOF_DIR: Final = "appendonlydir"
AOF_BASE: Final = "appendonly.aof.1.base.rdb"
AOF_MANIFEST: Final = "appendonly.aof.manifest"
LOCK_NAME: Final = "server.lock"
_CHUNK: Final = 1 << 20


class BackupRefused(Exception):
    """Not possible now (a daemon holds the data dir, the target holds data): nothing written."""


class BackupFailed(Exception):
    """The snapshot, the copy or its check went wrong."""


class BackupTimedOut(BackupFailed):
    """The server's snapshot did not finish in time."""


@dataclass
class BackupReport:
    directory: Path
    manifest: dict[str, Any] = field(default_factory=dict)


@dataclass
class RestoreReport:
    data_dir: Path
    manifest: dict[str, Any]
    replaced: Path | None = None  # where --force moved the data that was there


def _say_nothing(_: str) -> None:
    pass


# ---- backup ----


def backup(
    url: str,
    target: Path,
    namespace: str,
    *,
    timeout: float = 600.0,
    say: Callable[[str], None] = _say_nothing,
) -> BackupReport:
    """Snapshot the server at `url` into the new directory `target` (created; refused if it
    exists and is not empty). The server must be on this machine: its RDB file is read
    from the directory the server reports (`CONFIG GET dir`)."""
    Keys(namespace)  # the namespace's spelling, checked as everywhere
    target = target.absolute()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise BackupRefused(f"{target} exists and is not an empty directory: give a new one")
    from .migrate import _embedded_up  # starts a stopped daemon's server for the time

    with _embedded_up(url, say):
        client = open_sync(url, socket_timeout=60.0)
        try:
            source, info = _snapshot(client, timeout, say)
        finally:
            client.close()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        size, digest = _copy(source, partial / RDB_NAME)
        if url.startswith("embedded:"):
            # The embedded server runs with `--save ""` and loads its AOF, never this file:
            # it would only take the data's size again on the data dir's disk.
            with contextlib.suppress(OSError):
                source.unlink()
        say(f"asynctaskd: copied {size} bytes; loading the copy to check it")
        counts = _loaded_counts(partial, namespace)
        manifest = {
            "format": FORMAT,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(info["saved_at"])),
            "created_at_unix": info["saved_at"],
            "server": info["server"],
            "source": _shown(url),
            "namespace": namespace,
            "file": RDB_NAME,
            "bytes": size,
            "sha256": digest,
            **counts,
        }
        _write_json(partial / MANIFEST, manifest)
        _fsync_dir(partial)
        if target.exists():
            target.rmdir()  # empty, checked above
        partial.rename(target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return BackupReport(target, manifest)


def _snapshot(
    client: redis.Redis, timeout: float, say: Callable[[str], None]
) -> tuple[Path, dict[str, Any]]:
    """BGSAVE, waited for; the RDB file it wrote, and when and by which server."""
    server = client.info("server")
    name = "valkey" if "valkey_version" in server else "redis"
    version = str(server.get("valkey_version") or server.get("redis_version"))
    deadline = time.monotonic() + timeout
    while True:
        before = int(client.info("persistence").get("rdb_saves", 0))
        asked_at = time.time()
        try:
            # SCHEDULE: while an AOF rewrite runs, the save starts right after it.
            reply = client.execute_command("BGSAVE", "SCHEDULE")  # type: ignore[no-untyped-call]  # unannotated in redis-py
            break
        except redis.ResponseError as exc:
            if "already in progress" not in str(exc):
                raise BackupFailed(f"BGSAVE refused: {exc}") from None
            # someone else's save, begun before we asked: let it end, then ask for ours
            _wait_saved(client, before, True, deadline)
    say("asynctaskd: the server is writing its snapshot (BGSAVE)")
    started = "started" in str(reply).lower() or reply is True
    # rdb_saves counts saves begun, failed ones too: the status tells (it is ours, the last).
    _wait_saved(client, before, started, deadline)
    persistence = client.info("persistence")
    if persistence.get("rdb_last_bgsave_status") != "ok":
        raise BackupFailed(
            "the server's BGSAVE failed (INFO persistence rdb_last_bgsave_status: "
            f"{persistence.get('rdb_last_bgsave_status')}): see its log; a full disk is "
            "the usual cause"
        )
    directory = str(client.config_get("dir").get("dir", ""))
    filename = str(client.config_get("dbfilename").get("dbfilename", ""))
    if not directory or not filename:
        raise BackupFailed("CONFIG GET dir/dbfilename gave nothing (forbidden by an ACL?)")
    source = Path(directory) / filename
    try:
        mtime = source.stat().st_mtime
    except OSError as exc:
        raise BackupFailed(
            f"the snapshot {source} is not readable here ({exc.strerror}): run backup on "
            "the server's machine, as a user who may read its directory"
        ) from None
    if mtime < asked_at - 2:
        raise BackupFailed(
            f"{source} is older than the snapshot just taken: that server is not on this "
            "machine (or writes elsewhere); run backup on the server's machine"
        )
    saved_at = int(client.lastsave().timestamp())
    return source, {"saved_at": saved_at, "server": {"name": name, "version": version}}


def _wait_saved(client: redis.Redis, before: int, started: bool, deadline: float) -> None:
    """Wait for the save asked for (`started`: it runs already; else it is scheduled after
    an AOF rewrite) to end: `rdb_saves` past `before`, or a save seen running, and none
    running now."""
    while True:
        persistence: dict[str, Any] = client.info("persistence")
        if int(persistence.get("rdb_bgsave_in_progress", 0)):
            started = True
        elif started or int(persistence.get("rdb_saves", 0)) > before:
            return
        if time.monotonic() > deadline:
            raise BackupTimedOut("the server's BGSAVE did not finish in time (--timeout)")
        time.sleep(0.05)


def _copy(source: Path, dest: Path) -> tuple[int, str]:
    """Copy (one open file: a newer save renames another over `source` without harm) and
    fsync; the size and sha256."""
    digest = hashlib.sha256()
    size = 0
    with source.open("rb") as src, dest.open("xb") as out:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            out.write(chunk)
            size += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return size, digest.hexdigest()


def _loaded_counts(directory: Path, namespace: str) -> dict[str, Any]:
    """Load the RDB in `directory` into a private server: keys per database, shards and
    tasks per status of the namespace. BackupFailed when it does not load."""
    from .embedded import ServerProcess, require_valkey_binary
    from .migrate import MigrationFailed, _source_shards, _statuses

    binary = require_valkey_binary("checking a backup")
    with tempfile.TemporaryDirectory(prefix="asynctaskd-check-", dir=directory.parent) as tmp:
        os.link(directory / RDB_NAME, Path(tmp) / RDB_NAME)
        server = ServerProcess(binary, data_dir=Path(tmp), extra_args=("--dbfilename", RDB_NAME))
        try:
            server.start(timeout=300)
        except RuntimeError as exc:
            raise BackupFailed(f"the copied snapshot does not load: {exc}") from None
        try:
            client = redis.Redis.from_url(server.url)
            try:
                keyspace = client.info("keyspace")
                keys = {db: int(v["keys"]) for db, v in keyspace.items()}
                shards = _source_shards(client, Keys(namespace), namespace)
                try:
                    tasks = _statuses(client, namespace, shards)
                except MigrationFailed as exc:
                    raise BackupFailed(str(exc)) from None
            finally:
                client.close()
        finally:
            server.stop()
    return {"keys": sum(keys.values()), "keyspace": keys, "shards": shards, "tasks": tasks}


# ---- restore ----


def restore(source: Path, data_dir: Path, *, force: bool = False) -> RestoreReport:
    """Lay the backup in `source` out in `data_dir` (a daemon's `redis.data_dir`) so that
    the embedded server loads it at its next start.

    Refused while a daemon holds the data dir's lock, and when the data dir already holds
    data (an AOF or an RDB) unless `force`, which moves that aside (never deletes it).
    """
    source = source.absolute()
    manifest = read_manifest(source)
    rdb = source / str(manifest.get("file", RDB_NAME))
    _check_digest(rdb, manifest)
    valkey = data_dir.absolute() / VALKEY_DIR
    valkey.mkdir(parents=True, exist_ok=True, mode=0o750)
    with _locked(valkey):
        # A server left running by a daemon that died without it (no parent-death signal)
        # would go on writing appendonlydir: stopped first, as the daemon's start does.
        from .embedded import EmbeddedServer

        EmbeddedServer(Path("valkey-server"), valkey)._stop_leftover()
        existing = [p for p in (valkey / AOF_DIR, valkey / RDB_NAME) if _holds_data(p)]
        replaced = None
        if existing and not force:
            names = ", ".join(str(p) for p in existing)
            raise BackupRefused(
                f"{data_dir} already holds data ({names}): restore into an empty data dir, "
                "or pass --force to move that aside"
            )
        if existing:
            replaced = valkey / time.strftime("before-restore-%Y%m%dT%H%M%S")
            replaced.mkdir()
            for path in existing:
                path.rename(replaced / path.name)
        owner = valkey.stat()
        staging = Path(tempfile.mkdtemp(prefix=f".{AOF_DIR}.restore-", dir=valkey))
        try:
            _copy(rdb, staging / AOF_BASE)
            # The incr part is added by the server at its start, as after a rewrite.
            (staging / AOF_MANIFEST).write_text(f"file {AOF_BASE} seq 1 type b\n")
            with (staging / AOF_MANIFEST).open("rb") as f:
                os.fsync(f.fileno())
            for path in (staging, staging / AOF_BASE, staging / AOF_MANIFEST):
                _own(path, owner)
            staging.chmod(0o750)
            _fsync_dir(staging)
            staging.rename(valkey / AOF_DIR)
            _fsync_dir(valkey)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return RestoreReport(data_dir, manifest, replaced)


def read_manifest(source: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((source / MANIFEST).read_text())
    except FileNotFoundError:
        raise BackupFailed(f"{source} holds no {MANIFEST}: not a backup") from None
    except (OSError, ValueError) as exc:
        raise BackupFailed(f"{source / MANIFEST} is not readable: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BackupFailed(f"{source / MANIFEST} is not a backup of this format ({FORMAT})")
    return manifest


def _check_digest(rdb: Path, manifest: dict[str, Any]) -> None:
    digest = hashlib.sha256()
    try:
        with rdb.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    except OSError as exc:
        raise BackupFailed(f"{rdb}: {exc.strerror}") from None
    if digest.hexdigest() != manifest.get("sha256"):
        raise BackupFailed(f"{rdb} does not match the sha256 in its manifest: damaged")


@contextlib.contextmanager
def _locked(valkey: Path) -> Iterator[None]:
    """The daemon's lock on the data dir, for the time of the restore: refused while a
    daemon (its embedded server) holds it, and no daemon starts meanwhile."""
    fd = os.open(valkey / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise BackupRefused(
                f"the data dir {valkey.parent} is in use by a running asynctaskd daemon "
                f"(pid {holder}): stop it first (systemctl stop asynctaskd)"
            ) from None
        yield
    finally:
        os.close(fd)  # releases the lock


def _holds_data(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.exists()


def _own(path: Path, owner: os.stat_result) -> None:
    """Files a root restore writes belong to the data dir's owner (the daemon's user)."""
    if os.geteuid() == 0:
        os.chown(path, owner.st_uid, owner.st_gid)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with path.open("x") as f:
        f.write(json.dumps(data, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _shown(url: str) -> str:
    """`url` without its password."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)).geturl()
