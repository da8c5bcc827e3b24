"""The asyncio API (``ahold``, ``aonce``) against a real Redis: the sync semantics, on one loop.

Many coroutines of one event loop share one owner id, one heartbeat task and one subscriber
connection; these tests check that they still never share a lease, that a release wakes a
waiter, that cancelled coroutines leave nothing behind, and that sync and async holders of one
resource exclude each other.
"""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest
import pytest_asyncio
import redis

from celery_leases import LeaseBusy, LeaseConfigError, LeaseLost, Leases, Shared
from celery_leases._aio.heartbeat import loop_heartbeat
from celery_leases._lease import Want
from celery_leases._registry import KEEPER
from tests.support.lifetimes import mark_up
from tests.support.polling import SCHEDULING

pytestmark = pytest.mark.asyncio

MakeLeases = Callable[..., Leases]


async def until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``condition`` on the loop until it is truthy, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.005)


@pytest_asyncio.fixture
async def make_aleases(make_leases: MakeLeases) -> AsyncIterator[MakeLeases]:
    """Factory of Leases whose asyncio connections are closed before the test's loop ends."""
    made: list[Leases] = []

    def make(**settings: Any) -> Leases:
        leases = make_leases(**settings)
        made.append(leases)
        return leases

    yield make
    for leases in made:
        await leases.aclose()


@pytest_asyncio.fixture
async def aleases(make_aleases: MakeLeases) -> Leases:
    return make_aleases()


def registry(client: redis.Redis, leases: Leases) -> set[str]:
    """The entries of the calling process's owner registry (slot group 0), without its
    keeper ("~", no entry: see lua/_registry.lua)."""
    key = leases.store.keys.registry(leases.identity().owner, 0)
    return {str(m) for m in client.smembers(key)} - {KEEPER}


def subscribers(client: redis.Redis, leases: Leases, resource: str) -> int:
    ((_, count),) = client.pubsub_numsub(leases.store.keys.channel(resource))
    return int(count)


def is_free(client: redis.Redis, leases: Leases, resource: str) -> bool:
    return client.exists(leases.store.keys.exclusive(resource)) == 0


async def settled(leases: Leases) -> None:
    """Wait until the attempts of cancelled callers, and the releases they start, are over.

    A cancelled caller returns at once; an acquire it had in flight finishes in the background
    and gives back what it was granted.
    """
    state = leases.astore._state()
    await until(lambda: not state.tasks, SCHEDULING, "the background releases")


def waiting(leases: Leases, resource: str) -> bool:
    """True once the loop's subscriber listens for releases of ``resource``."""
    return leases.store.keys.channel(resource) in leases.astore.subscribed_channels()


async def test_exclusive_hold_excludes_and_is_not_reentrant(aleases: Leases, leases_redis):
    async with aleases.ahold("r", ttl=30) as lease:
        assert lease.resource == "r"
        assert not lease.shared
        assert 0 < lease.expires_in <= 30
        lease.check()
        # another coroutine of this loop (the same owner) is busy like anyone else
        with pytest.raises(LeaseBusy) as info:
            async with aleases.ahold("r", wait=0):
                pass
        assert info.value.resource == "r"
        assert info.value.retry_after is not None
        assert 0 < info.value.retry_after <= 30
        assert info.value.waited == 0.0
        assert waiting(aleases, "r") is False  # wait=0 tries once, never subscribes
        assert len(registry(leases_redis, aleases)) == 1
    assert is_free(leases_redis, aleases, "r")
    assert registry(leases_redis, aleases) == set()
    with pytest.raises(LeaseLost):
        lease.check()  # released
    async with aleases.ahold("r", wait=0) as again:
        assert again.token > lease.token


