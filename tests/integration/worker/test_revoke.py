"""Cooperative revocation with real workers (issue 31): ``leases.revoke()`` and its deadline.

A worker's task holds ``rv:<rid>``; the test process revokes it and waits for the lease in a
thread of its own, as the next holder. The times are read on the Redis clock (``TIME``), the
one clock every process shares: when the revocation was sent, when the holder learnt of it,
when the next holder was granted.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_leases import FencedRedis, Leases
from celery_leases.config import renewal_interval
from tests.support.polling import wait_until
from tests.support.workers import WorkerProc, leases_cli, worker_factory

pytestmark = pytest.mark.worker

APP = "tests.integration.worker.revoke_app"
#: the workers' ttl (worker_env): a renewal every third of its horizon
TTL = 3.0


@pytest.fixture
def start_revoke_worker(
    request: pytest.FixtureRequest, worker_env: dict[str, str], tmp_path: Path
) -> Iterator[Callable[..., WorkerProc]]:
    with worker_factory(request.node, APP, worker_env, tmp_path, "r") as start:
        yield start


@pytest.fixture
def app_module(worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The app module in this process (to send its tasks), on this test's prefix."""
    for key in ("LEASES_TEST_BROKER", "LEASES_TEST_BACKEND", "LEASES_TEST_LEDGER"):
        monkeypatch.setenv(key, worker_env[key])
    import tests.integration.worker.revoke_app as module

    monkeypatch.setattr(module, "PREFIX", worker_env["CELERY_LEASES_KEY_PREFIX"])
    monkeypatch.setattr(module, "LEDGER_URL", worker_env["LEASES_TEST_LEDGER"])
    return module


def redis_us(client: redis.Redis) -> int:
    sec, usec = client.time()
    return int(sec) * 1_000_000 + int(usec)


def event(client: redis.Redis, module: Any, name: str, timeout: float = 60.0) -> str:
    key = module.ledger_key("events", name)
    return str(wait_until(lambda: client.lrange(key, 0, -1), timeout, f"ledger event {name}")[0])


class NextHolder(threading.Thread):
    """The next holder: waits for ``resource`` in the test process, records the Redis time
    it was granted and its token, writes the report fenced with it, and lets go."""

    def __init__(self, leases: Leases, client: redis.Redis, fenced: FencedRedis, rid: str):
        super().__init__(daemon=True)
        self.leases, self.client, self.fenced, self.rid = leases, client, fenced, rid
        self.granted_us = 0
        self.token = 0
        self.wrote: bool | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.leases.hold(f"rv:{self.rid}", wait=120) as lease:
                self.granted_us = redis_us(self.client)
                self.token = lease.token
                self.wrote = self.fenced.set(f"report:{self.rid}", "next", fence=lease)
        except BaseException as exc:  # reported by the test
            self.error = exc


def interval() -> float:
    """Seconds between two renewals of a worker's lease of TTL (the default lost margin)."""
    from celery_leases import LeaseSettings

    settings = LeaseSettings(ttl=TTL)
    return renewal_interval(TTL * (1 - settings.lost_margin))


def test_the_holder_learns_at_its_next_renewal_and_the_next_holder_follows_its_release(
    start_revoke_worker, app_module, send, make_leases, leases_redis
):
    """on_lost="interrupt": LeaseRevoked in the body within a renewal interval (+100 ms,
    measured); the body stops, its release hands the lease on long before the deadline."""
    start_revoke_worker(concurrency=1)
    test_leases = make_leases(ttl=TTL)
    fenced = app_module.fenced_store()
    rid = "obeys"
    result = send(app_module.obeys, rid, 120.0)
    first_token = int(event(leases_redis, app_module, f"started:{rid}"))
    waiter = NextHolder(test_leases, leases_redis, fenced, rid)
    waiter.start()
    sent_us = redis_us(leases_redis)
    done = test_leases.revoke(f"rv:{rid}", reason="operator", deadline=60)
    assert done.tokens == (first_token,)
    assert len(done.holders) == 1
    assert 0 < done.deadline <= 60
    learned_us, _, reason = event(leases_redis, app_module, f"revoked:{rid}").split(" ", 2)
    assert reason == "operator"
    assert result.get(timeout=60) == "revoked"
    waiter.join(60)
    assert waiter.error is None
    assert waiter.granted_us
    latency = (int(learned_us) - sent_us) / 1e6
    bound = interval() + 0.1
    print(
        f"revocation learnt after {latency * 1000:.0f} ms (renewal interval + 100 ms: "
        f"{bound * 1000:.0f} ms)"
    )
    # the holder learnt before the deadline, and the next holder came after the holder
    assert 0 < latency < 60
    assert waiter.granted_us > int(learned_us)
    assert waiter.granted_us < sent_us + 60_000_000  # the release, not the deadline
    assert waiter.token > first_token
    assert waiter.wrote is True


