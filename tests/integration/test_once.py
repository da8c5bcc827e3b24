"""``leases.once``: init-once with receipts, across processes, kills and workers.

Callers in other processes run ``tests/integration/once_helpers.py``; what their initializers do
is recorded in a ledger in Redis under the test's prefix (see that module).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_leases import LeaseBusy, LeaseLost, Leases
from tests.integration.worker.conftest import WorkerProc, wait_until
from tests.support.reserved import hold_reserved

REPO = Path(__file__).resolve().parents[2]
HELPER = "tests.integration.once_helpers"
#: how long a caller in another process may take to come back (it waits at most 30 s itself)
CALLER_TIMEOUT = 40.0


def ledger_key(prefix: str, *parts: object) -> str:
    """A ledger key of ``once_helpers`` (not imported here: it makes a Celery app)."""
    return f"{{{prefix}:ledger}}:" + ":".join(str(p) for p in parts)


@dataclass
class Caller:
    """One ``once_helpers`` subprocess."""

    role: str
    proc: subprocess.Popen[str]

    def result(self) -> dict[str, Any]:
        out, err = self.proc.communicate(timeout=CALLER_TIMEOUT)
        assert self.proc.returncode == 0, f"caller {self.role} failed:\n{out}\n{err}"
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert lines, f"caller {self.role} printed no result:\n{out}\n{err}"
        result: dict[str, Any] = json.loads(lines[-1])
        return result

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def caller_env(leases_redis_url: str, leases_prefix: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_LEASES_")}
    env.update(
        {
            "ONCE_TEST_BROKER": leases_redis_url,
            "CELERY_LEASES_REDIS_URL": leases_redis_url,
            "CELERY_LEASES_KEY_PREFIX": leases_prefix,
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


@pytest.fixture
def start_caller(caller_env: dict[str, str]) -> Iterator[Callable[..., Caller]]:
    """Factory: ``start_caller(name, role, *options)`` -> a running caller of ``once``."""
    callers: list[Caller] = []

    def start(name: str, role: str, *options: str) -> Caller:
        argv = [sys.executable, "-m", HELPER, name, role, *options]
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=caller_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        caller = Caller(role, proc)
        callers.append(caller)
        return caller

    yield start
    for c in callers:
        if c.proc.poll() is None:
            c.kill9()
        for stream in (c.proc.stdout, c.proc.stderr):
            if stream is not None:
                stream.close()


@dataclass
class Ledger:
    """What the initializers of ``name`` recorded."""

    client: redis.Redis
    prefix: str

    def key(self, *parts: object) -> str:
        return ledger_key(self.prefix, *parts)

    def runs(self, name: str) -> int:
        return int(self.client.get(self.key("runs", name)) or 0)

    def ran(self, name: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.client.lrange(self.key("ran", name), 0, -1)]

    def done(self, name: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.client.lrange(self.key("done", name), 0, -1)]

    def length(self, *parts: object) -> int:
        return int(self.client.llen(self.key(*parts)))

    def redis_ms(self) -> int:
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000


@pytest.fixture
def ledger(leases_redis: redis.Redis, leases_prefix: str) -> Ledger:
    return Ledger(leases_redis, leases_prefix)


# --- across processes -------------------------------------------------------------------------


def test_six_concurrent_callers_run_fn_once_and_get_the_same_receipt(
    start_caller: Callable[..., Caller], ledger: Ledger, leases: Leases
) -> None:
    name = "analysis:42:input"
    callers = [
        start_caller(name, f"P{i}", "--sleep", "1", "--wait", "30", "--barrier") for i in range(6)
    ]
    wait_until(lambda: ledger.length("ready", name) == 6, 30, "six callers at the barrier")
    ledger.client.rpush(ledger.key("go", name), *["go"] * 6)
    results = [c.result() for c in callers]

    assert ledger.runs(name) == 1
    errors = [r for r in results if "error" in r]
    assert not errors
    (initializer,) = [r for r in results if r["ran"]]
    (ran,) = ledger.ran(name)
    assert ran["role"] == initializer["role"]
    receipts = [r["receipt"] for r in results]
    assert all(receipt == receipts[0] for receipt in receipts)
    # the receipt is the initializer's value, and the initializer got the same plain value
    assert receipts[0]["role"] == initializer["role"]
    assert receipts[0]["pair"] == [1, 2]
    assert {r["pair_type"] for r in results} == {"list"}
    assert leases.receipt(name) == receipts[0]
    # they really were concurrent: all of them called once() before the initializer finished
    (done,) = ledger.done(name)
    assert max(r["called_ms"] for r in results) < done["at_ms"]


def test_waiter_takes_over_after_the_initializer_is_killed(
    start_caller: Callable[..., Caller], ledger: Ledger, leases: Leases
) -> None:
    name = "takeover"
    ttl = 1.0
    a = start_caller(name, "A", "--block", "--ttl", str(ttl))
    wait_until(lambda: ledger.ran(name), 30, "A's initializer to start")
    b = start_caller(name, "B", "--wait", "30")
    wait_until(lambda: ledger.length("calling", name) == 2, 30, "B to call once()")
    assert ledger.runs(name) == 1  # B waits for A's lease
    # a caller that does not wait long enough gets LeaseBusy, and its fn is not called
    with pytest.raises(LeaseBusy):
        leases.once(name, lambda: pytest.fail("fn called while A initialises"), wait=0.2)

    killed_ms = ledger.redis_ms()
    a.kill9()
    result = b.result()

    assert result["ran"] is True
    assert result["receipt"]["role"] == "B"
    ran = ledger.ran(name)
    assert [r["role"] for r in ran] == ["A", "B"]
    # B ran only once A's lease had run out: A renewed it every ttl/3, so it lived on for at
    # least about 2/3 of the TTL after the kill (1/3 allowed), and at most the TTL (as much
    # again allowed for the waiter to notice the expiry)
    took = ran[1]["at_ms"] - killed_ms
    assert ttl * 1000 / 3 <= took <= 2 * ttl * 1000, f"B ran {took} ms after A was killed"
    assert [d["role"] for d in ledger.done(name)] == ["B"]
    assert leases.receipt(name) == result["receipt"]


def test_waiter_runs_fn_again_when_the_initializer_raises(
    start_caller: Callable[..., Caller], ledger: Ledger, leases: Leases
) -> None:
    name = "raises"
    a = start_caller(name, "A", "--block", "--fail")
    wait_until(lambda: ledger.ran(name), 30, "A's initializer to start")
    b = start_caller(name, "B", "--wait", "30")
    wait_until(lambda: ledger.length("calling", name) == 2, 30, "B to call once()")
    ledger.client.rpush(ledger.key("release", name), "go")  # now A's initializer raises
    failed, took_over = a.result(), b.result()

    assert failed["error"] == "ValueError"
    assert failed["message"] == "A fails on purpose"
    assert "receipt" not in failed
    assert took_over["ran"] is True
    assert took_over["receipt"]["role"] == "B"
    assert [r["role"] for r in ledger.ran(name)] == ["A", "B"]
    assert took_over["called_ms"] < ledger.done(name)[0]["at_ms"]  # B waited for A
    assert leases.receipt(name) == took_over["receipt"]


# --- in this process --------------------------------------------------------------------------


def test_fn_raises_no_receipt_and_the_next_caller_runs_fn_again(
    make_leases: Callable[..., Leases],
) -> None:
    first, second = make_leases(), make_leases()
    name = "boom"
    calls: list[str] = []

    def boom() -> str:
        calls.append("boom")
        raise ValueError("boom")

    with pytest.raises(ValueError, match=r"^boom$"):
        first.once(name, boom)
    assert first.receipt(name) is None
    assert first.store.holders(first.store.keys.once_resource(name)) == []

    def fine() -> str:
        calls.append("fine")
        return "fine"

    assert second.once(name, fine, wait=0) == "fine"
    assert calls == ["boom", "fine"]
    assert first.receipt(name) == "fine"
    assert first.once(name, boom) == "fine"  # a receipt exists: fn is not called
    assert calls == ["boom", "fine"]


def test_initializer_that_lost_its_lease_stores_nothing(
    make_leases: Callable[..., Leases], leases_redis: redis.Redis
) -> None:
    """Its lease ran out mid-way and a successor took it: the late initializer must neither
    store its receipt nor give back the successor's lease."""
    first, successor = make_leases(), make_leases()
    name = "lost-mid-way"
    resource = first.store.keys.once_resource(name)
    with ExitStack() as stack:
        taken = []

        def fn() -> str:
            # what expiry does, without waiting for it; then the successor is granted the lease
            leases_redis.delete(first.store.keys.exclusive(resource))
            taken.append(stack.enter_context(hold_reserved(successor, resource, wait=0)))
            return "late"

        with pytest.raises(LeaseLost):
            first.once(name, fn, ttl=5)
        assert first.receipt(name) is None
        assert leases_redis.exists(first.store.keys.receipt(name)) == 0
        (holder,) = first.store.holders(resource)
        assert holder.token == taken[0].token
        taken[0].check()


