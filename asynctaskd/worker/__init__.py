"""The daemon loop: claim due work, run handler calls concurrently, save outcomes, drain.

One claim loop feeds a task group of handler calls, bounded by `max_inflight` slots;
it claims only as many tasks as it has free slots, so nothing claimed waits for a slot.
A renewal loop extends every held lease in one call per shard and cancels a call whose
lease is gone. Every outcome goes through `Store.save`, which enforces fence and version.

The parts, one per module, wired together in `core.Worker` only:

- `core`: `Worker`, its lifecycle (run, stop, drain) and the claim loop; one call's run.
- `claiming`: claim rounds (submit and query work per shard, rate-lane tokens), lookups
  of parked tasks, the idle wait and the nudges that cut it short.
- `leases`: the renewal loop, and giving a lease back without an outcome.
- `vendor`: the handler's submit, query and find, with their context and timeouts.
- `saving`: saves (and withdraws) under fence and version; saves that must land.
- `call`: one call in flight (`Call`) and the calls the worker holds (`InFlight`).
"""

from .core import Worker, default_worker_id

__all__ = ["Worker", "default_worker_id"]
