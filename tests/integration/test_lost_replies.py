"""Script calls whose reply is lost: a loopback proxy in front of the real test Redis forwards
the request (it runs), then cuts the connection before the reply reaches the client, or holds
the reply back past the client's socket timeout. Every call must come out as if the reply had
arrived, or fail cleanly, and leave no orphan grant or claim behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlparse

import pytest

from celery_leases import LeaseBackendError, Leases, Shared, _scripts
from celery_leases._claims import Claimed, ClaimHolder
from celery_leases._lease import Held, Want
from celery_leases._sync.driver import LeaseStore
from tests.support.polling import SCHEDULING, wait_until
from tests.support.proxy import LossyProxy
from tests.support.topologies import resources_in_distinct_groups

#: the socket timeout of the stores behind the proxy; a held-back reply comes later than it
SOCKET_TIMEOUT = 0.5
HELD_BACK = 3 * SOCKET_TIMEOUT


def sha(source: str) -> bytes:
    """What identifies a script's EVALSHA request on the wire."""
    return hashlib.sha1(source.encode()).hexdigest().encode()


@pytest.fixture
def proxy(leases_redis_url: str) -> Iterator[LossyProxy]:
    """A lossy proxy in front of the test Redis."""
    url = urlparse(leases_redis_url)
    with LossyProxy(url.hostname or "127.0.0.1", url.port or 6379) as p:
        yield p


@pytest.fixture
def lossy_url(proxy: LossyProxy, leases_redis_url: str) -> str:
    """The test Redis URL, through the proxy."""
    db = int(urlparse(leases_redis_url).path.lstrip("/") or 0)
    return proxy.url(db)


@pytest.fixture
def make_lossy(make_leases: Callable[..., Leases], lossy_url: str) -> Callable[..., Leases]:
    """Factory: Leases whose Redis connections go through the proxy."""

    def make(**settings: object) -> Leases:
        settings.setdefault("socket_timeout", SOCKET_TIMEOUT)
        return make_leases(redis_url=lossy_url, **settings)

    return make


def lose(proxy: LossyProxy, source: str, how: str, *, after: int = 0) -> None:
    """Arm ``proxy`` to lose the next reply to script ``source``: cut, or held back."""
    if how == "cut":
        proxy.drop_next_reply(sha(source), after=after)
    else:
        proxy.delay_next_reply(sha(source), HELD_BACK, after=after)


HOW = pytest.mark.parametrize("how", ["cut", "timeout"])


@pytest.fixture
def mine(make_lossy: Callable[..., Leases]) -> Leases:
    """Leases of this test whose Redis connections go through the proxy."""
    return make_lossy()


@pytest.fixture
def other(make_leases: Callable[..., Leases]) -> Leases:
    """Leases of another node, straight to Redis: who would take an orphan's resource."""
    return make_leases(node="other-node")


def assert_free_for_others(other: Leases, *resources: str) -> None:
    """Another owner can take ``resources`` right away: no orphan grant is left."""
    with other.hold(resources, wait=0):
        pass


def registry_empty(leases: Leases) -> bool:
    return leases.store.entries(leases.identity().owner) == []


# --- grants ---------------------------------------------------------------------------------
@HOW
@pytest.mark.parametrize("slot_groups", [1, 4])
def test_hold_of_a_free_resource_survives_a_lost_grant_reply(
    make_lossy: Callable[..., Leases],
    make_leases: Callable[..., Leases],
    proxy: LossyProxy,
    how: str,
    slot_groups: int,
):
    mine = make_lossy(slot_groups=slot_groups)
    other = make_leases(node="other-node", slot_groups=slot_groups)
    # with 4 groups, a resource outside the home group: the home call and the grant go out
    # together in one pipeline
    resource = "printer"
    if slot_groups > 1:
        spread = resources_in_distinct_groups(mine, slot_groups)
        resource = next(r for r in spread if mine.store.keys.group_of(r))
    lose(proxy, _scripts.ACQUIRE, how)

    with mine.hold(resource) as lease:
        assert not proxy.armed()  # the reply was lost
        (holder,) = other.store.holders(resource)
        assert (holder.token, holder.owner) == (lease.token, mine.identity().owner)

    assert registry_empty(mine)
    assert_free_for_others(other, resource)


