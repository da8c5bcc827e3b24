"""A private Redis Cluster and a private Sentinel set on 127.0.0.1, for tests and benchmarks
(dev-only: not in the wheel).

- :class:`LocalCluster`: several ``redis-server --cluster-enabled yes`` processes joined with
  ``redis-cli --cluster create`` (``valkey-cli`` works too); its URL is ``redis+cluster://``.
- :class:`LocalSentinel`: one master, its replicas and several ``redis-server --sentinel``
  processes watching it; its URL is ``sentinel://...?master_name=...``.

With ``tls=ServerTLS(...)`` every process (data nodes, the cluster bus, replication, the
sentinels) speaks TLS only and requires client certificates; the URLs then carry the TLS
options (``rediss+cluster://...?ssl_ca_certs=...``, ``sentinel://...&ssl=true&sentinel_ssl=true``).

Both are context managers and stop every process they started.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import TYPE_CHECKING, Any, Final, cast

import redis

from celery_leases._redis_server import (
    HOST,
    RedisServer,
    ServerTLS,
    StartStop,
    free_port,
    probe_client,
)
from tests.support.servers import ensure_server_binary

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ("LocalCluster", "LocalSentinel")

_POLL: Final = 0.05


def _wait(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout:.0f}s")
        time.sleep(_POLL)


class LocalCluster(StartStop):
    """A Redis Cluster of ``masters`` primaries (and ``replicas`` replicas of each).

    Args:
        masters: primaries; the 16384 slots are split between them (at least 3).
        replicas: replicas per primary.
        node_timeout_ms: ``cluster-node-timeout``: how soon a silent node counts as failed.
        tls: TLS only, client certificates required, on the client ports and the cluster bus.
    """

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 0,
        *,
        node_timeout_ms: int = 2000,
        tls: ServerTLS | None = None,
    ) -> None:
        if masters < 3:
            raise ValueError("a Redis Cluster needs at least 3 primaries")
        self.servers: list[RedisServer] = []
        self._masters = masters
        self._replicas = replicas
        self._node_timeout_ms = node_timeout_ms
        self.tls = tls

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a seed; with TLS ``rediss+cluster://`` with
        the CA and the client certificate."""
        seeds = ",".join(f"{HOST}:{s.port}" for s in self.servers)
        if self.tls is not None:
            return f"rediss+cluster://{seeds}?{self.tls.url_query()}"
        return f"redis+cluster://{seeds}"

    def start(self) -> None:
        """Start the nodes, join them into one cluster and wait until every slot is served.

        Raises:
            RuntimeError: no ``redis-cli``/``valkey-cli``, or the cluster did not form.
        """
        binary = ensure_server_binary()
        cli = _cli_beside(binary)
        try:
            for _ in range(self._masters * (1 + self._replicas)):
                server = RedisServer(
                    _cluster_port(),
                    binary=binary,
                    extra_args=[
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", "nodes.conf",
                        "--cluster-node-timeout", str(self._node_timeout_ms),
                        *_TLS_PEERS["cluster"] * (self.tls is not None),
                    ],
                    tls=self.tls,
                )  # fmt: skip
                self.servers.append(server)
                server.start()
            argv = [
                cli, *_cli_tls(self.tls), "--cluster", "create",
                *(f"{HOST}:{s.port}" for s in self.servers),
                "--cluster-replicas", str(self._replicas),
                "--cluster-yes",
            ]  # fmt: skip
            result = subprocess.run(
                argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
            )
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stdout}{result.stderr}")
            _wait("the cluster did not serve every slot", self._formed, 30.0)
        except BaseException:
            self.stop()
            raise

    def _formed(self) -> bool:
        for server in self.servers:
            client = probe_client(server.url, 1.0)
            try:
                info = cast("dict[str, Any]", client.cluster("INFO"))  # parsed by redis-py
            finally:
                client.close()
            if info.get("cluster_state") != "ok":
                return False
            if int(info.get("cluster_slots_ok", 0)) != 16384:
                return False
            if int(info.get("cluster_known_nodes", 0)) != len(self.servers):
                return False
        return True

    def stop(self) -> None:
        """Stop every node."""
        servers, self.servers = self.servers, []
        for server in servers:
            server.stop()


