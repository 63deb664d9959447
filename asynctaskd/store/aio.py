"""`Store`: asyncio access to tasks in Redis, one method per script (over `Ops`), its
round trips (`batcher`), reads (`reads`), the daemon registry and the deployment record."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import msgspec

from asynctaskd.errors import ConfigError
from asynctaskd.keys import PROTOCOL_VERSION, deployment_problem
from asynctaskd.model import Phase, Status

from .batcher import _Pipelines
from .failures import _mapped
from .ops import PROMOTE_LIMIT
from .reads import _Reads
from .replies import Call, ClaimBatch, Code, Lease, LookupBatch, Result, Sweep

# The name it had as one module: log records keep it.
logger = logging.getLogger("asynctaskd.store")


class Store(_Pipelines, _Reads):
    """Asyncio access to tasks in Redis. One instance per daemon or client."""

    # Convenience wrappers over Ops, one per script.

    async def claim(
        self,
        shard: int,
        phase: Phase,
        n: int,
        lease_ms: int,
        owner: str,
        promote_limit: int = PROMOTE_LIMIT,
        grants: Mapping[str, int] | None = None,
    ) -> ClaimBatch:
        """Claim up to n due tasks; corrupt ones are quarantined and reported, not returned."""
        call = self.ops.claim(shard, phase, n, lease_ms, owner, promote_limit, grants)
        batch = await self.run(call)
        await self._quarantine(batch)
        return batch

    async def claim_each(self, calls: Sequence[Call[ClaimBatch]]) -> list[ClaimBatch | Exception]:
        """Claim calls (`Ops.claim`: a shard's phases, say) in one round trip: each one's
        batch, or the error it met; raises StoreUnavailable if the round trip itself
        failed. Corrupt tasks are quarantined as `claim` does."""
        results, _, _ = await self.pipeline(calls, name="claim")
        for batch in results:
            if isinstance(batch, ClaimBatch):
                await self._quarantine(batch)
        return results

    async def _quarantine(self, batch: ClaimBatch) -> None:
        for bad in batch.corrupt:
            logger.error(
                "quarantining corrupt task: %s", bad.reason, extra={"task_id": bad.task_id}
            )
            await self.run(self.ops.quarantine(bad.task_id, bad.reason))

    async def lookup(
        self, shard: int, n: int, lease_ms: int, owner: str, handlers: Sequence[str]
    ) -> LookupBatch:
        """Lease up to n due lookups; corrupt tasks are quarantined, not returned."""
        batch = await self.run(self.ops.lookup(shard, n, lease_ms, owner, handlers))
        for bad in batch.corrupt:
            logger.error(
                "quarantining corrupt task: %s", bad.reason, extra={"task_id": bad.task_id}
            )
            await self.run(self.ops.quarantine(bad.task_id, bad.reason))
        return batch

    async def start(self, lease: Lease, idempotent: bool) -> Result:
        return await self.run(self.ops.start(lease, idempotent))

    async def save(
        self,
        lease: Lease,
        status: Status,
        *,
        delay_ms: int = 0,
        fields: dict[str, str | bytes | int | float] | None = None,
    ) -> Result:
        return await self.run(self.ops.save(lease, status, delay_ms=delay_ms, fields=fields))

    async def renew(self, lease_ms: int, leases: Sequence[Lease]) -> dict[str, Code]:
        """Renew many leases, one call per shard; returns each task's code."""
        return await self._per_shard(leases, lambda shard, group: self.ops.renew(
            shard, lease_ms, group))  # fmt: skip

    async def release(self, leases: Sequence[Lease]) -> dict[str, Code]:
        """Give leases back without an outcome, one call per shard; each task's code."""
        return await self._per_shard(leases, self.ops.release)

    async def _per_shard(
        self, leases: Sequence[Lease], build: Callable[[int, list[Lease]], Call[list[Code]]]
    ) -> dict[str, Code]:
        by_shard: dict[int, list[Lease]] = {}
        for lease in leases:
            by_shard.setdefault(lease.shard, []).append(lease)
        out: dict[str, Code] = {}
        for shard, group in by_shard.items():
            codes = await self.run(build(shard, group))
            out.update(zip((lease.task_id for lease in group), codes, strict=True))
        return out

    async def cancel(self, task_id: str, tenant: str | None = None) -> Result:
        return await self.run(self.ops.cancel(task_id, tenant))

    async def reap(self, shard: int, limit: int, max_reclaims: int) -> list[tuple[str, Status]]:
        return await self.run(self.ops.reap(shard, limit, max_reclaims))

    async def time_out(self, shard: int, limit: int) -> Sweep:
        return await self.run(self.ops.time_out(shard, limit))

    async def resolve(
        self,
        task_id: str,
        target: Status,
        *,
        external_id: str = "",
        handle_json: bytes = b"",
        message: str = "",
    ) -> Result:
        return await self.run(
            self.ops.resolve(
                task_id, target, external_id=external_id, handle_json=handle_json, message=message
            )
        )

    async def expire(self, shard: int, retention_ms: int, limit: int) -> list[str]:
        return await self.run(self.ops.expire(shard, retention_ms, limit))

    async def purge(self, shard: int, older_than_ms: int, limit: int) -> list[str]:
        return await self.run(self.ops.purge(shard, older_than_ms, limit))

    # Pauses (submit phase), on every shard.

    async def pause(self, dimension: str, note: str = "") -> bool:
        """Hold back new submits for a dimension on every shard; True if newly paused."""
        results = [await self.run(self.ops.pause(s, dimension, note))
                   for s in range(self.keys.shards)]  # fmt: skip
        return any(results)

    async def resume(self, dimension: str) -> int:
        """Lift a pause on every shard; returns how many held tasks went back."""
        moved = 0
        for shard in range(self.keys.shards):
            while True:
                n, left = await self.run(self.ops.resume(shard, dimension))
                moved += n
                if not left:
                    break
        return moved

    async def publish_daemon(
        self, daemon_id: str, handler_keys: Sequence[str], record: bytes, ttl_ms: int
    ) -> None:
        """Heartbeat: this daemon and the handler keys it serves, valid for ttl_ms."""
        expiry = str(int(time.time() * 1000) + ttl_ms)
        with _mapped("heartbeat"):
            async with self.redis.pipeline(transaction=False) as pipe:
                if handler_keys:
                    pipe.hset(self.keys.handlers(), mapping=dict.fromkeys(handler_keys, expiry))
                pipe.hset(self.keys.daemons(), daemon_id, record)
                await pipe.execute()

    async def remove_daemon(self, daemon_id: str) -> None:
        with _mapped("heartbeat"):
            await self.redis.hdel(self.keys.daemons(), daemon_id)

    async def register_deployment(self) -> None:
        """Record this namespace's protocol version and shard count, or check them against
        what the first daemon recorded: ConfigError when they differ (a daemon with another
        shard count would leave tasks on shards nobody claims, and break dedup)."""
        key = self.keys.deployment()
        mine = {"protocol": PROTOCOL_VERSION, "shards": self.keys.shards}
        with _mapped("deployment"):
            await self.redis.set(key, msgspec.json.encode(mine), nx=True)
            stored = await self.redis.get(key)
        problem = deployment_problem(stored, self.keys)
        if problem:
            raise ConfigError(f"{problem}: set [redis] shards to match")