async def test_list_is_all_or_nothing_and_yields_in_order(aleases: Leases, leases_redis):
    async with aleases.ahold(["a", Shared("s"), "c"]) as (a, s, c):
        assert (a.resource, s.resource, c.resource) == ("a", "s", "c")
        assert s.shared
        assert not a.shared
    async with aleases.ahold("b"):
        with pytest.raises(LeaseBusy) as info:
            async with aleases.ahold(["a", "b", "c"], wait=0):
                pass
        assert info.value.resource == "b"
        assert is_free(leases_redis, aleases, "a")
        assert is_free(leases_redis, aleases, "c")


async def test_shared_with_limit(aleases: Leases):
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(aleases.ahold(Shared("pool", limit=2)))
        second = await stack.enter_async_context(aleases.ahold(Shared("pool", limit=2)))
        assert first.shared
        assert second.shared
        assert second.token > first.token
        with pytest.raises(LeaseBusy):
            async with aleases.ahold(Shared("pool", limit=2)):
                pass
        with pytest.raises(LeaseBusy):
            async with aleases.ahold("pool"):  # exclusive: not while shared holders live
                pass
    async with aleases.ahold("pool"):
        pass


async def test_bad_input_is_refused_before_any_redis_call(aleases: Leases):
    with pytest.raises(LeaseConfigError, match="at least one resource"):
        async with aleases.ahold([]):
            pass
    with pytest.raises(LeaseConfigError, match="ttl"):
        async with aleases.ahold("r", ttl=0):
            pass
    with pytest.raises(LeaseConfigError, match="wait"):
        async with aleases.ahold("r", wait="5"):  # type: ignore[call-overload]
            pass
    with pytest.raises(LeaseConfigError, match="twice"):
        async with aleases.ahold(["r", "r"]):
            pass
    with pytest.raises(LeaseConfigError, match="non-empty"):
        await aleases.aonce("", lambda: 1)
    with pytest.raises(LeaseConfigError, match="callable"):
        await aleases.aonce("x", 5)  # type: ignore[arg-type]
    with pytest.raises(LeaseConfigError, match="Shared"):
        async with aleases.ahold(5):  # type: ignore[call-overload]
            pass
    with pytest.raises(LeaseConfigError, match="Shared"):
        async with aleases.ahold([5]):  # type: ignore[list-item]
            pass


async def test_200_coroutines_one_resource_never_overlap(aleases: Leases, leases_redis):
    """200 coroutines of one loop, one owner id: one holder at a time, each its own token."""
    inside: list[int] = []
    ledger: list[tuple[str, int, int]] = []
    leases_seen: list[object] = []
    fence = aleases.store.keys.named("test", "fence")

    async def worker(n: int) -> None:
        async with aleases.ahold("hot", wait=None, ttl=10) as lease:
            inside.append(n)
            ledger.append(("in", n, lease.token))
            leases_seen.append(lease)
            assert len(inside) == 1, f"coroutines {inside} hold 'hot' at once"
            # a fenced write, as a store guarded by the lease would do it; and a real await
            # inside the block, so the others run meanwhile
            last = int(leases_redis.get(fence) or 0)
            assert lease.token > last
            leases_redis.set(fence, lease.token)
            await asyncio.sleep(0)
            await aleases.astore.ping()
            lease.check()
            inside.remove(n)
            ledger.append(("out", n, lease.token))

    await asyncio.gather(*(worker(n) for n in range(200)))
    depth = 0
    for kind, _, _ in ledger:
        depth += 1 if kind == "in" else -1
        assert depth in (0, 1)
    tokens = [token for kind, _, token in ledger if kind == "in"]
    assert len(tokens) == 200
    assert len(set(tokens)) == 200  # no two coroutines got the same grant
    assert tokens == sorted(tokens)  # and they grow in the order of the grants
    assert len({id(lease) for lease in leases_seen}) == 200
    assert registry(leases_redis, aleases) == set()
    assert is_free(leases_redis, aleases, "hot")
    await until(lambda: subscribers(leases_redis, aleases, "hot") == 0, SCHEDULING, "unsubscribe")


