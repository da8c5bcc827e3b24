"""A tour of every Redis path of the engine, for tests that change how it reaches Redis.

The ACL tests run it as the documented user, the TLS tests through ``rediss://``: whatever
permission or transport breaks one of the paths fails the tour.
"""

from __future__ import annotations

import pytest

from celery_leases import LeaseBusy, Leases, Shared
from celery_leases._claims import Claimed, ClaimHolder
from celery_leases._identity import Identity
from celery_leases._lease import Want
from tests.support.polling import wait_until

#: the tour's leases ttl setting (seconds): short, so renewals and expiries come quickly
TOUR_TTL = 1.5


def tour(leases: Leases) -> None:
    """Run every kind of Redis call the library makes, checking each answer.

    ``leases`` must have ``ttl=TOUR_TTL`` and be alone on its key prefix.
    """
    store = leases.store
    assert leases.settings.ttl == TOUR_TTL
    ident = leases.identity()
    assert store.ping()

    # the store's calls one by one: acquire, renew, release
    (held,) = store.acquire([Want("tour:1")], ident, ttl=30)
    assert store.renew([held], held.owner, timeout=5) == set()
    assert store.release([held]) == [True]

    # hold: the heartbeat renews (the lease's time left goes up again) until the block ends
    with leases.hold("report:42") as lease:
        seen = [store.holders("report:42")[0].expires_in]

        def renewed() -> bool:
            left = store.holders("report:42")[0].expires_in
            seen.append(left)
            return left > seen[-2]

        wait_until(renewed, 10, "a heartbeat renewal of report:42")
        lease.check()

    # a list with shared members, a second shared holder, a limit reached
    with leases.hold(["repo:7", Shared("remote:3"), Shared("api:k", limit=2)]) as held_list:
        assert [h.resource for h in held_list] == ["repo:7", "remote:3", "api:k"]
        with leases.hold(Shared("remote:3")), leases.hold(Shared("api:k", limit=2)):
            with pytest.raises(LeaseBusy), leases.hold(Shared("api:k", limit=2)):
                pass
            with pytest.raises(LeaseBusy), leases.hold("remote:3"):
                pass

    # waiting (SUBSCRIBE, UNSUBSCRIBE): a holder without a heartbeat runs out after 2 s; a
    # short wait gives up, a long one is woken when it runs out (the same process is busy too)
    (blocker,) = store.acquire([Want("w:1")], ident, ttl=2)
    with pytest.raises(LeaseBusy), leases.hold("w:1", wait=0.1):
        pass
    with leases.hold("w:1", wait=10):
        pass
    assert store.release([blocker]) == [False]  # it had run out

    # once and receipts
    assert leases.once("analysis:1:input", lambda: {"p": 1}) == {"p": 1}
    assert leases.once("analysis:1:input", lambda: {"p": 2}) == {"p": 1}
    assert leases.receipt("analysis:1:input") == {"p": 1}
    assert leases.forget("analysis:1:input")
    assert leases.receipt("analysis:1:input") is None

    assert set(store.load_scripts()) >= {"acquire", "renew", "release", "commit_receipt"}

    # a beat claim: the first claim of a run wins, the second loses
    won, run, _, _ = store.beat_claim("entry", due_ms=None, bucket=60.0, replica="r1", keep=60)
    again, run2, _, winner = store.beat_claim(
        "entry", due_ms=None, bucket=60.0, replica="r2", keep=60
    )
    assert won
    assert not again or run2 != run
    assert winner in ("r1", "r2")

    # what the CLI reads and writes: holders, registries, liveness, a forced release, audit
    (lease,) = leases.acquire([Want("res:99")], ttl=30)
    owner = lease._held.owner
    assert [h.resource for h in store.holders("res:99")] == ["res:99"]
    registries = store.read_registries([o for o, _ in store.owners()])
    items = [(o, e) for o, entries in registries.items() for e in entries]
    assert any(e.resource == "res:99" for _, e in items)
    assert all(left is not None for left in store.check_entries(items))
    assert store.read_liveness([owner])[owner] is not None
    assert store.node_owners(ident.node)
    (other,) = store.acquire([Want("res:100")], ident, ttl=30)
    (holder,) = store.holders("res:100")
    assert store.force_release("res:100", holder)
    assert store.release([other]) == [False]
    store.audit({"resource": "res:100", "by": "tour"})
    assert store.audit_log(1)[0]["resource"] == "res:100"

    # reconcile: an owner whose liveness ran out (nothing renews it) loses its leases
    dead = Identity("dead@nowhere", "0", 1)
    store.acquire([Want("orphan:1")], dead, ttl=30)

    def reconciled() -> bool:
        report = store.reconcile()
        assert report.errors == []
        return (dead.owner, "orphan:1") in report.released

    wait_until(reconciled, 10, "a reconcile to free the dead owner's lease")
    assert store.holders("orphan:1") == []

    # start-up cleanup: frees every lease of the node's other incarnations
    report = store.cleanup_node(ident.node, keep_incarnation="another")
    assert report.errors == []
    assert "res:99" in {r for _, r in report.released}
    assert store.holders("res:99") == []
    leases.release([lease])  # already freed: a no-op

    # unique claims: claim (queued), a duplicate, the index the CLI reads, the worker's
    # handover, a requeue (retry), a take-over waiting for the release, an unclaim
    assert isinstance(store.unique_claim("job:1", "task-1", 30), Claimed)
    assert isinstance(store.unique_claim("job:1", "task-2", 30), ClaimHolder)
    assert [c.key for c in store.queued_claims()] == ["job:1"]
    taken = store.unique_handover("job:1", "task-1", ident, 30)
    assert not isinstance(taken, ClaimHolder)
    running = store.unique_holder("job:1")
    assert running is not None
    assert (running.state, running.task_id) == ("running", "task-1")
    assert store.unique_requeue(taken, 30)
    again = store.unique_take("job:1", "task-1", ident, 30, wait=1)
    assert not isinstance(again, ClaimHolder)
    assert store.release([again]) == [True]
    assert isinstance(store.unique_claim("job:1", "task-3", 30), Claimed)
    assert store.unique_unclaim("job:1", "task-3")
