"""Real ``celery beat`` replicas for the beat integration tests.

A :class:`BeatCluster` is a group of replicas of ``tests.integration.beat.beat_app`` that share a
key prefix and a queue on the test Redis; each replica has its own schedule file. No worker
consumes the queue, so every run the replicas send stays there as a message, stamped by the
sending replica (see ``beat_app``). A test reads them back with :meth:`BeatCluster.messages` and
reads what each replica decided from its log (:meth:`BeatProc.claims`, :meth:`BeatProc.skips`).
Replicas are stopped with SIGTERM, then SIGKILL; their logs are printed when a test fails.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest
import redis

from tests.integration.worker.conftest import wait_until

REPO = Path(__file__).resolve().parents[3]
APP = "tests.integration.beat.beat_app"
LEASED = "celery_leases.beat:LeasedScheduler"
SKEWED = f"{APP}:SkewedScheduler"
START_TIMEOUT = 30.0
#: the ``celery`` console script of this environment
CELERY_SCRIPT = str(Path(sys.executable).with_name("celery"))

_LINE = r"^\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): \w+/MainProcess\] "
CLAIMED_RE = re.compile(_LINE + r"leases: beat claimed (?P<entry>\S+) \((?P<run>[^)]*)\)$", re.M)
SKIPS_RE = re.compile(
    _LINE + r"leases: beat skips (?P<entry>\S+) \((?P<run>[^)]*)\): sent by (?P<winner>.+)$", re.M
)
SENDING_RE = re.compile(_LINE + r"Scheduler: Sending due task (?P<entry>\S+) ", re.M)
LEADER_RE = re.compile(_LINE + r"leases: beat replica (?P<replica>\S+) is the leader$", re.M)


def log_time(ts: str) -> float:
    """A log line's timestamp (local time, as Celery's formatter writes it) as epoch seconds."""
    return datetime.strptime(ts, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def run_id(run: str) -> int:
    """The run of a claim log line: the bucket of ``bucket N``, else the due time in epoch ms."""
    if run.startswith("bucket "):
        return int(run.split()[1])
    return round(datetime.fromisoformat(run).timestamp() * 1000)


@dataclass(frozen=True)
class Decision:
    """One replica's claim or skip of one run, from its log."""

    replica: str
    entry: str
    run: int
    at: float  # log time (epoch seconds)
    winner: str = ""


@dataclass(frozen=True)
class Sent:
    """One message a replica sent, as found in the queue."""

    task: str
    replica: str
    pid: int
    sent_ms: int  # Redis clock, read by the sender just before it published
    claim: str | None  # the entry's claim key ("<run> <replica name>") at that moment
    task_id: str

    @property
    def claimed_run(self) -> int | None:
        return None if self.claim is None else int(self.claim.split(" ", 1)[0])

    @property
    def claimed_by_pid(self) -> int | None:
        if self.claim is None:
            return None
        return int(self.claim.rsplit("/", 1)[1])


@dataclass
class BeatProc:
    """One ``celery beat`` subprocess."""

    label: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    killed_at_ms: int | None = None

    def start(self) -> BeatProc:
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                self.argv, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_for_log(self, text: str, timeout: float) -> None:
        def seen() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(
                    f"beat {self.label} exited with {self.proc.returncode}:\n{self.log()[-4000:]}"
                )
            return text in self.log()

        wait_until(seen, timeout, f"{text!r} in the log of beat {self.label}")

    def claims(self, entry: str) -> list[Decision]:
        return [
            Decision(self.label, m["entry"], run_id(m["run"]), log_time(m["ts"]))
            for m in CLAIMED_RE.finditer(self.log())
            if m["entry"] == entry
        ]

    def skips(self, entry: str) -> list[Decision]:
        return [
            Decision(self.label, m["entry"], run_id(m["run"]), log_time(m["ts"]), m["winner"])
            for m in SKIPS_RE.finditer(self.log())
            if m["entry"] == entry
        ]

    def sending(self, entry: str) -> list[float]:
        """Log times of this replica's ``Sending due task <entry>`` lines."""
        return [log_time(m["ts"]) for m in SENDING_RE.finditer(self.log()) if m["entry"] == entry]

    def leader_since(self) -> list[float]:
        return [log_time(m["ts"]) for m in LEADER_RE.finditer(self.log())]

    def kill9(self, now_ms: Callable[[], int]) -> int:
        """SIGKILL the replica; returns the Redis time (ms) read just before the signal."""
        assert self.proc is not None
        self.killed_at_ms = now_ms()
        self.proc.kill()
        self.proc.wait(10)
        return self.killed_at_ms

    def stop(self, timeout: float = 10.0) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@dataclass
