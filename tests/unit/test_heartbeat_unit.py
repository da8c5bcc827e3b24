"""Heartbeat driven by hand: a fake clock, a fake store, ``tick()`` called directly (no thread)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from celery_leases._keys import Keyspace
from celery_leases._lease import Held
from celery_leases._renewround import RETRY_AFTER_FAILURE
from celery_leases._sync.heartbeat import Heartbeat
from celery_leases.exceptions import LeaseBackendError

# Binary fractions keep the fake clock exact: 1.5 s horizon -> renew every 0.5 s.
STEP = 1 / 16
HORIZON = 1.5
INTERVAL = HORIZON / 3


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class RenewCall:
    owner: str
    resources: list[str]
    timeout: float
    at: float
    first_deadline: float


@dataclass
class FakeStore:
    """Stands in for LeaseStore: renew() does what the test says, and records each call."""

    clock: FakeClock
    socket_timeout: float = 5.0
    url: str = "redis://127.0.0.1:6379/0"
    calls: list[RenewCall] = field(default_factory=list)
    fail: list[BaseException] = field(default_factory=list)  # raised by the next calls, in order
    missing: set[str] = field(default_factory=set)  # resources "Redis" no longer has
    duration: float = 0.0  # how long each call takes on the fake clock
    frozen: bool = False  # like a frozen Redis: each call times out after its whole timeout

    def __post_init__(self) -> None:
        self.settings = SimpleNamespace(socket_timeout=self.socket_timeout, url=self.url)
        self.keys = Keyspace("unit")

    def renew(self, held: list[Held], owner: str, timeout: float) -> set[int]:
        self.calls.append(
            RenewCall(
                owner,
                [h.resource for h in held],
                timeout,
                self.clock(),
                min(h.deadline for h in held),
            )
        )
        self.clock.advance(self.duration)
        if self.frozen:
            self.clock.advance(timeout)
            raise LeaseBackendError(f"no reply within {timeout:.2f}s")
        if self.fail:
            raise self.fail.pop(0)
        return {i for i, h in enumerate(held) if h.resource in self.missing}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> FakeStore:
    return FakeStore(clock)


@pytest.fixture
def lost_log() -> list[tuple[str, float]]:
    return []


@pytest.fixture
def beat(clock: FakeClock, lost_log: list[tuple[str, float]]) -> Iterator[Heartbeat]:
    hb = Heartbeat(
        clock=clock,
        lost_callback=lambda h: lost_log.append((h.resource, clock())),
        autostart=False,
    )
    yield hb
    assert hb._thread is None, "a unit test must not start the heartbeat thread"


def make_held(
    store: Any,
    clock: FakeClock,
    resource: str,
    *,
    owner: str = "node/inc/1",
    horizon: float = HORIZON,
) -> Held:
    now = clock()
    # the fake store stands in for the engine that granted the lease and for the driver
    # that renews it (beat.add(held, held.engine))
    return Held(
        engine=store,
        owner=owner,
        resource=resource,
        mode="x",
        token=1,
        ttl=horizon / 0.9,
        acquired_at=now,
        confirmed_at=now,
        horizon=horizon,
    )


def run(beat: Heartbeat, clock: FakeClock, until: float) -> None:
    """Tick every STEP until the fake clock reaches ``until``."""
    while clock() < until:
        clock.advance(STEP)
        beat.tick()


@pytest.mark.parametrize("count", [1, 7, 300])
def test_one_renew_call_per_interval_whatever_the_number_of_leases(beat, store, clock, count):
    held = [make_held(store, clock, f"r{i}") for i in range(count)]
    for h in held:
        beat.add(h, h.engine)

    run(beat, clock, 10.0)

    assert [c.at for c in store.calls] == [INTERVAL * k for k in range(1, 21)]
    for call in store.calls:
        assert sorted(call.resources) == sorted(h.resource for h in held)
        assert call.owner == "node/inc/1"
    assert not any(h.lost for h in held)
    # each lease was confirmed by the last renewal (sent at 10.0)
    assert {h.confirmed_at for h in held} == {10.0}


def test_one_call_per_owner_and_interval(beat, store, clock):
    # the heartbeat keeps weak references: the test keeps the leases alive
    held = [make_held(store, clock, f"a{i}", owner="n/i/1") for i in range(5)]
    held += [make_held(store, clock, f"b{i}", owner="n/i/2") for i in range(5)]
    for h in held:
        beat.add(h, h.engine)

    run(beat, clock, 2.0)

    assert len(store.calls) == 2 * 4
    assert sorted(c.owner for c in store.calls) == ["n/i/1"] * 4 + ["n/i/2"] * 4


def test_a_lease_not_confirmed_by_its_deadline_is_lost_once(beat, store, clock, lost_log):
    store.fail = [LeaseBackendError("redis is down")] * 1000
    held = make_held(store, clock, "r")
    own_calls: list[float] = []
    held.on_lost.append(lambda h: own_calls.append(clock()))
    beat.add(held, held.engine)

    run(beat, clock, HORIZON - STEP)
    assert not held.lost
    assert held.is_lost(clock()) is False

    run(beat, clock, 5 * HORIZON)

    assert held.lost
    assert own_calls == [HORIZON]
    assert lost_log == [("r", HORIZON)]
    assert beat.snapshot() == []
    # nothing is renewed once the lease counts as lost
    assert all(c.at < HORIZON for c in store.calls)


def test_lease_that_redis_no_longer_has_is_lost_at_that_renewal(beat, store, clock, lost_log):
    keep, gone = make_held(store, clock, "keep"), make_held(store, clock, "gone")
    beat.add(keep, keep.engine)
    beat.add(gone, gone.engine)
    store.missing = {"gone"}

    run(beat, clock, 4 * HORIZON)

    assert lost_log == [("gone", INTERVAL)]
    assert gone.lost
    assert not keep.lost
    assert keep.confirmed_at == store.calls[-1].at
    assert all(c.resources == ["keep"] for c in store.calls[1:])


def test_failing_callback_does_not_stop_the_others(beat, store, clock, lost_log):
    store.missing = {"r"}
    held = make_held(store, clock, "r")
    seen: list[str] = []

    def broken(h: Held) -> None:
        raise RuntimeError("a receiver failed")

    held.on_lost.extend([broken, lambda h: seen.append(h.resource)])
    beat.add(held, held.engine)

    run(beat, clock, 2 * INTERVAL)

    assert seen == ["r"]
    assert lost_log == [("r", INTERVAL)]


def test_store_error_does_not_kill_the_loop(beat, store, clock, lost_log):
    store.fail = [LeaseBackendError("blip")]
    held = make_held(store, clock, "r")
    beat.add(held, held.engine)

    run(beat, clock, 10.0)  # tick() raised nothing

    assert store.calls[0].at == INTERVAL
    assert len(store.calls) == 20
    assert not held.lost
    assert lost_log == []
    assert held.confirmed_at == 10.0


@pytest.mark.parametrize("horizon", [HORIZON, 27.0])
def test_renewal_after_a_failure_is_retried_within_the_interval(beat, clock, horizon):
    store = FakeStore(clock, fail=[LeaseBackendError("blip")])
    held = make_held(store, clock, "r", horizon=horizon)
    beat.add(held, held.engine)
    interval = horizon / 3

    run(beat, clock, interval)
    assert [c.at for c in store.calls] == [interval]
    delay = beat.tick()
    assert delay is not None
    assert delay <= min(interval, RETRY_AFTER_FAILURE)

    run(beat, clock, interval + min(interval, RETRY_AFTER_FAILURE))

    assert len(store.calls) == 2
    assert store.calls[1].at - store.calls[0].at <= min(interval, RETRY_AFTER_FAILURE)
    assert held.confirmed_at == store.calls[1].at
    assert not held.lost


def test_renewal_timeout_ends_at_the_first_deadline(beat, clock):
    store = FakeStore(clock, socket_timeout=60.0)
    leases = [make_held(store, clock, "short", horizon=0.75)]
    clock.advance(0.25)
    leases.append(make_held(store, clock, "long", horizon=6.0))
    for h in leases:
        beat.add(h, h.engine)

    run(beat, clock, 3.0)

    assert store.calls
    for call in store.calls:
        assert 0 < call.timeout <= call.first_deadline - call.at
    # and never above the socket timeout
    store2 = FakeStore(clock, socket_timeout=0.125)
    other = make_held(store2, clock, "other", horizon=27.0)
    beat.add(other, other.engine)
    run(beat, clock, clock() + 10.0)
    assert store2.calls
    assert all(c.timeout <= 0.125 for c in store2.calls)


def test_a_slow_renewal_confirms_at_the_time_it_was_sent(beat, clock):
    store = FakeStore(clock, duration=0.25)
    held = make_held(store, clock, "r")
    beat.add(held, held.engine)

    run(beat, clock, INTERVAL)

    (call,) = store.calls
    assert clock() == call.at + 0.25
    # Redis extended the lease somewhere in [sent, returned]: only "sent" is safe to trust
    assert held.confirmed_at == call.at


@pytest.mark.parametrize("outcome", ["fails", "succeeds"])
def test_a_renewal_that_returns_after_the_deadline_does_not_save_the_lease(
    beat, clock, lost_log, outcome
):
    # the fake store answers late; a real one would have timed out at the deadline
    store = FakeStore(clock, duration=HORIZON)
    if outcome == "fails":
        store.fail = [LeaseBackendError("timeout")]
    held = make_held(store, clock, "r")
    beat.add(held, held.engine)
    run(beat, clock, INTERVAL - STEP)

    clock.advance(STEP)
    assert beat.tick() == 0.0  # the call returned past the deadline: look again at once
    assert clock() == INTERVAL + HORIZON
    beat.tick()

    assert held.lost
    assert lost_log == [("r", INTERVAL + HORIZON)]
    run(beat, clock, 3 * HORIZON)
    assert len(lost_log) == 1


def test_released_lease_is_neither_renewed_nor_lost(beat, store, clock, lost_log):
    held = make_held(store, clock, "r")
    other = make_held(store, clock, "other")
    beat.add(held, held.engine)
    beat.add(other, other.engine)
    run(beat, clock, INTERVAL)
    held.released = True
    beat.discard(held)

    run(beat, clock, 5 * HORIZON)

    assert all(c.resources == ["other"] for c in store.calls[1:])
    assert held.mark_lost() is False
    assert lost_log == []


def test_a_lease_nobody_references_is_dropped(beat, store, clock, lost_log):
    kept = make_held(store, clock, "kept")
    beat.add(kept, kept.engine)
    beat.add(make_held(store, clock, "dropped"), store)  # no reference left: gone from the registry

    run(beat, clock, 2 * HORIZON)

    assert {r for c in store.calls for r in c.resources} == {"kept"}
    assert lost_log == []


def test_nothing_held_means_nothing_to_do(beat, store, clock):
    assert beat.tick() is None
    held = make_held(store, clock, "r")
    beat.add(held, held.engine)
    delay = beat.tick()
    assert delay == INTERVAL
    held.released = True
    beat.discard(held)
    assert beat.tick() is None
    assert store.calls == []


@pytest.mark.parametrize("frozen_first", [True, False])
def test_a_frozen_store_does_not_cost_the_leases_of_another(beat, clock, lost_log, frozen_first):
    frozen, healthy = FakeStore(clock, frozen=True), FakeStore(clock)
    # same grant time, same horizon: both batches are due together and share one deadline
    stores = [frozen, healthy] if frozen_first else [healthy, frozen]
    held = [make_held(store, clock, f"r{i}") for i, store in enumerate(stores)]
    for h in held:
        beat.add(h, h.engine)
    on_frozen = held[0] if frozen_first else held[1]
    on_healthy = held[1] if frozen_first else held[0]

    run(beat, clock, 5 * HORIZON)

    assert not on_healthy.lost
    assert on_healthy.confirmed_at >= 5 * HORIZON - INTERVAL - STEP
    # lost at its deadline (the tick after the call that timed out at the deadline)
    [(resource, lost_at)] = lost_log
    assert resource == on_frozen.resource
    assert HORIZON <= lost_at <= HORIZON + STEP
    # the frozen store was tried, within the time it had
    assert frozen.calls
    assert all(c.timeout <= c.first_deadline - c.at for c in frozen.calls)


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname in ("ERROR", "WARNING")]


def test_each_redis_servers_first_failure_is_an_error_of_its_own(beat, clock, caplog):
    """A failing server never hides another's failure at DEBUG, and a server whose leases
    are gone is forgotten: its next failure is an ERROR again."""
    a = FakeStore(clock, url="redis://a:6379/0")
    b = FakeStore(clock, url="redis://b:6379/0")
    a.fail = [LeaseBackendError("a down")] * 3
    on_a = make_held(a, clock, "on-a", horizon=27.0)
    beat.add(on_a, on_a.engine)
    caplog.set_level("DEBUG")
    run(beat, clock, 9.0 + STEP)  # the first renewal of a fails
    assert _errors(caplog) == ["leases: renewal of 1 lease(s) failed: a down"]

    caplog.clear()
    b.fail = [LeaseBackendError("b down")]
    on_b = make_held(b, clock, "on-b", horizon=27.0)
    beat.add(on_b, on_b.engine)
    run(beat, clock, 10.5)  # a fails again (DEBUG), b fails for the first time (ERROR)
    assert _errors(caplog) == ["leases: renewal of 1 lease(s) failed: b down"]
    assert any("still failing: a down" in r.getMessage() for r in caplog.records)

    caplog.clear()
    run(beat, clock, 12.0)  # both answer again, each told apart
    assert sorted(_errors(caplog)) == [
        "leases: renewals succeed again (redis://a:6379/0)",
        "leases: renewals succeed again (redis://b:6379/0)",
    ]

    caplog.clear()
    a.fail = [LeaseBackendError("a down again")] * 100
    run(beat, clock, 21.5)  # a fails again: news, at ERROR
    on_a.released = True  # a's only lease goes while a fails; b renews on: a is forgotten
    run(beat, clock, 40.0)
    again = make_held(a, clock, "on-a-2", horizon=27.0)
    beat.add(again, again.engine)
    run(beat, clock, 50.0)
    told = [e for e in _errors(caplog) if "a down again" in e]
    assert told == ["leases: renewal of 1 lease(s) failed: a down again"] * 2
