"""Sentinel: producers and daemons find the master through redis+sentinel:// URLs, and keep
working when Sentinel promotes a replica after the master is killed."""

from __future__ import annotations

import contextlib
import signal
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from redis import Redis as SyncRedis

from asynctaskd import AsyncClient, Client, Status
from asynctaskd.config import parse_config
from asynctaskd.connection import open_async
from asynctaskd.daemon import Daemon
from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess, run_server
from asynctaskd.embedded import find_binary, free_port
from asynctaskd.errors import StoreUnavailable
from asynctaskd.keys import Keys
from tests.configs import tls_daemon_toml, write_daemon_config
from tests.conftest import SERVER_BINARIES, statuses, wait_until_sync
from tests.servers import SERVICE, Pki, PrivateServer, SentinelProcess, make_pki, start_server
from tests.test_daemon import start_daemon

# Replicas and masters-to-be: AOF on, and a full sync that starts at once.
NODE_ARGS = ("--appendonly", "yes", "--repl-diskless-sync-delay", "0")


@pytest.fixture(params=SERVER_BINARIES)
def binary(request: pytest.FixtureRequest) -> Path:
    found = find_binary(request.param)
    if found is None:
        pytest.skip(f"{request.param} is not installed")
    return found


def info(port: int, section: str) -> dict[str, object]:
    with SyncRedis(host="127.0.0.1", port=port, socket_timeout=5) as r:
        return dict(r.info(section))


def sentinel_view(sentinel: SentinelProcess) -> tuple[int, int, int]:
    """(master port, replicas up, other sentinels) as one sentinel sees them."""
    with sentinel.client() as r:
        master = r.sentinel_master(SERVICE)
        replicas = r.sentinel_slaves(SERVICE)
    up = sum(1 for x in replicas if not (x["is_sdown"] or x["is_disconnected"]))
    return master["port"], up, master["num-other-sentinels"]


