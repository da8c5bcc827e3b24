"""Bugs the model of unique modes (test_model_unique.py) found, each as a deterministic test."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult

from celery_leases import LeasedTask, Leases, _parking
from celery_leases._claims import Claimed, ClaimMode
from celery_leases._identity import Identity
from celery_leases._lease import Held
from celery_leases._modes import kept
from celery_leases._parking import DONE_KEEP_MS, PARKED_HEADER, tombstone
from celery_leases._unique import on_task_revoked
from tests.support.polling import wait_until

WINDOW = 1.0  # unique_confirm_window: how long a pending claim lives
W = Identity("worker@host", "inc", 303)


def _sync(k: str, n: int) -> None:
    """Never run: only its sends are looked at."""


def _keep_last_app(
    make_leases: Callable[..., Leases],
) -> tuple[Leases, Any, list[tuple[str, list[Any], dict[str, Any]]]]:
    """A keep_last task whose publishes are captured (task id, args, headers)."""
    app = Celery("umodel-regressions", set_as_current=False)
    published: list[tuple[str, list[Any], dict[str, Any]]] = []

    def send_task(name: str, args: Any = None, kwargs: Any = None, *rest: Any, **opts: Any) -> Any:
        published.append((opts["task_id"], list(args or ()), dict(opts.get("headers") or {})))
        return AsyncResult(opts["task_id"], app=app)

    app.send_task = send_task  # type: ignore[method-assign]
    ext = make_leases(app, unique_confirm_window=WINDOW, handon_timeout=5.0)

    sync = app.task(
        base=LeasedTask, name="umodel.sync", unique="sync:{k}", unique_mode="keep_last"
    )(_sync)
    app.finalize()
    return ext, sync, published


def _pending_claim(ext: Leases, task_id: str) -> int:
    """The claim a producer makes before its publish (``_publish_unique``), left pending."""
    mode = kept(ClaimMode("k", forget=60.0), "sync:1", "umodel.sync", ("1", 0), {}, {})
    claimed = ext.store.unique_claim("sync:1", task_id, WINDOW, mode)
    assert isinstance(claimed, Claimed)
    return claimed.token


@pytest.mark.parametrize("unsent", ["producer died", "publish failed"])
def test_keep_last_arguments_given_to_a_copy_never_published_still_run(
    make_leases: Callable[..., Leases], unsent: str
) -> None:
    """Found by the model: t0 producer A claims the key for task-a (pending: it lives
    unique_confirm_window until A's publish confirms it); t1 producer B sends with newer
    arguments: they go to task-a, and B gets task-a's AsyncResult; t2 A dies before its
    publish (or its publish fails and it gives its claim back). Before the fix nothing ever
    ran: B's arguments were kept for a task that was never sent. They now run, as task-a,
    handed on by the pump once the claim is gone."""
    ext, sync, published = _keep_last_app(make_leases)
    token = _pending_claim(ext, "task-a")
    result = sync.apply_async(("1", 1))  # producer B
    assert result.id == "task-a"
    assert published == []
    if unsent == "publish failed":
        assert ext.store.unique_unclaim("sync:1", "task-a", token)

    def handed_on() -> bool:
        _parking.pump(ext)
        return bool(published)

    wait_until(handed_on, 5 * WINDOW + 5.0, "B's arguments to be published")
    assert [(t, a) for t, a, _ in published] == [("task-a", ["1", 1])]
    # the worker that gets it takes the claim as a follow-up's, once
    headers = published[0][2]
    assert headers.get(PARKED_HEADER)
    handed = (tombstone("task-a", 0), DONE_KEEP_MS, "")
    held = ext.store.unique_take("sync:1", "task-a", W, 3.0, 0.0, handed)
    assert isinstance(held, Held)
    ext.store.release([held])
    assert _parking.list_parked(ext) == []


def test_a_copy_that_ran_leaves_nothing_parked(make_leases: Callable[..., Leases]) -> None:
    """The copy that got the newer arguments runs with them, once: its start forgets what
    was kept for it in case it was never sent."""
    ext, sync, published = _keep_last_app(make_leases)
    first = sync.apply_async(("1", 0))
    assert sync.apply_async(("1", 1)).id == first.id
    assert [t for t, _, _ in published] == [first.id]
    held = ext.store.unique_take("sync:1", first.id, W, 3.0, 0.0, None)
    assert isinstance(held, Held)
    assert _parking.list_parked(ext) == []
    ext.store.release([held])
    time.sleep(WINDOW + 0.2)
    _parking.pump(ext)
    assert [t for t, _, _ in published] == [first.id]


def test_a_revoked_copy_does_not_run_the_arguments_it_was_given(
    make_leases: Callable[..., Leases],
) -> None:
    """A queued copy revoked before it ran (the worker discards its message) gives back its
    claim, and the arguments later sends gave it do not run either."""
    ext, sync, published = _keep_last_app(make_leases)
    first = sync.apply_async(("1", 0))
    assert sync.apply_async(("1", 1)).id == first.id

    class Request:
        id = first.id
        headers = published[0][2]
        args = ("1", 0)
        kwargs: dict[str, Any] = {}

    on_task_revoked(sender=sync, request=Request())
    assert ext.store.unique_holder("sync:1") is None
    assert _parking.list_parked(ext) == []
