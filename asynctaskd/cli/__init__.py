"""The `asynctaskd` command: run the daemon, develop locally, inspect and repair tasks.

Exit codes (also in `asynctaskd --help`): 0 ok; 1 failed (Redis unreachable, or `wait` /
`watch` saw the task end without succeeding); 2 usage, configuration or input error; 3 not
found; 4 refused (not possible now: the task's state, a quota, a permission); 5 timed out
(`wait --timeout`).

The package: `main` (the entry point, and the commands that need no client), `parser`
(the command line), `commands` (those that run on a client), `operator` (tokens, groups,
limits, stats), `common` (exit codes, connection options, input and output helpers).
"""

from .common import DEFAULT_URL as DEFAULT_URL
from .common import EXIT_FAILED, EXIT_NOT_FOUND, EXIT_REFUSED, EXIT_TIMED_OUT
from .common import EXIT_USAGE as EXIT_USAGE
from .main import main
from .parser import EPILOG as EPILOG

__all__ = ["EXIT_FAILED", "EXIT_NOT_FOUND", "EXIT_REFUSED", "EXIT_TIMED_OUT", "main"]