async def test_waiter_is_woken_by_the_release(aleases: Leases):
    """The holder's lease lives 60 s and the waiter gives up after 20 s: only the release,
    not the holder's expiry, can hand it over in time."""
    got: list[int] = []

    async def waiter() -> None:
        async with aleases.ahold("r", wait=120) as lease:
            got.append(lease.token)

    async with aleases.ahold("r", ttl=60) as held:
        task = asyncio.create_task(waiter())
        await until(lambda: waiting(aleases, "r"), SCHEDULING, "the waiter to subscribe")
        assert not got
    await asyncio.wait_for(task, 30)
    assert got
    assert got[0] > held.token


async def test_sync_release_wakes_an_async_waiter(aleases: Leases):
    got: list[int] = []

    async def waiter() -> None:
        async with aleases.ahold("r", wait=120) as lease:
            got.append(lease.token)

    with aleases.hold("r", ttl=60) as held:
        task = asyncio.create_task(waiter())
        await until(lambda: waiting(aleases, "r"), SCHEDULING, "the waiter to subscribe")
    await asyncio.wait_for(task, 30)
    assert got
    assert got[0] > held.token


async def test_wait_runs_out_with_busy(aleases: Leases, leases_redis):
    async with aleases.ahold("r", ttl=60):
        with pytest.raises(LeaseBusy) as info:
            async with aleases.ahold("r", wait=0.2):
                pass
    assert info.value.resource == "r"
    assert info.value.waited >= 0.2
    await until(lambda: subscribers(leases_redis, aleases, "r") == 0, SCHEDULING, "unsubscribe")


async def test_holder_expiry_hands_over_without_a_release(make_aleases, leases_redis):
    """A holder that never releases (its process died): the waiter gets it once it expires."""
    aleases = make_aleases()
    dead = make_aleases(node="dead")  # another owner; its lease is never renewed
    (held,) = dead.store.acquire([Want("r")], dead.identity(), ttl=0.5)
    async with aleases.ahold("r", wait=20) as lease:
        assert lease.token > held.token


async def test_cancelled_waiters_leave_nothing_behind(aleases: Leases, leases_redis):
    async with aleases.ahold("r", ttl=60):
        tasks = [asyncio.create_task(enter_and_exit(aleases, "r")) for _ in range(5)]
        await until(lambda: waiting(aleases, "r"), SCHEDULING, "a waiter to subscribe")
        for task in tasks:
            task.cancel()
        for task in tasks:
            with pytest.raises(asyncio.CancelledError):
                await task
        # the local set first: the SUBSCRIBE may not have reached Redis yet (its connection
        # may still be connecting), when Redis counts no subscriber either
        await until(lambda: not aleases.astore.subscribed_channels(), SCHEDULING, "the unsubscribe")
        await until(lambda: subscribers(leases_redis, aleases, "r") == 0, SCHEDULING, "unsubscribe")
        await settled(aleases)
        assert len(registry(leases_redis, aleases)) == 1  # the holder's own entry
    await settled(aleases)
    assert registry(leases_redis, aleases) == set()
    assert is_free(leases_redis, aleases, "r")


async def enter_and_exit(leases: Leases, resource: str, wait: float | None = None) -> None:
    async with leases.ahold(resource, wait=wait):
        pass


async def test_cancelled_holder_releases_at_once(aleases: Leases, leases_redis):
    entered = asyncio.Event()

    async def holder() -> None:
        async with aleases.ahold("r", ttl=60):
            entered.set()
            await asyncio.Event().wait()  # until cancelled

    task = asyncio.create_task(holder())
    await entered.wait()
    assert not is_free(leases_redis, aleases, "r")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert is_free(leases_redis, aleases, "r")  # released on the way out, not by expiry
    assert registry(leases_redis, aleases) == set()
    async with aleases.ahold("r", wait=0):
        pass


