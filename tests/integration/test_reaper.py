"""The reaper frees the leases of a dead pool process, never those of a process that reused its pid.

Timeline: t0 the reaper finds pid P dead; t1 a new pool process gets pid P (so the same owner
id, node/incarnation/P) and takes a lease; t2 the reaper cleans owner node/incarnation/P. It
must free only what was granted before t0.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest

from celery_leases import Leases, worker
from celery_leases._identity import Identity
from celery_leases._lease import Want

#: the pid of the dead pool process, reused by a new one (never checked against /proc here)
PID = 4_000_001


def test_reaper_spares_a_lease_taken_by_a_process_that_reused_a_dead_pid(
    make_leases: Callable[..., Leases], monkeypatch: pytest.MonkeyPatch
) -> None:
    node = "reaper@test-host"
    ext = make_leases(ttl=30, node=node)  # the node setting: no process-wide naming here
    store = ext.store
    step = worker.LeaseBootstep(SimpleNamespace(app=ext.app, hostname=node))
    mine = ext.identity()
    child = Identity(node, mine.incarnation, PID)

    (old,) = store.try_acquire([Want("res:old")], child, 30)  # the first process with pid P
    new: list[int] = []

    def pid_alive(pid: int) -> bool:
        if pid == PID and not new:
            # t0 P is dead; t1, before the cleanup, a new pool process with pid P takes a lease
            (held,) = store.try_acquire([Want("res:new")], child, 30)
            new.append(held.token)
            return False
        return pid != PID

    monkeypatch.setattr(worker, "_pid_alive", pid_alive)
    report = step.reap()  # t2

    assert new, "the reaper never checked pid P"
    assert report.released == [(child.owner, "res:old")]
    assert [h.token for h in store.holders("res:old")] == []
    assert [(h.owner, h.token) for h in store.holders("res:new")] == [(child.owner, new[0])], (
        "the reaper freed the lease of the process that reused the dead pid"
    )
    # the owner stays registered under its node: a restart of the node can still find it
    assert child.owner in store.node_owners(node)
    assert old.token < new[0]

    # once that process is gone too, the next pass frees its lease
    monkeypatch.setattr(worker, "_pid_alive", lambda pid: pid != PID)
    assert step.reap().released == [(child.owner, "res:new")]
    assert store.holders("res:new") == []
    assert child.owner not in store.node_owners(node)
