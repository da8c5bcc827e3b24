"""Beat's run markers (an entry's overlap policy) honour ``unique_confirm``: one script call
a sent run with it off, the marker living ``unique_ttl`` from its claim; two with it on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery.beat import ScheduleEntry

from celery_leases import Leases
from celery_leases._beat_runs import OVERLAP_OPTION, RunGate, run_key
from celery_leases._scripts import SHA
from tests.support.acl import CommandLog

#: the queue TTL of the markers, and the confirm window
UNIQUE_TTL, WINDOW = 600.0, 20.0


@pytest.mark.parametrize("confirm", [False, True], ids=["unique_confirm-off", "default"])
def test_a_sent_run_costs_one_call_with_unique_confirm_off(
    make_leases: Callable[..., Leases], leases_redis_url: str, leases_prefix: str, confirm: bool
):
    leases = make_leases(
        unique_confirm=confirm, unique_ttl=UNIQUE_TTL, unique_confirm_window=WINDOW
    )
    published: list[Any] = []
    gate = RunGate()

    def entry_of(name: str) -> ScheduleEntry:
        options = {OVERLAP_OPTION: "skip"}
        return ScheduleEntry(name=name, task="proj.x", schedule=60.0, options=options)

    gate.send(leases, entry_of("warm-up"), published.append)  # the client's first calls
    published.clear()
    entry = entry_of("nightly")
    with CommandLog(leases_redis_url) as log:
        gate.send(leases, entry, published.append)
    assert published == [entry]
    calls = [
        line
        for line in log.lines
        if line.upper().startswith("EVALSHA ")
        and leases_prefix in line
        and line.split()[1] in set(SHA.values())
    ]
    assert len(calls) == (2 if confirm else 1), calls
    holder = leases.store.unique_holder(run_key("nightly"))
    assert holder is not None
    assert holder.state == "queued"
    assert holder.expires_in is not None
    # confirmed: the queue TTL; off: the queue TTL from the claim on, never the window
    assert holder.expires_in > UNIQUE_TTL - 60