def ready(metrics_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/readyz", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def serving(metrics_port: int, master: PrivateServer) -> bool:
    """Ready, and its handler published: /readyz can answer before the first heartbeat,
    and a strict submit before it is refused."""
    if not ready(metrics_port):
        return False
    with SyncRedis(port=master.port, socket_timeout=5) as r:
        return bool(r.hexists(Keys("atd").handlers(), "demo"))


def gate_count(metrics_port: int, outcome: str) -> float:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    name = f'asynctaskd_durability_gate_seconds_count{{outcome="{outcome}"}}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@contextlib.contextmanager
def stopping(*servers: PrivateServer) -> Iterator[None]:
    try:
        yield
    finally:
        for server in servers:
            server.stop()


def log_tail(server: PrivateServer, size: int = 4000) -> str:
    """The end of a server's or a sentinel's log, headed by its port."""
    path = server.data_dir / "server.log"
    text = path.read_text()[-size:] if path.exists() else "(no log)"
    return f"\n--- {type(server).__name__} {server.port} ---\n{text}"


def watched_master(
    stack: contextlib.ExitStack, binary: Path, master_args: tuple[str, ...] = ()
) -> tuple[PrivateServer, list[PrivateServer], list[SentinelProcess], str]:
    """A master, two replicas in sync and three sentinels (quorum 2) that see them all,
    stopped by `stack`; returns them and the sentinel URL (whose first address is dead:
    discovery moves on to the next one)."""
    master = PrivateServer(binary, extra_args=(*NODE_ARGS, *master_args))
    stack.callback(master.stop)
    master.start()
    replicas = []
    for _ in range(2):
        replica = PrivateServer(
            binary, extra_args=(*NODE_ARGS, "--replicaof", "127.0.0.1", str(master.port))
        )
        stack.callback(replica.stop)
        replicas.append(replica.start())
    wait_until_sync(
        lambda: info(master.port, "replication").get("connected_slaves") == 2,
        "two replicas in sync",
    )
    sentinels = []
    for _ in range(3):
        sentinel = SentinelProcess(binary, master.port, quorum=2)
        stack.callback(sentinel.stop)
        sentinels.append(sentinel.start())
    wait_until_sync(
        lambda: all(sentinel_view(s) == (master.port, 2, 2) for s in sentinels),
        "every sentinel to see the master, two replicas and the other sentinels",
        timeout=15,
    )
    addresses = ",".join(f"127.0.0.1:{p}" for p in [free_port(), *(s.port for s in sentinels)])
    return master, replicas, sentinels, f"redis+sentinel://{addresses}/{SERVICE}/0"


def promoted(old: PrivateServer, sentinels: list[SentinelProcess]) -> int | None:
    """The port of the master every sentinel names, once it is not `old` and says so."""
    ports = {sentinel_view(s)[0] for s in sentinels}
    if len(ports) != 1 or old.port in ports:
        return None
    port = ports.pop()
    return port if info(port, "replication").get("role") == "master" else None


@pytest.mark.slow
def test_daemon_and_client_carry_on_through_a_failover(binary: Path, tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        master, replicas, sentinels, url = watched_master(stack, binary)

        vendor = stack.enter_context(FakeVendorProcess.start(Behaviour(polls_to_done=20)))
        metrics_port = free_port()
        config = write_daemon_config(
            tmp_path / "config.toml",
            url,
            vendor.url,
            redis={"wait_replicas": 1},
            worker={"lease": "2s", "shutdown_grace": "5s"},
            metrics={"listen": f"127.0.0.1:{metrics_port}"},
        )
        daemon = start_daemon(config)
        stack.callback(lambda: daemon.poll() is None and daemon.kill())
        wait_until_sync(lambda: serving(metrics_port, master), "the daemon to serve", timeout=20)
        client = stack.enter_context(Client.from_url(url))

        before = [client.submit("demo", {"i": i}, tracking_timeout=120).id for i in range(20)]
        # Kill only once every vendor job exists and both replicas have every write: a
        # task in its submit phase could otherwise lose its handle with the master and
        # park in SUBMIT_UNKNOWN, as it should (at most one vendor submit).
        past_submit = {Status.SUBMITTED, Status.RUNNING, Status.SUCCEEDED}
        wait_until_sync(
            lambda: set(statuses(client, before)) <= past_submit,
            "every task past its vendor submit",
            timeout=20,
        )
        with SyncRedis(host="127.0.0.1", port=master.port, socket_timeout=5) as r:
            assert r.execute_command("WAIT", 2, 5000) == 2
        # tracked across the kill: the vendor jobs run on
        assert statuses(client, before).get(Status.SUCCEEDED, 0) < 20
        master.kill()
        new_port = wait_until_sync(
            lambda: promoted(master, sentinels), "a replica promoted by Sentinel", timeout=30
        )
        assert new_port in {r.port for r in replicas}

        # The same client, without any retry of ours, now writes to the new master.
        after = [client.submit("demo", {"i": i}, tracking_timeout=120).id for i in range(20)]
        try:
            wait_until_sync(
                lambda: statuses(client, before + after) == {Status.SUCCEEDED: 40},
                "all 40 tasks to succeed",
                timeout=60,
            )
        except AssertionError as exc:
            # What each task is now (None: gone), and what the daemon, the replicas and the
            # sentinels logged: a task that vanishes across the failover (seen about once
            # in a hundred runs under load) is otherwise unexplained.
            now = {i: None if (t := client.get(i)) is None else t.status for i in before + after}
            gone = [
                ("before" if i in before else "after", i) for i, st in now.items() if st is None
            ]
            logs = "".join(p.read_text()[-3000:] for p in tmp_path.glob("daemon-*.log"))
            servers = "".join(log_tail(s) for s in [*replicas, *sentinels])
            raise AssertionError(
                f"{exc}: {Counter(now.values())}, gone: {gone}\n{logs}{servers}"
            ) from None
        created = [e for e in vendor.submit_log() if e["outcome"] == "created"]
        assert len(created) == 40 and len({e["ref"] for e in created}) == 40
        # Every vendor submit waited for a replica to acknowledge its "started" mark.
        assert gate_count(metrics_port, "ok") >= 40
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=20) == 0


# The old master of the failovers below stays up and takes writes, as one that stalled, or
# that the sentinels lost sight of, does until Sentinel demotes it (and throws away what it
# took meanwhile). Here Sentinel can never demote it: REPLICAOF and SLAVEOF are disabled.
UNDEMOTABLE = ("--rename-command", "REPLICAOF", "", "--rename-command", "SLAVEOF", "")


def fail_over(master: PrivateServer, sentinels: list[SentinelProcess]) -> int:
    """Have Sentinel promote a replica of `master`, which stays a master; the new port."""
    with sentinels[0].client() as r:
        assert r.sentinel_failover(SERVICE)
    new_port: int = wait_until_sync(
        lambda: promoted(master, sentinels), "a replica promoted by Sentinel", timeout=30
    )
    assert info(master.port, "replication").get("role") == "master"  # two masters now
    return new_port


@pytest.mark.slow
async def test_a_connection_in_use_across_a_failover_is_not_used_again(binary: Path) -> None:
    # redis-py asks the sentinels only when it opens a connection, and takes a connection
    # back as it is: one that was busy (a pipeline waiting for its replies, a blocked
    # BLPOP) when the master changed went on to write to the old master.
    with contextlib.ExitStack() as stack:
        master, _, sentinels, url = watched_master(stack, binary, UNDEMOTABLE)
        client = open_async(url)
        try:
            pool = client.connection_pool
            busy = await pool.get_connection()
            assert (busy.host, busy.port) == ("127.0.0.1", master.port)
            new_port = fail_over(master, sentinels)
            await client.set("opened-after", 1)  # a new connection: asks the sentinels
            await pool.release(busy)
            await client.set("reused", 1)  # the pool hands out `busy` again first
        finally:
            await client.aclose()
        with SyncRedis(port=new_port, socket_timeout=5) as new:
            assert new.exists("opened-after", "reused") == 2
        with SyncRedis(port=master.port, socket_timeout=5) as old:
            assert old.exists("opened-after", "reused") == 0


@pytest.mark.slow
def test_daemon_leaves_an_old_master_that_still_takes_writes(binary: Path, tmp_path: Path) -> None:
    # An idle daemon opens no connection, so nothing made it ask the sentinels again: it
    # went on claiming from the old master while producers wrote to the new one.
    with contextlib.ExitStack() as stack:
        master, _, sentinels, url = watched_master(stack, binary, UNDEMOTABLE)
        vendor = stack.enter_context(FakeVendorProcess.start(Behaviour(polls_to_done=2)))
        metrics_port = free_port()
        config = write_daemon_config(
            tmp_path / "config.toml",
            url,
            vendor.url,
            redis={"wait_replicas": 1},
            worker={"lease": "2s", "shutdown_grace": "5s"},
            metrics={"listen": f"127.0.0.1:{metrics_port}"},
        )
        daemon = start_daemon(config)
        stack.callback(lambda: daemon.poll() is None and daemon.kill())
        wait_until_sync(lambda: serving(metrics_port, master), "the daemon to serve", timeout=20)
        with Client.from_url(url) as client:
            before = [client.submit("demo", {"i": i}, tracking_timeout=120).id for i in range(10)]
            wait_until_sync(
                lambda: statuses(client, before) == {Status.SUCCEEDED: 10},
                "the first tasks to succeed",
                timeout=20,
            )
        new_port = fail_over(master, sentinels)

        # A client made now asks the sentinels first, so these tasks are on the new master
        # only (a producer's long-lived client: docs/deploy.md, section 8).
        with Client.from_url(url) as client:
            after = [client.submit("demo", {"i": i}, tracking_timeout=120).id for i in range(20)]
            try:
                wait_until_sync(
                    lambda: statuses(client, after) == {Status.SUCCEEDED: 20},
                    "the tasks submitted after the failover to succeed",
                    timeout=30,
                )
            except AssertionError as exc:
                logs = "".join(p.read_text()[-3000:] for p in tmp_path.glob("daemon-*.log"))
                raise AssertionError(f"{exc}: {statuses(client, after)}\n{logs}") from None
        created = [e["ref"] for e in vendor.submit_log() if e["outcome"] == "created"]
        assert sorted(created) == sorted(before + after)
        with SyncRedis(port=new_port, socket_timeout=5) as r:
            events = r.xrange(Keys("atd").events(0))
        assert [e for _, e in events if e[b"status"] == b"SUBMIT_UNKNOWN"] == []
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=20) == 0