def test_a_holder_that_ignores_it_keeps_the_lease_until_the_deadline_then_is_fenced_off(
    start_revoke_worker, app_module, send, make_leases, leases_redis
):
    """on_lost="log": the holder learns through check(), works on past the deadline; the
    next holder is granted only at the deadline, with a new token, and the old holder's
    late fenced write is refused."""
    start_revoke_worker(concurrency=1)
    test_leases = make_leases(ttl=TTL)
    fenced = app_module.fenced_store()
    rid = "stubborn"
    deadline = 4.0
    result = send(app_module.stubborn, rid, 15.0)
    first_token = int(event(leases_redis, app_module, f"started:{rid}"))
    waiter = NextHolder(test_leases, leases_redis, fenced, rid)
    waiter.start()
    sent_us = redis_us(leases_redis)
    done = test_leases.revoke(f"rv:{rid}", reason="rebalance", deadline=deadline)
    assert done.tokens == (first_token,)
    # the mark names the deadline on the Redis clock; until then the holder's renewals (it
    # goes on renewing) never extend the lease past it
    until_ms = int(leases_redis.get(test_leases.store.keys.revocation(f"rv:{rid}")).split()[0])
    key = test_leases.store.keys.exclusive(f"rv:{rid}")
    looks = 0
    while waiter.is_alive() and looks < 10_000:
        pipe = leases_redis.pipeline(transaction=True)
        (sec, usec), left, value = pipe.time().pttl(key).get(key).execute()
        # the old holder's lease only: once it ran out, the key is the next holder's
        if left > 0 and value is not None and int(value.split()[0]) == first_token:
            assert int(sec) * 1000 + int(usec) // 1000 + left <= until_ms + 1
        looks += 1
        waiter.join(0.02)
    learned_us, _, reason = event(leases_redis, app_module, f"revoked:{rid}").split(" ", 2)
    assert reason == "rebalance"
    waiter.join(60)
    assert waiter.error is None
    assert waiter.granted_us
    latency = (int(learned_us) - sent_us) / 1e6
    print(
        f"revocation learnt (check()) after {latency * 1000:.0f} ms; "
        f"next holder granted {(waiter.granted_us - sent_us) / 1e6:.2f}s after the revoke "
        f"(deadline {deadline}s)"
    )
    assert latency < deadline
    # never before the deadline: the holder still held it (revoke.lua's clock read came
    # after sent_us, and the lease ran out at that clock + the deadline)
    assert waiter.granted_us >= sent_us + deadline * 1_000_000
    assert waiter.token > first_token
    assert waiter.wrote is True
    # the old holder's late write is refused; the next holder's report stands
    assert result.get(timeout=60) is False
    assert event(leases_redis, app_module, f"wrote:{rid}") == "False"
    stored = leases_redis.get(fenced.key(f"report:{rid}"))
    assert stored in ("next", b"next")


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A revoke_app leases <args>`` as an operator runs it."""
    return leases_cli(APP, env, *args)


def test_the_cli_revokes_beside_the_forced_release(
    start_revoke_worker, app_module, send, worker_env, leases_redis
):
    start_revoke_worker(concurrency=1)
    rid = "cli"
    result = send(app_module.obeys, rid, 120.0)
    token = int(event(leases_redis, app_module, f"started:{rid}"))

    nobody = run_cli(worker_env, "revoke", "rv:nobody")
    assert nobody.returncode == 1
    assert "no lease is held on 'rv:nobody'" in nobody.stderr
    bad = run_cli(worker_env, "revoke", f"rv:{rid}", "--deadline", "0")
    assert bad.returncode == 2
    assert "--deadline" in bad.stderr

    done = run_cli(
        worker_env, "revoke", f"rv:{rid}", "--reason", "ops", "--deadline", "90", "--json"
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [h["token"] for h in report["holders"]] == [token]
    assert report["reason"] == "ops"
    assert 0 < report["deadline"] <= 90
    assert "leases: revoked rv:cli held by" in done.stderr  # logged at WARNING, with who
    assert result.get(timeout=60) == "revoked"
    assert event(leases_redis, app_module, f"revoked:{rid}").endswith(" ops")
