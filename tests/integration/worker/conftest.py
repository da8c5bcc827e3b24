"""Real ``celery worker`` subprocesses for the worker integration tests.

Each test gets its own queue and key prefix; workers are started with ``subprocess.Popen``,
waited for against a deadline, stopped with SIGTERM then SIGKILL, and their logs are printed
when the test fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis

from celery_leases import Leases
from celery_leases._redis_server import url_answers
from tests.polling import wait_until

REPO = Path(__file__).resolve().parents[3]
APP = "tests.integration.worker.wapp"
READY_TIMEOUT = 30.0


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


@dataclass
class WorkerProc:
    """One ``celery worker`` subprocess."""

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
            self.wait_for_log("ready.", READY_TIMEOUT)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

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
            wait_until(
                lambda k=kid: not Path(f"/proc/{k}").exists() or _zombie(k),
                10,
                f"child {kid} to die",
            )


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def queue(leases_prefix: str) -> str:
    """The queue of this test's workers."""
    return f"q-{leases_prefix}"


@pytest.fixture
def worker_env(leases_redis_url: str, leases_prefix: str, queue: str) -> dict[str, str]:
    """Environment for this test's workers (copy and change it per worker as needed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_LEASES_")}
    env.update(
        {
            "LEASES_TEST_BROKER": leases_redis_url,
            "LEASES_TEST_BACKEND": leases_redis_url,
            "LEASES_TEST_LEDGER": leases_redis_url,
            "LEASES_TEST_QUEUE": queue,
            "CELERY_LEASES_REDIS_URL": leases_redis_url,
            "CELERY_LEASES_KEY_PREFIX": leases_prefix,
            "CELERY_LEASES_TTL": "3",
            "CELERY_LEASES_RETRY_DELAY": "0.2",
            "CELERY_LEASES_RETRY_MAX_DELAY": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


@pytest.fixture
def start_worker(
    request: pytest.FixtureRequest, worker_env: dict[str, str], tmp_path: Path
) -> Iterator[Callable[..., WorkerProc]]:
    """Factory: ``start_worker(pool="prefork", concurrency=2, hostname=None, env=None)``."""
    workers: list[WorkerProc] = []

    def start(
        pool: str = "prefork",
        concurrency: int = 2,
        hostname: str | None = None,
        env: dict[str, str] | None = None,
        extra: list[str] | None = None,
        wait: bool = True,
    ) -> WorkerProc:
        name = hostname or f"w{len(workers)}-{pool}-{os.getpid()}@{socket.gethostname()}"
        argv = [
            sys.executable, "-m", "celery", "-A", APP, "worker",
            "-P", pool, "-c", str(concurrency), "-n", name,
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-l", "info", *(extra or []),
        ]  # fmt: skip
        w = WorkerProc(
            hostname=name,
            pool=pool,
            log_path=tmp_path / f"worker-{len(workers)}",
            argv=argv,
            env={**worker_env, **(env or {})},
        )
        workers.append(w)
        return w.start(wait=wait)

    yield start
    for w in workers:
        w.stop()
    failed = any(
        getattr(request.node, f"rep_{when}", None) is not None
        and getattr(request.node, f"rep_{when}").failed
        for when in ("setup", "call")
    )
    if failed:
        for w in workers:
            sys.stderr.write(f"\n===== log of worker {w.hostname} ({w.pool}) =====\n")
            sys.stderr.write(w.log()[-20000:])


@pytest.fixture
def wapp(worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The test app module, imported in this process (to send tasks and read the ledger)."""
    for key in ("LEASES_TEST_BROKER", "LEASES_TEST_BACKEND", "LEASES_TEST_LEDGER"):
        os.environ.setdefault(key, worker_env[key])
    import tests.integration.worker.wapp as module

    monkeypatch.setattr(module, "PREFIX", worker_env["CELERY_LEASES_KEY_PREFIX"])
    return module


@dataclass
class Sender:
    """Sends tasks of the test app to this test's queue."""

    queue: str

    def __call__(self, task: Any, *args: Any, **kwargs: Any) -> Any:
        options = kwargs.pop("_options", {})
        return task.apply_async(args, kwargs, queue=self.queue, **options)


@pytest.fixture
def send(queue: str) -> Sender:
    """``send(task, *args, **kwargs)`` -> AsyncResult, on this test's queue."""
    return Sender(queue)


@pytest.fixture
def test_leases(make_leases: Callable[..., Leases]) -> Leases:
    """A Leases in the test process on the workers' prefix (to inspect and contend)."""
    return make_leases(ttl=3)


@pytest.fixture
def ledger(wapp: ModuleType, leases_redis_url: str) -> Iterator[Any]:
    """Read the ledger the tasks write."""
    client = redis.Redis.from_url(leases_redis_url, decode_responses=True)

    class Ledger:
        def key(self, *parts: object) -> str:
            return wapp.ledger_key(*parts)

        def overlaps(self) -> int:
            return int(client.get(self.key("overlaps")) or 0)

        def runs(self) -> int:
            return int(client.get(self.key("runs")) or 0)

        def tokens(self, resource: str) -> list[int]:
            return [int(t) for t in client.lrange(self.key("tokens", resource), 0, -1)]

        def events(self, name: str) -> list[str]:
            return list(client.lrange(self.key("events", name), 0, -1))

        def wait_event(self, name: str, timeout: float = 20.0) -> str:
            return str(wait_until(lambda: self.events(name), timeout, f"ledger event {name}")[0])

    yield Ledger()
    client.close()


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """RabbitMQ URL for broker tests; skipped when nothing answers (failure under CI)."""
    url = os.environ.get("CELERY_LEASES_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1):
            pass
    except OSError:
        if os.environ.get("CI"):
            pytest.fail("RabbitMQ does not answer on 127.0.0.1:5672 (CI is set)")
        pytest.skip("RabbitMQ does not answer on 127.0.0.1:5672")
    return url


__all__ = ["WorkerProc", "children_of", "url_answers", "wait_until"]


# --- restart/fault tests ---
def kill_whole_worker(worker: WorkerProc) -> None:
    """SIGKILL a worker's main process, then its pool children; wait until all are gone.

    The main process goes first: alive, it would see a child die and reap its leases itself.
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
        wait_until(lambda k=kid: not Path(f"/proc/{k}").exists() or _zombie(k), 10, f"{kid} to die")
