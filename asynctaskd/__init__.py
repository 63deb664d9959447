"""asynctaskd: submit vendor jobs once, track them to the end, from Redis.

Layout, in the order data flows:
  model      statuses, legal transitions, the Task snapshot
  errors     the exception tree
  keys       every Redis key name (namespace, shard hash tag)
  codec      JSON-like payload checks; task hash <-> Task
  scripts    reads lua/*.lua and their header contracts
  store      the only code that talks to Redis about tasks (its batches: wire)
  client     producers and operators: submit, get, cancel, wait, watch, list, resolve
  handlers   the Handler protocol, outcomes and registry; http_handler
  retry      pure failure classification and backoff
  worker     claim -> call -> save loop, leases, drain
  reaper     expired leases, deadlines, retention, status gauges
  daemon     wires everything into one task group; signals; drain order
  cli        the `asynctaskd` command
  devtools   fake vendor, demo handler, `asynctaskd dev`: never loaded by the above
"""

from typing import TYPE_CHECKING, Any

from .client import AsyncClient, Client
from .errors import (
    AsyncTaskdError,
    ConfigError,
    CorruptTask,
    HandlerError,
    IllegalTransition,
    InvalidTask,
    NotPermitted,
    NotSent,
    PayloadTooLarge,
    PermanentError,
    QuotaExceeded,
    RetryableError,
    ScriptError,
    StoreUnavailable,
    TaskNotFound,
    UnknownHandler,
)
from .model import Status, Task, TaskError

if TYPE_CHECKING:
    from .handlers import (
        Failed,
        Handler,
        HandlerContext,
        Resubmit,
        Running,
        Submitted,
        Succeeded,
    )

# The handler API pulls in httpx; producers who only import the client should not pay
# for it, so these names load on first use (PEP 562).
_LAZY = {
    "Failed", "Handler", "HandlerContext", "Resubmit", "Running", "Submitted", "Succeeded"
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import handlers

        return getattr(handlers, name)
    raise AttributeError(f"module 'asynctaskd' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncTaskdError",
    "Client",
    "ConfigError",
    "CorruptTask",
    "Failed",
    "Handler",
    "HandlerContext",
    "HandlerError",
    "IllegalTransition",
    "InvalidTask",
    "NotPermitted",
    "NotSent",
    "PayloadTooLarge",
    "PermanentError",
    "QuotaExceeded",
    "Resubmit",
    "RetryableError",
    "Running",
    "ScriptError",
    "Status",
    "StoreUnavailable",
    "Submitted",
    "Succeeded",
    "Task",
    "TaskError",
    "TaskNotFound",
    "UnknownHandler",
]