async def test_cancellation_at_any_point_leaks_nothing(aleases: Leases, leases_redis):
    """Cancel 100 contending coroutines at random moments: waiting, acquiring, holding."""
    rng = random.Random(7)
    done = 0

    async def contender() -> None:
        nonlocal done
        async with aleases.ahold("c", wait=None, ttl=10):
            await asyncio.sleep(0.001)
        done += 1

    async def cancel_later(task: asyncio.Task[None], delay: float) -> None:
        await asyncio.sleep(delay)
        task.cancel()

    tasks = [asyncio.create_task(contender()) for _ in range(100)]
    await asyncio.gather(*(cancel_later(t, rng.uniform(0, 0.05)) for t in tasks))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
    assert cancelled > 0
    assert cancelled + done == 100
    errors = [r for r in results if r is not None and not isinstance(r, asyncio.CancelledError)]
    assert errors == []
    # a grant that reached a cancelled coroutine is released by a background task
    await settled(aleases)
    await until(lambda: is_free(leases_redis, aleases, "c"), SCHEDULING, "the lease to be released")
    await until(lambda: not registry(leases_redis, aleases), SCHEDULING, "an empty registry")
    await until(lambda: subscribers(leases_redis, aleases, "c") == 0, SCHEDULING, "unsubscribe")
    # no ticket of a cancelled waiter is left in the waiter queue
    keys = aleases.store.keys
    await until(
        lambda: not leases_redis.exists(keys.waiters("c"), keys.ticket_expiry("c")),
        SCHEDULING,
        "an empty waiter queue",
    )
    async with aleases.ahold("c", wait=0):
        pass


async def test_renewed_past_its_ttl_by_one_call_per_interval(aleases: Leases, leases_redis):
    beat = loop_heartbeat()
    async with AsyncExitStack() as stack:
        leases = [
            await stack.enter_async_context(aleases.ahold(f"r{i}", ttl=0.6)) for i in range(5)
        ]
        start = beat.renewals
        await until(lambda: beat.renewals >= start + 4, SCHEDULING, "four renewals")
        # one renew call confirms all five leases at once
        assert len({lease._held.confirmed_at for lease in leases}) == 1
        for lease in leases:
            lease.check()
            key = aleases.store.keys.exclusive(lease.resource)
            assert leases_redis.get(key) == f"{lease.token} {aleases.identity().owner}"
    await until(lambda: not beat.running, SCHEDULING, "the idle heartbeat task to end")


async def test_lost_when_the_key_goes(aleases: Leases, leases_redis):
    async with AsyncExitStack() as stack:
        lease = await stack.enter_async_context(aleases.ahold("r", ttl=0.6))
        leases_redis.delete(aleases.store.keys.exclusive("r"))
        await until(lambda: lease.lost, SCHEDULING, "the heartbeat to notice")
        with pytest.raises(LeaseLost):
            lease.check()
        assert lease.expires_in == 0.0
        with pytest.raises(LeaseLost) as info:
            await stack.aclose()  # leaving the block tells
    assert info.value.resource == "r"


async def test_lost_when_redis_freezes(make_aleases, make_redis_server):
    server = make_redis_server()
    aleases = make_aleases(redis_url=server.url)
    ttl = 1.0
    async with AsyncExitStack() as stack:
        lease = await stack.enter_async_context(aleases.ahold("r", ttl=ttl))
        await until(
            lambda: lease._held.confirmed_at > lease._held.acquired_at, SCHEDULING, "renewal"
        )
        server.pause()
        paused_at = time.monotonic()
        try:
            await until(lambda: lease.lost, 5 * ttl, "the heartbeat to give up")
            lost_at = time.monotonic()
            with pytest.raises(LeaseLost):
                lease.check()
        finally:
            server.resume()
        with pytest.raises(LeaseLost):
            await stack.aclose()
    # before Redis could have expired it: the renewal's deadline caught the stall
    assert paused_at < lost_at < lease._held.confirmed_at + ttl


