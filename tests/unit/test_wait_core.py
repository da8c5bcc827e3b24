"""Waiting, written once (celery_leases/_wait.py), driven by scripted replies without Redis.

A wait yields ``Listen`` besides the usual requests; here each is answered in turn, as a
driver would (a ``Heard``, or a Failure thrown in). The drivers' own part, what they do
when the caller goes away, is tried with their I/O replaced by the same scripts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_leases import _grants, _wait
from celery_leases._aio.driver import AsyncLeaseStore
from celery_leases._aio.subscriber import Abandoned, Listening
from celery_leases._claims import ClaimHolder
from celery_leases._identity import Identity
from celery_leases._keys import holder_value
from celery_leases._lease import Held, Want
from celery_leases._lostreply import BOOK
from celery_leases._protocol import Failure, Heard, Listen, Op, Script, Send
from celery_leases._scripts import AcquireReply, ReleaseReply, UniqueHandoverReply
from celery_leases._sync.driver import LeaseStore
from celery_leases.config import LeaseSettings
from celery_leases.exceptions import LeaseBackendError, LeaseBusy
from tests.support.steps import drive, refused, scripts

WORKER = Identity("worker-a@host", "inca", 101)
OTHER = "worker-b@host/incb/202"
GRANTED, BUSY, HANDED = AcquireReply.GRANTED, AcquireReply.BUSY, AcquireReply.HANDED
NOW: list[int] = [1_700_000_000, 0]  # the Redis clock, as TIME gives it


class Clock:
    """``time`` for ``_wait``: a monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(_wait, "time", clock)
    return clock


@pytest.fixture
def store() -> Iterator[LeaseStore]:
    """A store that never reaches Redis; its owner's liveness is fresh (no home call)."""
    store = LeaseStore(LeaseSettings(redis_url="redis://127.0.0.1:1/0", key_prefix="unit"))
    store.engine.registered[WORKER.owner] = 1e12
    yield store
    store.close()


def script(*answers: Any) -> Callable[[Op], Any]:
    """Answers in turn: a callable is called with the request, a Failure is raised."""
    queue = list(answers)

    def answer(op: Op) -> Any:
        assert queue, f"the wait made one request more than expected: {op!r}"
        reply = queue.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply(op) if callable(reply) else reply

    return answer


def kinds(made: list[Op]) -> list[str]:
    """Each request as a word: the script or command names of a Send, ``listen`` (with 0:
    the subscription) for a Listen."""
    out: list[str] = []
    for op in made:
        if isinstance(op, Listen):
            out.append("listen0" if op.timeout == 0 else "listen")
        else:
            out.extend(scripts([op]))
    return out


def _acquire(store: LeaseStore, wait: float | None, resource: str = "r") -> _wait.Wait[list[Held]]:
    return _wait.acquire(store.engine, [Want(resource)], WORKER, 10.0, wait, "task-1")


def _drop(store: LeaseStore, held: list[Held]) -> None:
    for h in held:
        BOOK.drop(h.owner, store.resource_keys(h.resource).exclusive, h.token)


def _left(store: LeaseStore, made: list[Op], resource: str = "r") -> bool:
    """True if a leave.lua call of ``made`` takes the ticket out of ``resource``'s queue."""
    calls = [c for op in made if isinstance(op, Send) for c in op.calls]
    leaves = [c for c in calls if isinstance(c, Script) and c.name == "leave"]
    return any(store.resource_keys(resource).waiters in c.keys for c in leaves)


def test_a_grant_at_once_needs_no_ticket_and_no_subscription(store: LeaseStore):
    held, made = drive(_acquire(store, 30.0).steps, script([[GRANTED, 7]]))
    assert [h.token for h in held] == [7]
    assert kinds(made) == ["acquire"]
    _drop(store, held)


def test_busy_with_no_wait_is_lease_busy_naming_the_holders_task(store: LeaseStore):
    value = holder_value(5, OTHER)
    registry = ["x 5 task-9 r"]
    wait = _acquire(store, 0.0)
    with pytest.raises(LeaseBusy, match="'r'") as caught:
        drive(wait.steps, script([[BUSY, 1, 1500]], [value], [registry]))
    assert caught.value.retry_after == 1.5
    assert caught.value.holder_task == "task-9"


