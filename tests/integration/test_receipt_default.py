"""``receipt(name, default=...)`` tells "no receipt" from a receipt whose value is None."""

from __future__ import annotations

import asyncio

from celery_leases import Leases


def test_receipt_tells_no_receipt_from_a_none_receipt(leases: Leases) -> None:
    missing = object()
    calls: list[int] = []

    def init() -> None:
        calls.append(1)

    assert leases.receipt("none-value", default=missing) is missing
    assert leases.once("none-value", init) is None
    assert leases.receipt("none-value", default=missing) is None  # a receipt, valued None
    assert leases.receipt("none-value") is None  # the old call is unchanged
    assert leases.once("none-value", init) is None
    assert calls == [1]  # a None receipt is a receipt: not run again

    async def main() -> None:
        assert await leases.areceipt("none-value", default=missing) is None
        assert await leases.areceipt("absent", default=missing) is missing
        await leases.aclose()

    asyncio.run(main())
    assert leases.forget("none-value")
    assert leases.receipt("none-value", default=missing) is missing