async def test_a_killed_subscriber_connection_strands_no_waiter(make_aleases, make_redis_server):
    """The loop's pub/sub connection is killed while a coroutine waits: it listens again (a
    new connection) and is still woken by the release, long before the holder's expiry."""
    server = make_redis_server()
    aleases = make_aleases(redis_url=server.url)
    admin = redis.Redis.from_url(server.url, decode_responses=True)
    got: list[int] = []

    async def waiter() -> None:
        async with aleases.ahold("r", wait=120) as lease:
            got.append(lease.token)

    try:
        async with aleases.ahold("r", ttl=60):
            task = asyncio.create_task(waiter())
            await until(lambda: subscribers(admin, aleases, "r") == 1, SCHEDULING, "a subscription")
            assert admin.client_kill_filter(_type="pubsub") == 1
            await until(
                lambda: subscribers(admin, aleases, "r") == 1, SCHEDULING, "a new subscription"
            )
        await asyncio.wait_for(task, 30)
    finally:
        admin.close()
    assert len(got) == 1


async def test_a_block_that_raises_keeps_its_own_error(aleases: Leases, leases_redis):
    async def body() -> None:
        async with aleases.ahold("r", ttl=0.6) as lease:
            leases_redis.delete(aleases.store.keys.exclusive("r"))
            await until(lambda: lease.lost, SCHEDULING, "the heartbeat to notice")
            raise ValueError("mine")

    with pytest.raises(ValueError, match="mine"):
        await body()


async def test_sync_and_async_holders_exclude_each_other(aleases: Leases, leases_redis):
    with aleases.hold("r"), pytest.raises(LeaseBusy):
        async with aleases.ahold("r", wait=0):
            pass
    async with aleases.ahold("r"):
        with pytest.raises(LeaseBusy), aleases.hold("r", wait=0):
            pass


async def test_threads_and_coroutines_contending_never_overlap(aleases: Leases):
    """Sync holders in threads and async holders on the loop, one resource, one ledger."""
    lock = threading.Lock()
    inside: list[str] = []
    tokens: list[int] = []
    overlaps: list[list[str]] = []

    def enter(who: str, token: int) -> None:
        with lock:
            inside.append(who)
            tokens.append(token)
            if len(inside) > 1:
                overlaps.append(list(inside))

    def leave(who: str) -> None:
        with lock:
            inside.remove(who)

    def sync_worker(n: int) -> None:
        for _ in range(5):
            with aleases.hold("mixed", wait=30, ttl=10) as lease:
                enter(f"t{n}", lease.token)
                time.sleep(0.001)
                leave(f"t{n}")

    async def async_worker(n: int) -> None:
        for _ in range(5):
            async with aleases.ahold("mixed", wait=30, ttl=10) as lease:
                enter(f"c{n}", lease.token)
                await asyncio.sleep(0.001)
                leave(f"c{n}")

    await asyncio.gather(
        *(asyncio.to_thread(sync_worker, n) for n in range(4)),
        *(async_worker(n) for n in range(10)),
    )
    assert overlaps == []
    assert len(tokens) == 70
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == 70


async def test_async_renewals_never_cut_the_registry_short(aleases: Leases, leases_redis):
    """The sync and async heartbeats renew one owner; a short async lease must not shorten
    the registry that also records a long sync one."""
    key = aleases.store.keys.registry(aleases.identity().owner, 0)
    beat = loop_heartbeat()
    with aleases.hold("long", ttl=600):
        async with aleases.ahold("short", ttl=0.6):
            start = beat.renewals
            await until(lambda: beat.renewals >= start + 2, SCHEDULING, "async renewals")
            # 4 x 600 s from the sync grant; an async renewal alone would set 4 x 30 s
            assert leases_redis.pttl(key) > 4 * 30 * 1000


async def test_aonce_runs_once_for_concurrent_callers(aleases: Leases):
    runs = 0

    async def init() -> dict[str, int]:
        nonlocal runs
        runs += 1
        await asyncio.sleep(0.05)
        return {"files": 12}

    results = await asyncio.gather(*(aleases.aonce("input", init, wait=30) for _ in range(20)))
    assert runs == 1
    assert results == [{"files": 12}] * 20
    assert await aleases.areceipt("input") == {"files": 12}
    assert await aleases.aforget("input") is True
    assert await aleases.areceipt("input") is None
    assert await aleases.aforget("input") is False