async def test_sentinel_and_nodes_with_passwords(
    binary: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The password comes from the environment, as for redis:// URLs; sentinel_auth=yes
    # hands it to the sentinels too.
    monkeypatch.setenv("REDIS_PASSWORD", "s3cret")
    master = PrivateServer(binary, extra_args=("--requirepass", "s3cret")).start()
    sentinel = SentinelProcess(
        binary,
        master.port,
        conf=("requirepass s3cret", f"sentinel auth-pass {SERVICE} s3cret"),
    )
    with stopping(master, sentinel):
        sentinel.start()
        url = f"redis+sentinel://127.0.0.1:{sentinel.port}/{SERVICE}/3?sentinel_auth=yes"
        async with AsyncClient.from_url(url) as client:
            task = await client.submit("demo", {"x": 1}, tracking_timeout=60, strict=False)
            with Client.from_url(url) as sync_client:
                got = sync_client.get(task.id)
                assert got is not None and got.status is Status.PENDING_SUBMIT
        # the task went to database 3 of the master, behind its password
        with SyncRedis(port=master.port, password="s3cret", db=3) as r:
            assert r.dbsize() > 0
        # without sentinel_auth the sentinel refuses, and says so
        plain = url.removesuffix("?sentinel_auth=yes")
        with Client.from_url(plain) as sync_client, pytest.raises(StoreUnavailable) as failure:
            sync_client.stats()
        message = str(failure.value)
        assert "No master found for 'mymaster'" in message and "AuthenticationError" in message
        assert "s3cret" not in message


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    # Sentinel hands out the master's IP address, so the certificate names it.
    return make_pki(tmp_path_factory.mktemp("pki"), server_names="IP:127.0.0.1")


async def test_tls_through_sentinel(pki: Pki) -> None:
    """rediss+sentinel://: TLS to the sentinel and to the master it names; a daemon with the
    [redis] TLS keys completes a task that a producer submitted with URL options."""
    master = start_server("redis-server", pki)
    sentinel = SentinelProcess(master.binary, master.tls_port, pki)
    with stopping(master, sentinel):
        sentinel.start()
        url = f"rediss+sentinel://127.0.0.1:{sentinel.tls_port}/{SERVICE}/0"
        async with run_server(Behaviour(polls_to_done=1)) as vendor_url:
            config = parse_config(tls_daemon_toml(url, pki, vendor_url))
            daemon = Daemon(config)
            async with anyio.create_task_group() as tg:
                await tg.start(daemon.serve)
                assert daemon.worker is not None
                try:
                    async with AsyncClient.from_url(f"{url}?{pki.client_query()}") as client:
                        task = await client.submit("demo", {"tls": True}, tracking_timeout=60)
                        done = await client.wait(task.id, timeout=20)
                        assert done is not None and done.status is Status.SUCCEEDED, done
                finally:
                    daemon.worker.stop()
