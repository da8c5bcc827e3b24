from __future__ import annotations

import pytest

from celery_leases import LeaseBusy


def test_hold_then_busy(leases):
    with leases.hold("x") as lease:
        assert lease.token > 0
        with pytest.raises(LeaseBusy) as info, leases.hold("x"):
            pass
        assert info.value.resource == "x"
    with leases.hold("x") as again:
        assert again.token > lease.token
