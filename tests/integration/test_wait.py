"""Waiting for a busy resource: bounded, woken by a release or an expiry, holding nothing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_leases import LeaseBusy, Leases
from celery_leases._identity import Identity
from celery_leases._lease import Want
from tests.support.holders import hold_by_hand
from tests.support.polling import SCHEDULING, wait_until


def poll(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    return wait_until(condition, timeout, what, step=0.01)


def subscribers(client: redis.Redis, leases: Leases, resource: str) -> int:
    ((_, count),) = client.pubsub_numsub(leases.store.keys.channel(resource))
    return int(count)


class Waiter(threading.Thread):
    """Runs ``leases.hold(resource, wait=...)`` in a thread and records what happened."""

    def __init__(self, leases: Leases, resource: Any, wait: float | None, ttl: float = 10):
        super().__init__(daemon=True)
        self.leases, self.resource, self.wait, self.ttl = leases, resource, wait, ttl
        self.granted_at: float | None = None
        self.got: list[str] = []
        self.error: BaseException | None = None
        self.started_at = time.monotonic()

    def run(self) -> None:
        try:
            with self.leases.hold(self.resource, wait=self.wait, ttl=self.ttl) as got:
                self.granted_at = time.monotonic()
                leases = got if isinstance(got, list) else [got]
                self.got = [lease.resource for lease in leases]
        except BaseException as exc:
            self.error = exc

    def finish(self, timeout: float) -> None:
        self.join(timeout)
        assert not self.is_alive(), "the waiter never returned"


def waiting_on_a_holder(
    leases: Leases, client: redis.Redis, ttl: float, wait: float
) -> tuple[list[Any], Waiter]:
    """Another owner's lease on "r" with a fixed expiry of ``ttl`` (not renewed), and a
    ``Waiter`` thread for it, subscribed to its release."""
    held = hold_by_hand(leases, "r", ttl)
    waiter = Waiter(leases, "r", wait=wait)
    waiter.start()
    poll(lambda: subscribers(client, leases, "r") == 1, SCHEDULING, "the waiter to subscribe")
    return held, waiter


def test_wait_zero_is_busy_at_once(leases: Leases, leases_redis):
    ttl = 60.0
    with leases.hold("r", ttl=ttl):
        start = time.monotonic()
        with pytest.raises(LeaseBusy) as info, leases.hold("r", wait=0):
            pass
        elapsed = time.monotonic() - start
    assert info.value.resource == "r"
    assert info.value.waited == 0.0
    assert info.value.retry_after is not None
    assert 0 < info.value.retry_after <= ttl
    assert elapsed < ttl / 2  # not waiting for the holder (the bound is no measure of speed)
    assert subscribers(leases_redis, leases, "r") == 0  # it never subscribed


def test_busy_names_the_first_busy_resource_of_a_list(leases: Leases):
    with (
        leases.hold("second"),
        pytest.raises(LeaseBusy) as info,
        leases.hold(["first", "second", "third"], wait=0),
    ):
        pass
    assert info.value.resource == "second"


def test_wait_n_raises_after_about_n(leases: Leases):
    wait = 0.6
    with leases.hold("r", ttl=30):
        start = time.monotonic()
        with pytest.raises(LeaseBusy) as info, leases.hold("r", wait=wait):
            pass
        elapsed = time.monotonic() - start
    assert info.value.resource == "r"
    assert wait <= info.value.waited <= elapsed
    assert elapsed < wait + SCHEDULING / 2  # it gives up: the holder is renewed, never freed
    assert f"waited {info.value.waited:.1f}s" in str(info.value)


def test_a_waiter_is_woken_by_the_release(leases: Leases, leases_redis):
    ttl = 60.0
    held, waiter = waiting_on_a_holder(leases, leases_redis, ttl, wait=3 * ttl)

    remaining = leases_redis.pttl(leases.store.keys.exclusive("r")) / 1000
    released_at = time.monotonic()
    assert leases.store.release(held) == [True]
    waiter.finish(3 * ttl)

    assert waiter.error is None
    assert waiter.granted_at is not None
    assert remaining > ttl / 2
    assert waiter.granted_at - released_at < remaining / 2  # woken, not by the expiry


def test_a_woken_waiter_runs_on_before_its_unsubscribe_is_sent(
    leases: Leases, leases_redis, monkeypatch
):
    """The UNSUBSCRIBE of a waiter that got its grant is sent by the returner thread: held
    back here, the waiter still returns with its lease, and the connection is unsubscribed
    once the returner runs (not left to receive every later release of the resource)."""
    gate = threading.Event()
    unsubscribe = redis.client.PubSub.unsubscribe

    def held_back(pubsub: redis.client.PubSub, *channels: str) -> Any:
        assert threading.current_thread().name == "celery-leases-unsubscriber"
        gate.wait(30)
        return unsubscribe(pubsub, *channels)

    monkeypatch.setattr(redis.client.PubSub, "unsubscribe", held_back)
    try:
        held, waiter = waiting_on_a_holder(leases, leases_redis, 60.0, wait=60.0)
        assert leases.store.release(held) == [True]
        waiter.finish(SCHEDULING)
        assert waiter.error is None
        assert waiter.got == ["r"]
        assert subscribers(leases_redis, leases, "r") == 1  # its UNSUBSCRIBE is held back
    finally:
        gate.set()
    poll(
        lambda: subscribers(leases_redis, leases, "r") == 0,
        SCHEDULING,
        "the returner's unsubscribe",
    )


def test_closing_a_store_ends_its_unsubscriber_thread(make_leases, leases_redis):
    leases = make_leases()
    holder = Identity("holder", "inc", 1)
    held = leases.store.try_acquire([Want("r")], holder, 60.0)
    assert isinstance(held, list)
    waiter = Waiter(leases, "r", wait=60.0)
    waiter.start()
    poll(lambda: subscribers(leases_redis, leases, "r"), SCHEDULING, "the waiter to subscribe")
    assert leases.store.release(held) == [True]
    waiter.finish(SCHEDULING)
    assert waiter.error is None

    returner = leases.store._subscribers._returner
    assert returner is not None
    thread = returner._thread
    assert thread.name == "celery-leases-unsubscriber"
    leases.store.close()
    poll(lambda: not thread.is_alive(), SCHEDULING, "the unsubscriber thread to end")
    assert subscribers(leases_redis, leases, "r") == 0


def test_a_waiter_gets_the_lease_of_a_killed_holder_after_its_ttl(leases: Leases, leases_redis):
    # long enough that the lease outlives the kill and the wait for the killed process
    ttl = 3.0
    child = textwrap.dedent(
        """
        import sys, time
        from celery import Celery
        from celery_leases import Leases

        leases = Leases(Celery("holder", set_as_current=False),
                        redis_url=sys.argv[1], key_prefix=sys.argv[2], node="doomed")
        with leases.hold("r", ttl=float(sys.argv[3])) as lease:
            print(leases.identity().owner, lease.token, flush=True)
            time.sleep(600)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child, leases.settings.url, leases.settings.key_prefix, str(ttl)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        owner, token = proc.stdout.readline().split()
        # let the holder's heartbeat renew a few times, so the kill lands mid-lease
        time.sleep(ttl / 2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=SCHEDULING)
        killed_at = time.monotonic()
        remaining = leases_redis.pttl(leases.store.keys.exclusive("r")) / 1000
        assert remaining > 0, "the lease should outlive its killed holder for a while"

        with leases.hold("r", wait=SCHEDULING) as lease:
            granted_at = time.monotonic()
            assert lease.token > int(token)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()

    # nobody released it: the dead holder's registry entry is still there
    registry = leases_redis.smembers(leases.store.keys.registry(owner, 0))
    # the entry names the grant call that made it: "x <token> -%c<call id> r"
    assert any(re.fullmatch(rf"x {token} -%c\S+ r", entry) for entry in registry), registry
    waited = granted_at - killed_at
    assert waited >= remaining * 0.9  # not before the lease ran out
    assert waited < remaining + SCHEDULING / 2  # woken by its expiry, not the end of the wait


