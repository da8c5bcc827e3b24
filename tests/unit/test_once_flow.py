"""once's flow (celery_leases/once.py::_flow), carried out without Redis: one flow, whose
steps both once and aonce only carry out."""

from __future__ import annotations

import time
from typing import Any

import pytest

from celery_leases import once as once_module
from celery_leases._lease import Held, Lease
from celery_leases._protocol import drive
from celery_leases.exceptions import LeaseLost


def _lease() -> Lease:
    now = time.monotonic()
    held = Held(None, "n/i/1", "once:x", "x", 9, 10.0, now, now, 9.0)  # type: ignore[arg-type]
    return Lease("once:x", 9, 10.0, False, held)


def _carry_out(answers: dict[type, Any], seen: list[str]) -> Any:
    def carry_out(step: Any) -> Any:
        seen.append(type(step).__name__)
        answer = answers[type(step)]
        if isinstance(answer, BaseException):
            raise answer
        return answer(step) if callable(answer) else answer

    return carry_out


def test_a_receipt_found_first_runs_nothing():
    seen: list[str] = []
    answers = {once_module._GetReceipt: '{"value": 3}'}
    value = drive(once_module._flow("x", None), _carry_out(answers, seen), BaseException)
    assert value == 3
    assert seen == ["_GetReceipt"]


def test_an_initializer_that_raises_still_releases_the_lease():
    seen: list[str] = []
    answers = {
        once_module._GetReceipt: lambda step: None,
        once_module._Acquire: _lease(),
        once_module._Call: ValueError("boom"),
        once_module._Release: None,
    }
    with pytest.raises(ValueError, match="boom"):
        drive(once_module._flow("x", None), _carry_out(answers, seen), BaseException)
    assert seen == ["_GetReceipt", "_Acquire", "_GetReceipt", "_Call", "_Release"]


def test_a_receipt_the_lease_no_longer_covers_is_not_stored_and_the_lease_released():
    seen: list[str] = []
    answers = {
        once_module._GetReceipt: lambda step: None,
        once_module._Acquire: _lease(),
        once_module._Call: {"path": "/data"},
        once_module._Commit: False,  # the holder check in commit_receipt.lua refused it
        once_module._Release: None,
    }
    with pytest.raises(LeaseLost):
        drive(once_module._flow("x", None), _carry_out(answers, seen), BaseException)
    assert seen[-2:] == ["_Commit", "_Release"]
