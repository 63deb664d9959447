"""A local Redis Cluster from the same binaries: N masters (optionally a replica each).

Built with CLUSTER ADDSLOTSRANGE, CLUSTER MEET and CLUSTER REPLICATE over plain
connections, so it needs no redis-cli and works for redis-server and valkey-server
alike. Every node is a `ServerProcess` on a free loopback port, stopped by PID;
`extra_args` go to every node (an ACL file, say).
"""

from __future__ import annotations

from pathlib import Path

from redis import Redis
from redis.exceptions import RedisError

from asynctaskd.embedded import PortTaken, ServerProcess, free_port
from tests.conftest import wait_until_sync

SLOTS = 16384


class LocalCluster:
    def __init__(
        self, binary: Path, directory: Path, *, masters: int = 3, replicas: int = 0,
        aof: bool = True, node_timeout_ms: int = 2000, extra_args: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.masters: list[ServerProcess] = []
        self.replicas: list[ServerProcess] = []
        args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms),
                "--cluster-require-full-coverage", "no", *extra_args)  # fmt: skip
        self._bus: dict[str, int] = {}  # node name -> cluster bus port

        def node(name: str) -> ServerProcess:
            # an explicit bus port: the default (port + 10000) overflows for high ports
            bus = free_port()
            proc = ServerProcess(binary, data_dir=directory / name, aof=aof,
                                 extra_args=(*args, "--cluster-port", str(bus)))  # fmt: skip
            self._bus[name] = bus
            return proc

        self._node = node
        self.masters = [node(f"m{i}") for i in range(masters)]
        self.replicas = [node(f"r{i}") for i in range(masters * replicas)]

    @property
    def bus(self) -> dict[int, int]:
        """Client port -> cluster bus port, for each node as it is now."""
        return {n.port: self._bus[n.data_dir.name] for n in self.nodes}

    @property
    def nodes(self) -> list[ServerProcess]:
        return self.masters + self.replicas

    @property
    def url(self) -> str:
        """A redis+cluster:// URL naming every master as a seed."""
        seeds = ",".join(f"127.0.0.1:{m.port}" for m in self.masters)
        return f"redis+cluster://{seeds}"

    def start(self) -> LocalCluster:
        for group in (self.masters, self.replicas):
            for i, node in enumerate(group):
                group[i] = self._start_node(node)
        per = SLOTS // len(self.masters)
        for i, master in enumerate(self.masters):
            first = i * per
            last = SLOTS - 1 if i == len(self.masters) - 1 else first + per - 1
            with Redis(port=master.port) as r:
                r.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        first_port = self.masters[0].port
        for node in self.nodes[1:]:
            with Redis(port=node.port) as r:
                r.execute_command("CLUSTER", "MEET", "127.0.0.1", first_port, self.bus[first_port])
        wait_until_sync(lambda: all(self._knows_all(n) for n in self.nodes), "nodes to meet", 30)
        for i, replica in enumerate(self.replicas):
            master = self.masters[i % len(self.masters)]
            with Redis(port=master.port) as r:
                master_id = r.execute_command("CLUSTER", "MYID")
            with Redis(port=replica.port) as r:
                r.execute_command("CLUSTER", "REPLICATE", master_id)
        wait_until_sync(self.healthy, "cluster_state:ok on every node", 30)
        return self

    def _start_node(self, node: ServerProcess) -> ServerProcess:
        """Start a node; one whose bus port was taken before its bind (ServerProcess
        retries a taken client port itself) is made again with new ports."""
        for _ in range(3):
            try:
                return node.start()
            except PortTaken:
                (node.data_dir / "nodes.conf").unlink(missing_ok=True)  # names the old ports
                node = self._node(node.data_dir.name)
        return node.start()

    def _knows_all(self, node: ServerProcess) -> bool:
        with Redis(port=node.port) as r:
            lines = r.execute_command("CLUSTER", "NODES").decode().splitlines()
        return len(lines) == len(self.nodes) and not any("handshake" in x for x in lines)

    def healthy(self) -> bool:
        for node in self.nodes:
            if node.process is None or node.process.poll() is not None:
                continue
            try:
                with Redis(port=node.port, socket_timeout=1) as r:
                    info = r.execute_command("CLUSTER", "INFO").decode()
            except RedisError:
                return False
            if "cluster_state:ok" not in info:
                return False
        if self.replicas:
            for replica in self.replicas:
                if replica.process is None or replica.process.poll() is not None:
                    continue
                with Redis(port=replica.port) as r:
                    if r.info("replication").get("master_link_status") not in ("up", None):
                        return False
        return True

    def primary_of_slot(self, slot: int) -> ServerProcess:
        with Redis(port=self.masters[0].port) as r:
            for start, end, primary, *_ in r.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(primary[1])
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(slot)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
