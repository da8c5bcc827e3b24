"""Declaring a LeasedTask: templates are checked against the signature when the task is made.

No worker and no Redis. ``@app.task`` is lazy, so every test forces the task into existence
(``app.finalize()`` or ``task._get_current_object()``). Every task here is declared with
``shared=False``: a shared task would be added to every Celery app finalized later in this
process, and the broken ones would then break unrelated tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_leases import LeasedTask, LeaseError, Shared
from celery_leases._lease import MAX_NAME_BYTES
from celery_leases.exceptions import LeaseConfigError


@pytest.fixture
def app() -> Celery:
    """A fresh app per test (a finalize that raised leaves an app half-built)."""
    return Celery("decl", set_as_current=False)


def declare(app: Celery, fun: Callable[..., Any], **options: Any) -> Any:
    """Declare ``fun`` as a LeasedTask on ``app`` and make the task class exist now."""
    proxy = app.task(base=LeasedTask, shared=False, **options)(fun)
    return proxy._get_current_object()


def test_unknown_field_fails_at_declaration_naming_task_and_field(app: Celery) -> None:
    @app.task(base=LeasedTask, shared=False, lease="analysis:{analysis_idd}")
    def init_analysis(analysis_id: int) -> None:
        raise AssertionError("never runs")

    with pytest.raises(LeaseConfigError) as info:
        app.finalize()
    message = str(info.value)
    assert "init_analysis" in message
    assert "analysis_idd" in message
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, LeaseError)


def test_unknown_field_in_leases_list_fails_when_the_task_is_made(app: Celery) -> None:
    def sync(repo_id: int, remote_id: int) -> None:
        raise AssertionError("never runs")

    with pytest.raises(LeaseConfigError, match=r"sync.*\{key\}"):
        declare(app, sync, leases=["repo:{repo_id}", Shared("api:{key}", limit=3)])


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("a:{x", "malformed"),
        ("a:x}", "malformed"),
        ("a:{}", "positional"),
        ("a:{0}", "positional"),
        ("a:{0.real}", "positional"),
    ],
)
def test_malformed_or_positional_template(app: Celery, template: str, why: str) -> None:
    def shaped(x: int) -> None:
        raise AssertionError("never runs")

    with pytest.raises(LeaseConfigError, match=why) as info:
        declare(app, shaped, lease=template)
    assert "shaped" in str(info.value)
    assert repr(template) in str(info.value)


def test_var_positional_cannot_be_named(app: Celery) -> None:
    def task(*parts: str) -> None:
        raise AssertionError("never runs")

    with pytest.raises(LeaseConfigError, match=r"\*parts"):
        declare(app, task, lease="p:{parts}")


def test_lease_and_leases_both_given(app: Celery) -> None:
    def task(a: int) -> None:
        raise AssertionError("never runs")

    with pytest.raises(LeaseConfigError, match="not both"):
        declare(app, task, lease="a:{a}", leases=["b:{a}"])


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("on_busy", "later"),
        ("on_busy", "RETRY"),
        ("on_lost", "ignore"),
        ("on_backend_error", "ignore"),
        ("on_backend_error", True),
        ("lease_ttl", -1),
        ("lease_ttl", 0),
        ("lease_ttl", "30"),
        ("busy_timeout", -5.0),
        ("wait_timeout", -0.1),
    ],
)
def test_invalid_task_option(app: Celery, option: str, value: object) -> None:
    def optioned(a: int) -> None:
        raise AssertionError("never runs")

    with pytest.raises(LeaseConfigError, match=option) as info:
        declare(app, optioned, lease="a:{a}", **{option: value})
    assert "optioned" in str(info.value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("leases", ["a:{a}", [], ["a:{a}", ""], ["a:{a}", 7]])
def test_invalid_leases_list(app: Celery, leases: object) -> None:
    def task(a: int) -> None:
        raise AssertionError("never runs")

    with pytest.raises(LeaseConfigError):
        declare(app, task, leases=leases)


@pytest.mark.parametrize("limit", [0, -1, True, 1.5])
def test_shared_limit_must_be_a_positive_whole_number(limit: object) -> None:
    with pytest.raises(LeaseConfigError, match="limit"):
        Shared("api:{key}", limit=limit)  # type: ignore[arg-type]


def test_valid_options_are_accepted(app: Celery) -> None:
    def task(a: int) -> None:
        raise AssertionError("never runs")

    made = declare(
        app,
        task,
        lease="a:{a}",
        lease_ttl=0.5,
        on_busy="wait",
        on_lost="log",
        on_backend_error="fail",
        busy_timeout=10,
        wait_timeout=0,
    )
    assert made.wait_timeout == 0
    assert made.on_backend_error == "fail"
    assert made._render_leases((1,), {})[0].resource == "a:1"


def test_bound_task_accepts_its_parameters_and_renders(app: Celery) -> None:
    def gated(self: Any, account_id: int, amount: int = 1, region: str = "eu") -> None:
        raise AssertionError("never runs")

    task = declare(app, gated, bind=True, lease="acct:{account_id}:{region}")
    wants = task._render_leases((42,), {"region": "us"})
    assert [w.resource for w in wants] == ["acct:42:us"]
    # `self` is not a parameter a template can name
    with pytest.raises(LeaseConfigError, match=r"\{self\}"):
        declare(Celery("decl-b", set_as_current=False), gated, bind=True, lease="x:{self}")


def test_class_based_task_accepts_valid_templates() -> None:
    class Transfer(LeasedTask):
        name = "decl.transfer"
        leases = ["acct:{src}", Shared("bank:{bank}", limit=2)]

        def run(self, src: int, dst: int, bank: str = "main") -> None:
            raise AssertionError("never runs")

    task = Transfer()
    wants = task._render_leases((1, 2), {})
    assert [(w.resource, w.mode, w.limit) for w in wants] == [
        ("acct:1", "x", 0),
        ("bank:main", "s", 2),
    ]


def test_class_based_task_with_unknown_field_fails_at_class_creation() -> None:
    with pytest.raises(LeaseConfigError) as info:

        class Broken(LeasedTask):
            lease = "x:{b}"

            def run(self, a: int) -> None:
                raise AssertionError("never runs")

    assert "Broken" in str(info.value)
    assert "{b}" in str(info.value)


def test_kwargs_task_accepts_any_field_and_renders_from_keywords(app: Celery) -> None:
    def loose(a: int, **extra: Any) -> None:
        raise AssertionError("never runs")

    task = declare(app, loose, leases=["a:{a}", Shared("t:{tenant}:{zone}")])
    wants = task._render_leases((5,), {"tenant": "acme", "zone": 3})
    assert [w.resource for w in wants] == ["a:5", "t:acme:3"]
    # a field the call does not supply is an error when the task runs, naming the template
    with pytest.raises(LeaseConfigError, match="tenant"):
        task._render_leases((5,), {"zone": 3})


def test_defaults_are_applied_when_rendering(app: Celery) -> None:
    def step(analysis_id: int, step: str = "align", *, shard: int = 0) -> None:
        raise AssertionError("never runs")

    task = declare(app, step, lease="analysis:{analysis_id}:{step}:{shard}")
    assert [w.resource for w in task._render_leases((7,), {})] == ["analysis:7:align:0"]
    assert [w.resource for w in task._render_leases((), {"analysis_id": 7, "shard": 2})] == [
        "analysis:7:align:2"
    ]
    assert [w.resource for w in task._render_leases((7, "call"), {})] == ["analysis:7:call:0"]


def test_attribute_and_index_fields_check_the_root_name(app: Celery) -> None:
    def task(job: Any, ids: list[int]) -> None:
        raise AssertionError("never runs")

    made = declare(app, task, lease="job:{job.real}:{ids[0]}")
    assert made._render_leases((3, [9, 8]), {})[0].resource == "job:3:9"


def test_arguments_that_do_not_fit_fail_with_a_config_error(app: Celery) -> None:
    def task(a: int) -> None:
        raise AssertionError("never runs")

    made = declare(app, task, lease="a:{a}")
    with pytest.raises(LeaseConfigError, match="do not fit"):
        made._render_leases((), {})


def test_lease_busy_is_an_expected_end_next_to_the_tasks_own_throws(app: Celery) -> None:
    from celery_leases import LeaseBusy

    def plain(rid: str) -> None: ...

    def own(rid: str) -> None: ...

    assert declare(app, plain, lease="r:{rid}").throws == (LeaseBusy,)
    assert declare(app, own, lease="r:{rid}", throws=(KeyError,)).throws == (KeyError, LeaseBusy)
    assert LeasedTask.throws == (LeaseBusy,)


def test_a_template_too_long_without_its_fields_is_refused_at_declaration(app: Celery) -> None:
    # its names are at least as long as its text outside the fields
    def always_too_long(x: str) -> None: ...

    with pytest.raises(LeaseConfigError) as info:
        declare(app, always_too_long, lease="é" * MAX_NAME_BYTES + "{x}")
    assert "lease template, without its fields, is 2,048 bytes long" in str(info.value)
    assert "always_too_long" in str(info.value)

    def fits_for_one_character(x: str) -> None: ...

    task = declare(app, fits_for_one_character, lease="y" * (MAX_NAME_BYTES - 1) + "{x}")
    assert len(task._render_leases(("z",), {})[0].resource) == MAX_NAME_BYTES
