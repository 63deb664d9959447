"""Wires the components into one task group: the only place that owns the whole tree.

Drain order on SIGTERM or SIGINT (a second signal skips to step 3):
  1. stop claiming (the worker's intake scope is cancelled; STOPPING=1 is sent);
  2. let in-flight calls finish, up to `worker.shutdown_grace`;
  3. cancel the calls still running;
  4. release their leases, shielded and capped at 2 s, so peers take over at once
     (a submit cut off after its vendor call started is parked in SUBMIT_UNKNOWN);
  5. stop the reaper, heartbeat, durability checks and health listener;
  6. close the HTTP client and Redis (and stop an embedded server);
  7. exit 0.
SIGHUP reloads the handler table from the config file.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec

from . import __version__, admission, http_handler, systemd
from .config import Config, load_config, parse_listen
from .connection import follow_master, open_async
from .durability import DurabilityWatch
from .embedded import EmbeddedServer, require_valkey_binary
from .errors import ConfigError, ScriptError, StoreUnavailable
from .handlers import HandlerEntry, load_handlers
from .health import serve_health
from .keys import Keys
from .metrics import Metrics
from .reaper import run_reaper
from .store import Store, redis_credentials
from .transport import DEFAULT_MAX_RESPONSE_BYTES, make_http_client
from .worker import Worker

__all__ = ["Daemon", "redis_url", "serve"]

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 5.0
HEARTBEAT_TTL_MS = 30_000
LOOP_LAG_INTERVAL = 0.25  # the event-loop lag probe sleeps this long and measures oversleep
SENTINEL_INTERVAL = 1.0  # at most this long between questions to the sentinels (follow_master)


@contextlib.asynccontextmanager
async def redis_url(config: Config) -> AsyncIterator[str]:
    """The configured URL, or a private Valkey (AOF on) for `url = "embedded"`."""
    if config.redis.url != "embedded":
        yield config.redis.url
        return
    binary = require_valkey_binary("redis.url = 'embedded'")
    root = Path(await anyio.Path(config.redis.data_dir).resolve())
    # Started from this (the main) thread, not a worker thread: the server dies with the
    # thread that started it (EmbeddedServer), and worker threads come and go.
    server = EmbeddedServer(binary, root / "valkey").start()
    logger.info(
        "embedded valkey on %s, data in %s; producers and the CLI: --url embedded://%s",
        server.socket,
        server.data_dir,
        root,
    )
    server.watch(_embedded_server_died)
    try:
        yield server.url
    finally:
        await anyio.to_thread.run_sync(server.stop)


def _embedded_server_died(why: str) -> None:
    """The embedded server exited under the daemon (a full disk: Valkey stops when it
    cannot append to its AOF): exit at once with status 1, as a crash would, so that the
    service manager restarts the daemon with a new server once the cause is gone. A drain
    could not hand anything back without a server; what was acknowledged is in the AOF,
    and leases and call marks let the next daemon take over, as after a kill."""
    logger.critical(
        "the embedded valkey server exited (%s): stopping the daemon; a full disk under "
        "redis.data_dir is the usual cause (docs/deploy.md, section 10)",
        why,
    )
    logging.shutdown()
    os._exit(1)


async def _check_server(store: Store) -> None:
    value = await store.server_setting("maxmemory-policy")
    if value is None:  # CONFIG may be forbidden by ACL: only a note
        logger.info("could not read maxmemory-policy; make sure it is noeviction")
    elif value != "noeviction":
        logger.warning(
            "Redis maxmemory-policy is %r: it may evict tasks. Set it to noeviction.", value
        )


def shared_http_client(config: Config) -> httpx.AsyncClient:
    """The client every handler call shares: a pool as large as the calls in flight.

    A call makes one request at a time, so with at least `max_inflight` connections no
    request waits for a pool slot. Waiting for one costs CPU as well as time: W3 at 2,000
    in flight did 3,600 polls/s through 1,000 aiohttp connections, 4,100 through 4,000.
    """
    return make_http_client(max_connections=max(1000, config.worker.max_inflight))


def handler_http_clients(config: Config) -> dict[str, httpx.AsyncClient]:
    """A client of its own for each handler that sets `proxy` or `max_response_bytes`
    (the rest share `shared_http_client`). An unusable proxy URL is a ConfigError."""
    clients: dict[str, httpx.AsyncClient] = {}
    for i, hc in enumerate(config.handlers):
        if hc.proxy is None and hc.max_response_bytes is None:
            continue
        try:
            clients[hc.key] = make_http_client(
                max_connections=max(1000, config.worker.max_inflight),
                proxy=hc.proxy,
                max_response_bytes=hc.max_response_bytes or DEFAULT_MAX_RESPONSE_BYTES,
            )
        except (ValueError, ImportError) as exc:  # ImportError: socks5 without socksio
            raise ConfigError(f"handlers[{i}] ({hc.key}).proxy: {exc}") from None
    return clients


class Daemon:
    """One daemon process: store, worker, reaper, health, heartbeat, signals."""

    def __init__(
        self, config: Config, config_path: Path | None = None, *, own_process: bool = False
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.own_process = own_process  # the process is this daemon's: tune its GC
        self.metrics = Metrics()
        self.worker: Worker | None = None
        self.redis_ok = False
        self.published = False  # this daemon's record (its handlers) is in Redis
        self.durability: DurabilityWatch | None = None
        self.health_port: int | None = None  # where /metrics is served, once it is
        self.started_at = time.time()
        self._loaded: list[HandlerEntry] = []  # every handler built, for closing at exit

    def ready(self) -> tuple[bool, str]:
        worker = self.worker
        # Ready means taking work: the first claim round ran and producers can see the
        # handlers this daemon serves (`asynctaskd stats`, the client's unknown-handler check).
        if worker is None or not worker.first_pass.is_set() or not self.published:
            return False, "starting"
        if worker.draining:
            return False, "draining"
        if not self.redis_ok:
            return False, "redis unreachable"
        stalled = worker.stalled_for
        if stalled > float(self.config.worker.watchdog):
            return False, f"due work waited {stalled:.0f}s without a claim"
        return True, "ready"

    def readyz(self) -> tuple[bool, str]:
        """`/readyz`: `ready()`, and on a line of its own what the durability gate enforces.

        The gate never decides readiness: readiness drives the systemd watchdog, and a
        daemon restarted every WatchdogSec for a setting of Redis would only stop all
        work. A gate that is off is reported here, in metrics and by an alert instead.
        """
        ok, why = self.ready()
        report = self.durability.report if self.durability is not None else None
        if report is not None:
            why += "\ndurability: " + report.detail
        return ok, why

    async def serve(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        config = self.config
        async with redis_url(config) as url:
            redis = open_async(
                url,
                config.redis.tls,
                credentials=redis_credentials(),
                socket_timeout=float(config.redis.socket_timeout) + 5,
            )
            keys = Keys(config.redis.namespace, config.redis.shards)
            settings = {"retention_ms": round(float(config.reaper.retention) * 1000)}
            store = Store(redis, keys, settings)
            http = shared_http_client(config)
            own = handler_http_clients(config)
            try:
                await self._run(store, http, task_status, own)
            finally:
                with anyio.move_on_after(2, shield=True):
                    await http.aclose()
                    for client in own.values():
                        await client.aclose()
                    await store.close()
                    await redis.aclose()

    async def _run(
        self,
        store: Store,
        http: httpx.AsyncClient,
        task_status: Any,
        handler_http: dict[str, httpx.AsyncClient] | None = None,
    ) -> None:
        config = self.config
        if config.metrics.enabled:
            store.on_call = self.metrics.observe_redis_call
        delay = 0.2
        while True:  # Redis may start after us (boot order, failover): wait, do not exit
            try:
                await store.prepare()
                break
            except StoreUnavailable as exc:
                logger.warning("Redis is not reachable yet, retrying in %.1fs: %s", delay, exc)
                await anyio.sleep(delay)
                delay = min(5.0, delay * 2)
        self.redis_ok = True
        await store.register_deployment()  # ConfigError: another shard count or protocol
        await _check_server(store)
        durability = DurabilityWatch(store, config.redis, self.metrics)
        gate = await durability.start()  # logs what the gate enforces, and what it does not
        self.durability = durability
        handlers = load_handlers(
            list(config.handlers),
            builders=http_handler.builders(config.handlers, self.config_path),
        )
        self._loaded.extend(handlers.values())
        if not handlers:
            logger.warning("no handlers configured: this daemon will claim nothing useful")
        # Admission limits: plans run on the daemon's own store (admission.run_on_store).
        await self._apply_limits(store, config)
        worker = Worker(
            store,
            handlers,
            config,
            http=http,
            handler_http=handler_http,
            metrics=self.metrics,
            gate=gate,
        )
        durability.on_gate = worker.use_gate
        self.worker = worker
        if self.own_process:
            tune_gc()
        async with anyio.create_task_group() as tg:
            if config.metrics.enabled:
                host, port = parse_listen(config.metrics.listen)
                self.health_port = await tg.start(
                    serve_health, host, port, self.metrics, self.readyz
                )
                tg.start_soon(self._loop_lag)
            # Through Sentinel: follow a failover within a third of a lease, so renewals
            # reach a new master before the leases it holds expire (docs/reliability.md).
            interval = min(SENTINEL_INTERVAL, float(config.worker.lease) / 3)
            tg.start_soon(follow_master, store.redis, interval)
            tg.start_soon(run_reaper, store, config, self.metrics)
            tg.start_soon(self._heartbeat, store, worker, handlers)
            tg.start_soon(durability.run)
            tg.start_soon(self._signals, worker, store)
            tg.start_soon(admission.run_sync, store, self.metrics)
            tg.start_soon(self._watchdog, worker)
            stopped = anyio.Event()

            async def run_worker() -> None:
                try:
                    await worker.run()
                finally:
                    stopped.set()

            tg.start_soon(run_worker)
            # READY once the first claim round ran: the daemon is really taking work.
            with anyio.move_on_after(10):
                await worker.first_pass.wait()
            systemd.notify(f"READY=1\nSTATUS=claiming for {len(handlers)} handler(s)")
            logger.info("daemon %s ready, handlers: %s", worker.id, ", ".join(sorted(handlers)))
            task_status.started(worker.id)
            await stopped.wait()
            systemd.notify("STOPPING=1")
            tg.cancel_scope.cancel()
        with anyio.move_on_after(2, shield=True), contextlib.suppress(StoreUnavailable):
            await store.remove_daemon(worker.id)
        await self._close_handlers()
        logger.info("daemon %s stopped after %d calls", worker.id, worker.completed)

    async def _close_handlers(self) -> None:
        """Close the HTTP clients that handlers own (every generation, after a reload too)."""
        with anyio.move_on_after(2, shield=True):
            for entry in self._loaded:
                close = getattr(entry.handler, "aclose", None)
                if callable(close):
                    try:
                        await close()
                    except Exception as exc:
                        logger.warning("closing handler %s failed: %s", entry.key, exc)

    async def _heartbeat(
        self, store: Store, worker: Worker, handlers: dict[str, HandlerEntry]
    ) -> None:
        durability = self.durability
        while True:
            record = msgspec.json.encode(
                {
                    "id": worker.id,
                    "version": __version__,
                    "pid": os.getpid(),
                    "handlers": sorted(worker.handlers),
                    "inflight": worker.inflight,
                    "completed": worker.completed,
                    "started_at": self.started_at,
                    "heartbeat_at": time.time(),
                    "draining": worker.draining,
                    "durability": durability and durability.report,  # what its gate enforces
                }
            )
            try:
                await store.publish_daemon(
                    worker.id, list(worker.handlers), record, HEARTBEAT_TTL_MS
                )
                if not self.redis_ok and durability is not None:  # reconnected, perhaps
                    durability.recheck_soon()  # to another server: check what it keeps
                # Producers may not load scripts (docs/security.md): after a restart or a
                # failover emptied the script cache, an idle daemon loads them back here.
                if not await store.scripts_loaded():
                    logger.warning("Redis lost the asynctaskd scripts; loading them again")
                    await store.prepare()
                self.redis_ok = self.published = True
            except Exception as exc:  # the heartbeat must outlive any failure
                self.redis_ok = False
                logger.warning("heartbeat failed: %s", exc)
            await anyio.sleep(HEARTBEAT_INTERVAL)

    async def _loop_lag(self) -> None:
        """Sleep a fixed interval and record the oversleep: blocking code shows up here."""
        while True:
            started = time.perf_counter()
            await anyio.sleep(LOOP_LAG_INTERVAL)
            late = time.perf_counter() - started - LOOP_LAG_INTERVAL
            self.metrics.event_loop_lag.observe(max(0.0, late))

    async def _watchdog(self, worker: Worker) -> None:
        interval = systemd.watchdog_interval()
        healthy = 1.0
        while True:
            ok, why = self.ready()
            self.metrics.watchdog_ok.set(1 if ok or why in ("draining", "starting") else 0)
            if interval is not None and (ok or worker.draining):
                systemd.notify("WATCHDOG=1")
            elif interval is not None:
                logger.error("watchdog: not pinging systemd: %s", why)
            await anyio.sleep(interval or healthy)

    async def _signals(self, worker: Worker, store: Store) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    config = self._reload(worker)
                    if config is not None:
                        await self._apply_limits(store, config)
                    continue
                logger.info("signal %s: %s", signal.Signals(signum).name,
                            "stopping now" if worker.draining else "draining")  # fmt: skip
                if not worker.draining:
                    systemd.notify("STOPPING=1")  # step 1 of the drain order
                worker.stop(now=worker.draining)

    async def _apply_limits(self, store: Store, config: Config) -> None:
        """Write the config's [[limits]] to Redis (shared by every daemon) and sync shards."""
        try:
            kept = await admission.apply_config(store, config.limits, config.handlers)
        except (StoreUnavailable, ScriptError) as exc:
            logger.error("could not write [[limits]] to Redis (SIGHUP retries): %s", exc)
            return
        for scope in kept:
            logger.warning(
                "limits for %s were set at runtime and win over the config file "
                "(asynctaskd limits clear %s hands them back to it)",
                scope,
                scope,
            )

    def _reload(self, worker: Worker) -> Config | None:
        if self.config_path is None:
            logger.warning("SIGHUP: no config file to reload")
            return None
        try:
            config = load_config(self.config_path)
            handlers = load_handlers(
                list(config.handlers),
                builders=http_handler.builders(config.handlers, self.config_path),
            )
        except ConfigError as exc:
            logger.error("SIGHUP: reload failed, keeping the running config: %s", exc)
            return None
        self._loaded.extend(handlers.values())
        worker.handlers = handlers
        logger.info(
            "SIGHUP: reloaded %d handler(s): %s", len(handlers), ", ".join(sorted(handlers))
        )
        return config


def tune_gc() -> None:
    """Fewer, cheaper garbage collections, once the daemon is set up.

    A handler call allocates a few dozen objects, and CPython collects its youngest
    generation every 700: at thousands of calls a second the collections, and the full
    ones that walk every module, class and function loaded, took a sixth of the daemon's
    CPU per call when measured (instant handler, no HTTP; docs/performance-history.md,
    sixth pass). What is loaded by now lives as long
    as the process, so it is frozen out of collections; the young generation is collected
    every 10,000 allocations, the older ones seldom. Cyclic garbage still goes, later.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 50, 100)


def install_uvloop() -> Callable[[], Any] | None:
    """The loop factory for anyio.run: uvloop when installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - a declared dependency, absent on some platforms
        return None
    return uvloop.new_event_loop


def serve(config: Config, config_path: Path | None = None) -> None:
    """Run a daemon in this process until it drains (blocking)."""
    daemon = Daemon(config, config_path, own_process=True)
    factory = install_uvloop()
    options: dict[str, Any] = {"loop_factory": factory} if factory else {}
    anyio.run(daemon.serve, backend="asyncio", backend_options=options)