def test_a_wait_longer_than_the_socket_timeout(make_leases):
    leases = make_leases()
    wait = 7.0
    assert wait > leases.settings.socket_timeout
    with leases.hold("r", ttl=10):  # renewed: its expiry never ends the wait
        start = time.monotonic()
        with pytest.raises(LeaseBusy) as info, leases.hold("r", wait=wait):
            pass
        elapsed = time.monotonic() - start
    assert info.value.waited >= wait
    assert elapsed < wait + SCHEDULING / 2  # it gives up: the holder is renewed, never freed


def test_wait_none_waits_until_the_release(make_leases, leases_redis):
    # a short socket timeout, so the wait outlasts it several times in little time
    leases = make_leases(socket_timeout=0.5)
    hold_for = 4 * leases.settings.socket_timeout
    with leases.hold("r", ttl=10):
        waiter = Waiter(leases, "r", wait=None)
        waiter.start()
        poll(lambda: subscribers(leases_redis, leases, "r"), SCHEDULING, "the waiter to subscribe")
        time.sleep(hold_for)  # the time passing is the point: the waiter must outlast it
        assert waiter.is_alive()
        released_at = time.monotonic()
    waiter.finish(SCHEDULING)
    assert waiter.error is None
    assert waiter.got == ["r"]
    assert waiter.granted_at is not None
    assert waiter.granted_at >= released_at
    assert waiter.granted_at - waiter.started_at >= hold_for


