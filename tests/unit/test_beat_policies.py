"""Beat entries' lease options: checked when the schedule is loaded, stripped before a send."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from celery.beat import ScheduleEntry
from celery.schedules import BaseSchedule, crontab

from celery_leases._beat_runs import (
    EntryPolicy,
    check_entries,
    check_kept,
    entry_policy,
    send_options,
)
from celery_leases.exceptions import LeaseConfigError


def test_an_entry_without_options_allows_overlap_and_has_no_catch_up():
    assert entry_policy("e", None) == EntryPolicy("allow", None)
    assert entry_policy("e", {"queue": "q"}) == EntryPolicy("allow", None)


@pytest.mark.parametrize("overlap", ["allow", "skip", "buffer_one"])
def test_each_overlap_policy_is_accepted(overlap: str):
    assert entry_policy("e", {"leases_overlap": overlap}).overlap == overlap


@pytest.mark.parametrize("window", [0, 30, 90.5])
def test_a_window_of_seconds_is_accepted(window: float):
    assert entry_policy("e", {"leases_catchup_window": window}).catchup_window == window


def test_an_unknown_overlap_policy_names_the_entry():
    with pytest.raises(LeaseConfigError, match=r"beat entry 'nightly': leases_overlap='never'"):
        entry_policy("nightly", {"leases_overlap": "never"})


@pytest.mark.parametrize("window", [-1, -0.5, float("nan"), float("inf"), "60", True])
def test_a_negative_or_non_numeric_window_names_the_entry(window: Any):
    with pytest.raises(LeaseConfigError, match=r"beat entry 'nightly': leases_catchup_window="):
        entry_policy("nightly", {"leases_catchup_window": window})


def test_the_options_are_stripped_before_the_send():
    options = {"queue": "q", "leases_overlap": "skip", "leases_catchup_window": 5}
    assert send_options(options) == {"queue": "q"}
    assert options["leases_overlap"] == "skip"  # the entry keeps them


def test_a_schedule_is_checked_entry_by_entry():
    good: dict[str, Any] = {
        "a": {"task": "t", "schedule": 10.0, "options": {"leases_catchup_window": 60}},
        "b": {"task": "t", "schedule": timedelta(minutes=1), "options": {}},
        "c": {"task": "t", "schedule": crontab(), "options": {"leases_catchup_window": 60}},
        "d": {"task": "t", "schedule": 5},
    }
    check_entries(good, "claim")
    with pytest.raises(LeaseConfigError, match=r"'bad': leases_overlap='sometimes'"):
        check_entries({**good, "bad": {"options": {"leases_overlap": "sometimes"}}}, "claim")


def test_a_catch_up_window_where_it_cannot_apply_is_refused():
    entry = {"task": "t", "schedule": 10.0, "options": {"leases_catchup_window": 60}}
    with pytest.raises(LeaseConfigError, match=r"'a': leases_catchup_window needs beat_mode"):
        check_entries({"a": entry}, "leader")
    custom = {**entry, "schedule": _Custom()}  # a solar schedule, say (needs ephem)
    with pytest.raises(LeaseConfigError, match=r"'s': .* interval and crontab schedules only"):
        check_entries({"s": custom}, "claim")


class _Custom(BaseSchedule):
    """A schedule of its own (neither an interval nor a crontab)."""


def test_a_scheduler_that_drops_the_options_is_an_error():
    configured = {"a": {"task": "t", "schedule": 5, "options": {"leases_overlap": "skip"}}}
    kept = ScheduleEntry("a", "t", schedule=5, options={"leases_overlap": "skip"})
    check_kept(configured, {"a": kept})
    dropped = ScheduleEntry("a", "t", schedule=5, options={"queue": "q"})
    with pytest.raises(LeaseConfigError, match=r"'a': this scheduler does not keep the options"):
        check_kept(configured, {"a": dropped})
