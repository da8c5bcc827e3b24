"""Declaring ``unique=``: the template and options are checked when the task is made.

No worker and no Redis (``Leases`` is never made here). Tasks are declared with
``shared=False`` so a broken one cannot reach other apps of this process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_leases import DuplicateTask, LeasedTask, LeaseError, Shared
from celery_leases.exceptions import LeaseBusy, LeaseConfigError


@pytest.fixture
def app() -> Celery:
    return Celery("unique-decl", set_as_current=False)


def declare(app: Celery, fun: Callable[..., Any], **options: Any) -> Any:
    proxy = app.task(base=LeasedTask, shared=False, **options)(fun)
    return proxy._get_current_object()


def report(account_id: int, kind: str = "daily", **extra: Any) -> None:
    raise AssertionError("never runs")


def test_the_key_is_rendered_from_bound_arguments(app: Celery):
    task = declare(app, report, unique="report:{account_id}:{kind}:{region}")

    assert task._unique_key((7,), {"region": "eu"}) == "report:7:daily:eu"
    assert (
        task._unique_key([], {"account_id": 7, "kind": "weekly", "region": "us"})
        == "report:7:weekly:us"
    )
    assert task._lease_templates == ()  # unique needs no lease


def test_unique_and_leases_together(app: Celery):
    task = declare(app, report, unique="report:{account_id}", lease="account:{account_id}")

    assert task._unique_key((1,), {}) == "report:1"
    assert [w.resource for w in task._render_leases((1,), {})] == ["account:1"]


def strict(account_id: int) -> None:
    raise AssertionError("never runs")


def test_an_unknown_field_fails_at_declaration(app: Celery):
    with pytest.raises(LeaseConfigError) as info:
        declare(app, strict, unique="report:{acount_id}")
    message = str(info.value)
    assert "unique template 'report:{acount_id}'" in message
    assert "{acount_id}" in message
    assert "account_id" in message  # the parameters it could have named


@pytest.mark.parametrize("bad", ["", 5, Shared("report:{account_id}"), ["report"]])
def test_unique_must_be_a_template_string(app: Celery, bad: object):
    with pytest.raises(LeaseConfigError, match="unique= must be a non-empty str template"):
        declare(app, report, unique=bad)


def test_a_positional_field_fails(app: Celery):
    with pytest.raises(LeaseConfigError, match="positional field"):
        declare(app, report, unique="report:{}")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"on_duplicate": "sometimes"}, "on_duplicate='sometimes' is not one of"),
        ({"unique_ttl": 0}, "unique_ttl must be a positive number"),
        ({"unique_ttl": "1h"}, "unique_ttl must be a positive number"),
    ],
)
def test_bad_options_fail_at_declaration(app: Celery, options: dict[str, Any], match: str):
    with pytest.raises(LeaseConfigError, match=match):
        declare(app, report, unique="report:{account_id}", **options)


def test_arguments_that_do_not_fit_are_a_config_error(app: Celery):
    task = declare(app, report, unique="report:{account_id}")
    with pytest.raises(LeaseConfigError, match="arguments do not fit"):
        task._unique_key((), {})


def test_duplicate_task_is_a_lease_busy_that_survives_json_results():
    exc = DuplicateTask("report:7", "abc", "running", 12.5)

    assert isinstance(exc, LeaseBusy)
    assert isinstance(exc, LeaseError)
    assert exc.resource == "celery_leases:unique:report:7"
    assert "report:7" in str(exc)
    assert "abc" in str(exc)
    assert "running" in str(exc)
    # celery's JSON result backend rebuilds an exception as cls(*args)
    rebuilt = DuplicateTask(*exc.args)
    assert (rebuilt.key, rebuilt.task_id, rebuilt.state, rebuilt.retry_after) == (
        "report:7",
        "abc",
        "running",
        12.5,
    )


# --- unique_mode / unique_window (issue 31) ---------------------------------------------------
@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"unique": "r:{account_id}", "unique_mode": "debounce!"}, "unique_mode='debounce!'"),
        ({"unique": "r:{account_id}", "unique_mode": "throttle"}, "needs unique_window="),
        (
            {"unique": "r:{account_id}", "unique_mode": "throttle", "unique_window": -1},
            "unique_window=-1 must be a number of seconds > 0",
        ),
        (
            {"unique": "r:{account_id}", "unique_mode": "throttle", "unique_window": "60"},
            "unique_window='60'",
        ),
        (
            {"unique": "r:{account_id}", "unique_mode": "replace", "unique_window": 5},
            "unique_window= means nothing with unique_mode='replace'",
        ),
        ({"unique": "r:{account_id}", "unique_window": 5}, "means nothing with unique_mode="),
        ({"unique_mode": "throttle", "unique_window": 5}, "unique_mode= needs unique="),
        ({"lease": "a:{account_id}", "unique_window": 5}, "unique_window= needs unique="),
        (
            {"unique": "r:{account_id}", "unique_mode": "keep_last", "on_duplicate": "raise"},
            "on_duplicate= means nothing with unique_mode='keep_last'",
        ),
        (
            {"unique": "r:{account_id}", "unique_mode": "keep_last", "unique_window": 2},
            "unique_window= means nothing with unique_mode='keep_last'",
        ),
        ({"unique": "r:{account_id}", "unique_mode": "debounce"}, "needs unique_window="),
        (
            {"unique": "r:{account_id}", "unique_mode": "debounce", "unique_window": 0},
            "unique_window=0 must be a number of seconds > 0",
        ),
        (
            {
                "unique": "r:{account_id}",
                "unique_mode": "debounce",
                "unique_window": 5,
                "unique_max_wait": 2,
            },
            "unique_max_wait=2 is less than unique_window=5",
        ),
        (
            {
                "unique": "r:{account_id}",
                "unique_mode": "throttle",
                "unique_window": 5,
                "unique_max_wait": 20,
            },
            "unique_max_wait= means nothing with unique_mode='throttle'",
        ),
        (
            {
                "unique": "r:{account_id}",
                "unique_mode": "debounce",
                "unique_window": 5,
                "on_duplicate": "existing",
            },
            "on_duplicate= means nothing with unique_mode='debounce'",
        ),
        ({"unique_max_wait": 5}, "unique_max_wait= needs unique="),
        (
            {
                "unique": "r:{account_id}",
                "unique_mode": "throttle",
                "unique_window": 2,
                "on_duplicate": "cancel",
            },
            "on_duplicate='cancel' is for unique_mode='refuse' or 'replace', not 'throttle'",
        ),
        (
            {"unique": "r:{account_id}", "unique_mode": "keep_last", "on_duplicate": "cancel"},
            "on_duplicate='cancel' is for unique_mode='refuse' or 'replace', not 'keep_last'",
        ),
        (
            {
                "unique": "r:{account_id}",
                "unique_mode": "debounce",
                "unique_window": 2,
                "on_duplicate": "cancel",
            },
            "on_duplicate='cancel' is for unique_mode='refuse' or 'replace', not 'debounce'",
        ),
        (
            {"unique": "r:{account_id}", "unique_cancel_deadline": 0},
            "unique_cancel_deadline=0 must be a number of seconds > 0",
        ),
        (
            {"unique": "r:{account_id}", "unique_cancel_deadline": "5"},
            "unique_cancel_deadline='5' must be a number of seconds > 0",
        ),
        (
            {"unique": "r:{account_id}", "unique_confirm": "no"},
            "unique_confirm='no' must be True or False",
        ),
        ({"unique_cancel_deadline": 5}, "unique_cancel_deadline= needs unique="),
        ({"unique_confirm": False}, "unique_confirm= needs unique="),
        ({"on_duplicate": "sometimes"}, "on_duplicate='sometimes' is not one of"),
    ],
)
def test_bad_modes_fail_at_declaration_naming_task_and_option(
    app: Celery, options: dict[str, Any], match: str
):
    with pytest.raises(LeaseConfigError, match=match) as info:
        declare(app, report, name="modes.bad", **options)
    assert "'modes.bad'" in str(info.value)


@pytest.mark.parametrize(
    "options",
    [
        {"unique_mode": "refuse"},
        {"unique_mode": "replace", "on_duplicate": "raise"},
        {"unique_mode": "throttle", "unique_window": 0.5, "on_duplicate": "ignore"},
        {"unique_mode": "keep_last"},
        {"unique_mode": "debounce", "unique_window": 2.0},
        {"unique_mode": "debounce", "unique_window": 2.0, "unique_max_wait": 2.0},
        {"unique_mode": "refuse", "on_duplicate": "cancel", "unique_cancel_deadline": 5},
        {"unique_mode": "replace", "on_duplicate": "cancel", "unique_confirm": False},
    ],
)
def test_good_modes_are_declared(app: Celery, options: dict[str, Any]):
    task = declare(app, report, unique="r:{account_id}", **options)
    assert task.unique_mode == options["unique_mode"]