class BeatCluster:
    """Beat replicas of ``beat_app`` sharing one key prefix and one queue on the test Redis."""

    redis_url: str
    prefix: str
    queue: str
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    replicas: dict[str, BeatProc] = field(default_factory=dict)
    _client: redis.Redis | None = None

    @property
    def client(self) -> redis.Redis:
        if self._client is None:
            self._client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        return self._client

    def redis_ms(self) -> int:
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def start(
        self,
        label: str,
        *,
        skew: float = 0.0,
        scheduler: str | None = None,
        env: dict[str, str] | None = None,
        console_script: bool = False,
    ) -> BeatProc:
        """Start replica ``label`` (not waiting for it); ``skew`` seconds off the real clock.

        ``console_script``: run it as the ``celery`` console script (argv[0] ``.../celery``, as
        in production) instead of ``python -m celery``.
        """
        base = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "LEASES_"))}
        full_env = {
            **base,
            "LEASES_BEAT_BROKER": self.redis_url,
            "LEASES_BEAT_QUEUE": self.queue,
            "LEASES_BEAT_REPLICA": label,
            "LEASES_BEAT_SKEW": str(skew),
            "CELERY_LEASES_REDIS_URL": self.redis_url,
            "CELERY_LEASES_KEY_PREFIX": self.prefix,
            "PYTHONUNBUFFERED": "1",
            **self.env,
            **(env or {}),
        }
        scheduler = scheduler or (SKEWED if skew else LEASED)
        command = [CELERY_SCRIPT] if console_script else [sys.executable, "-m", "celery"]
        argv = [
            *command, "-A", APP, "beat",
            "-S", scheduler, "-s", str(self.workdir / f"sched-{label}"),
            "--pidfile", "", "--max-interval", "1", "-l", "info",
        ]  # fmt: skip
        beat = BeatProc(label, argv, full_env, self.workdir / f"beat-{label}.log")
        self.replicas[label] = beat
        return beat.start()

    def wait_started(self, timeout: float = START_TIMEOUT) -> None:
        for beat in self.replicas.values():
            beat.wait_for_log("beat: Starting...", timeout)

    def messages(self) -> list[Sent]:
        """Every message in the queue, oldest send first."""
        out = []
        for raw in self.client.lrange(self.queue, 0, -1):
            message = json.loads(raw)
            headers = message["headers"]
            body = message["body"]
            if message["properties"].get("body_encoding") == "base64":
                body = base64.b64decode(body).decode()
            args, kwargs, _ = json.loads(body)
            assert args == [], f"unexpected arguments in {message}"
            assert kwargs == {}, f"unexpected arguments in {message}"
            out.append(
                Sent(
                    task=headers["task"],
                    replica=headers["x_replica"],
                    pid=int(headers["x_pid"]),
                    sent_ms=int(headers["x_sent_ms"]),
                    claim=headers["x_claim"],
                    task_id=headers["id"],
                )
            )
        return sorted(out, key=lambda s: s.sent_ms)

    def sent(self, task: str) -> list[Sent]:
        return [s for s in self.messages() if s.task == task]

    def claims(self, entry: str) -> list[Decision]:
        return sorted(
            (d for beat in self.replicas.values() for d in beat.claims(entry)),
            key=lambda d: d.at,
        )

    def skips(self, entry: str) -> list[Decision]:
        return [d for beat in self.replicas.values() for d in beat.skips(entry)]

    def by_pid(self, pid: int) -> str:
        for beat in self.replicas.values():
            if beat.proc is not None and beat.pid == pid:
                return beat.label
        raise AssertionError(f"no replica of this cluster has pid {pid}")

    def stop(self) -> None:
        for beat in self.replicas.values():
            beat.stop()

    def logs(self) -> str:
        return "".join(
            f"\n===== log of beat {b.label} (pid {b.pid}) =====\n{b.log()[-15000:]}"
            for b in self.replicas.values()
            if b.proc is not None
        )

    def close(self) -> None:
        """Stop the replicas and delete this cluster's queue (and kombu's keys for it)."""
        self.stop()
        try:
            self.client.delete(
                self.queue, f"_kombu.binding.{self.queue}", f"_kombu.binding_permanent.{self.queue}"
            )
        finally:
            self.client.close()


#: clusters whose logs are printed when the current test fails
_WATCHED: list[BeatCluster] = []


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed and _WATCHED:
        report.sections.append(("beat replica logs", "".join(c.logs() for c in _WATCHED)))


def open_cluster(redis_url: str, prefix: str, workdir: Path, **env: str) -> BeatCluster:
    """A cluster on ``prefix`` whose queue is ``q-<prefix>``; close it with ``close_cluster``."""
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = BeatCluster(redis_url, prefix, f"q-{prefix}", workdir, env=dict(env))
    _WATCHED.append(cluster)
    return cluster


def close_cluster(cluster: BeatCluster) -> None:
    cluster.close()
    if cluster in _WATCHED:
        _WATCHED.remove(cluster)


@pytest.fixture
def make_beat_cluster(
    leases_redis_url: str, leases_prefix: str, tmp_path: Path
) -> Iterator[Callable[..., BeatCluster]]:
    """Factory: ``make_beat_cluster(**env)`` -> a BeatCluster on this test's prefix."""
    made: list[BeatCluster] = []

    def make(**env: str) -> BeatCluster:
        prefix = f"{leases_prefix}-{len(made)}" if made else leases_prefix
        cluster = open_cluster(leases_redis_url, prefix, tmp_path / f"c{len(made)}", **env)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        close_cluster(cluster)


def time_passes_until(cluster: BeatCluster, until_ms: int, what: str) -> None:
    """Let the replicas run until the Redis clock reaches ``until_ms`` (a window to observe)."""
    left = (until_ms - cluster.redis_ms()) / 1000
    wait_until(lambda: cluster.redis_ms() >= until_ms, max(left, 0) + 5, what, step=0.1)


def gaps_ms(sends: list[Sent]) -> list[tuple[int, Sent, Sent]]:
    """(gap, earlier, later) between consecutive sends."""
    return [(b.sent_ms - a.sent_ms, a, b) for a, b in itertools.pairwise(sends)]


__all__ = [
    "LEASED",
    "SKEWED",
    "BeatCluster",
    "BeatProc",
    "Decision",
    "Sent",
    "close_cluster",
    "gaps_ms",
    "open_cluster",
    "time_passes_until",
    "wait_until",
]
