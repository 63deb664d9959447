"""Producer and operator API: AsyncClient and Client (blocking).

Both clients share every rule. A method builds a *plan*: a generator that validates its
arguments, yields the Redis work it needs (a script `Call`, a batch of `Reads`, a
`Pause`, or a `TaskEvent` for `watch`), gets each reply back, and returns the result.
Plans do no I/O; `AsyncClient` runs them with asyncio and `Client` with blocking sockets.

The package, by seam: `context` (tunables, results, plan types, the per-client context),
`validation` (argument checks, the create call), the plans (`tasks`: get and cancel;
`submit`; `groups`: routing and group definitions; `watch`: wait and watch; `listing`:
list and its cursors; `operator`: stats, pauses, limits, resolve, purge), and the two
runners, `aio` (`AsyncClient`) and `sync` (`Client`).
"""

from .aio import AsyncClient
from .context import Stats, TaskEvent, TaskPage
from .operator import ArchiveTarget as ArchiveTarget
from .sync import Client
from .validation import content_dedup_key as content_dedup_key
from .validation import task_shard as task_shard
from .watch import event_from_entry as event_from_entry
from .watch import stream_entries as stream_entries
from .watch import task_event as task_event

__all__ = ["AsyncClient", "Client", "Stats", "TaskEvent", "TaskPage"]
