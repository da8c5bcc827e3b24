"""Lease options on a task declared without ``base=LeasedTask`` are used or refused.

``@app.task(lease=...)`` is what people coming from celery-once write first. On an app with
``Leases(app)`` the task gets LeasedTask's behaviour, whenever it was declared, whatever the
app's task class; a task that cannot get it is refused naming it. No Redis: the leases are
not taken here (tests/integration/worker/test_plain_task_options.py runs one in a worker).
Every task is declared with ``shared=False`` (see test_task_declaration.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, Task

from celery_leases import LeasedTask, Leases
from celery_leases.exceptions import LeaseConfigError
from celery_leases.worker import LeaseBootstep


def test_plain_task_declared_after_leases_is_a_leased_task() -> None:
    app = Celery("plain-after", set_as_current=False)
    Leases(app)

    @app.task(shared=False, lease="report:{account_id}", on_busy="skip", lease_ttl=9)
    def build(account_id: int) -> int:
        return account_id

    task = build._get_current_object()
    assert isinstance(task, LeasedTask)
    assert [t.text for t in task._lease_templates] == ["report:{account_id}"]
    assert (task.on_busy, task.lease_ttl) == ("skip", 9)
    assert [w.resource for w in task._render_leases((7,), {})] == ["report:7"]
    assert task.name.endswith("build")


def test_plain_task_declared_before_leases_counts_too() -> None:
    app = Celery("plain-before", set_as_current=False)

    @app.task(shared=False, unique="u:{key}")
    def early(key: str) -> None: ...

    @app.task(shared=False)
    def unleased() -> None: ...

    Leases(app)
    app.finalize()
    task = app.tasks[early.name]
    assert isinstance(task, LeasedTask)
    assert task._unique_key(("k",), {}) == "u:k"
    assert not isinstance(app.tasks[unleased.name], LeasedTask)  # no option: left alone


def test_task_made_before_leases_is_adopted_at_leases() -> None:
    app = Celery("plain-made", set_as_current=False)
    app.finalize()

    @app.task(shared=False, lease="m:{x}")
    def made(x: int) -> None: ...

    assert not isinstance(made, LeasedTask)  # today's Celery: a plain attribute
    Leases(app)
    assert isinstance(app.tasks[made.name], LeasedTask)


def test_custom_task_cls_keeps_working_around_the_leases() -> None:
    calls: list[str] = []

    class Audited(Task):  # type: ignore[type-arg]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            calls.append("audited")
            return super().__call__(*args, **kwargs)

    app = Celery("plain-cls", set_as_current=False, task_cls=Audited)
    Leases(app)

    @app.task(shared=False, lease="c:{x}", bind=True)
    def bound(self: Any, x: int) -> int:
        return x

    task = bound._get_current_object()
    assert isinstance(task, LeasedTask)
    assert isinstance(task, Audited)
    # the user's __call__ wraps LeasedTask's: it runs first
    mro = type(task).__mro__
    assert mro.index(Audited) < mro.index(LeasedTask)
    assert [w.resource for w in task._render_leases((3,), {})] == ["c:3"]  # self is not x


def test_bad_option_on_a_plain_task_fails_at_declaration_naming_it() -> None:
    app = Celery("plain-bad", set_as_current=False)
    app.finalize()
    Leases(app)
    with pytest.raises(LeaseConfigError, match=r"typo_task.*\{idd\}"):

        @app.task(shared=False, lease="a:{idd}")
        def typo_task(id: int) -> None: ...


def test_task_that_cannot_take_the_behaviour_is_refused_naming_it() -> None:
    class Sealed(Task):  # type: ignore[type-arg]
        """A base whose task classes may not be subclassed again (TypeError, as Python's)."""

        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            if "run" not in cls.__dict__:
                raise TypeError(f"{cls.__name__} is sealed")

    app = Celery("plain-sealed", set_as_current=False)
    app.finalize()
    Leases(app)
    with pytest.raises(LeaseConfigError, match=r"sealed_task.*sealed.*base=LeasedTask"):

        @app.task(shared=False, base=Sealed, lease="s:{x}")
        def sealed_task(x: int) -> None: ...


def test_task_registered_after_finalize_is_adopted_at_worker_start() -> None:
    """``app.register_task`` bypasses Celery's task factory: the bootstep adopts it."""
    app = Celery("plain-registered", set_as_current=False)
    app.finalize()
    Leases(app, node="unit@host")  # a node of its own: the bootstep must not set the process's

    class Registered(app.Task):  # type: ignore[name-defined,misc]
        name = "plain.registered"
        lease = "reg:{x}"

        def run(self, x: int) -> int:
            return x

    app.register_task(Registered())
    assert not isinstance(app.tasks["plain.registered"], LeasedTask)
    LeaseBootstep(SimpleNamespace(app=app, hostname="unit@host"))
    task = app.tasks["plain.registered"]
    assert isinstance(task, LeasedTask)
    assert [w.resource for w in task._render_leases((5,), {})] == ["reg:5"]


def test_bad_registered_task_is_refused_at_worker_start() -> None:
    app = Celery("plain-registered-bad", set_as_current=False)
    app.finalize()
    Leases(app, node="unit@host")

    class Broken(app.Task):  # type: ignore[name-defined,misc]
        name = "plain.broken"
        lease = "b:{missing}"

        def run(self, x: int) -> None: ...

    app.register_task(Broken())
    with pytest.raises(LeaseConfigError, match=r"plain\.broken.*\{missing\}"):
        LeaseBootstep(SimpleNamespace(app=app, hostname="unit@host"))


def test_a_task_refused_at_leases_leaves_no_half_made_leases() -> None:
    app = Celery("plain-refused-early", set_as_current=False)
    app.finalize()

    @app.task(shared=False, lease="a:{nope}")
    def early_bad(x: int) -> None: ...

    with pytest.raises(LeaseConfigError, match=r"early_bad.*\{nope\}"):
        Leases(app)
    assert "leases" not in app.__dict__  # fixing the task and trying again is possible
