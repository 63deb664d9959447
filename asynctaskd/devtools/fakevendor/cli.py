"""The fake vendor's command line: `python -m asynctaskd.devtools.fakevendor --port 0`,
one option per `Behaviour` knob; it prints the URL it listens on once bound."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import msgspec

from .server import _FIELD_HELP, Behaviour, serve

__all__ = ["main"]


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m asynctaskd.devtools.fakevendor",
        description="A fake vendor HTTP server: submit once, poll until done.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--port-file", type=Path, help="write the bound port to this file")
    for field in msgspec.structs.fields(Behaviour):
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            type=_number,
            default=None,
            help=f"{_FIELD_HELP[field.name]} (default: {field.default})",
        )
    return parser


def _announce(url: str, port_file: Path | None) -> None:
    if port_file is not None:
        # Write then rename, so a reader never sees a half-written port; and before the
        # line, so whoever reads the line can read the file too.
        partial = port_file.with_name(port_file.name + ".partial")
        partial.write_text(url.rsplit(":", 1)[1])
        partial.replace(port_file)
    print(f"fakevendor listening on {url}", flush=True)  # noqa: T201 - the CLI's one contract line


def _run(main_coro: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:  # uvloop is optional (not on Windows)
        asyncio.run(main_coro)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main_coro)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: parse knobs, serve until signalled, return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    knobs = {
        field.name: getattr(args, field.name)
        for field in msgspec.structs.fields(Behaviour)
        if getattr(args, field.name) is not None
    }
    try:
        behaviour = msgspec.convert(knobs, Behaviour)
    except msgspec.ValidationError as exc:
        parser.error(str(exc))
    port_file: Path | None = args.port_file
    _run(
        serve(
            behaviour,
            host=args.host,
            port=args.port,
            on_ready=lambda url: _announce(url, port_file),
        )
    )
    return 0