def test_ahold_gives_up_on_a_redis_that_stops_answering(
    mine: Leases, other: Leases, proxy: LossyProxy
):
    # the reply of the grant is held back far past the socket timeout: the call must end at
    # that timeout as a lost reply (read back on a new connection), not wait for the reply
    import asyncio

    proxy.delay_next_reply(sha(_scripts.ACQUIRE), 60 * SOCKET_TIMEOUT)

    async def run() -> tuple[int, int]:
        try:
            async with mine.ahold("printer") as lease:
                assert not proxy.armed()
            async with mine.ahold("printer") as again:  # the next call gets its own reply
                pass
            return lease.token, again.token
        finally:
            await mine.astore.aclose()

    async def bounded() -> tuple[int, int]:
        return await asyncio.wait_for(run(), 20 * SOCKET_TIMEOUT)

    first, second = asyncio.run(bounded())
    assert 0 < first < second
    assert registry_empty(mine)
    assert_free_for_others(other, "printer")


@HOW
def test_ahold_of_a_free_resource_survives_a_lost_grant_reply(
    mine: Leases,
    other: Leases,
    proxy: LossyProxy,
    how: str,
):
    import asyncio

    lose(proxy, _scripts.ACQUIRE, how)

    async def run() -> int:
        try:
            async with mine.ahold("printer") as lease:
                assert not proxy.armed()
                return lease.token
        finally:
            await mine.astore.aclose()

    token = asyncio.run(run())
    assert token > 0
    assert registry_empty(mine)
    assert_free_for_others(other, "printer")


@HOW
def test_a_request_across_slot_groups_survives_a_lost_reply_in_its_second_group(
    make_lossy: Callable[..., Leases],
    make_leases: Callable[..., Leases],
    proxy: LossyProxy,
    how: str,
):
    mine = make_lossy(slot_groups=4)
    other = make_leases(node="other-node", slot_groups=4)
    names = resources_in_distinct_groups(mine, 3)
    with mine.hold("warm-up"):  # registered: each group's grant is a call of its own
        pass
    lose(proxy, _scripts.ACQUIRE, how, after=1)  # the first group's call goes through

    with mine.hold(tuple(names)) as leases:
        assert not proxy.armed()
        assert [lease.resource for lease in leases] == names

    assert registry_empty(mine)
    assert_free_for_others(other, *names)


def test_a_lost_reply_never_takes_a_live_lease_of_another_thread(
    mine: Leases, other: Leases, proxy: LossyProxy
):
    # two threads of one process share its owner id: each may hold a shared lease
    first = mine.hold(Shared("pool"))
    first_lease = first.__enter__()
    got: list[int] = []

    def second() -> None:
        lose(proxy, _scripts.ACQUIRE, "cut")
        with mine.hold(Shared("pool")) as lease:
            got.append(lease.token)

    thread = threading.Thread(target=second)
    thread.start()
    thread.join(30)
    assert got
    assert got[0] != first_lease.token
    # the first thread's lease is still there, and still its own
    holders = other.store.holders("pool")
    assert [h.token for h in holders] == [first_lease.token]
    first.__exit__(None, None, None)
    assert registry_empty(mine)
    assert_free_for_others(other, "pool")


@HOW
def test_once_runs_once_when_its_grant_reply_is_lost(
    mine: Leases,
    other: Leases,
    proxy: LossyProxy,
    how: str,
):
    calls: list[int] = []
    lose(proxy, _scripts.ACQUIRE, how)

    def migrate(n: int) -> Callable[[], str]:
        def run() -> str:
            calls.append(n)
            return f"done {n}"

        return run

    receipt = mine.once("migrate", migrate(1), wait=2.0)

    assert not proxy.armed()
    assert calls == [1]
    assert receipt == other.once("migrate", migrate(2), wait=2.0)
    assert calls == [1]
    assert registry_empty(mine)


@pytest.mark.parametrize(("ttl", "kept"), [(30.0, True), (0.8, False)])
def test_a_lost_grant_is_adopted_only_with_time_left_on_its_horizon(
    mine: Leases,
    other: Leases,
    proxy: LossyProxy,
    caplog: pytest.LogCaptureFixture,
    ttl: float,
    kept: bool,
):
    # the reply comes after the socket timeout (0.5 s): a lease of ttl 0.8 s (horizon 0.72 s)
    # would count as lost before the heartbeat could renew it, so it is given back and the
    # grant made again; one of ttl 30 s is kept
    lose(proxy, _scripts.ACQUIRE, "timeout")
    with caplog.at_level(logging.INFO, logger="celery_leases._readback"):
        (lease,) = mine.acquire([Want("printer")], ttl=ttl)
    try:
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert ("is kept" in messages) is kept, messages
        assert ("given back" in messages) is not kept, messages
        (holder,) = other.store.holders("printer")
        assert holder.token == lease.token
    finally:
        mine.release([lease])
    assert registry_empty(mine)
    assert_free_for_others(other, "printer")


