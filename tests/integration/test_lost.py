"""A holder that cannot renew learns that its lease is lost before anyone else can take it.

Every test runs on a private Redis: they freeze it, pause its clients, or restart it empty.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
import redis

from celery_leases import LeaseLost
from celery_leases.signals import lease_lost
from tests.support.polling import wait_until

TTL = 1.0


def poll(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    return wait_until(condition, timeout, what, step=0.005)


class LostLog:
    """Monotonic times at which ``lease_lost`` was sent, per owner and resource."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float]] = []
        self._lock = threading.Lock()

    def __call__(self, sender: Any = None, **kwargs: Any) -> None:
        with self._lock:
            self.events.append((kwargs["owner"], kwargs["resource"], time.monotonic()))

    def times(self, owner: str, resource: str) -> list[float]:
        with self._lock:
            return [t for o, r, t in self.events if (o, r) == (owner, resource)]


@pytest.fixture
def lost_log() -> Iterator[LostLog]:
    log = LostLog()
    lease_lost.connect(log, weak=False)
    yield log
    lease_lost.disconnect(log)


@pytest.fixture
def server(make_redis_server):
    return make_redis_server()


def confirmed_once(lease: Any) -> bool:
    """True once the heartbeat confirmed the lease after its grant (its connection is open)."""
    return bool(lease._held.confirmed_at > lease._held.acquired_at)


def leave_lost(stack: ExitStack) -> None:
    """Leave the ``hold()`` block of ``stack``: it must tell that the lease was lost."""
    with pytest.raises(LeaseLost):
        stack.close()


def test_frozen_redis_holder_learns_before_anyone_else_can_acquire(server, make_leases, lost_log):
    holder = make_leases(redis_url=server.url, node="holder")
    owner = holder.identity().owner
    with ExitStack() as stack:
        lease = stack.enter_context(holder.hold("r", ttl=TTL))
        poll(lambda: confirmed_once(lease), TTL, "a first renewal")
        server.pause()
        paused_at = time.monotonic()
        try:
            poll(lambda: lost_log.times(owner, "r"), 3 * TTL, "lease_lost")
            with pytest.raises(LeaseLost):
                lease.check()
            assert lease.lost
            assert lease.expires_in == 0.0
            # the point of this test is time passing past the TTL while Redis is frozen
            time.sleep(max(0.0, paused_at + 1.5 * TTL - time.monotonic()))
        finally:
            server.resume()
        resumed_at = time.monotonic()

        second = make_leases(redis_url=server.url, node="second")
        with second.hold("r", wait=5 * TTL) as taken:
            granted_at = time.monotonic()
            assert taken.token > lease.token
        leave_lost(stack)

    (lost_at,) = lost_log.times(owner, "r")
    assert paused_at < lost_at < resumed_at < granted_at
    # before Redis itself could have expired the lease (its TTL runs from a renewal that
    # was sent no earlier than confirmed_at)
    assert lost_at < lease._held.confirmed_at + TTL


def test_client_pause_holder_learns_before_anyone_else_can_acquire(server, make_leases, lost_log):
    holder = make_leases(redis_url=server.url, node="holder")
    owner = holder.identity().owner
    admin = redis.Redis.from_url(server.url)
    waiter = redis.Redis.from_url(server.url, socket_timeout=10 * TTL)
    try:
        admin.ping()
        waiter.ping()
        with ExitStack() as stack:
            lease = stack.enter_context(holder.hold("r", ttl=TTL))
            poll(lambda: confirmed_once(lease), TTL, "a first renewal")
            pause_ms = int(1.5 * TTL * 1000)
            assert admin.execute_command("CLIENT", "PAUSE", pause_ms, "ALL")
            paused_at = time.monotonic()

            poll(lambda: lost_log.times(owner, "r"), 3 * TTL, "lease_lost")
            with pytest.raises(LeaseLost):
                lease.check()
            assert waiter.ping()  # held back by Redis until the pause is over
            resumed_at = time.monotonic()
            assert resumed_at - paused_at >= pause_ms / 1000 * 0.95

            second = make_leases(redis_url=server.url, node="second")
            with second.hold("r", wait=5 * TTL) as taken:
                granted_at = time.monotonic()
                assert taken.token > lease.token
            leave_lost(stack)
    finally:
        admin.close()
        waiter.close()

    (lost_at,) = lost_log.times(owner, "r")
    assert paused_at < lost_at < resumed_at < granted_at
    assert lost_at < lease._held.confirmed_at + TTL


