"""Private servers for the connection tests: a test PKI (openssl), TLS-only servers, sentinels.

Every server listens on a free loopback port and is stopped by PID (ServerProcess).
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

import pytest
from redis import Redis as SyncRedis

from asynctaskd.embedded import ServerProcess, find_binary, free_port

SERVICE = "mymaster"


class Pki:
    """A throwaway CA, a server certificate, a client certificate, and an unrelated CA."""

    def __init__(self, directory: Path, server_names: str) -> None:
        self.dir = directory
        self.server_names = server_names
        self.ca = directory / "ca.crt"
        self.server_cert = directory / "server.crt"
        self.server_key = directory / "server.key"
        self.client_cert = directory / "client.crt"
        self.client_key = directory / "client.key"
        self.other_ca = directory / "other-ca.crt"

    def client_query(self) -> str:
        """The URL options of a client that trusts the CA and shows its certificate."""
        return (
            f"ssl_ca_certs={self.ca}&ssl_certfile={self.client_cert}&ssl_keyfile={self.client_key}"
        )

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.check_hostname = False
        context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context


def _openssl(*args: str) -> None:
    proc = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {proc.stderr}")


def make_pki(directory: Path, server_names: str = "DNS:localhost,IP:127.0.0.1") -> Pki:
    """EC P-256 certificates valid for two days, made with the openssl command.

    `server_names` is the server certificate's subjectAltName. Every leaf certificate may
    act as client and server, because Redis presents its server certificate when it
    connects to a master (replication, Sentinel) over TLS.
    """
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory, server_names)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for name in ("ca", "other-ca"):
        _openssl(
            "req", "-x509", "-new", *key, "-days", "2",
            "-keyout", str(directory / f"{name}.key"), "-out", str(directory / f"{name}.crt"),
            "-subj", f"/CN=asynctaskd test {name}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip
    for name, names in (("server", server_names), ("client", "DNS:asynctaskd-client")):
        extensions = directory / f"{name}.ext"
        extensions.write_text(
            f"subjectAltName={names}\n"
            "basicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature\n"
            "extendedKeyUsage=serverAuth,clientAuth\n"
            "authorityKeyIdentifier=keyid,issuer\n"
            "subjectKeyIdentifier=hash\n"
        )
        csr = directory / f"{name}.csr"
        _openssl(
            "req", "-new", *key, "-keyout", str(directory / f"{name}.key"), "-out", str(csr),
            "-subj", f"/CN=asynctaskd test {name}",
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", str(csr), "-days", "2",
            "-CA", str(pki.ca), "-CAkey", str(directory / "ca.key"), "-CAcreateserial",
            "-extfile", str(extensions), "-out", str(directory / f"{name}.crt"),
        )  # fmt: skip
    return pki


class NoTls(Exception):
    """The server binary was built without TLS."""


class PrivateServer(ServerProcess):
    """A server on loopback that may require a password, and with `pki` listens on a TLS
    port only (`--port 0`) and requires client certificates.

    `start()` raises NoTls if TLS was asked for and the binary has no TLS support.
    """

    def __init__(
        self, binary: Path, pki: Pki | None = None, *, extra_args: tuple[str, ...] = ()
    ) -> None:
        super().__init__(binary, extra_args=extra_args)
        self.pki = pki
        self.tls_port = free_port() if pki is not None else 0

    @property
    def listen_port(self) -> int:
        return self.tls_port or self.port

    @property
    def url(self) -> str:
        if self.pki is not None:
            return f"rediss://localhost:{self.tls_port}/0"
        return f"redis://127.0.0.1:{self.port}/0"

    def _argv(self) -> list[str]:
        return [*super()._argv(), *self._tls_args()]

    def _tls_args(self) -> list[str]:
        if self.pki is None:
            return []
        return [
            "--port", "0",
            "--tls-port", str(self.tls_port),
            "--tls-cert-file", str(self.pki.server_cert),
            "--tls-key-file", str(self.pki.server_key),
            "--tls-ca-cert-file", str(self.pki.ca),
        ]  # fmt: skip

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                log = self.data_dir / "server.log"
                text = log.read_text() if log.exists() else ""
                if "TLS support" in text or "connection type tls" in text:
                    raise NoTls(f"{self.binary} is built without TLS support")
                raise RuntimeError(f"{self.binary} exited at start: {text[-2000:]}")
            if answers(self.listen_port, self.pki):
                return
            time.sleep(0.02)
        raise RuntimeError(f"{self.binary} did not answer on port {self.listen_port} in {timeout}s")


def answers(port: int, pki: Pki | None = None) -> bool:
    """The server answers PING (or refuses it for want of a password)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as raw:
            s = raw if pki is None else pki.context().wrap_socket(raw)
            with s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def start_server(binary_name: str, pki: Pki | None = None, *extra_args: str) -> PrivateServer:
    """Start a server, or skip the test if the binary is missing or has no TLS."""
    binary = find_binary(binary_name)
    if binary is None:
        pytest.skip(f"{binary_name} is not installed")
    server = PrivateServer(binary, pki, extra_args=extra_args)
    try:
        return server.start()
    except NoTls:
        server.stop()
        pytest.skip(f"{binary_name} is built without TLS support")
    except BaseException:
        server.stop()
        raise


class SentinelProcess(PrivateServer):
    """`<binary> sentinel.conf --sentinel` watching SERVICE, with short failure timers.

    With `pki` it listens on TLS only and talks TLS to the servers (`tls-replication`);
    `conf` lines are appended to the generated config (passwords).
    """

    def __init__(
        self,
        binary: Path,
        master_port: int,
        pki: Pki | None = None,
        *,
        quorum: int = 1,
        conf: tuple[str, ...] = (),
    ) -> None:
        super().__init__(binary, pki)
        self.master_port = master_port
        self.quorum = quorum
        self.conf = conf

    def _argv(self) -> list[str]:
        lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            f"dir {self.data_dir}",
            f"logfile {self.data_dir / 'server.log'}",
        ]
        tls = self._tls_args()
        lines += [f"{tls[i][2:]} {tls[i + 1]}" for i in range(0, len(tls), 2)]
        if self.pki is not None:
            lines.append("tls-replication yes")
        lines += [
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.master_port} {self.quorum}",
            f"sentinel down-after-milliseconds {SERVICE} 500",
            f"sentinel failover-timeout {SERVICE} 5000",
            *self.conf,
        ]
        path = self.data_dir / "sentinel.conf"
        path.write_text("\n".join(lines) + "\n")
        return [str(self.binary), str(path), "--sentinel"]

    def client(self) -> SyncRedis:
        """A plain connection to this sentinel (no TLS, no password)."""
        return SyncRedis(host="127.0.0.1", port=self.port, socket_timeout=5)
