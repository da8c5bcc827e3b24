"""A leased task's body runs as a plain task's does: under the tracer's own request.

Celery's tracer calls ``run`` directly for a task without a ``__call__`` of its own; a
LeasedTask has one, and runs the body the same way when the tracer called it (no copy of the
request pushed). A direct call, a call from inside a leased body, and a base class that wraps
the body in a ``__call__`` of its own still go through ``Task.__call__``.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, Task

from celery_leases import LeasedTask, current_leases


def _app(make_leases: Any) -> Celery:
    app = Celery("body", set_as_current=False)
    app.conf.task_store_eager_result = False
    make_leases(app)
    return app


def test_a_traced_body_runs_under_the_tracers_request(make_leases):
    app = _app(make_leases)
    seen: list[tuple[Any, ...]] = []

    @app.task(bind=True, shared=False, lease="body:{n}")
    def leased(self: Task[Any, Any], n: int) -> int:
        request = self.request
        seen.append(
            (
                request.id,
                request.called_directly,
                tuple(request.args),
                len(self.request_stack),
                [lease.resource for lease in current_leases()],
            )
        )
        if n > 0:
            leased(n - 1)  # a direct call from inside the body: a request of its own
        return n

    result = leased.apply((1,), task_id="t-1")
    assert result.successful(), result.traceback
    assert seen[0] == ("t-1", False, (1,), 1, ["body:1"])
    # the nested direct call pushed its own request, with its own arguments
    assert seen[1][2] == (0,)
    assert seen[1][3] == 2
    assert seen[1][4] == ["body:0"]
    # a direct call outside any task: Task.__call__ pushes the request, as before
    seen.clear()
    assert leased(0) == 0
    assert seen[0][1] is True
    assert seen[0][4] == ["body:0"]


def test_a_base_that_wraps_the_body_still_wraps_it(make_leases):
    app = _app(make_leases)
    wrapped: list[str] = []

    class Wrapping(Task):  # type: ignore[type-arg]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            wrapped.append("before")
            try:
                return super().__call__(*args, **kwargs)
            finally:
                wrapped.append("after")

    class Both(LeasedTask, Wrapping):
        pass

    @app.task(base=Both, shared=False, lease="wrap:{n}")
    def task(n: int) -> list[str]:
        wrapped.append("body")
        return [lease.resource for lease in current_leases()]

    assert Both._celery_call is False
    assert task.apply((3,)).get() == ["wrap:3"]
    assert wrapped == ["before", "body", "after"]
