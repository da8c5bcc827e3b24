"""The fault-injection suite's harness: a fleet of real workers, the Redis under test, a report.

- **Redis under test**: a private server (``--enable-debug-command yes`` for DEBUG SLEEP) that
  the scenarios restart, pause, cut and slow down. Only the leases live there.
- **Broker**: RabbitMQ (``CELERY_LEASES_TEST_AMQP_URL``), never the Redis under test: a task
  lost by a broker that lost its data would say nothing about leases. RabbitMQ also gives a
  killed worker's unacknowledged messages back at once (its connection closes), where the
  Redis transport waits for a visibility timeout. One queue per scenario, deleted after it.
  The kill scenario also runs on the Redis transport (``make_fleet(..., broker="redis")``),
  on a private Redis of its own, with a short visibility timeout.
- **Lost tasks** are told apart (``Losses``): a task whose last message no worker received
  and which is gone from the broker was lost by the broker (kombu's Redis transport pops a
  message before it records it as unacknowledged, so a kill -9 of a worker can lose it: see
  docs/faults.md); a task received and never finished is ours.
- **Ledger**: the shared test Redis (db 15) under the scenario's own prefix (ledger.py).
- **Report**: each scenario adds a row; the table is printed at the end of the run, and written
  as markdown to ``$CELERY_LEASES_FAULTS_REPORT`` when that is set.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import statistics
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_leases._redis_server import RedisServer
from tests.faults.ledger import Counts, Ledger
from tests.support.polling import wait_until
from tests.support.workers import (
    WorkerProc,
    amqp_url_or_skip,
    kill_whole_worker,
    pytest_runtest_makereport,
    worker_argv,
    write_logs_if_failed,
)

APP = "tests.faults.faults_app"
TASK = "tests.faults.faults_app.work"
#: lease TTL of the fleet (seconds): short, so that faults past the TTL stay short
TTL = 2.0
#: seconds allowed for all tasks of a scenario to complete once the faults are over
DRAIN_TIMEOUT = 90.0
#: the Redis transport's visibility_timeout in the kill scenario on Redis (seconds): longer
#: than a message stays unacknowledged on a live worker (bodies last at most 2.5 s)
VISIBILITY_TIMEOUT = 15.0
#: seconds for which every unfinished task must look lost by the broker (never received, not
#: in the broker) before the drain stops waiting for them; a message is out of the broker and
#: not yet received only between kombu's pop and its record as unacknowledged (microseconds)
BROKER_LOSS_SETTLE = 3.0

BROKERS = ("amqp", "redis")

#: a task id (uuid4) in a message's text
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

_REPORTS = pytest.StashKey[list["ScenarioReport"]]()


@dataclass
class Fault:
    """One injected fault: when it ended (ledger ms) and the tasks its victims had inside."""

    kind: str
    end_ms: int
    #: (task id, resource) of the bodies the fault's victims were running
    in_flight: list[tuple[str, str]] = field(default_factory=list)
    #: seconds until a lease was granted again (for a kill: on each resource a victim held)
    recovered: float | None = None
    #: for a kill, seconds until every task a victim was running completed elsewhere
    redone: float | None = None

    def describe(self) -> str:
        text = self.kind
        if self.in_flight:
            text += f" ({len(self.in_flight)} running)"
        text += " -" if self.recovered is None else f" {self.recovered:.2f}s"
        if self.in_flight:
            redone = "never" if self.redone is None else f"{self.redone:.2f}s"
            text += f" (their tasks done again after {redone})"
        return text


@dataclass
class Losses:
    """The tasks of a scenario that never completed, by who lost them."""

    #: never received by any worker (their last message) and gone from the broker
    by_broker: list[str] = field(default_factory=list)
    #: received by a worker and never finished, or still waiting in the broker: ours
    ours: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.by_broker) + len(self.ours)

    def describe(self) -> str:
        return (
            f"{len(self.by_broker)} lost by the broker before any worker received them "
            f"{self.by_broker[:5]}; {len(self.ours)} received and never finished "
            f"(or still queued) {self.ours[:5]}"
        )


class BrokerLostMessages(UserWarning):
    """Tasks lost by kombu's Redis transport before any worker received them (not ours)."""


