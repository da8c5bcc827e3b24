"""A lost grant's recovery adopts only what it can prove its own call granted (issue 26, part 8).

The race, driven step by step on the real test Redis, in one process (two "threads" of one
owner id share its store):

1. A's grant call runs in Redis (busy: sibling B holds the resource with token T) and its
   reply is lost; A's recovery reads back the lease key and the owner's registry;
2. at that moment B still holds T, so the read sees T as the owner's;
3. B then releases T (after A's read, before A decides);
4. a recovery that took "a grant of this owner that no live lease holds" for its own
   adopted T, and A's ``hold()`` entered its block with T while Redis had no key;
5. another owner was granted the resource at once: two exclusive holders.

The recovery must adopt only a grant whose registry entry bears its own call's id; here it
finds none, sends the call again, and is granted a fresh token (or told busy), never T.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_leases import _grants
from celery_leases._aio.driver import AsyncLeaseStore
from celery_leases._grants import Busy
from celery_leases._identity import Identity
from celery_leases._lease import Held, Want
from celery_leases._one_attempt import failure_of
from celery_leases._protocol import Command, Op, Script, Send, adrive, drive
from celery_leases._sync.driver import LeaseStore

OWNER = Identity("part8@host", "inca", 4242)  # threads A and B
OTHER = Identity("part8-other@host", "inca", 4343)  # another process
TTL = 10.0
ROUNDS = 5


def _is_grant(op: Op) -> bool:
    return isinstance(op, Send) and any(
        isinstance(c, Script) and c.name == "acquire" and len(c.keys) > 5 for c in op.calls
    )


def _is_read_back(op: Op) -> bool:
    return isinstance(op, Send) and any(
        isinstance(c, Command) and c.words[0] == "SMEMBERS" for c in op.calls
    )


class Race:
    """What the driver of A's grant does: the first grant call runs, and its reply is lost;
    right after the read-back ran in Redis, ``between`` runs (B's release)."""

    def __init__(self, between: Callable[[], Any]) -> None:
        self.between = between
        self.lost = False
        self.released = False

    def after(self, op: Op) -> None:
        if _is_grant(op) and not self.lost:
            self.lost = True
            raise RedisTimeoutError("the reply was lost (test)")
        if _is_read_back(op) and self.lost and not self.released:
            self.released = True
            self.between()


def _check(store: LeaseStore, resource: str, outcome: list[Held] | Busy, token: int) -> None:
    """A holds only a lease Redis has for it; then another owner is refused."""
    value: Any = store.client.get(store.resource_keys(resource).exclusive)
    if isinstance(outcome, list):
        (held,) = outcome
        assert held.token != token, "the recovery adopted the token the sibling released"
        assert value is not None
        assert str(value) == f"{held.token} {OWNER.owner}"
    other = store.try_acquire([Want(resource)], OTHER, TTL)
    if isinstance(outcome, list):
        assert isinstance(other, Busy), "two exclusive holders"
        store.release(outcome)
    elif isinstance(other, list):
        store.release(other)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_lost_grant_never_adopts_the_token_its_sibling_just_released(
    make_leases_store: Callable[..., LeaseStore], round_: int
) -> None:
    store = make_leases_store()
    resource = f"part8:sync:{round_}"
    b = store.try_acquire([Want(resource)], OWNER, TTL)  # thread B holds T
    assert isinstance(b, list)
    token = b[0].token
    race = Race(lambda: store.release(b))

    def execute(op: Op) -> Any:
        reply = store._execute(op)
        race.after(op)
        return reply

    steps = _grants.try_acquire(store.engine, [Want(resource)], OWNER, TTL)
    outcome = drive(steps, execute, RedisError, failure_of)
    assert race.lost
    assert race.released
    _check(store, resource, outcome, token)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_an_asyncio_lost_grant_never_adopts_the_token_its_sibling_just_released(
    make_leases_store: Callable[..., LeaseStore], round_: int
) -> None:
    store = make_leases_store()
    resource = f"part8:aio:{round_}"

    async def scenario() -> tuple[list[Held] | Busy, int]:
        astore = AsyncLeaseStore(store.settings, engine=store.engine)
        try:
            b = await astore.try_acquire([Want(resource)], OWNER, TTL)
            assert isinstance(b, list)
            pending: list[Any] = []
            race = Race(lambda: pending.append(b))
            state = astore._state()

            async def execute(op: Op) -> Any:
                reply = await astore._execute(state, op)
                race.after(op)
                if pending:  # B's release, on the loop, between A's read and its decision
                    await astore.release(pending.pop())
                return reply

            steps = _grants.try_acquire(store.engine, [Want(resource)], OWNER, TTL)
            outcome = await adrive(steps, execute, RedisError, failure_of)
            assert race.lost
            assert race.released
            return outcome, b[0].token
        finally:
            await astore.aclose()

    outcome, token = asyncio.run(scenario())
    _check(store, resource, outcome, token)
