"""Issue 27's newcomer findings that need a real Redis: each said what it is."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from celery_leases import LeaseBusy, Shared


def test_a_nested_hold_says_it_is_the_same_owner(leases):
    with leases.hold("report:7"), pytest.raises(LeaseBusy) as info, leases.hold("report:7"):
        pass
    busy = info.value
    assert busy.same_owner is True
    assert "same owner" in str(busy)
    assert "not reentrant" in str(busy)
    assert "another owner" not in str(busy)
    # it survives a result backend's round trip as itself
    again = pickle.loads(pickle.dumps(busy))
    assert again.same_owner is True
    assert str(again) == str(busy)


def test_a_nested_ahold_says_it_is_the_same_owner(leases):
    async def main() -> LeaseBusy:
        async with leases.ahold("report:8"):
            with pytest.raises(LeaseBusy) as info:
                async with leases.ahold("report:8"):
                    pass
        return info.value

    busy = asyncio.run(main())
    assert busy.same_owner is True
    assert "not reentrant" in str(busy)


def test_an_exclusive_hold_inside_a_shared_one_is_the_same_owner(leases):
    with leases.hold(Shared("pool")), pytest.raises(LeaseBusy) as info, leases.hold("pool"):
        pass
    assert info.value.same_owner is True


def test_a_full_shared_limit_is_not_blamed_on_the_asking_owner(leases):
    # its own shared lease is one of the holders, not the one reason it is busy
    first = Shared("pool", limit=1)
    with leases.hold(first), pytest.raises(LeaseBusy) as info, leases.hold(first):
        pass
    assert info.value.same_owner is False
    assert "another owner" in str(info.value)
