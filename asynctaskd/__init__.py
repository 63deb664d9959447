"""asynctaskd: submit vendor jobs once, track them to the end, from Redis.

Layout, in the order data flows:
  model      statuses, legal transitions, the Task snapshot
  errors     the exception tree
  keys       every Redis key name (namespace, shard hash tag)
  codec      JSON-like payload checks; task hash <-> Task
  scripts    reads lua/*.lua and their header contracts
  store      the only code that talks to Redis about tasks
"""

from .errors import (
    AsyncTaskdError,
    ConfigError,
    CorruptTask,
    HandlerError,
    IllegalTransition,
    InvalidTask,
    NotSent,
    PayloadTooLarge,
    PermanentError,
    RetryableError,
    ScriptError,
    StoreUnavailable,
    TaskNotFound,
    UnknownHandler,
)
from .model import Status, Task, TaskError

__version__ = "0.1.0"

__all__ = [
    "AsyncTaskdError",
    "ConfigError",
    "CorruptTask",
    "HandlerError",
    "IllegalTransition",
    "InvalidTask",
    "NotSent",
    "PayloadTooLarge",
    "PermanentError",
    "RetryableError",
    "ScriptError",
    "Status",
    "StoreUnavailable",
    "Task",
    "TaskError",
    "TaskNotFound",
    "UnknownHandler",
]