def test_a_waiting_list_holds_none_of_its_members(leases: Leases, leases_redis):
    rival = Identity("rival", "inc", 1)
    with leases.hold("b", ttl=10):
        waiter = Waiter(leases, ["a", "b", "c"], wait=120)
        waiter.start()
        poll(lambda: subscribers(leases_redis, leases, "b"), SCHEDULING, "the waiter to subscribe")
        for _ in range(3):
            assert leases.store.holders("a") == []
            assert leases.store.holders("c") == []
            # another owner can take and give back the free members meanwhile (each release
            # wakes the waiter, which tries again and must let go of everything again). It
            # waits its turn: a wake-up that comes while the rival holds "a" finds "a" busy,
            # and queues the waiter there until its next attempt (first come, first served)
            got = leases.store.acquire([Want("a"), Want("c")], rival, 10.0, wait=SCHEDULING)
            assert leases.store.release(got) == [True, True]
        assert waiter.is_alive()
        assert leases.store.holders("a") == []
    waiter.finish(SCHEDULING)
    assert waiter.error is None
    assert waiter.got == ["a", "b", "c"]


def test_a_woken_waiter_skips_redis_pys_message_parsing(leases: Leases, leases_redis, monkeypatch):
    """On a plain socket read with hiredis, the wait reads its wake-up past redis-py's
    get_message (see _lanes.skip_replies), and still wakes on the release."""
    kinds: list[str] = []  # of the messages redis-py's get_message returned
    get_message = redis.client.PubSub.get_message

    def counted(pubsub: redis.client.PubSub, *args: Any, **kwargs: Any) -> Any:
        message = get_message(pubsub, *args, **kwargs)
        if message is not None:
            kinds.append(message["type"])
        return message

    monkeypatch.setattr(redis.client.PubSub, "get_message", counted)
    held, waiter = waiting_on_a_holder(leases, leases_redis, 120.0, wait=120.0)
    released_at = time.monotonic()
    assert leases.store.release(held) == [True]
    waiter.finish(SCHEDULING)
    assert waiter.error is None
    assert waiter.granted_at is not None
    assert waiter.granted_at - released_at < 60  # woken, not the holder's expiry (120 s)
    assert "subscribe" in kinds  # the SUBSCRIBE's confirmations: read by redis-py
    assert "message" not in kinds  # the wake-up: not


def test_a_killed_subscriber_connection_strands_no_waiter(make_leases, make_redis_server):
    """The waiter's pub/sub connection is killed while it waits: redis-py's path connects
    and subscribes again, and the release still wakes it, long before the holder's expiry."""
    server = make_redis_server()
    leases = make_leases(redis_url=server.url)
    admin = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        held, waiter = waiting_on_a_holder(leases, admin, 120.0, wait=120.0)
        assert admin.client_kill_filter(_type="pubsub") == 1
        poll(
            lambda: subscribers(admin, leases, "r") == 1,
            SCHEDULING,
            "the waiter to subscribe again",
        )
        released_at = time.monotonic()
        assert leases.store.release(held) == [True]
        waiter.finish(SCHEDULING)
    finally:
        admin.close()
    assert waiter.error is None
    assert waiter.granted_at is not None
    assert waiter.granted_at - released_at < 60  # woken, not the holder's expiry (120 s)


def test_a_wait_that_runs_out_gives_its_connection_back(make_leases, leases_redis):
    """A wait that ends in LeaseBusy unsubscribes and keeps its connection for the next wait,
    as a granted one does: closing it would cost every timed-out wait a new connection."""
    leases = make_leases()
    holder = Identity("holder", "inc", 1)
    held = leases.store.try_acquire([Want("r")], holder, 60.0)
    assert isinstance(held, list)
    with pytest.raises(LeaseBusy):
        leases.store.acquire([Want("r")], Identity("waiter", "inc", 1), 60.0, wait=0.2)
    # unsubscribed (by the returner thread), and kept idle for the next wait
    poll(lambda: subscribers(leases_redis, leases, "r") == 0, SCHEDULING, "the unsubscribe")
    poll(lambda: len(leases.store._subscribers._idle) == 1, SCHEDULING, "the idle connection")
    leases.store.release(held)