def test_a_waiter_subscribes_before_its_first_queued_attempt_and_is_granted_on_a_wake(
    store: LeaseStore, clock: Clock
):
    wait = _acquire(store, 30.0)
    answers = script([[BUSY, 1, 500]], Heard(None), [[BUSY, 1, 500]], Heard(None), [[GRANTED, 9]])
    held, made = drive(wait.steps, answers)
    assert [h.token for h in held] == [9]
    assert kinds(made) == ["acquire", "listen0", "acquire", "listen", "acquire"]
    subscribe, listen = made[1], made[3]
    assert isinstance(subscribe, Listen)
    assert isinstance(listen, Listen)
    ticket_channel = listen.handed_on
    assert ticket_channel is not None
    assert list(subscribe.channels) == [store.resource_keys("r").channel, ticket_channel]
    assert listen.channels == subscribe.channels
    assert 0 < listen.timeout <= 0.5 + _grants.EXPIRY_SLACK  # the holder's expiry at the latest
    first = made[0].calls[0]  # type: ignore[union-attr]
    queued = made[2].calls[0]  # type: ignore[union-attr]
    assert ticket_channel.rsplit(":", 1)[1] in " ".join(map(str, queued.args))  # the ticket
    assert ticket_channel.rsplit(":", 1)[1] not in " ".join(map(str, first.args))
    _drop(store, held)


def test_a_wait_that_runs_out_leaves_the_queue_and_raises_lease_busy(
    store: LeaseStore, clock: Clock
):
    def late(op: Op) -> Heard:
        clock.now += 31  # past the deadline
        return Heard(None)

    wait = _acquire(store, 30.0)
    answers = script(
        [[BUSY, 1, 500]], Heard(None), [[BUSY, 1, 500]], late, [[BUSY, 1, 400]], [[0]], [None]
    )
    with pytest.raises(LeaseBusy) as caught:
        drive(wait.steps, answers)
    assert caught.value.waited == 31
    assert caught.value.retry_after == 0.4


def test_a_handoff_it_accepts_ends_the_wait_without_a_call(store: LeaseStore, clock: Clock):
    wait = _acquire(store, 30.0)
    answers = script([[BUSY, 1, 500]], Heard(None), [[BUSY, 1, 500]], Heard("55"))
    held, made = drive(wait.steps, answers)
    assert [(h.token, h.task_id) for h in held] == [(55, "task-1")]
    assert held[0].ticket  # its registry entry is still the ticket's until the first renewal
    assert kinds(made) == ["acquire", "listen0", "acquire", "listen"]
    _drop(store, held)