class LocalSentinel(StartStop):
    """One master, ``replicas`` replicas and ``sentinels`` sentinels watching them.

    Args:
        master_name: the name the sentinels know the master by.
        replicas: replicas of the master.
        sentinels: sentinel processes; the quorum is a majority of them.
        down_after_ms: ``down-after-milliseconds``: how soon a silent master counts as down.
        failover_timeout_ms: ``failover-timeout``.
        tls: TLS only, client certificates required, on the data servers (replication too) and
            the sentinels, which talk TLS to the data servers and to each other.
    """

    def __init__(
        self,
        master_name: str = "leases-master",
        *,
        replicas: int = 1,
        sentinels: int = 3,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
        tls: ServerTLS | None = None,
    ) -> None:
        self.master_name = master_name
        self.tls = tls
        self.data: list[RedisServer] = []  # the first one starts as the master
        self.sentinel_ports: list[int] = []
        self._replicas = replicas
        self._sentinels = sentinels
        self._down_after_ms = down_after_ms
        self._failover_timeout_ms = failover_timeout_ms
        self._procs: list[subprocess.Popen[bytes]] = []
        self._dir: str | None = None

    @property
    def url(self) -> str:
        """``sentinel://`` with every sentinel and the master's name; with TLS also
        ``ssl=true&sentinel_ssl=true`` and the CA and the client certificate (for both)."""
        hosts = ",".join(f"{HOST}:{p}" for p in self.sentinel_ports)
        url = f"sentinel://{hosts}/0?master_name={self.master_name}"
        if self.tls is not None:
            url += f"&ssl=true&sentinel_ssl=true&{self.tls.url_query()}"
        return url

    def _url(self, port: int) -> str:
        """The URL of the one server (data server or sentinel) on ``port``."""
        if self.tls is not None:
            return f"rediss://{HOST}:{port}/0?{self.tls.url_query()}"
        return f"redis://{HOST}:{port}/0"

    def start(self) -> None:
        """Start the master, its replicas (in sync) and the sentinels (agreed on the master)."""
        binary = ensure_server_binary()
        self._dir = tempfile.mkdtemp(prefix="celery-leases-sentinel-")
        try:
            peers = _TLS_PEERS["replication"] * (self.tls is not None)
            master = RedisServer(binary=binary, extra_args=peers, tls=self.tls)
            self.data.append(master)
            master.start()
            for _ in range(self._replicas):
                replica = RedisServer(
                    binary=binary,
                    extra_args=[*peers, "--replicaof", HOST, str(master.port)],
                    tls=self.tls,
                )
                self.data.append(replica)
                replica.start()
            _wait("the replicas did not sync", lambda: self._in_sync(master), 30.0)
            quorum = self._sentinels // 2 + 1
            for i in range(self._sentinels):
                self._start_sentinel(binary, i, master.port, quorum)
            _wait("the sentinels did not agree", self._sentinels_agree, 30.0)
        except BaseException:
            self.stop()
            raise

    def _start_sentinel(self, binary: str, index: int, master_port: int, quorum: int) -> None:
        assert self._dir is not None
        port = free_port()
        workdir = os.path.join(self._dir, f"sentinel-{index}")
        os.mkdir(workdir)
        conf = os.path.join(workdir, "sentinel.conf")
        name = self.master_name
        with open(conf, "w") as fh:
            if self.tls is None:
                fh.write(f"port {port}\n")
            else:
                fh.write(f"port 0\ntls-port {port}\ntls-replication yes\n")
                args = self.tls.server_args()  # --name value pairs
                pairs = zip(args[::2], args[1::2], strict=True)
                fh.writelines(f"{key.removeprefix('--')} {value}\n" for key, value in pairs)
            fh.write(
                f"bind {HOST}\nprotected-mode no\ndir {workdir}\n"
                f"sentinel monitor {name} {HOST} {master_port} {quorum}\n"
                f"sentinel down-after-milliseconds {name} {self._down_after_ms}\n"
                f"sentinel failover-timeout {name} {self._failover_timeout_ms}\n"
                f"sentinel parallel-syncs {name} 1\n"
            )
        log = open(os.path.join(workdir, "sentinel.log"), "ab")  # noqa: SIM115 (kept by Popen)
        with log:
            proc = subprocess.Popen(
                [binary, conf, "--sentinel"], stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        self._procs.append(proc)
        self.sentinel_ports.append(port)
        _wait(
            f"sentinel on port {port} did not answer",
            lambda: _answers(self._url(port)),
            10.0,
        )

    def _in_sync(self, master: RedisServer) -> bool:
        info = _info(master.url, "replication")
        online = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
        return len([v for v in online if v.get("state") == "online"]) == self._replicas

    def master_port(self) -> int:
        """The port of the master the sentinels currently name."""
        return _named_master(self._url(self.sentinel_ports[0]), self.master_name)

    def master(self) -> RedisServer:
        """The data server the sentinels currently name as master."""
        port = self.master_port()
        return next(s for s in self.data if s.port == port)

    def _sentinels_agree(self) -> bool:
        expected = self.data[0].port
        for port in self.sentinel_ports:
            if _named_master(self._url(port), self.master_name) != expected:
                return False
            # every sentinel must know the replicas and the other sentinels
            client = probe_client(self._url(port), 1.0)
            try:
                state = cast("dict[str, Any]", client.sentinel_master(self.master_name))
            finally:
                client.close()
            if int(state.get("num-slaves", 0)) != self._replicas:
                return False
            if int(state.get("num-other-sentinels", 0)) != self._sentinels - 1:
                return False
        return True

    def wait_for_new_master(self, old_port: int, timeout: float = 60.0) -> RedisServer:
        """Wait until every sentinel names a master other than ``old_port`` and it takes writes."""

        def moved() -> bool:
            ports = {_named_master(self._url(p), self.master_name) for p in self.sentinel_ports}
            if ports == {old_port} or len(ports) != 1:
                return False
            return _info(self._url(ports.pop()), "replication").get("role") == "master"

        _wait("no new master was promoted", moved, timeout)
        return self.master()

    def stop(self) -> None:
        """Stop the sentinels, then the data servers, and remove the temp dir."""
        procs, self._procs = self._procs, []
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        data, self.data = self.data, []
        for server in data:
            server.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self.sentinel_ports = []


#: server arguments that make the servers talk TLS to each other (with TLS on)
_TLS_PEERS: Final = {
    "cluster": ["--tls-cluster", "yes", "--tls-replication", "yes"],
    "replication": ["--tls-replication", "yes"],
}


def _cli_tls(tls: ServerTLS | None) -> list[str]:
    """``redis-cli`` arguments for a TLS server (none without TLS)."""
    if tls is None:
        return []
    return [
        "--tls", "--cacert", tls.ca_certs,
        "--cert", tls.client_certfile, "--key", tls.client_keyfile,
    ]  # fmt: skip


def _named_master(sentinel_url: str, name: str) -> int:
    """The port of the master that the sentinel at ``sentinel_url`` names."""
    client = probe_client(sentinel_url, 1.0)
    try:
        addr = cast("tuple[str, int]", client.sentinel_get_master_addr_by_name(name))
    finally:
        client.close()
    return int(addr[1])


def _info(url: str, section: str) -> dict[str, Any]:
    client = probe_client(url, 1.0)
    try:
        return client.info(section)
    finally:
        client.close()


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 55535)
        if all(_port_free(p) for p in (port, port + 10000)):
            return port
    raise RuntimeError("no free port pair for a cluster node on 127.0.0.1")


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _answers(url: str) -> bool:
    client = probe_client(url, 0.5)
    try:
        return bool(client.ping())
    finally:
        client.close()


def _cli_beside(binary: str) -> str:
    """``redis-cli`` (or ``valkey-cli``) next to the server binary, else on PATH."""
    folder = os.path.dirname(binary)
    for name in ("redis-cli", "valkey-cli"):
        path = os.path.join(folder, name)
        if os.access(path, os.X_OK):
            return path
        found = shutil.which(name)
        if found is not None:
            return found
    raise RuntimeError(f"no redis-cli or valkey-cli beside {binary} or on PATH")
