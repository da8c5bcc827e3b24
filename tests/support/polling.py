"""Waiting in tests: poll a condition against a deadline, never a bare sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

#: the deadline of a wait for what only takes scheduling (a thread to run, a message to be
#: read, a subscription to be made or dropped): generous, as the machine may be loaded; a
#: deadline is never a measure of speed
SCHEDULING = 60.0


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, step: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(step)
