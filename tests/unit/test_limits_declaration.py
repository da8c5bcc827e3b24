"""Rates are checked when they are written: Rate(...), a task's rate=/rates=, limit()."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_leases import LeasedTask, Rate, RateLimited
from celery_leases._limits import PERIODS, parse_rate, want
from celery_leases.exceptions import LeaseBusy, LeaseConfigError


@pytest.mark.parametrize(
    ("text", "n", "period"),
    [("10/s", 10, 1.0), ("100/m", 100, 60.0), ("1/h", 1, 3600.0), (" 5 /s", None, None)],
)
def test_parse_rate(text: str, n: int | None, period: float | None) -> None:
    if n is None:
        with pytest.raises(LeaseConfigError, match=repr(text)):
            parse_rate(text, "here")
    else:
        assert parse_rate(text, "here") == (n, period)


@pytest.mark.parametrize("bad", ["10/d", "10", "0/s", "-1/s", "1.5/s", "ten/s", "", None, 10])
def test_a_bad_rate_is_refused_naming_the_value(bad: object) -> None:
    with pytest.raises(LeaseConfigError, match="Rate\\('api'\\)") as refused:
        Rate("api", bad)  # type: ignore[arg-type]
    assert repr(bad) in str(refused.value) or str(bad) in str(refused.value)


def test_cost_must_fit_the_rate() -> None:
    assert Rate("api", "3/s", cost=3).cost == 3
    with pytest.raises(LeaseConfigError, match="cost 4 is more than"):
        Rate("api", "3/s", cost=4)
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(LeaseConfigError, match="cost"):
            Rate("api", "3/s", cost=bad)  # type: ignore[arg-type]
    with pytest.raises(LeaseConfigError, match="cost 9"):
        want("api", "3/m", 9)


def test_rate_keeps_its_parsed_values_and_compares_by_what_was_written() -> None:
    rate = Rate("api:{a}", "100/m", cost=2)
    assert (rate.n, rate.period, rate.cost) == (100, PERIODS["m"], 2)
    assert rate == Rate("api:{a}", "100/m", cost=2)
    with pytest.raises(LeaseConfigError, match="template"):
        Rate("", "1/s")


def test_rate_limited_is_a_lease_busy_that_survives_serialisation() -> None:
    exc = RateLimited("api:1", 0.25)
    assert isinstance(exc, LeaseBusy)
    again = type(exc)(*exc.args)
    assert (again.resource, again.retry_after) == ("api:1", 0.25)
    assert "admits again in 0.250s" in str(exc)


def declare(**options: object) -> None:
    """Declare a task ``b(x)`` with ``options`` on a fresh app and make it exist now
    (``@app.task`` is lazy; ``shared=False`` keeps a broken one out of other apps)."""

    def b(x: int) -> None: ...

    app = Celery("decl", set_as_current=False)
    app.task(base=LeasedTask, shared=False, **options)(b)._get_current_object()


def test_a_rate_template_must_name_task_parameters() -> None:
    with pytest.raises(LeaseConfigError, match=r"\{account\}, which is not a parameter"):
        declare(rate=Rate("api:{account}", "1/s"))


def test_rate_and_rates_are_checked_at_declaration() -> None:
    with pytest.raises(LeaseConfigError, match="either rate= or rates="):
        declare(rate=Rate("x", "1/s"), rates=[Rate("y", "1/s")])
    with pytest.raises(LeaseConfigError, match="rates= must be a non-empty list"):
        declare(rates=[])
    with pytest.raises(LeaseConfigError, match="a rate must be a Rate"):
        declare(rate="10/s")
    declare(rates=[Rate("x:{x}", "1/s"), Rate("all", "5/m", cost=2)])


def test_defer_never_retries_a_rate_limit_through_the_broker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under on_busy="defer" a limit's refusal parks (see _call_leased): only a task that
    stayed busy on every attempt of its delivery gets to _busy, which raises, never retries."""

    def b(x: int) -> None: ...

    app = Celery("defer", set_as_current=False)
    task = app.task(base=LeasedTask, shared=False, rate=Rate("api:{x}", "1/s"), on_busy="defer")(
        b
    )._get_current_object()
    retried: list[LeaseBusy] = []
    monkeypatch.setattr(type(task), "_retry_busy", lambda self, busy, a, k: retried.append(busy))
    with pytest.raises(RateLimited):
        task._busy(RateLimited("api:1", 0.4), "defer", (1,), {})
    with pytest.raises(LeaseBusy):  # a lease busy on every attempt of a defer: raised
        task._busy(LeaseBusy("doc:1"), "defer", (1,), {})
    assert retried == []
