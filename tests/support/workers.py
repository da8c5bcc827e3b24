"""Real ``celery worker`` subprocesses for tests: start, wait, stop, kill -9, read their logs.

Shared by the worker integration tests (tests/integration/worker) and the fault-injection
suite (tests/faults). Workers are started with ``subprocess.Popen``, waited for against a
deadline, stopped with SIGTERM then SIGKILL; a conftest prints their logs when a test fails.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.polling import wait_until

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT = 30.0


def leases_cli(app: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A <app> leases <args>`` as an operator runs it, from the repository root (no
    input, 60 s at most); the caller checks its exit code."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", app, "leases", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        input="",
        check=False,
    )


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc), zombies excluded."""
    out: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[1] == str(pid) and fields[0] not in ("Z", "X"):
            out.append(int(entry.name))
    return sorted(out)


def zombie(pid: int) -> bool:
    """True if ``pid`` is a zombie or gone (it runs no code any more)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def worker_argv(
    app: str, pool: str, concurrency: int, hostname: str, extra: Sequence[str] = ()
) -> list[str]:
    """The command line of a ``celery worker`` of ``app`` without gossip, mingle, heartbeat."""
    return [
        sys.executable, "-m", "celery", "-A", app, "worker",
        "-P", pool, "-c", str(concurrency), "-n", hostname,
        "--without-gossip", "--without-mingle", "--without-heartbeat",
        "-l", "info", *extra,
    ]  # fmt: skip


@dataclass
class WorkerProc:
    """One ``celery worker`` subprocess (started again with ``start()`` under the same name)."""

    hostname: str
    pool: str
    log_path: Path
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    logs: list[Path] = field(default_factory=list)

    def start(self, *, wait: bool = True) -> WorkerProc:
        self.starts += 1
        path = self.log_path.with_suffix(f".{self.starts}.log")
        self.logs.append(path)
        with open(path, "wb") as out:
            self.proc = subprocess.Popen(
                self.argv, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        self.wait_for_log("ready.", timeout)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.logs if p.exists())

    def current_log(self) -> str:
        return self.logs[-1].read_text(errors="replace") if self.logs else ""

    def wait_for_log(self, text: str, timeout: float) -> None:
        def seen() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(
                    f"worker {self.hostname} exited with {self.proc.returncode}:\n"
                    + self.current_log()[-4000:]
                )
            return text in self.current_log()

        wait_until(seen, timeout, f"{text!r} in the log of {self.hostname}")

    def children(self) -> list[int]:
        return children_of(self.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.send_signal(sig)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(10)

    def kill9(self) -> None:
        """SIGKILL the main process; its pool children die with it (pdeathsig)."""
        assert self.proc is not None
        kids = self.children()
        self.proc.kill()
        self.proc.wait(10)
        for kid in kids:
            wait_until(functools.partial(zombie, kid), 10, f"child {kid} to die")


def kill_whole_worker(worker: WorkerProc) -> list[int]:
    """SIGKILL a worker's main process, then its pool children; wait until all are gone.

    The main process goes first: alive, it would see a child die and reap its leases itself.
    Returns the pids that were killed.
    """
    kids = worker.children()
    os.kill(worker.pid, signal.SIGKILL)
    for kid in kids:
        try:
            os.kill(kid, signal.SIGKILL)
        except ProcessLookupError:
            continue  # already gone with its parent
    assert worker.proc is not None
    worker.proc.wait(10)
    for kid in kids:
        wait_until(functools.partial(zombie, kid), 10, f"{kid} to die")
    return [worker.pid, *kids]


@contextmanager
def worker_factory(
    item: pytest.Item, app: str, env: dict[str, str], logs: Path, letter: str = "w"
) -> Iterator[Callable[..., WorkerProc]]:
    """``start(pool="prefork", concurrency=2, hostname=None, env=None, extra=None, wait=True)``
    starts a worker of ``app``; every one is stopped on exit, its log printed if ``item`` failed.
    """
    workers: list[WorkerProc] = []

    def start(
        pool: str = "prefork",
        concurrency: int = 2,
        hostname: str | None = None,
        env: dict[str, str] | None = None,
        extra: list[str] | None = None,
        wait: bool = True,
    ) -> WorkerProc:
        n = len(workers)
        name = hostname or f"{letter}{n}-{pool}-{os.getpid()}@{socket.gethostname()}"
        w = WorkerProc(
            hostname=name,
            pool=pool,
            log_path=logs / f"worker-{n}",
            argv=worker_argv(app, pool, concurrency, name, extra or []),
            env={**base_env, **(env or {})},
        )
        workers.append(w)
        return w.start(wait=wait)

    base_env = env
    try:
        yield start
    finally:
        for w in workers:
            w.stop()
        write_logs_if_failed(item, workers)


def write_logs_if_failed(item: pytest.Item, workers: Sequence[WorkerProc]) -> None:
    """Print the workers' logs to stderr if the test's set-up or call failed."""
    failed = any(
        getattr(item, f"rep_{when}", None) is not None and getattr(item, f"rep_{when}").failed
        for when in ("setup", "call")
    )
    if failed:
        for w in workers:
            sys.stderr.write(f"\n===== log of worker {w.hostname} ({w.pool}) =====\n")
            sys.stderr.write(w.log()[-20000:])


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keep each phase's report on the item (``item.rep_setup``, ``item.rep_call``...).

    A conftest imports this hook to use :func:`write_logs_if_failed`.
    """
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{report.when}", report)


def amqp_url_or_skip() -> str:
    """RabbitMQ URL for broker tests; skipped when nothing answers (a failure under CI)."""
    url = os.environ.get("CELERY_LEASES_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1):
            pass
    except OSError:
        if os.environ.get("CI"):
            pytest.fail("RabbitMQ does not answer on 127.0.0.1:5672 (CI is set)")
        pytest.skip("RabbitMQ does not answer on 127.0.0.1:5672")
    return url