def check_losses(fleet: Fleet, losses: Losses, why: str) -> None:
    """No task lost by us; none lost by the broker either, but on kombu's Redis transport.

    A task received by a worker and never finished is ours: a failure. A task whose last
    message no worker received and which is gone from the broker was lost by the broker:
    on RabbitMQ (acks_late, at-least-once) a failure too; on the Redis transport a known loss
    of kombu's (docs/faults.md, "What the broker can lose"), reported, not failed.
    """
    assert not losses.ours, f"{losses.describe()}: OUR bug; {why}"
    if not losses.by_broker:
        return
    text = (
        f"{fleet.name}: {len(losses.by_broker)} task(s) lost by the broker before any worker "
        f"received them ({fleet.broker} transport): {losses.by_broker[:5]}"
    )
    if fleet.broker != "redis":
        raise AssertionError(
            f"{text} (or still queued: RabbitMQ's queue is not read); with acks_late it "
            f"delivers at-least-once; {why}"
        )
    text += " (kombu's Redis transport pops a message before it records it as unacked: known, "
    text += "see docs/faults.md)"
    print(text)
    warnings.warn(text, BrokerLostMessages, stacklevel=2)


@dataclass
class ScenarioReport:
    """One row of the report."""

    scenario: str
    sent: int
    runs: int
    completed: int
    duplicates: int
    overlaps: int
    stale_rejected: int
    lost: int
    broker_lost: int
    retried_lost: int
    retried_backend: int
    faults: int
    recover_max: float | None
    recover_median: float | None
    wall: float
    note: str = ""
    faults_detail: str = ""

    HEADER = (
        "| scenario | faults | tasks sent | bodies run | overlaps | stale writes rejected "
        "| lost | retried (lease lost / Redis down) | duplicates | time to recover "
        "(median / max) | wall |"
    )
    RULE = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"

    def row(self) -> str:
        def s(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f}s"

        lost = f"{self.lost}"
        if self.broker_lost:
            lost += f" (+{self.broker_lost} by the broker)"

        return (
            f"| {self.scenario} | {self.faults} | {self.sent} | {self.runs} | {self.overlaps} "
            f"| {self.stale_rejected} | {lost} | {self.retried_lost} / "
            f"{self.retried_backend} | {self.duplicates} | {s(self.recover_median)} / "
            f"{s(self.recover_max)} | {self.wall:.0f}s |"
        )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_REPORTS] = []


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    reports = config.stash.get(_REPORTS, [])
    if not reports:
        return
    lines = [ScenarioReport.HEADER, ScenarioReport.RULE, *(r.row() for r in reports)]
    notes = [f"- {r.scenario}: {r.note}" for r in reports if r.note]
    notes += ["", "Time to recover from each fault, in order:", ""]
    notes += [f"- {r.scenario}: {r.faults_detail}" for r in reports]
    terminalreporter.section("fault injection report")
    for line in [*lines, "", *notes]:
        terminalreporter.write_line(line)
    out = os.environ.get("CELERY_LEASES_FAULTS_REPORT")
    if out:
        Path(out).write_text("\n".join([*lines, "", *notes]) + "\n")


def hold_for(seconds: float) -> None:
    """Keep a fault in place for ``seconds`` (its length, not a wait for something to happen)."""
    threading.Event().wait(seconds)


