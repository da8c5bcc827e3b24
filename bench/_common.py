"""Shared helpers of the benchmarks: the Redis to run against, counters, statistics, output."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import redis
import redis.connection

from celery_leases._redis_server import RedisServer
from celery_leases._sync import lanes as _lanes
from tests.support.servers import ensure_server_binary

__all__ = (
    "CommandStats",
    "Row",
    "Worker",
    "WriteCounter",
    "format_rate",
    "machine_info",
    "median",
    "percentile",
    "redis_target",
    "render_markdown",
    "render_text",
    "replace_section",
    "server_version",
    "spawn_worker",
    "timed",
    "write_json",
    "write_text",
)

LOOPBACK_NAMES: Final = frozenset({"localhost", "localhost.localdomain"})


# --- the Redis under test ----------------------------------------------------------------------
def _is_loopback(url: str) -> bool:
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return True
    host = parts.hostname or ""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def redis_target(url: str | None) -> Iterator[tuple[str, bool]]:
    """Yield ``(url, private)``: a private server of our own, or ``url`` (loopback only).

    A private server means INFO commandstats counts our commands and nobody else's.

    Raises:
        SystemExit: ``url`` is not a loopback address, or does not answer.
    """
    if url is not None:
        if not _is_loopback(url):
            raise SystemExit(f"--redis-url must point at a loopback address, not {url!r}")
        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
        try:
            client.ping()
        except redis.RedisError as exc:
            raise SystemExit(f"--redis-url {url!r} does not answer: {exc}") from None
        finally:
            client.close()
        yield url, False
        return
    server = RedisServer(binary=ensure_server_binary())
    server.start()
    try:
        yield server.url, True
    finally:
        server.stop()


@dataclass(frozen=True)
class CommandStats:
    """One INFO commandstats snapshot: command -> (calls, usec)."""

    stats: dict[str, tuple[int, int]]

    @classmethod
    def take(cls, client: redis.Redis) -> CommandStats:
        info = client.info("commandstats")
        out: dict[str, tuple[int, int]] = {}
        for name, value in info.items():
            if isinstance(value, dict):
                out[str(name).removeprefix("cmdstat_")] = (
                    int(value.get("calls", 0)),
                    int(value.get("usec", 0)),
                )
        return cls(out)

    def calls_since(self, before: CommandStats, command: str) -> int:
        return self.stats.get(command, (0, 0))[0] - before.stats.get(command, (0, 0))[0]

    def usec_since(self, before: CommandStats, command: str) -> int:
        return self.stats.get(command, (0, 0))[1] - before.stats.get(command, (0, 0))[1]


class WriteCounter:
    """Counts client round trips: socket writes made by redis-py, per thread.

    While active it wraps ``send_packed_command`` of redis-py's connection class, the one call
    every command (single, pipelined or scripted) goes through to reach the socket, and
    ``celery_leases._lanes._direct``, the lanes' own write and read of one call. No client
    here pipelines, so each write is one command and one round trip; a pipeline counts once.
    Only threads that did a write appear; the heartbeat thread counts apart from the caller's.
    """

    def __init__(self) -> None:
        self._counts: Counter[int] = Counter()
        self._names: dict[int, str] = {}
        self._lock = threading.Lock()
        self._original: Any = None
        self._direct: Any = None
        self._owner: type = _send_owner()

    def __enter__(self) -> WriteCounter:
        original = self._owner.__dict__["send_packed_command"]
        direct = self._direct = _lanes._direct
        counts, names, lock = self._counts, self._names, self._lock

        def count() -> None:
            thread = threading.current_thread()
            with lock:
                counts[thread.ident or 0] += 1
                names[thread.ident or 0] = thread.name

        def send_packed_command(conn: Any, *args: Any, **kwargs: Any) -> Any:
            count()
            return original(conn, *args, **kwargs)

        def direct_call(conn: Any, sock: Any, parser: Any, packed: list[bytes]) -> Any:
            count()
            return direct(conn, sock, parser, packed)

        self._original = original
        self._owner.send_packed_command = send_packed_command  # type: ignore[attr-defined]
        _lanes._direct = direct_call
        return self

    def __exit__(self, *exc: object) -> None:
        self._owner.send_packed_command = self._original  # type: ignore[attr-defined]
        _lanes._direct = self._direct

    def of_thread(self, ident: int | None = None) -> int:
        """Writes made so far by the thread ``ident`` (default: the calling thread)."""
        with self._lock:
            return self._counts[threading.get_ident() if ident is None else ident]

    def of_name(self, name: str) -> int:
        """Writes made so far by threads called ``name``."""
        with self._lock:
            return sum(n for ident, n in self._counts.items() if self._names.get(ident) == name)


def _send_owner() -> type:
    for cls in redis.connection.Connection.__mro__:
        if "send_packed_command" in cls.__dict__:
            return cls
    raise RuntimeError("redis-py has no send_packed_command to count writes with")


# --- workers ------------------------------------------------------------------------------------
@dataclass
class Worker:
    """One ``celery worker`` subprocess of a benchmark."""

    pool: str
    concurrency: int
    hostname: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


def spawn_worker(
    app: str,
    pool: str,
    concurrency: int,
    hostname: str,
    log_path: Path,
    env: dict[str, str],
    cwd: Path,
) -> Worker:
    """Start ``celery -A app worker`` (no gossip, mingle or heartbeat), logging to ``log_path``;
    the caller waits until it answers a ping."""
    argv = [
        sys.executable, "-m", "celery", "-A", app, "worker",
        "-P", pool, "-c", str(concurrency), "-n", hostname,
        "--without-gossip", "--without-mingle", "--without-heartbeat",
        "-l", "warning",
    ]  # fmt: skip
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Worker(pool, concurrency, hostname, proc, log_path)


# --- statistics ---------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def percentile(values: Sequence[float], pct: float) -> float:
    """Linear-interpolated percentile (with 50 samples, p99 lies between the two largest)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * pct / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def format_rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def timed(fn: Callable[[], object], count: int) -> float:
    """Seconds that ``count`` calls of ``fn`` take."""
    start = time.perf_counter()
    for _ in range(count):
        fn()
    return time.perf_counter() - start


