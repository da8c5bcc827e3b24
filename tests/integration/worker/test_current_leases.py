"""current_leases() inside real workers: order, rendering, isolation between threads, modes
and fencing tokens."""

from __future__ import annotations

from itertools import pairwise

import pytest

from celery_leases import LeaseBusy, Shared, current_leases

from .conftest import wait_until

pytestmark = pytest.mark.worker

RESULT_TIMEOUT = 30.0
WORKER_TTL = 3.0  # CELERY_LEASES_TTL of the worker_env fixture


def test_outside_a_task_there_are_no_leases():
    assert current_leases() == ()


def test_declaration_order_and_rendering_from_args_kwargs_and_defaults(
    start_worker, worker_app, send
):
    start_worker("solo", 1)
    # declared p, k, d: the reverse of the sorted order the leases are taken in
    out = send(worker_app.declared_order, "1", b="two").get(timeout=RESULT_TIMEOUT)
    assert [(r, shared) for r, _, shared, _, _ in out] == [
        ("p:1", False),
        ("k:two", True),
        ("d:dflt", False),
    ]
    for _, token, _, expires_in, ttl in out:
        assert token >= 1
        assert ttl == WORKER_TTL
        assert 0 < expires_in <= ttl

    out = send(worker_app.declared_order, "1", "two", c="three").get(timeout=RESULT_TIMEOUT)
    assert [r for r, *_ in out] == ["p:1", "k:two", "d:three"]

    out = send(worker_app.declared_order, a="x", b="y", c="z").get(timeout=RESULT_TIMEOUT)
    assert [r for r, *_ in out] == ["p:x", "k:y", "d:z"]

    # same process, after leased tasks: a plain task sees nothing
    assert send(worker_app.unleased_view).get(timeout=RESULT_TIMEOUT) == []


def test_threads_each_see_only_their_own_lease(start_worker, worker_app, send):
    n = 4
    start_worker("threads", n)
    results = [send(worker_app.sees_own, f"t{i}", n) for i in range(n)]
    outs = [r.get(timeout=RESULT_TIMEOUT) for r in results]
    assert all(out["together"] for out in outs), "the tasks did not run at the same time"
    assert len({out["thread"] for out in outs}) == n
    assert [out["leases"] for out in outs] == [[f"cc:t{i}"] for i in range(n)]


def test_multi_takes_exclusive_shared_and_limited_shared(
    start_worker, worker_app, send, test_leases
):
    start_worker("prefork", 2)
    results = [send(worker_app.multi, a, "B", c="C", seconds=2.0) for a in ("1", "2")]

    def both_hold():
        return (
            len(test_leases.store.holders("shared:B")) == 2
            and len(test_leases.store.holders("limited:C")) == 2
        )

    wait_until(both_hold, RESULT_TIMEOUT, "both tasks to hold shared:B and limited:C")
    assert [h.mode for h in test_leases.store.holders("multi:1")] == ["x"]
    assert {h.mode for h in test_leases.store.holders("shared:B")} == {"s"}
    # what the tasks hold behaves as declared
    with test_leases.hold(Shared("shared:B")):
        pass  # shared is compatible with shared
    with pytest.raises(LeaseBusy) as busy, test_leases.hold(Shared("limited:C", limit=2)):
        pass  # a third holder is over the limit
    assert busy.value.resource == "limited:C"
    for resource in ("shared:B", "multi:2"):
        with pytest.raises(LeaseBusy), test_leases.hold(resource):
            pass

    outs = [r.get(timeout=RESULT_TIMEOUT) for r in results]
    for a, out in zip(("1", "2"), outs, strict=True):
        assert [(r, shared) for r, _, shared in out["leases"]] == [
            (f"multi:{a}", False),
            ("shared:B", True),
            ("limited:C", True),
        ]
    for resource in ("multi:1", "multi:2", "shared:B", "limited:C"):
        assert test_leases.store.holders(resource) == []


def test_fencing_tokens_of_successive_tasks_strictly_increase(
    start_worker, worker_app, send, ledger
):
    start_worker("prefork", 2)
    tokens = []
    for _ in range(4):
        out = send(worker_app.guarded, "fence", 0.0).get(timeout=RESULT_TIMEOUT)
        ((resource, token),) = out["leases"]
        assert resource == "res:fence"
        tokens.append(token)
    assert all(a < b for a, b in pairwise(tokens)), tokens
    assert ledger.tokens("res:fence") == tokens
    # shared grants count too
    shared = []
    for a in ("s1", "s2", "s3"):
        out = send(worker_app.multi, a, "fence").get(timeout=RESULT_TIMEOUT)
        shared.append(next(t for r, t, _ in out["leases"] if r == "shared:fence"))
    assert all(a < b for a, b in pairwise(shared)), shared