class Fleet:
    """The workers of one scenario, its queue, its ledger and the Redis under test."""

    def __init__(
        self,
        name: str,
        *,
        server: RedisServer,
        ledger: Ledger,
        broker: str,
        broker_url: str,
        env: dict[str, str],
        tmp_path: Path,
    ) -> None:
        self.name = name
        self.broker = broker
        self.broker_url = broker_url
        self.server = server
        self.ledger = ledger
        self.queue = f"faults-{ledger.prefix}"
        self.env = env
        self.tmp_path = tmp_path
        self.workers: list[WorkerProc] = []
        self.faults: list[Fault] = []
        self.sent: list[str] = []
        self.resources: list[str] = []
        self.sender = Celery(f"faults-sender-{name}", broker=broker_url, set_as_current=False)
        self.admin = redis.Redis.from_url(server.url, socket_timeout=30, decode_responses=True)
        self.started = time.monotonic()

    # --- workers ----------------------------------------------------------------------------
    def add(self, pool: str, concurrency: int, env: dict[str, str] | None = None) -> WorkerProc:
        """Start a worker (not waiting for it: see ``ready()``)."""
        n = len(self.workers)
        hostname = f"{self.name}-{n}-{pool}@{socket.gethostname()}"
        w = WorkerProc(
            hostname=hostname,
            pool=pool,
            log_path=self.tmp_path / f"{self.name}-worker-{n}",
            argv=worker_argv(APP, pool, concurrency, hostname),
            env={**self.env, "FAULTS_NODE": hostname, **(env or {})},
        )
        self.workers.append(w)
        return w.start(wait=False)

    def ready(self) -> None:
        for w in self.workers:
            if w.alive():
                w.wait_ready()

    def stop(self) -> None:
        """Warm shutdown of every worker at once, SIGKILL after a deadline."""
        live = [w for w in self.workers if w.alive()]
        for w in live:
            assert w.proc is not None
            w.proc.send_signal(signal.SIGTERM)
        for w in live:
            w.stop(timeout=15)

    # --- tasks ------------------------------------------------------------------------------
    def send_work(
        self,
        count: int,
        resources: int,
        seed: int,
        body: float = 0.03,
        long_share: float = 0.05,
        long_body: tuple[float, float] = (0.5, 2.5),
        task: str = TASK,
    ) -> list[str]:
        """Send ``count`` work tasks (or ``task``, with the same arguments) on ``resources``
        resources.

        Bodies last 0..``body`` s; a ``long_share`` of them last ``long_body`` s, longer than
        a renewal interval, most longer than the TTL.
        """
        rng = random.Random(seed)
        rids = [f"{self.name}-{i}" for i in range(resources)]
        self.resources += [f"r:{rid}" for rid in rids if f"r:{rid}" not in self.resources]
        ids = []
        with self.sender.producer_or_acquire() as producer:
            for _ in range(count):
                task_id = str(uuid.uuid4())
                rid = rng.choice(rids)
                long = rng.random() < long_share
                seconds = rng.uniform(*long_body) if long else rng.uniform(0, body)
                self.sender.send_task(
                    task,
                    (rid, round(seconds, 4)),
                    queue=self.queue,
                    task_id=task_id,
                    producer=producer,
                )
                ids.append(task_id)
        self.sent += ids
        return ids

    def send(self, task: str, *args: Any) -> str:
        task_id = str(uuid.uuid4())
        self.sender.send_task(
            f"tests.faults.faults_app.{task}", args, queue=self.queue, task_id=task_id
        )
        self.sent.append(task_id)
        return task_id

    def wait_completed(self, count: int, timeout: float = 60.0) -> None:
        wait_until(
            lambda: self.ledger.completed() >= count,
            timeout,
            f"{count} completed tasks in scenario {self.name}",
            step=0.02,
        )

    def settled(self) -> bool:
        """Every sent task completed or failed for good."""
        finished = self.ledger.done_ids() | set(self.ledger.failed_ids())
        return finished.issuperset(self.sent)

    def drained(self) -> Callable[[], bool]:
        """A predicate: settled, or, on the Redis transport, every unfinished task lost by the
        broker (nothing will come of it) for BROKER_LOSS_SETTLE s in a row, looked at once a
        second. (RabbitMQ's queue cannot be read without taking its messages: there, what is
        never received fails the scenario anyway, after the full drain.)"""
        since: float | None = None
        looked = 0.0

        def drained() -> bool:
            nonlocal since, looked
            if self.settled():
                return True
            if self.broker != "redis":
                return False
            now = time.monotonic()
            if now - looked < 1.0:
                return False
            looked = now
            losses = self.losses()
            if losses.ours or not losses.by_broker:
                since = None
                return False
            since = now if since is None else since
            return now - since >= BROKER_LOSS_SETTLE

        return drained

    # --- faults -----------------------------------------------------------------------------
    def fault(self, kind: str, in_flight: list[tuple[str, str]] | None = None) -> Fault:
        """Record that a fault of ``kind`` just ended."""
        f = Fault(kind, self.ledger.now_ms(), in_flight or [])
        self.faults.append(f)
        return f

    def running(self, pids: list[int], timeout: float = 10.0) -> int | None:
        """The first of ``pids`` seen running a task body within ``timeout``, or None."""

        def find() -> int | None:
            return next((p for p in pids if self.ledger.in_flight_of(p)), None)

        with contextlib.suppress(AssertionError):
            found: int = wait_until(find, timeout, "a process running a task body", step=0.005)
            return found
        return None

    def kill_child(self, worker: WorkerProc) -> list[int]:
        """kill -9 of one pool child of a prefork worker, one running a task body if any."""
        kids = worker.children()
        assert kids, f"{worker.hostname} has no pool children"
        victim = self.running(kids) or kids[0]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: victim not in worker.children(), 10, f"child {victim} to die")
        self.fault("kill -9 child", self.in_flight([victim]))
        return [victim]

    def kill_worker(self, worker: WorkerProc) -> list[int]:
        """kill -9 of a worker's main process and its children, once one runs a task body."""
        self.running([worker.pid, *worker.children()])
        pids = kill_whole_worker(worker)
        self.fault("kill -9 worker", self.in_flight(pids))
        return pids

    def in_flight(self, pids: list[int]) -> list[tuple[str, str]]:
        return sorted({t for p in pids for t in self.ledger.in_flight_of(p)})

    # --- the end ----------------------------------------------------------------------------
    def recovery(self) -> list[float]:
        """Seconds from the end of each fault until a lease was granted again.

        For a kill, until every resource a victim was inside was granted to another holder
        (the dead holder's lease freed); for the others, until any body entered a resource
        again. Also sets, for a kill, when the victims' tasks had all completed elsewhere.
        """
        out = []
        for f in self.faults:
            if f.in_flight:
                firsts = [self.ledger.first_enter_after(f.end_ms, r) for _, r in f.in_flight]
                end = None if None in firsts else max(t for t in firsts if t is not None)
                done = self.ledger.done_at([t for t, _ in f.in_flight])
                if None not in done:
                    f.redone = max(0, max(t for t in done if t is not None) - f.end_ms) / 1000
            else:
                end = self.ledger.first_enter_after(f.end_ms)
            if end is not None:
                f.recovered = max(0, end - f.end_ms) / 1000
                out.append(f.recovered)
        return out

    def in_broker(self, task_ids: list[str]) -> set[str]:
        """Those of ``task_ids`` with a message still in the broker (Redis transport only):
        in a queue, or unacknowledged (kombu's ``unacked`` hash, restored after the
        visibility timeout). The broker's Redis is this scenario's own, so all of it is read."""
        if not task_ids or self.broker != "redis":
            return set()
        found: set[str] = set()
        with redis.Redis.from_url(self.broker_url, socket_timeout=30) as client:
            for key in client.scan_iter(count=1000):
                kind = client.type(key)
                if kind == b"list":
                    items = client.lrange(key, 0, -1)
                elif kind == b"hash":
                    items = client.hvals(key)
                else:
                    continue
                for item in items:
                    found.update(_UUID.findall(item.decode(errors="replace")))
        return found.intersection(task_ids)

    def losses(self) -> Losses:
        """The tasks sent that never completed (nor failed), by who lost them.

        A task whose last message no worker ever received (``task_received``) and which no
        longer has a message in the broker was lost by the broker; anything else is ours.
        """
        unfinished = sorted(set(self.sent) - self.ledger.done_ids() - set(self.ledger.failed_ids()))
        unseen = self.ledger.never_received(unfinished)
        by_broker = sorted(set(unseen) - self.in_broker(unseen))
        return Losses(by_broker=by_broker, ours=sorted(set(unfinished) - set(by_broker)))

    def finish(self, reports: list[ScenarioReport], note: str = "") -> tuple[Counts, Losses]:
        """Wait for the tasks to settle, add the scenario's row; returns (counts, losses).

        Failed tasks count as lost (``counts.failed`` names them); ``losses`` splits the
        tasks that never finished between the broker and us.
        """
        with contextlib.suppress(AssertionError):  # what did not finish is reported as lost
            wait_until(self.drained(), DRAIN_TIMEOUT, f"every task of {self.name} to finish", 0.1)
        counts = self.ledger.counts()
        done = self.ledger.done_ids()
        losses = self.losses()
        lost = len(set(self.sent) - done) - len(losses.by_broker)
        recover = self.recovery()
        reports.append(
            ScenarioReport(
                scenario=self.name,
                sent=len(self.sent),
                runs=counts.runs,
                completed=counts.completed,
                duplicates=counts.completions - counts.completed,
                overlaps=counts.overlaps,
                stale_rejected=counts.writes_rejected,
                lost=lost,
                broker_lost=len(losses.by_broker),
                retried_lost=counts.retried_lost,
                retried_backend=counts.retried_backend,
                faults=len(self.faults),
                recover_max=max(recover) if recover else None,
                recover_median=statistics.median(recover) if recover else None,
                wall=time.monotonic() - self.started,
                note=note,
                faults_detail="; ".join(f.describe() for f in self.faults),
            )
        )
        return counts, losses

    def close(self) -> None:
        self.stop()
        self.admin.close()
        if self.broker != "amqp":  # a private Redis, stopped with the scenario
            return
        try:
            with self.sender.connection_for_write() as conn:
                channel: Any = conn.default_channel
                channel.queue_delete(self.queue)
                channel.exchange_delete(self.queue)
        except Exception as exc:  # cleanup only
            print(f"could not delete queue {self.queue}: {exc}")


