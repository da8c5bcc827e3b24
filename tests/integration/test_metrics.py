"""celery_leases.metrics against a real Redis: each metric moves when its event happens."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from celery_leases import LeaseBusy, LeaseLost, Shared, worker
from celery_leases._identity import Identity
from celery_leases._lease import Want
from celery_leases.metrics import LeaseMetrics, install
from celery_leases.worker import LeaseBootstep, run_reconcile
from tests.support.polling import wait_until

NS = "celery_leases"


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> Iterator[LeaseMetrics]:
    installed = install(registry)
    yield installed
    installed.uninstall()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(f"{NS}_{name}", labels)
    assert got is not None, f"no sample {name} {labels}"
    return got


def held(registry: CollectorRegistry, mode: str = "exclusive") -> float:
    return value(registry, "leases_held", mode=mode)


def test_install_is_idempotent_per_registry(registry, metrics):
    assert install(registry) is metrics
    other = CollectorRegistry()
    second = install(other)
    try:
        assert second is not metrics
        with pytest.raises(ValueError, match="namespace"):
            install(registry, namespace="other")
    finally:
        second.uninstall()


def test_uninstall_stops_counting_and_allows_a_new_install(registry, leases):
    first = install(registry)
    first.uninstall()
    first.uninstall()  # harmless twice
    with leases.hold("r"):
        pass
    assert registry.get_sample_value(f"{NS}_acquire_seconds_count") is None
    again = install(registry)
    try:
        with leases.hold("r"):
            assert held(registry) == 1
        assert value(registry, "acquire_seconds_count") == 1
    finally:
        again.uninstall()


def test_held_gauge_follows_hold_and_release(registry, metrics, leases):
    assert held(registry) == 0
    with leases.hold(["a", Shared("b")]):
        assert held(registry) == 1
        assert held(registry, "shared") == 1
        with leases.hold("c"):
            assert held(registry) == 2
        assert held(registry) == 1
    assert held(registry) == 0
    assert held(registry, "shared") == 0
    # one observation per acquired lease: a+b together, then c
    assert value(registry, "acquire_seconds_count") == 3
    assert value(registry, "acquire_seconds_sum") >= 0


def test_acquire_seconds_includes_the_wait(registry, metrics, leases):
    first = leases.acquire([Want("r")])
    try:
        with pytest.raises(LeaseBusy):
            leases.acquire([Want("r")], wait=0.2)
    finally:
        leases.release(first)
    with leases.hold("r"):
        pass
    assert value(registry, "acquire_seconds_count") == 2
    assert value(registry, "busy_total", task="-") == 1


def test_busy_counter_is_labelled_with_the_task_name(registry, metrics, leases):
    app = leases.app

    @app.task(name="proj.busy_task", bind=True)
    def busy_task(self):
        try:
            leases.release(leases.acquire([Want("r")], task_id=self.request.id))
        except LeaseBusy:
            return "busy"
        return "free"

    with leases.hold("r"):
        assert busy_task.apply().get() == "busy"
        with pytest.raises(LeaseBusy):
            leases.acquire([Want("r")])
    assert value(registry, "busy_total", task="proj.busy_task") == 1
    assert value(registry, "busy_total", task="-") == 1
    assert held(registry) == 0


def leave_lost(stack: ExitStack) -> None:
    """Leave the ``hold()`` block of ``stack``: it must tell that the lease was lost."""
    with pytest.raises(LeaseLost):
        stack.close()


def test_lost_lease_is_counted_once_and_not_decremented_twice(registry, metrics, leases):
    with ExitStack() as stack:
        lease = stack.enter_context(leases.hold("r", ttl=0.6))
        assert held(registry) == 1
        leases.store.client.delete(leases.store.resource_keys("r").exclusive)
        wait_until(lambda: lease.lost, 5, "the heartbeat to find the lease lost")
        wait_until(lambda: value(registry, "lost_total") == 1, 5, "lost_total")
        assert held(registry) == 0
        leave_lost(stack)
    # release() sent lease_released for the lost lease too: still 0, not -1
    assert held(registry) == 0
    assert value(registry, "lost_total") == 1


def test_renew_histogram_counts_renew_calls(registry, metrics, leases):
    with leases.hold("r", ttl=0.3):
        wait_until(
            lambda: value(registry, "renew_seconds_count") >= 3, 5, "three renew calls observed"
        )
    assert value(registry, "renew_seconds_sum") > 0
    assert value(registry, "renew_failures_total") == 0


def test_renew_failure_is_counted_when_redis_pauses(
    registry, metrics, make_leases, make_redis_server
):
    server = make_redis_server()
    private = make_leases(redis_url=server.url)
    with ExitStack() as stack:
        lease = stack.enter_context(private.hold("r", ttl=1.0))
        wait_until(lambda: lease._held.confirmed_at > lease._held.acquired_at, 5, "a first renewal")
        server.pause()
        try:
            wait_until(
                lambda: value(registry, "renew_failures_total") >= 1, 5, "a failed renew call"
            )
            wait_until(lambda: lease.lost, 5, "the lease to count as lost")
        finally:
            server.resume()
        leave_lost(stack)
    assert value(registry, "lost_total") == 1
    assert held(registry) == 0


def reaped_pid() -> int:
    """The pid of a process that ran and was reaped (dead, and not a zombie)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_cleanup_counter_by_kind(registry, metrics, make_leases, monkeypatch):
    monkeypatch.setattr(worker, "_active", None)  # start() sets it; restored afterwards
    ext = make_leases(node="metrics-node")
    store, ident = ext.store, ext.identity()
    # a past incarnation of the node held two leases; a dead child of this one held one
    old = Identity(ident.node, "0ld1ncarnat1", 4242)
    child = Identity(ident.node, ident.incarnation, reaped_pid())
    assert isinstance(store.try_acquire([Want("old1"), Want("old2")], old, 30), list)
    assert isinstance(store.try_acquire([Want("child")], child, 30), list)
    step = LeaseBootstep(SimpleNamespace(app=ext.app, hostname=ident.node))
    step.start(SimpleNamespace(timer=None))
    assert value(registry, "cleanup_released_total", kind="startup") == 2
    step.reap()
    assert value(registry, "cleanup_released_total", kind="reaper") == 1
    assert isinstance(store.try_acquire([Want("mine")], ident, 30), list)
    step.final_release()
    assert value(registry, "cleanup_released_total", kind="shutdown") == 1
    assert run_reconcile(ext) is not None
    assert value(registry, "cleanup_released_total", kind="reconcile") == 0
    # none of these went through Leases.acquire/release: the gauge never moved
    assert held(registry) == 0


def test_a_failing_observer_never_stops_the_heartbeat(registry, metrics, leases, monkeypatch):
    def broken(*args: object) -> None:
        raise RuntimeError("observer bug")

    monkeypatch.setattr(metrics, "renew_seconds", SimpleNamespace(observe=broken))
    with leases.hold("r", ttl=0.3) as lease:
        start = lease._held.confirmed_at
        wait_until(lambda: lease._held.confirmed_at > start, 5, "renewals despite the observer")
    assert not lease.lost


def test_redelivery_outcomes_are_counted(registry, metrics):
    from celery_leases import signals

    assert value(registry, "redelivery_total", outcome="dropped") == 0
    for outcome in ("waiting", "dropped", "dropped", "ran"):
        signals.redelivery_guarded.send(sender="proj.t", task_id="x", retries=0, outcome=outcome)
    assert value(registry, "redelivery_total", outcome="waiting") == 1
    assert value(registry, "redelivery_total", outcome="dropped") == 2
    assert value(registry, "redelivery_total", outcome="ran") == 1
    assert value(registry, "redelivery_total", outcome="unguarded") == 0