def test_a_handoff_it_does_not_trust_is_a_wake_up(
    store: LeaseStore, clock: Clock, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(_grants.Ticket, "accepts", lambda self, token: False)
    wait = _acquire(store, 30.0)
    answers = script([[BUSY, 1, 500]], Heard(None), [[BUSY, 1, 500]], Heard("55"), [[HANDED, 55]])
    held, made = drive(wait.steps, answers)
    assert [h.token for h in held] == [55]
    assert kinds(made) == ["acquire", "listen0", "acquire", "listen", "acquire"]  # read back
    _drop(store, held)


def test_a_failed_subscriber_is_a_backend_error_and_the_wait_leaves_every_queue(
    store: LeaseStore, clock: Clock
):
    wait = _acquire(store, 30.0)
    cut = ConnectionError("subscriber connection lost")
    answers = script([[BUSY, 1, 500]], Heard(None), [[BUSY, 1, 500]], _failure(cut), [[0]])
    made: list[Op] = []
    with pytest.raises(LeaseBackendError, match="failed to wait for a release: ConnectionError"):
        drive(wait.steps, _recording(answers, made))
    assert kinds(made) == ["acquire", "listen0", "acquire", "listen", "leave"]
    assert _left(store, made)


def test_a_failed_attempt_leaves_every_queue_it_may_be_in(store: LeaseStore, clock: Clock):
    wait = _acquire(store, 30.0)
    answers = script([[BUSY, 1, 500]], Heard(None), refused(), [[0]])
    made: list[Op] = []
    with pytest.raises(LeaseBackendError):
        drive(wait.steps, _recording(answers, made))
    assert kinds(made) == ["acquire", "listen0", "acquire", "leave"]


def _failure(cause: BaseException) -> BaseException:
    return Failure(cause, lost=True)


def _recording(answer: Callable[[Op], Any], made: list[Op]) -> Callable[[Op], Any]:
    def record(op: Op) -> Any:
        made.append(op)
        return answer(op)

    return record


# --- the drivers' part: a caller that goes away -------------------------------------------
class _Listens:
    """A sync driver's subscriber pool whose listens are scripted (no connection)."""

    def __init__(self, answer: Callable[[Op], Any], made: list[Op]) -> None:
        self.answer, self.made = answer, made

    def listening(self, send: Callable[[Op], Any]) -> _Listens:
        self.send = send
        return self

    def execute(self, op: Op) -> Any:
        return self.listen(op) if isinstance(op, Listen) else self.send(op)

    def __enter__(self) -> _Listens:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def listen(self, op: Listen) -> Any:
        self.made.append(op)
        return self.answer(op)

    def close(self) -> None:
        return None


def test_an_interrupted_sync_wait_leaves_every_queue(
    store: LeaseStore, clock: Clock, monkeypatch: pytest.MonkeyPatch
):
    made: list[Op] = []
    answer = script([[BUSY, 1, 500]], Heard(None), [[BUSY, 1, 500]], KeyboardInterrupt(), [[0]])
    monkeypatch.setattr(store, "_subscribers", _Listens(answer, made))
    monkeypatch.setattr(store, "_execute", _recording(answer, made))
    with pytest.raises(KeyboardInterrupt):
        store.run_wait(_acquire(store, 30.0))
    assert kinds(made) == ["acquire", "listen0", "acquire", "listen", "leave"]
    assert _left(store, made)


def test_a_sync_wait_interrupted_before_its_ticket_gives_nothing_back(
    store: LeaseStore, monkeypatch: pytest.MonkeyPatch
):
    made: list[Op] = []
    monkeypatch.setattr(store, "_execute", _recording(script(KeyboardInterrupt()), made))
    with pytest.raises(KeyboardInterrupt):
        store.run_wait(_acquire(store, 30.0))
    assert kinds(made) == ["acquire"]


@pytest.fixture
def astore(store: LeaseStore) -> AsyncLeaseStore:
    return AsyncLeaseStore(store.settings, engine=store.engine)


def _scripted(
    monkeypatch: pytest.MonkeyPatch,
    astore: AsyncLeaseStore,
    answer: Callable[[Op], Any],
    made: list[Op],
) -> None:
    """The asyncio driver's requests and listens answered by ``answer`` (a reply, or an
    awaitable of one)."""

    async def execute(state: Any, op: Op) -> Any:
        made.append(op)
        reply = answer(op)
        return await reply if asyncio.isfuture(reply) else reply

    async def listen(self: Listening, op: Listen) -> Heard:
        made.append(op)
        if op.timeout > 0:
            self._event.clear()
            await self._event.wait()  # until woken: the caller went away
        if self.abandoned:
            raise Abandoned
        reply = answer(op)
        assert isinstance(reply, Heard)
        return reply

    monkeypatch.setattr(astore, "_execute", execute)
    monkeypatch.setattr(Listening, "listen", listen)


def test_a_grant_that_comes_back_to_a_cancelled_caller_is_released(
    astore: AsyncLeaseStore, store: LeaseStore, monkeypatch: pytest.MonkeyPatch
):
    async def run() -> list[Op]:
        made: list[Op] = []
        granted: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        _scripted(monkeypatch, astore, script(lambda op: granted, [[ReleaseReply.RELEASED]]), made)
        caller = asyncio.ensure_future(astore.run_wait(_acquire(store, 30.0)))
        while not made:
            await asyncio.sleep(0)
        caller.cancel()  # while its attempt is in flight
        with pytest.raises(asyncio.CancelledError):
            await caller
        granted.set_result([[GRANTED, 11]])  # the attempt granted after all
        await asyncio.wait_for(_drained(astore), 10)
        return made

    made = asyncio.run(run())
    assert kinds(made) == ["acquire", "release"]
    assert 11 in made[1].calls[0].args  # type: ignore[union-attr]


def test_a_cancelled_async_waiter_leaves_the_queues_in_a_task_of_its_own(
    astore: AsyncLeaseStore, store: LeaseStore, clock: Clock, monkeypatch: pytest.MonkeyPatch
):
    async def run() -> list[Op]:
        made: list[Op] = []
        leave_sent = asyncio.Event()

        def left(op: Op) -> list[Any]:
            leave_sent.set()
            return [[0]]

        answer = script([[BUSY, 1, 500]], Heard(None), [[BUSY, 1, 500]], left)
        _scripted(monkeypatch, astore, answer, made)
        caller = asyncio.ensure_future(astore.run_wait(_acquire(store, 30.0)))
        while kinds(made) != ["acquire", "listen0", "acquire", "listen"]:
            await asyncio.sleep(0)
        caller.cancel()  # while it listens
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.wait_for(leave_sent.wait(), 10)  # the caller did not wait for it
        await asyncio.wait_for(_drained(astore), 10)
        return made

    made = asyncio.run(run())
    assert kinds(made) == ["acquire", "listen0", "acquire", "listen", "leave"]
    assert _left(store, made)


async def _drained(astore: AsyncLeaseStore) -> None:
    """Until the loop's background tasks (what cancelled callers give back) are done."""
    state = astore._state()
    while state.tasks:
        await asyncio.wait(set(state.tasks))


# --- until_free ---------------------------------------------------------------------------
def _holders(*pttl_ms: int) -> list[Any]:
    """The reply of one read of a resource's holders: exclusive (if a pttl is given)."""
    if not pttl_ms:
        return [None, -2, [], NOW]
    return [holder_value(5, OTHER), pttl_ms[0], [], NOW]


def test_until_free_is_true_at_once_for_a_free_resource(store: LeaseStore, clock: Clock):
    free, made = drive(
        _wait.until_free(store.engine, "r", None).steps, script(Heard(None), _holders())
    )
    assert free is True
    assert kinds(made) == ["listen0", "cmd:GET", "cmd:PTTL", "cmd:ZRANGE", "now"]


def test_until_free_listens_until_the_holders_expiry_then_looks_again(
    store: LeaseStore, clock: Clock
):
    wait = _wait.until_free(store.engine, "r", None)
    answers = script(Heard(None), _holders(2500), Heard(None), _holders())
    free, made = drive(wait.steps, answers)
    assert free is True
    listen = made[2]
    assert isinstance(listen, Listen)
    assert listen.handed_on is None
    assert list(listen.channels) == [store.resource_keys("r").channel]
    assert listen.timeout == pytest.approx(2.5 + _grants.EXPIRY_SLACK)


def test_until_free_gives_up_at_its_timeout_taking_nothing(store: LeaseStore, clock: Clock):
    def late(op: Op) -> Heard:
        assert isinstance(op, Listen)
        assert op.timeout == pytest.approx(3.0)  # not the 60 s
        clock.now += 3
        return Heard(None)

    wait = _wait.until_free(store.engine, "r", 3.0)
    free, made = drive(wait.steps, script(Heard(None), _holders(60_000), late, _holders(57_000)))
    assert free is False
    assert [k for k in kinds(made) if k not in ("listen0", "listen")] == [
        "cmd:GET",
        "cmd:PTTL",
        "cmd:ZRANGE",
        "now",
    ] * 2  # reads only: no lease, no ticket


# --- unique_take --------------------------------------------------------------------------
def test_a_claim_in_the_restart_grace_is_waited_for_on_its_release_channel(
    store: LeaseStore, clock: Clock
):
    grace, taken = [[UniqueHandoverReply.GRACE, 800]], [[UniqueHandoverReply.TAKEN, 31]]
    wait = _wait.unique_take(store.engine, "k", "task-1", WORKER, 10.0, 30.0)
    held, made = drive(wait.steps, script(grace, Heard(None), grace, Heard(None), taken))
    assert isinstance(held, Held)
    assert held.token == 31
    assert kinds(made) == [
        "unique_handover",
        "listen0",
        "unique_handover",
        "listen",
        "unique_handover",
    ]
    listen = made[3]
    assert isinstance(listen, Listen)
    channel = store.resource_keys(store.keys.unique_resource("k")).channel
    assert list(listen.channels) == [channel]
    assert listen.timeout == pytest.approx(0.8 + _grants.EXPIRY_SLACK)
    _drop(store, [held])


def test_a_take_with_no_wait_is_answered_at_once(store: LeaseStore, clock: Clock):
    wait = _wait.unique_take(store.engine, "k", "task-1", WORKER, 10.0, 0.0)
    holder, made = drive(wait.steps, script([[UniqueHandoverReply.GRACE, 800]]))
    assert isinstance(holder, ClaimHolder)
    assert holder.state == "grace"
    assert kinds(made) == ["unique_handover"]