@pytest.fixture(scope="session")
def amqp_url() -> str:
    return amqp_url_or_skip()


@pytest.fixture
def reports(request: pytest.FixtureRequest) -> list[ScenarioReport]:
    return request.config.stash[_REPORTS]


@pytest.fixture
def make_fleet(
    request: pytest.FixtureRequest,
    make_redis_server: Callable[..., RedisServer],
    leases_redis_url: str,
    leases_prefix: str,
    tmp_path: Path,
) -> Iterator[Callable[..., Fleet]]:
    """Factory: ``make_fleet(name, broker="amqp", **settings)`` -> a Fleet with no workers yet.

    ``broker``: ``"amqp"`` (RabbitMQ, skipped when it does not answer, a failure under CI) or
    ``"redis"`` (kombu's Redis transport on a private Redis server of the scenario's own).
    ``settings`` are lease settings for every worker (``restart_grace=2`` ->
    ``CELERY_LEASES_RESTART_GRACE=2``).
    """
    fleets: list[Fleet] = []

    def make(name: str, broker: str = "amqp", **settings: object) -> Fleet:
        if broker == "amqp":
            broker_url = str(request.getfixturevalue("amqp_url"))
        elif broker == "redis":
            broker_url = make_redis_server().url
        else:
            raise ValueError(f"broker must be one of {BROKERS}, not {broker!r}")
        server = make_redis_server(extra_args=["--enable-debug-command", "yes"])
        ledger = Ledger(leases_redis_url, f"{leases_prefix}-{name}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_LEASES_")}
        env.update(
            {
                "FAULTS_BROKER": broker_url,
                "FAULTS_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT),
                "FAULTS_LEDGER_URL": leases_redis_url,
                "FAULTS_LEDGER_PREFIX": ledger.prefix,
                "CELERY_LEASES_REDIS_URL": server.url,
                "CELERY_LEASES_KEY_PREFIX": f"faults-{name}",
                "CELERY_LEASES_TTL": str(TTL),
                "CELERY_LEASES_SOCKET_TIMEOUT": "1",
                "CELERY_LEASES_SOCKET_CONNECT_TIMEOUT": "1",
                "CELERY_LEASES_RETRY_DELAY": "0.05",
                "CELERY_LEASES_RETRY_MAX_DELAY": "0.5",
                "CELERY_LEASES_RECONCILE_INTERVAL": "2",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update({f"CELERY_LEASES_{k.upper()}": str(v) for k, v in settings.items()})
        fleet = Fleet(
            name,
            server=server,
            ledger=ledger,
            broker=broker,
            broker_url=broker_url,
            env=env,
            tmp_path=tmp_path,
        )
        env["FAULTS_QUEUE"] = fleet.queue
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        fleet.close()
    write_logs_if_failed(request.node, [w for f in fleets for w in f.workers])


__all__ = [
    "BrokerLostMessages",
    "Fleet",
    "Losses",
    "ScenarioReport",
    "check_losses",
    "hold_for",
    "pytest_runtest_makereport",
]