def test_a_grant_left_by_a_recovery_that_cannot_reach_redis_is_logged_and_registered(
    mine: Leases,
    other: Leases,
    proxy: LossyProxy,
    caplog: pytest.LogCaptureFixture,
):
    proxy.drop_next_reply(sha(_scripts.ACQUIRE), then_refuse=True)
    with caplog.at_level(logging.ERROR), pytest.raises(LeaseBackendError):
        mine.acquire([Want("printer")], ttl=5)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("'printer'" in m and "TTL" in m for m in errors), errors
    # the orphan: in the owner's registry, and bounded by its TTL
    owner = mine.identity().owner
    assert [e.resource for e in other.store.entries(owner)] == ["printer"]
    (holder,) = other.store.holders("printer")
    assert holder.owner == owner
    assert 0 < holder.expires_in <= 5
    # a cleanup of that owner frees it at once
    assert other.store.cleanup_owner(owner).released == [(owner, "printer")]
    assert_free_for_others(other, "printer")


# --- release and renew replays -----------------------------------------------------------------
@HOW
def test_a_lost_release_reply_is_no_lost_lease(
    mine: Leases,
    other: Leases,
    proxy: LossyProxy,
    how: str,
):
    with mine.hold("printer"):
        lose(proxy, _scripts.RELEASE, how)
    # leaving the block did not raise LeaseLost: the release was sent again, found nothing
    # (the lost run freed it) and the lease still counted as held when it was sent
    assert not proxy.armed()
    assert registry_empty(mine)
    assert_free_for_others(other, "printer")


@HOW
def test_after_a_lost_reply_the_threads_next_calls_read_their_own_replies(
    mine: Leases, other: Leases, proxy: LossyProxy, how: str
):
    # grants and releases go on a connection of the thread's own (_lanes): a reply that
    # comes late must never be read as the reply to the thread's next call
    lose(proxy, _scripts.RELEASE, how)
    with mine.hold("first") as first:
        pass
    assert not proxy.armed()
    for name in ("second", "third"):
        with mine.hold(name) as lease:
            (holder,) = other.store.holders(name)
            assert (holder.token, holder.owner) == (lease.token, mine.identity().owner)
            assert lease.token > first.token
        assert other.store.holders(name) == []
    assert registry_empty(mine)


def test_a_release_replayed_is_harmless(make_leases: Callable[..., Leases]):
    mine = make_leases()
    other = make_leases(node="other-node")
    with mine.hold("r") as lease:
        h = lease._held
    # the same release.lua again, as a replay after a lost reply would send it
    assert mine.store.release([h]) == [False]
    with other.hold("r") as taken:
        # a replay of the old release never frees the lease another owner holds now
        assert mine.store.release([h]) == [False]
        assert [x.token for x in other.store.holders("r")] == [taken.token]


@HOW
def test_a_lost_renewal_reply_is_harmless(
    mine: Leases,
    other: Leases,
    proxy: LossyProxy,
    how: str,
):
    owner = mine.identity().owner
    with mine.hold("printer", ttl=10) as lease:
        held: Held = lease._held
        lose(proxy, _scripts.RENEW, how)
        # the renewal ran in Redis, but its caller hears of a failure (no retry)
        with pytest.raises(LeaseBackendError):
            mine.store.renew([held], owner, timeout=SOCKET_TIMEOUT * 2)
        # run again (and again), it extends the same lease; nothing is reported lost
        assert mine.store.renew([held], owner, timeout=5) == set()
        assert mine.store.renew([held], owner, timeout=5) == set()
        (holder,) = other.store.holders("printer")
        assert holder.token == lease.token
        assert holder.expires_in > 5
    assert registry_empty(mine)
    assert_free_for_others(other, "printer")


# --- beat ---------------------------------------------------------------------------------------
@HOW
def test_a_beat_replica_counts_its_own_win_when_the_claim_reply_is_lost(
    make_lossy: Callable[..., Leases],
    make_leases: Callable[..., Leases],
    proxy: LossyProxy,
    how: str,
):
    a = make_lossy().store
    b = make_leases().store
    lose(proxy, _scripts.BEAT_CLAIM, how)

    def claim(store: LeaseStore, replica: str) -> bool:
        won, _, _, _ = store.beat_claim(
            "nightly", due_ms=1_700_000_000_000, bucket=None, replica=replica, keep=60
        )
        return won

    assert claim(a, "replica-a")  # its own win, though the reply was lost
    assert not proxy.armed()
    assert not claim(b, "replica-b")
    # the run is sent once: asked again (a later tick), replica a does not win it twice
    assert not claim(a, "replica-a")