def test_restarted_empty_redis_holder_learns_at_its_next_renewal(server, make_leases, lost_log):
    # a longer TTL: the restart itself (kill, start, first PING) must fit well inside the
    # holder's renewal rounds, so that a renewal, not the deadline, tells it
    ttl = 2 * TTL
    holder = make_leases(redis_url=server.url, node="holder", restart_grace=ttl)
    owner = holder.identity().owner
    with ExitStack() as stack:
        # a new Redis counts as just restarted: the first grant waits out restart_grace too
        lease = stack.enter_context(holder.hold("r", ttl=ttl, wait=5 * ttl))
        poll(lambda: confirmed_once(lease), ttl, "a first renewal")
        before = lease.token
        killed_at = time.monotonic()
        server.restart()
        restarted_at = time.monotonic()

        second = make_leases(redis_url=server.url, node="second", restart_grace=ttl)
        with second.hold("r", wait=5 * ttl) as taken:
            granted_at = time.monotonic()
            after = taken.token
        with pytest.raises(LeaseLost):
            lease.check()
        leave_lost(stack)

    (lost_at,) = lost_log.times(owner, "r")
    assert killed_at < lost_at < granted_at
    # it was told by Redis at a renewal, not by its own deadline running out
    assert lost_at < lease._held.deadline
    # fencing tokens keep growing across the data loss
    assert after > before
    assert granted_at - restarted_at >= ttl * 0.95  # the grace held the second client back


def test_without_renewals_a_held_lease_is_lost_by_its_deadline(server, make_leases, lost_log):
    """Redis refusing connections (stopped) is noticed by the deadline alone."""
    holder = make_leases(redis_url=server.url, node="holder", socket_connect_timeout=0.2)
    owner = holder.identity().owner
    with ExitStack() as stack:
        lease = stack.enter_context(holder.hold("r", ttl=TTL))
        poll(lambda: confirmed_once(lease), TTL, "a first renewal")
        server.stop()
        stopped_at = time.monotonic()
        poll(lambda: lost_log.times(owner, "r"), 3 * TTL, "lease_lost")
        with pytest.raises(LeaseLost):
            lease.check()
        leave_lost(stack)
    (lost_at,) = lost_log.times(owner, "r")
    assert stopped_at < lost_at < lease._held.confirmed_at + TTL


def test_frozen_redis_while_the_pool_is_busy_holder_still_learns_in_time(
    server, make_leases, lost_log
):
    """A renewal must not wait on a connection handshake past the lease's deadline.

    Another thread of the holder's process is blocked in a Redis call on the store's client,
    so the pool has no idle connection when Redis freezes.
    """
    holder = make_leases(redis_url=server.url, node="holder")
    owner = holder.identity().owner
    queue = f"{{{holder.settings.key_prefix}}}:busy"
    blocked = threading.Thread(
        target=lambda: holder.store.client.blpop([queue], timeout=4 * TTL), daemon=True
    )
    admin = redis.Redis.from_url(server.url)
    try:
        with ExitStack() as stack:
            lease = stack.enter_context(holder.hold("r", ttl=TTL))
            poll(lambda: confirmed_once(lease), TTL, "a first renewal")
            blocked.start()
            poll(lambda: admin.info("clients")["blocked_clients"] == 1, TTL, "BLPOP")
            server.pause()
            paused_at = time.monotonic()
            try:
                poll(lambda: lost_log.times(owner, "r"), 6 * TTL, "lease_lost")
            finally:
                server.resume()
            leave_lost(stack)
        admin.rpush(queue, "done")
        blocked.join(5 * TTL)
    finally:
        admin.close()
    (lost_at,) = lost_log.times(owner, "r")
    assert paused_at < lost_at < lease._held.confirmed_at + TTL


def test_a_frozen_redis_does_not_cost_the_leases_held_on_another(make_redis_server, make_leases):
    """One heartbeat renews for every store: a frozen Redis must not starve a healthy one."""
    frozen_server, healthy_server = make_redis_server(), make_redis_server()
    frozen = make_leases(redis_url=frozen_server.url, node="a")
    healthy = make_leases(redis_url=healthy_server.url, node="b")
    with ExitStack() as frozen_stack:
        # taken first, so the heartbeat meets the frozen store first in every round
        on_frozen = frozen_stack.enter_context(frozen.hold("r", ttl=TTL))
        with healthy.hold("r", ttl=TTL) as on_healthy:
            poll(lambda: confirmed_once(on_healthy), TTL, "a first renewal")
            frozen_server.pause()
            try:
                start = time.monotonic()
                # the point is time passing: several TTLs of the healthy lease
                while time.monotonic() - start < 3 * TTL:
                    on_healthy.check()
                    time.sleep(TTL / 20)
                assert on_frozen.lost
            finally:
                frozen_server.resume()
            assert not on_healthy.lost
            assert [h.owner for h in healthy.store.holders("r")] == [healthy.identity().owner]
        leave_lost(frozen_stack)
