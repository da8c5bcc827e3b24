"""A busy error names the task that holds the resource, when Redis can tell."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from celery_leases import LeaseBusy, Leases, Shared
from celery_leases._lease import Want


def test_busy_names_the_holders_task(make_leases: Callable[..., Leases]) -> None:
    leases = make_leases(ttl=5)
    held = leases.acquire([Want("busy:task")], task_id="holder-task-1")
    try:
        with pytest.raises(LeaseBusy) as tried_once:
            leases.acquire([Want("busy:task")], task_id="second")
        with pytest.raises(LeaseBusy) as waited:
            leases.acquire([Want("busy:task")], wait=0.2)
    finally:
        leases.release(held)
    for busy in (tried_once.value, waited.value):
        assert busy.holder_task == "holder-task-1"
        # the holder is this very process: the message says so, and names the task
        assert busy.same_owner
        assert "task holder-task-1" in str(busy)
    assert waited.value.waited > 0


def test_busy_without_a_task_or_shared_names_none(make_leases: Callable[..., Leases]) -> None:
    leases = make_leases(ttl=5)
    with leases.hold("busy:plain"), pytest.raises(LeaseBusy) as plain:
        leases.acquire([Want("busy:plain")], task_id="second")
    assert plain.value.holder_task is None
    # args keep what Celery's JSON round trip needs to rebuild the error, same_owner included
    assert plain.value.args == ("busy:plain", plain.value.retry_after, 0.0, None, True)
    with leases.hold(Shared("busy:shared", limit=1)), pytest.raises(LeaseBusy) as shared:
        leases.acquire([Want("busy:shared", "s", 1)])
    assert shared.value.holder_task is None


@pytest.mark.asyncio
async def test_asyncio_busy_names_the_holders_task(make_leases: Callable[..., Leases]) -> None:
    leases = make_leases(ttl=5)
    held = leases.acquire([Want("busy:aio")], task_id="holder-task-2")
    try:
        with pytest.raises(LeaseBusy) as tried_once:
            await leases.aacquire([Want("busy:aio")])
        with pytest.raises(LeaseBusy) as waited:
            await leases.aacquire([Want("busy:aio")], wait=0.2)
    finally:
        leases.release(held)
        await leases.astore.aclose()
    assert tried_once.value.holder_task == "holder-task-2"
    assert waited.value.holder_task == "holder-task-2"