# --- unique claims -----------------------------------------------------------------------------
@HOW
def test_a_lost_unique_claim_reply_is_this_calls_own_claim(
    make_lossy: Callable[..., Leases], proxy: LossyProxy, how: str
):
    store = make_lossy().store
    lose(proxy, _scripts.UNIQUE_CLAIM, how)
    claimed = store.unique_claim("job:k", "task-1", 60)
    assert isinstance(claimed, Claimed)
    assert not claimed.again
    assert not proxy.armed()
    # so a failed publish gives it back
    assert store.unique_unclaim("job:k", "task-1", claimed.token)
    assert store.unique_holder("job:k") is None


def test_a_failed_publish_gives_back_a_claim_whose_reply_was_lost(
    lossy_url: str, leases_prefix: str, proxy: LossyProxy
):
    from kombu.exceptions import OperationalError

    from tests.integration.unique import unique_app
    from tests.integration.unique.test_unique_producer import socket_nobody_listens_on

    with socket_nobody_listens_on() as dead_port:
        app = unique_app.make_app(
            broker=f"redis://127.0.0.1:{dead_port}/0",
            queue=f"q-{leases_prefix}",
            backend=lossy_url,
            redis_url=lossy_url,
            key_prefix=leases_prefix,
            socket_timeout=SOCKET_TIMEOUT,
        )
        app.conf.broker_connection_retry = False
        app.conf.broker_connection_max_retries = 0
        ext: Leases = app.leases  # type: ignore[attr-defined]
        try:
            lose(proxy, _scripts.UNIQUE_CLAIM, "cut")
            with pytest.raises(OperationalError):
                app.tasks["unique_app.raising"].apply_async(("k",), retry=False)
            assert not proxy.armed()
            assert ext.store.unique_holder("job:k") is None
        finally:
            ext.store.close()
            app.close()


@contextlib.contextmanager
def _unique_app_on_a_dead_broker(
    lossy_url: str, leases_prefix: str, **settings: object
) -> Iterator[Any]:
    """The unique test app, its leases through the proxy, its broker a port nobody listens on
    (nothing can be published)."""
    from tests.integration.unique import unique_app
    from tests.integration.unique.test_unique_producer import socket_nobody_listens_on

    with socket_nobody_listens_on() as dead_port:
        app = unique_app.make_app(
            broker=f"redis://127.0.0.1:{dead_port}/0",
            queue=f"q-{leases_prefix}",
            backend=lossy_url,
            redis_url=lossy_url,
            key_prefix=leases_prefix,
            socket_timeout=SOCKET_TIMEOUT,
            **settings,
        )
        app.conf.broker_connection_retry = False
        app.conf.broker_connection_max_retries = 0
        try:
            yield app
        finally:
            app.leases.store.close()
            app.close()


def _claim_lost_then_unreachable(app: Any, proxy: LossyProxy) -> LeaseBackendError:
    """A unique send whose claim runs, whose reply is lost and whose resend finds Redis
    unreachable (the proxy refuses connections until ``accept_again``)."""
    proxy.drop_next_reply(sha(_scripts.UNIQUE_CLAIM), then_refuse=True)
    try:
        with pytest.raises(LeaseBackendError) as raised:
            app.tasks["unique_app.raising"].apply_async(("k",), retry=False)
    finally:
        proxy.accept_again()
    assert not proxy.armed()
    return raised.value


def test_a_claim_whose_reply_is_lost_and_resend_fails_frees_its_key_within_the_window(
    lossy_url: str, leases_prefix: str, proxy: LossyProxy, make_leases: Callable[..., Leases]
):
    """Issue 26, part 9: nothing is published, and the claim the lost call made does not
    block the key for unique_ttl (an hour) but for unique_confirm_window at most."""
    direct = make_leases().store  # straight to Redis
    with _unique_app_on_a_dead_broker(
        lossy_url, leases_prefix, unique_ttl=3600, unique_confirm_window=2
    ) as app:
        error = _claim_lost_then_unreachable(app, proxy)
        assert error.maybe_claimed
        assert error.key == "job:k"
        holder = direct.unique_holder("job:k")
        # the lost call claimed, for the task id the error names, pending
        assert holder is not None
        assert holder.state == "queued"
        assert holder.task_id == error.task_id
        assert holder.expires_in is not None
        assert holder.expires_in <= 2
        # sendable again (by another producer) within the window, not after an hour
        wait_until(
            lambda: isinstance(direct.unique_claim("job:k", "task-2", 60), Claimed),
            SCHEDULING,
            "the key to be free again",
            step=0.2,
        )
        assert direct.unique_unclaim("job:k", "task-2")


