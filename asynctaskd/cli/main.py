"""`main`, the entry point: parses the command line, runs the commands that need no client
(run, dev, web, check-config, scripts export, alerts) and hands the others to `commands`, then
maps the exceptions to the exit codes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Sequence

from asynctaskd.config import load_config
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

from .commands import _client_command
from .common import EXIT_FAILED, EXIT_NOT_FOUND, EXIT_REFUSED, EXIT_USAGE, _out, _say
from .operator import _alerts, _export_scripts
from .parser import _parser


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
            if config.telemetry.otel:
                from asynctaskd.tracing import vendor_spans

                vendor_spans(True)  # the extra is installed, or a ConfigError says what to do
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
        if args.command == "migrate":
            from .migrate import _migrate

            return _migrate(args)
        if args.command == "backup":
            from .backup import _backup

            return _backup(args)
        if args.command == "restore":
            from .backup import _restore

            return _restore(args)
        if args.command == "scripts" and args.scripts_command == "export":
            return _export_scripts(args.dir)
        if args.command == "alerts":
            return _alerts(args.runbook_base)
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