async def test_aonce_with_a_plain_function_runs_it_in_a_thread(aleases: Leases):
    threads: list[int] = []
    runs = 0

    def init() -> str:
        nonlocal runs
        runs += 1
        threads.append(threading.get_ident())
        time.sleep(0.05)
        return "ready"

    results = await asyncio.gather(*(aleases.aonce("plain", init) for _ in range(10)))
    assert results == ["ready"] * 10
    assert runs == 1
    assert threads != [threading.get_ident()]
    # the sync API sees the same receipt, and does not run anything again
    assert aleases.once("plain", lambda: "again") == "ready"


async def test_aonce_takeover_after_the_initializer_is_cancelled(aleases: Leases, leases_redis):
    started = asyncio.Event()
    order: list[str] = []

    async def stuck() -> str:
        order.append("first")
        started.set()
        await asyncio.Event().wait()
        return "never"

    async def quick() -> str:
        order.append("second")
        return "second's"

    first = asyncio.create_task(aleases.aonce("job", stuck))
    await started.wait()
    second = asyncio.create_task(aleases.aonce("job", quick, wait=20))
    resource = aleases.store.keys.once_resource("job")
    await until(lambda: waiting(aleases, resource), SCHEDULING, "the second caller to wait")
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await asyncio.wait_for(second, 30) == "second's"
    assert order == ["first", "second"]
    assert registry(leases_redis, aleases) == set()


INITIALIZER = """
import asyncio, sys
from celery import Celery
from celery_leases import Leases

leases = Leases(Celery("dies", set_as_current=False), redis_url=sys.argv[1], key_prefix=sys.argv[2])

async def stuck():
    print("initialising", flush=True)
    await asyncio.Event().wait()

asyncio.run(leases.aonce("job", stuck, ttl=1.0))
"""


async def test_aonce_takeover_after_the_initializer_process_dies(
    aleases: Leases, leases_redis_url: str, leases_prefix: str
):
    """kill -9 of the process running an async initializer: its lease runs out after its
    ttl and the next caller runs the initializer itself."""
    argv = [sys.executable, "-c", INITIALIZER, leases_redis_url, leases_prefix]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.strip() == b"initialising"
        resource = aleases.store.keys.once_resource("job")
        (holder,) = aleases.store.holders(resource)
        assert holder.owner != aleases.identity().owner
        proc.kill()
        await proc.wait()
        assert await aleases.aonce("job", lambda: "taken over", wait=20) == "taken over"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_aonce_takeover_after_the_initializer_fails(aleases: Leases):
    async def boom() -> None:
        raise RuntimeError("download failed")

    with pytest.raises(RuntimeError, match="download failed"):
        await aleases.aonce("job", boom)
    assert await aleases.areceipt("job") is None
    assert await aleases.aonce("job", lambda: 5) == 5


async def test_aonce_refuses_a_value_json_cannot_store(aleases: Leases):
    with pytest.raises(TypeError, match="JSON"):
        await aleases.aonce("odd", lambda: {1, 2})
    assert await aleases.areceipt("odd") is None


async def test_aonce_busy_when_the_wait_runs_out(aleases: Leases):
    gate = asyncio.Event()

    async def slow() -> int:
        await gate.wait()
        return 1

    first = asyncio.create_task(aleases.aonce("slow", slow))
    resource = aleases.store.keys.once_resource("slow")
    await until(lambda: aleases.store.holders(resource), SCHEDULING, "the initializer to start")
    with pytest.raises(LeaseBusy):
        await aleases.aonce("slow", slow, wait=0.1)
    gate.set()
    assert await first == 1