def test_the_next_send_gives_back_a_claim_a_failed_send_may_have_made(
    lossy_url: str, leases_prefix: str, proxy: LossyProxy, make_leases: Callable[..., Leases]
):
    """When Redis answers again, the producer's next unique send gives the claim back by
    task id first: it is not refused as a duplicate of a task that was never sent."""
    from kombu.exceptions import OperationalError

    direct = make_leases().store
    with _unique_app_on_a_dead_broker(lossy_url, leases_prefix, unique_confirm_window=600) as app:
        error = _claim_lost_then_unreachable(app, proxy)
        assert error.maybe_claimed
        holder = direct.unique_holder("job:k")
        assert holder is not None
        assert holder.task_id == error.task_id
        # the broker is dead: this send fails to publish, but not as a duplicate
        with pytest.raises(OperationalError):
            app.tasks["unique_app.raising"].apply_async(("k",), retry=False)
        assert direct.unique_holder("job:k") is None


@HOW
def test_a_lost_unique_handover_reply_leaves_no_orphan(
    make_lossy: Callable[..., Leases],
    make_leases: Callable[..., Leases],
    proxy: LossyProxy,
    how: str,
):
    worker = make_lossy()
    producer = make_leases(node="producer").store
    assert isinstance(producer.unique_claim("job:k", "task-1", 60), Claimed)
    lose(proxy, _scripts.UNIQUE_HANDOVER, how)

    held = worker.store.unique_handover("job:k", "task-1", worker.identity(), 10)

    assert not proxy.armed()
    assert isinstance(held, Held), held
    holder = producer.unique_holder("job:k")
    assert isinstance(holder, ClaimHolder)
    assert holder.token == held.token
    assert worker.store.release([held]) == [True]
    assert registry_empty(worker)
    # the key is free for the next task at once
    assert isinstance(producer.unique_claim("job:k", "task-2", 60), Claimed)


@HOW
def test_a_lost_unique_requeue_reply_is_read_back(
    make_lossy: Callable[..., Leases],
    make_leases: Callable[..., Leases],
    proxy: LossyProxy,
    how: str,
):
    worker = make_lossy()
    producer = make_leases(node="producer").store
    assert isinstance(producer.unique_claim("job:k", "task-1", 60), Claimed)
    held = worker.store.unique_handover("job:k", "task-1", worker.identity(), 10)
    assert isinstance(held, Held)
    lose(proxy, _scripts.UNIQUE_REQUEUE, how)

    assert worker.store.unique_requeue(held, 60)

    holder = producer.unique_holder("job:k")
    assert isinstance(holder, ClaimHolder)
    assert (holder.state, holder.task_id, holder.token) == ("queued", "task-1", held.token)


# --- once receipts -------------------------------------------------------------------------------
@HOW
def test_once_stores_its_receipt_when_the_commit_reply_is_lost(
    mine: Leases,
    other: Leases,
    proxy: LossyProxy,
    how: str,
):
    lose(proxy, _scripts.COMMIT_RECEIPT, how)
    receipt = mine.once("setup", lambda: "made", wait=2.0)
    assert not proxy.armed()
    assert other.once("setup", lambda: "again", wait=2.0) == receipt
    assert registry_empty(mine)


# --- asyncio ----------------------------------------------------------------------------------
@HOW
def test_asyncio_release_and_receipt_survive_lost_replies(
    mine: Leases,
    other: Leases,
    proxy: LossyProxy,
    how: str,
):
    import asyncio

    async def run() -> tuple[object, object]:
        try:
            async with mine.ahold("printer"):
                lose(proxy, _scripts.RELEASE, how)
            # no LeaseLost on the way out: the lease still counted held when released
            assert not proxy.armed()
            lose(proxy, _scripts.ACQUIRE, how)
            first = await mine.aonce("setup", lambda: "made", wait=2.0)
            assert not proxy.armed()
            lose(proxy, _scripts.COMMIT_RECEIPT, how)
            second = await mine.aonce("setup-2", lambda: "made 2", wait=2.0)
            assert not proxy.armed()
            return first, second
        finally:
            await mine.astore.aclose()

    first, second = asyncio.run(run())
    assert other.once("setup", lambda: "again", wait=2.0) == first
    assert other.once("setup-2", lambda: "again", wait=2.0) == second
    assert registry_empty(mine)
    assert_free_for_others(other, "printer")
