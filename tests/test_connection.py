"""Connection settings: URL shapes, TLS keys in the config, and bad input named up front.

No server is needed: clients connect lazily, and TLS files are read when a client is made.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio

from asynctaskd import AsyncClient, Client
from asynctaskd.config import RedisConfig, parse_config
from asynctaskd.connection import (
    TlsOptions,
    connection_problems,
    follow_master,
    master_address,
    open_async,
    open_sync,
)
from asynctaskd.errors import ConfigError
from tests.servers import Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="config.toml")
    return str(info.value)


# ---- URL shapes ----


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "rediss://redis.internal:6380/1?ssl_cert_reqs=required&ssl_check_hostname=false",
        "unix:///run/redis/redis.sock?db=2",
        "redis+sentinel://10.0.0.1:26379/mymaster",
        "redis+sentinel://app:pw@10.0.0.1:26379,10.0.0.2:26379,[::1]:26380/mymaster/3",
        "redis+sentinel://sentinel-a,sentinel-b/mymaster/?sentinel_auth=yes",
        "rediss+sentinel://s1:26379/mymaster?ssl_ca_certs=/etc/ca.pem&ssl_check_hostname=no",
        "redis+cluster://10.0.0.1:7000,10.0.0.2:7001",
        "redis+cluster://app:pw@node-a/",
        "rediss+cluster://node-a:6380?ssl_ca_certs=/etc/ca.pem",
    ],
)
def test_good_urls(url: str) -> None:
    assert connection_problems(url) == []


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://h:6379/0", "unknown scheme http://: expected redis://, rediss://, unix://"),
        ("localhost:6379", "expected a URL like redis://HOST:6379/0"),
        ("redis://h/0?ssl_ca_certs=/ca.pem", "option ssl_ca_certs needs a rediss:// URL"),
        ("redis://h/0?sslcert_reqs=none", "did you mean 'ssl_cert_reqs'?"),
        ("redis://h/0?db=x", "Invalid value for 'db'"),
        ("redis://h:port/0", "Port could not be cast"),
        (
            "rediss://h/0?ssl_cert_reqs=maybe",
            "ssl_cert_reqs must be one of none, optional, required",
        ),
        ("rediss://h/0?ssl_keyfile=/k.pem", "a client key needs its certificate"),
        ("redis+sentinel://10.0.0.1:26379", "no master service name: expected redis+sentinel://"),
        ("redis+sentinel:///mymaster", "no sentinel address"),
        ("redis+sentinel://h1:26379,:26379/mymaster", "bad sentinel address ':26379': no host"),
        ("redis+sentinel://h1:2637x/mymaster", "bad sentinel address 'h1:2637x': port must be"),
        ("redis+sentinel://h1:0/mymaster", "port must be 1-65535"),
        ("redis+sentinel://::1:26379/mymaster", "put IPv6 in brackets"),
        ("redis+sentinel://h1/mymaster/zero", "database must be a number, got 'zero'"),
        ("redis+sentinel://h1/mymaster/0/x", "too many path parts"),
        ("redis+sentinel://h1/mymaster?db=1", "unknown option 'db'"),
        ("redis+sentinel://h1/mymaster?sentinel_auth=maybe", "sentinel_auth must be yes or no"),
        ("redis+sentinel://h1/m?ssl_ca_certs=/ca", "needs a rediss+sentinel:// URL"),
        ("redis://[::1/0", "not a valid URL"),
        ("redis+cluster://", "no node address: expected redis+cluster://"),
        ("redis+cluster://h1:7000/3", "Redis Cluster has only database 0"),
        ("redis+cluster://h1,:7000", "bad node address ':7000': no host"),
        ("redis+cluster://h1?db=1", "unknown option 'db'"),
        ("redis+cluster://h1?ssl_ca_certs=/ca", "needs a rediss+cluster:// URL"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, message: str) -> None:
    [(field, text)] = connection_problems(url)
    assert field == "url" or field.startswith("ssl_")  # the URL, or one of its options
    assert message in text


@pytest.mark.parametrize(
    ("url", "tls", "field", "message"),
    [
        ("redis://h/0", TlsOptions(ca="/ca.pem"), "ca", "TLS options need a rediss:// URL"),
        ("unix:///s.sock", TlsOptions(verify="none"), "verify", "need a rediss:// URL"),
        ("redis+sentinel://h/m", TlsOptions(ca="/c"), "ca", "need a rediss+sentinel:// URL"),
        ("rediss://h/0?ssl_ca_certs=/a", TlsOptions(ca="/b"), "ca", "not both"),
        ("rediss://h/0?ssl_check_hostname=no", TlsOptions(verify="ca"), "verify", "not both"),
        ("rediss://h/0", TlsOptions(key="/k.pem"), "key", "needs its certificate"),
        ("rediss://h/0", TlsOptions(ca=""), "ca", "expected the path of a PEM file"),
    ],
)
def test_tls_options_that_do_not_fit_the_url(
    url: str, tls: TlsOptions, field: str, message: str
) -> None:
    [(got_field, text)] = connection_problems(url, tls)
    assert got_field == field
    assert message in text


# ---- the [redis] keys ----


def test_tls_keys_decode_and_default_to_unset(pki: Pki) -> None:
    assert RedisConfig().tls == TlsOptions()
    config = parse_config(
        f'[redis]\nurl = "rediss://redis.internal:6380/0"\ntls_ca = "{pki.ca}"\n'
        f'tls_cert = "{pki.client_cert}"\ntls_key = "{pki.client_key}"\ntls_verify = "ca"\n'
    )
    assert config.redis.tls == TlsOptions(
        ca=str(pki.ca), cert=str(pki.client_cert), key=str(pki.client_key), verify="ca"
    )


def test_sentinel_url_is_accepted() -> None:
    config = parse_config('[redis]\nurl = "redis+sentinel://s1:26379,s2:26379/mymaster/0"\n')
    assert config.redis.url.startswith("redis+sentinel://")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '[redis]\nurl = "ftp://h/0"\n',
            "config.toml:2: redis.url: expected a redis://, rediss://, unix://, "
            "redis+sentinel://, rediss+sentinel://, redis+cluster:// or rediss+cluster:// URL, "
            "or 'embedded'",
        ),
        (
            '[redis]\nurl = "redis+sentinel://s1:26379"\n',
            "config.toml:2: redis.url: no master service name: expected "
            "redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]",
        ),
        (
            '[redis]\nurl = "redis://h:6379/0"\nnamespace = "atd"\ntls_ca = "/etc/ca.pem"\n',
            "config.toml:4: redis.tls_ca: TLS options need a rediss:// URL, "
            "but the URL is redis://",
        ),
        (
            '[redis]\nurl = "rediss://h/0?ssl_certfile=/c.pem"\ntls_cert = "/d.pem"\n',
            "config.toml:3: redis.tls_cert: set it here or as ssl_certfile in the URL, not both",
        ),
        (
            '[redis]\nurl = "rediss://h/0"\ntls_key = "/k.pem"\n',
            "config.toml:3: redis.tls_key: a client key needs its certificate",
        ),
        (
            '[redis]\nurl = "embedded"\ntls_verify = "none"\n',
            "config.toml:3: redis.tls_verify: the embedded server speaks plain TCP",
        ),
        (
            '[redis]\nurl = "rediss://h/0"\ntls_verify = "strict"\n',
            "config.toml:3: redis.tls_verify: invalid enum value 'strict'",
        ),
    ],
)
def test_config_errors_name_the_key_and_line(text: str, expected: str) -> None:
    assert error_of(text).startswith(expected)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "redis+sentinel://app:hunter2@s1:26379,s2:26379/mymaster/0",
            "redis+sentinel://app:***@s1:26379,s2:26379/mymaster/0",
        ),
        ("redis+sentinel://:hunter2@[::1]:26379/m", "redis+sentinel://:***@[::1]:26379/m"),
        (
            "rediss+sentinel://s1/m?ssl_password=hunter2&sentinel_auth=yes",
            "rediss+sentinel://s1/m?ssl_password=***&sentinel_auth=yes",
        ),
    ],
)
def test_sentinel_passwords_are_masked(url: str, shown: str) -> None:
    assert parse_config(f'[redis]\nurl = "{url}"\n').redacted()["redis"]["url"] == shown


def test_a_url_too_broken_to_parse_still_loses_its_password() -> None:
    from asynctaskd.config.redaction import _mask_url

    assert (
        _mask_url("redis+sentinel://app:hunter2@[::1,s2/m") == "redis+sentinel://app:***@[::1,s2/m"
    )


# ---- TLS files are read when a client is made ----

Open = Callable[[str, TlsOptions], Any]


def _open_async(url: str, tls: TlsOptions) -> Any:
    return open_async(url, tls)


def _open_sync(url: str, tls: TlsOptions) -> Any:
    return open_sync(url, tls)


OPENERS = pytest.mark.parametrize("open_client", [_open_async, _open_sync], ids=["async", "sync"])


def _broken_files(pki: Pki, tmp: Path) -> dict[str, Path]:
    garbage = tmp / "garbage.pem"
    garbage.write_text("not a PEM file\n")
    encrypted = tmp / "encrypted.key"
    subprocess.run(
        ["openssl", "pkey", "-in", str(pki.client_key), "-aes256", "-passout", "pass:secret",
         "-out", str(encrypted)],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return {"garbage": garbage, "encrypted": encrypted, "missing": tmp / "missing.pem"}


@OPENERS
def test_tls_files_are_checked_when_a_client_is_made(
    open_client: Open, pki: Pki, tmp_path: Path
) -> None:
    files = _broken_files(pki, tmp_path)
    url = "rediss://redis.internal:6380/0"
    cert, key = str(pki.client_cert), str(pki.client_key)
    cases: list[tuple[TlsOptions, str]] = [
        (TlsOptions(ca=str(files["missing"])), "redis.tls_ca: cannot read"),
        (TlsOptions(ca=str(files["garbage"])), "redis.tls_ca: '"),
        (TlsOptions(cert=str(files["garbage"]), key=key), "redis.tls_cert: '"),
        (TlsOptions(cert=cert, key=str(files["garbage"])), "redis.tls_key: '"),
        (TlsOptions(cert=cert, key=str(files["missing"])), "redis.tls_key: cannot read"),
        (TlsOptions(cert=cert, key=str(tmp_path)), "redis.tls_key: cannot read"),
        (TlsOptions(cert=cert, key=str(pki.server_key)), "is not the key of the certificate"),
        (TlsOptions(cert=cert), "holds no private key: set its key file too"),
        (TlsOptions(cert=cert, key=str(files["encrypted"])), "not an unencrypted PEM private key"),
    ]
    for tls, message in cases:
        assert message in _message(open_client, url, tls), tls
    assert "missing.pem" in _message(open_client, url, TlsOptions(ca=str(files["missing"])))
    assert "holds no PEM certificate" in _message(
        open_client, url, TlsOptions(ca=str(files["garbage"]))
    )


def _message(open_client: Open, url: str, tls: TlsOptions) -> str:
    with pytest.raises(ConfigError) as info:
        open_client(url, tls)
    return str(info.value)


@OPENERS
def test_tls_files_in_the_url_are_checked_too(open_client: Open, pki: Pki, tmp_path: Path) -> None:
    missing = tmp_path / "missing-ca.pem"
    message = _message(open_client, f"rediss://h:6380/0?ssl_ca_certs={missing}", TlsOptions())
    assert message.startswith("Redis URL option ssl_ca_certs: cannot read")
    # through Sentinel too
    message = _message(
        open_client,
        f"rediss+sentinel://s1/m?ssl_certfile={pki.client_cert}&ssl_keyfile={pki.server_key}",
        TlsOptions(),
    )
    assert message.startswith("Redis URL option ssl_keyfile:") and "is not the key" in message


_READ_KEY = """
import sys
from asynctaskd.connection import TlsOptions, open_sync
from asynctaskd.errors import ConfigError
try:
    open_sync("rediss://h/0", TlsOptions(cert=sys.argv[1], key=sys.argv[2]))