async def test_two_loops_in_two_threads(aleases: Leases):
    """Each loop gets its own clients and heartbeat; their holders still exclude each other."""
    results: list[str] = []

    def other_loop() -> None:
        async def run() -> None:
            try:
                async with aleases.ahold("r", wait=0):
                    results.append("held")
            except LeaseBusy:
                results.append("busy")
            finally:
                await aleases.aclose()

        asyncio.run(run())

    async with aleases.ahold("r"):
        await asyncio.to_thread(other_loop)
    await asyncio.to_thread(other_loop)
    assert results == ["busy", "held"]


async def test_a_grant_outside_the_home_group_registers_the_owner_or_is_given_back(
    make_aleases: MakeLeases, leases_redis: redis.Redis
) -> None:
    # the home call and the grant go in one round trip (as on the sync side)
    leases = make_aleases(slot_groups=8, restart_grace=30.0)
    store = leases.store
    names = [f"r{i}" for i in range(100) if store.keys.group_of(f"r{i}") != 0]
    first, second = names[0], next(n for n in names if n != names[0])
    for name in (first, second):
        mark_up(leases_redis, store.keys.lifetime(store.keys.group_of(name)))
    owner = leases.identity().owner

    # the home group still in its restart grace refuses the owner: the grant is given back
    with pytest.raises(LeaseBusy) as busy:
        await leases.aacquire([Want(first)])
    assert busy.value.resource == "(owner registration)"
    assert store.holders(first) == []
    assert store.entries(owner) == []

    # once the home group is up, the same round trip registers the owner and grants
    mark_up(leases_redis, store.keys.lifetime(0))
    (lease,) = await leases.aacquire([Want(second)])
    assert [h.token for h in store.holders(second)] == [lease.token]
    assert owner in store.node_owners(leases.identity().node)
    await leases.arelease([lease])
    assert store.holders(second) == []


LANE = pytest.mark.skipif(sys.version_info < (3, 11), reason="the lane needs asyncio.timeout")


@LANE
async def test_ahold_after_its_connection_was_killed_loses_no_reply(
    aleases: Leases, leases_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # single script calls go down one connection of the loop's own (the lane); one killed
    # between two calls is connected afresh before the next call, as the pool's would be:
    # the call is not sent on a dead socket, its reply is not "lost", nothing is read back
    from celery_leases import _grants

    recoveries: list[object] = []
    recover = _grants.recover_call

    def counted(*args: Any) -> Any:
        recoveries.append(args)
        return recover(*args)

    monkeypatch.setattr(_grants, "recover_call", counted)
    async with aleases.ahold("r"):
        pass
    lane = aleases.astore._state().lane
    assert lane is not None
    killed = await lane.call(("CLIENT", "ID"))
    assert leases_redis.client_kill_filter(_id=killed) == 1

    async def closed() -> bool:
        try:
            return bool(await lane.conn.can_read())  # EOF seen by the loop
        except redis.ConnectionError:  # how redis-py 8.2 and later say so
            return True

    deadline = time.monotonic() + SCHEDULING
    while not await closed():
        assert time.monotonic() < deadline, "the killed connection never saw its EOF"
        await asyncio.sleep(0.005)

    async with aleases.ahold("r") as lease:
        assert leases_redis.exists(aleases.store.keys.exclusive("r")) == 1
    assert lease.token > 0
    assert recoveries == []
    assert await lane.call(("CLIENT", "ID")) != killed  # a new connection
    assert is_free(leases_redis, aleases, "r")


async def test_concurrent_releases_share_the_lane_one_at_a_time(
    aleases: Leases, leases_redis: redis.Redis
) -> None:
    # each release is a single script call in a task of its own: the first to come takes
    # the loop's lane, the others take the pool's connections meanwhile (never two calls on
    # one connection at once)
    names = [f"r{i}" for i in range(20)]
    held = [await aleases.aacquire([Want(name)]) for name in names]
    released = await asyncio.gather(*(aleases.arelease(leases) for leases in held))
    assert released == [[] for _ in names]  # none was lost
    assert all(is_free(leases_redis, aleases, name) for name in names)
