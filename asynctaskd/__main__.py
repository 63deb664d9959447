"""`python -m asynctaskd` runs the CLI."""

import signal
import sys


def _exit_during_startup(signum: int, frame: object) -> None:
    # Until the daemon installs its own handlers nothing is claimed: exit cleanly.
    raise SystemExit(0)


signal.signal(signal.SIGTERM, _exit_during_startup)

from .cli import main  # noqa: E402 - after the early signal handler on purpose

sys.exit(main())