except ConfigError as exc:
    print(exc)
"""


def _without_file_override() -> None:
    """In the child, before exec: give up root's right to read any file (the bounding set
    loses CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, so the exec'd process never has them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_an_unreadable_key_is_named(pki: Pki, tmp_path: Path) -> None:
    """Root reads files whatever their mode, so the check runs in a process that gave up
    that right."""
    key = tmp_path / "client.key"
    key.write_bytes(pki.client_key.read_bytes())
    key.chmod(0)
    out = subprocess.run(
        [sys.executable, "-c", _READ_KEY, str(pki.client_cert), str(key)],
        preexec_fn=_without_file_override if os.geteuid() == 0 else None,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.startswith("redis.tls_key: cannot read") and "Permission denied" in out, out


def test_an_encrypted_key_opens_with_its_password_from_the_url(pki: Pki, tmp_path: Path) -> None:
    files = _broken_files(pki, tmp_path)
    url = (
        f"rediss://h/0?ssl_certfile={pki.client_cert}&ssl_keyfile={files['encrypted']}"
        "&ssl_password=secret"
    )
    open_sync(url).close()  # opens, and the wrong password is named:
    message = _message(_open_sync, url.replace("=secret", "=wrong"), TlsOptions())
    assert "ssl_keyfile" in message, message


def test_bad_urls_raise_config_error_from_the_clients() -> None:
    with pytest.raises(ConfigError, match="Redis URL: no master service name"):
        Client.from_url("redis+sentinel://127.0.0.1:26379")
    with pytest.raises(ConfigError, match="Redis URL: unknown scheme"):
        AsyncClient.from_url("valkey://127.0.0.1:6379/0")


# ---- what the clients are made of ----


async def test_plain_urls_keep_the_waiting_pool() -> None:
    client = open_async(
        "redis://app@127.0.0.1:6390/2",
        credentials={"username": "env-user", "password": "env-pw"},
        max_connections=7,
        socket_timeout=3.0,
    )
    try:
        pool = client.connection_pool
        assert isinstance(pool, redis.asyncio.BlockingConnectionPool)
        assert pool.max_connections == 7 and pool.timeout is None
        kwargs = pool.connection_kwargs
        assert kwargs["socket_timeout"] == 3.0 and kwargs["health_check_interval"] == 30
        # the URL's user wins over the environment's, as redis-py does it
        assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("app", "env-pw", 2)
    finally:
        await client.aclose()


async def test_sentinel_urls_wait_for_a_connection_too(pki: Pki) -> None:
    client = open_async(
        f"rediss+sentinel://u:pw@s1:26379,s2/mymaster/4?sentinel_auth=yes&ssl_ca_certs={pki.ca}",
        TlsOptions(verify="ca"),
        max_connections=9,
    )
    try:
        pool: Any = client.connection_pool
        assert isinstance(pool, redis.asyncio.BlockingConnectionPool)
        assert pool.max_connections == 9 and pool.timeout is None
        assert pool.service_name == "mymaster" and pool.is_master
        kwargs = pool.connection_kwargs
        assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("u", "pw", 4)
        assert kwargs["ssl_ca_certs"] == str(pki.ca) and kwargs["ssl_check_hostname"] is False
        manager = pool.sentinel_manager
        addresses = [
            (
                s.connection_pool.connection_kwargs["host"],
                s.connection_pool.connection_kwargs["port"],
            )
            for s in manager.sentinels
        ]
        assert addresses == [("s1", 26379), ("s2", 26379)]
        sentinel_kwargs = manager.sentinels[0].connection_pool.connection_kwargs
        assert sentinel_kwargs["password"] == "pw"  # sentinel_auth=yes
        assert sentinel_kwargs["ssl_ca_certs"] == str(pki.ca)
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6390/0", "redis+cluster://127.0.0.1:7000", "unix:///tmp/r.sock"]
)
async def test_only_sentinel_clients_have_a_master_to_follow(url: str) -> None:
    client = open_async(url)
    try:
        assert master_address(client) is None
        with anyio.fail_after(1):
            await follow_master(client, 0.01)  # returns at once: nothing to follow
    finally:
        await client.aclose()


def test_sentinels_get_no_password_unless_asked() -> None:
    client = open_sync("redis+sentinel://s1/mymaster", credentials={"password": "pw"})
    try:
        pool: Any = client.connection_pool
        assert pool.connection_kwargs["password"] == "pw"
        sentinel = pool.sentinel_manager.sentinels[0]
        assert sentinel.connection_pool.connection_kwargs.get("password") is None
    finally:
        client.close()


def test_sync_client_over_tls_takes_url_options(pki: Pki) -> None:
    client = open_sync(f"rediss://localhost:6380/0?{pki.client_query()}")
    try:
        kwargs = client.connection_pool.connection_kwargs
        assert kwargs["ssl_ca_certs"] == str(pki.ca)
        assert kwargs["ssl_certfile"] == str(pki.client_cert)
        assert isinstance(client, redis.Redis)
    finally:
        client.close()