# --- output -------------------------------------------------------------------------------------
@dataclass
class Row:
    """One line of the result table."""

    part: str
    contender: str
    metric: str
    value: str
    ratio: str
    details: str
    target: str
    data: dict[str, Any] = field(default_factory=dict)


HEADERS: Final = ("part", "contender", "metric", "value", "ratio", "details", "target")


def _cells(row: Row) -> tuple[str, ...]:
    return (row.part, row.contender, row.metric, row.value, row.ratio, row.details, row.target)


def render_text(rows: Sequence[Row]) -> str:
    table = [HEADERS, *(_cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADERS))]
    lines = []
    for n, line in enumerate(table):
        cells = (cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_markdown(rows: Sequence[Row]) -> str:
    def esc(cell: str) -> str:
        return cell.replace("|", "\\|")

    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(esc(c) for c in _cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: str, payload: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(client: redis.Redis) -> dict[str, Any]:
    """What the numbers were measured on."""
    server = client.info("server")
    try:
        import hiredis

        parser = f"hiredis {hiredis.__version__}"
    except ImportError:
        parser = "pure-Python parser"
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "redis_py": f"{redis.__version__} ({parser})",
        "server": f"{server.get('redis_version', '?')} ({server.get('executable', '?')})",
        # other work on the machine at the start (1-minute load average; 0 is idle)
        "load": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def server_version(client: Any) -> str:
    """``redis_version`` from ``client.info("server")``; a cluster client's per-node replies too."""
    try:
        info = client.info("server")
    except Exception as exc:
        return f"? ({type(exc).__name__})"
    if isinstance(info, dict) and "redis_version" in info:
        return str(info["redis_version"])
    if isinstance(info, dict):  # redis-py's cluster client answers per node
        versions = sorted(
            {str(v.get("redis_version")) for v in info.values() if isinstance(v, dict)}
        )
        if versions:
            return ", ".join(versions)
    return "?"


def replace_section(path: Path, heading: str, section: str) -> None:
    """Replace the ``heading`` section (up to the next ``## ``) of the Markdown file ``path``.

    The section is appended when the page has none; ``section`` starts with ``heading``.
    """
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section.rstrip("\n") + "\n\n", text, count=1)
        text = text.rstrip("\n") + "\n"
    else:
        text = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