@pytest.mark.parametrize(
    "value",
    [{1, 2}, object(), {"x": float("nan")}, {(1, 2): "tuple key"}, b"bytes"],
    ids=["set", "object", "nan", "tuple-key", "bytes"],
)
def test_value_that_is_not_json_raises_type_error_and_stores_nothing(
    value: object, leases: Leases, leases_redis: redis.Redis
) -> None:
    name = "not-json"
    with pytest.raises(TypeError, match="not-json"):
        leases.once(name, lambda: value)
    assert leases.receipt(name) is None
    assert leases_redis.exists(leases.store.keys.receipt(name)) == 0
    assert leases.store.holders(leases.store.keys.once_resource(name)) == []
    assert leases.once(name, lambda: {"ok": True}, wait=0) == {"ok": True}


def test_forget_makes_once_run_fn_again(leases: Leases) -> None:
    name = "forget-me"
    runs: list[int] = []

    def fn() -> dict[str, int]:
        runs.append(len(runs) + 1)
        return {"run": len(runs)}

    assert leases.receipt(name) is None
    assert leases.forget(name) is False
    assert leases.once(name, fn) == {"run": 1}
    assert leases.receipt(name) == {"run": 1}
    assert leases.once(name, fn) == {"run": 1}
    assert leases.forget(name) is True
    assert leases.receipt(name) is None
    assert leases.forget(name) is False
    assert leases.once(name, fn) == {"run": 2}
    assert leases.receipt(name) == {"run": 2}
    assert runs == [1, 2]


