"""What finalize may download: declared hosts, public addresses, what a resolver answers."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp.abc
import pytest

from asynctaskd.downloads import (
    DownloadFailed,
    DownloadRefused,
    Downloads,
    _PublicOnly,
    host_pattern,
    non_public,
)

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.0.0.1", "private"),
        ("172.16.5.4", "private"),
        ("192.168.1.1", "private"),
        ("fd12:3456::1", "private"),
        ("169.254.169.254", "link-local"),  # cloud metadata services
        ("fe80::1%eth0", "link-local"),
        ("::ffff:10.0.0.1", "private"),  # IPv4-mapped: judged as the IPv4 address
        ("::ffff:127.0.0.1", "loopback"),
        ("64:ff9b::a00:1", "private"),  # NAT64 of 10.0.0.1
        ("100.64.0.1", "not a public address"),  # carrier-grade NAT
        ("0.0.0.0", "private"),
        ("224.0.0.1", "not a public address"),  # multicast
        ("fec0::1", "not a public address"),  # site-local
    ],
)
def test_non_public_addresses_are_named(address: str, why: str) -> None:
    reason = non_public(address)
    assert reason is not None and why in reason


@pytest.mark.parametrize("address", ["8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_pass(address: str) -> None:
    assert non_public(address) is None


@pytest.mark.parametrize(
    ("entry", "normalised"),
    [
        ("Files.Example.com.", "files.example.com"),
        ("*.replicate.delivery", "*.replicate.delivery"),
        ("127.0.0.1", "127.0.0.1"),
        ("[::1]", "::1"),
        ("0:0:0:0:0:0:0:1", "::1"),
    ],
)
def test_host_patterns_are_normalised(entry: str, normalised: str) -> None:
    assert host_pattern(entry) == normalised


@pytest.mark.parametrize(
    "entry",
    ["https://a.example.com", "a.example.com:443", "a.example.com/files", "*", "*.*.example.com",
     "", "127.1", "2130706433", "0x7f.1", "exa mple.com", "a..b"],
)  # fmt: skip
def test_host_patterns_refuse_what_is_no_host(entry: str) -> None:
    with pytest.raises(ValueError, match="expected a host name"):
        host_pattern(entry)


def downloads(*hosts: str, allow_private: bool = False) -> Downloads:
    return Downloads([host_pattern(h) for h in hosts], allow_private=allow_private)


def test_check_matches_exact_hosts_and_subdomains_of_wildcards() -> None:
    d = downloads("files.example.com", "*.cdn.example.net")
    assert str(d.check("https://FILES.example.com./a.png")) == "https://files.example.com./a.png"
    d.check("https://x.cdn.example.net/a.png")
    d.check("https://y.x.cdn.example.net/a.png")
    refused = [
        "https://cdn.example.net/a",
        "https://example.com/a",
        "https://files.example.com.evil.test/a",
        "https://evilcdn.example.net/a",
    ]
    for url in refused:
        with pytest.raises(DownloadRefused, match="not among the hosts"):
            d.check(url)


def test_check_takes_the_download_templates_own_host() -> None:
    d = downloads()
    d.check("https://api.vendor.example/v1/files/f/content", also="api.vendor.example")
    with pytest.raises(DownloadRefused):
        d.check("https://other.example/v1/files/f/content", also="api.vendor.example")


@pytest.mark.parametrize(
    "url",
    ["http://127.1/x", "http://2130706433/x", "http://0x7f.1/x", "http://10.0.0.1/x",
     "http://[::ffff:7f00:1]/x"],
)  # fmt: skip
def test_check_refuses_an_address_in_any_spelling(url: str) -> None:
    # Numeric spellings are never taken for names; declared addresses are still checked.
    d = downloads("10.0.0.1", "::ffff:7f00:1")
    with pytest.raises(DownloadRefused):
        d.check(url)


def test_private_addresses_pass_when_allowed() -> None:
    d = downloads("10.0.0.1", allow_private=True)
    d.check("http://10.0.0.1:8080/x")


@pytest.mark.parametrize(
    "url", ["ftp://files.example.com/x", "/relative", "http://[::1/bad", "http://exa mple.com/x",
            "http://\x00/x", "http:///nohost", "http://h:99999/port"],
)  # fmt: skip
def test_check_fails_on_what_is_no_usable_url(url: str) -> None:
    with pytest.raises(DownloadFailed):
        downloads("files.example.com").check(url)


class Answers(aiohttp.abc.AbstractResolver):
    """A resolver double that answers fixed addresses."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = addresses

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[aiohttp.abc.ResolveResult]:
        return [
            {"hostname": host, "host": a, "port": port, "family": family, "proto": 0, "flags": 0}
            for a in self.addresses
        ]

    async def close(self) -> None:
        pass


@pytest.mark.parametrize(
    "addresses", [("10.0.0.7",), ("93.184.215.14", "10.0.0.7"), ("2606:2800::1", "fe80::1")]
)
async def test_the_resolver_refuses_a_name_with_any_non_public_address(
    addresses: tuple[str, ...],
) -> None:
    resolver = _PublicOnly(Answers(*addresses))
    with pytest.raises(OSError, match=r"'files\.example\.com' resolves to"):
        await resolver.resolve("files.example.com", 443)


async def test_the_resolver_returns_public_answers_as_they_are() -> None:
    inner: Any = Answers("93.184.215.14", "2606:2800::1")
    found = await _PublicOnly(inner).resolve("files.example.com", 443)
    assert [f["host"] for f in found] == ["93.184.215.14", "2606:2800::1"]


async def test_a_failure_message_never_shows_the_url() -> None:
    # aiohttp quotes the URL in its errors; a presigned URL carries its signature there.
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: zz\r\n\r\nhello")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with Downloads(["127.0.0.1"], allow_private=True) as d:
            url = d.check(f"http://127.0.0.1:{port}/f?X-Signature=sig-SECRET-0123")

            async def fetch() -> None:
                async with d.get(url, {}) as got:
                    async for _ in got.chunks():
                        pass

            with pytest.raises(DownloadFailed) as info:
                await fetch()
    finally:
        server.close()
        await server.wait_closed()
    assert "Content-Length" in str(info.value)  # what went wrong is still said
    assert "sig-SECRET-0123" not in str(info.value)
    assert "url=<url>" in str(info.value)