def test_receipt_ttl_makes_the_receipt_expire(
    make_leases: Callable[..., Leases], leases_redis: redis.Redis
) -> None:
    receipt_ttl = 0.5
    plain = make_leases()
    by_setting = make_leases(receipt_ttl=receipt_ttl)
    key = plain.store.keys.receipt

    assert plain.once("kept", lambda: "kept") == "kept"
    assert leases_redis.pttl(key("kept")) == -1  # no expiry by default

    assert plain.once("by-arg", lambda: "by-arg", receipt_ttl=receipt_ttl) == "by-arg"
    assert by_setting.once("by-setting", lambda: "by-setting") == "by-setting"
    for name in ("by-arg", "by-setting"):
        assert 0 < leases_redis.pttl(key(name)) <= receipt_ttl * 1000
    wait_until(
        lambda: plain.receipt("by-arg") is None and plain.receipt("by-setting") is None,
        3 * receipt_ttl,
        "the receipts to expire",
    )
    assert plain.receipt("kept") == "kept"
    assert plain.once("by-arg", lambda: "again") == "again"  # gone: fn runs again


# --- inside tasks, on real workers ------------------------------------------------------------


@pytest.fixture
def once_workers(
    request: pytest.FixtureRequest,
    caller_env: dict[str, str],
    leases_prefix: str,
    leases_redis: redis.Redis,
    tmp_path: Path,
) -> Iterator[tuple[str, list[WorkerProc]]]:
    """Two prefork workers (concurrency 2) of ``once_helpers`` on this test's queue."""
    queue = f"q-{leases_prefix}"
    env = {**caller_env, "ONCE_TEST_QUEUE": queue}
    workers = []
    for i in range(2):
        name = f"once{i}-{os.getpid()}@{socket.gethostname()}"
        argv = [
            sys.executable, "-m", "celery", "-A", HELPER, "worker", "-P", "prefork", "-c", "2",
            "-n", name, "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-l", "info",
        ]  # fmt: skip
        workers.append(WorkerProc(name, "prefork", tmp_path / f"worker-{i}", argv, env))
    failed_before = request.session.testsfailed
    try:
        for w in workers:
            w.start(wait=False)
        for w in workers:
            w.wait_for_log("ready.", 30)
        yield queue, workers
    finally:
        for w in workers:
            w.stop()
        if request.session.testsfailed > failed_before:  # this test failed: show the logs
            for w in workers:
                sys.stderr.write(f"\n===== log of worker {w.hostname} =====\n{w.log()[-20000:]}")
        leases_redis.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")


@pytest.mark.worker
def test_once_inside_tasks_on_two_workers_runs_fn_once(
    once_workers: tuple[str, list[WorkerProc]], leases_redis_url: str, ledger: Ledger
) -> None:
    queue, workers = once_workers
    name = "dataset:7:unpacked"
    n = 8
    sender = Celery("once-sender", broker=leases_redis_url, set_as_current=False)
    try:
        with sender.connection_for_write() as conn, conn.Producer() as producer:
            for i in range(n):
                sender.send_task(
                    "once_helpers.needs_init", args=[name, i], queue=queue, producer=producer
                )
    finally:
        sender.close()
    wait_until(lambda: ledger.length("task-results", name) == n, 40, f"{n} task results")
    results = [json.loads(x) for x in ledger.client.lrange(ledger.key("task-results", name), 0, -1)]

    assert ledger.runs(name) == 1
    assert sorted(r["i"] for r in results) == list(range(n))
    assert Counter(r["ran"] for r in results) == {True: 1, False: n - 1}
    receipts = [r["receipt"] for r in results]
    assert all(receipt == receipts[0] for receipt in receipts)
    (initializer,) = [r for r in results if r["ran"]]
    assert receipts[0]["role"] == f"task-{initializer['i']}"
    # the tasks ran in both workers, in more than one process each
    assert {r["node"] for r in results} == {w.hostname for w in workers}
    assert len({r["pid"] for r in results}) >= 3
