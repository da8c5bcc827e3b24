"""The grant operations of the sans-IO core (celery_leases/_grants.py), driven without Redis."""

from __future__ import annotations

import pytest

from celery_leases import _grants
from celery_leases._engine import LeaseEngine
from celery_leases._lostreply import BOOK
from celery_leases._protocol import Send
from celery_leases._registry import Entry
from celery_leases._scripts import ReleaseReply
from celery_leases.config import LeaseSettings
from celery_leases.exceptions import LeaseBackendError
from tests.support.steps import drive, lost, refused, replies, scripts


def _engine() -> LeaseEngine:
    return LeaseEngine(LeaseSettings(redis_url="redis://127.0.0.1:1/0", key_prefix="unit"))


def test_a_release_whose_reply_is_lost_is_sent_again_and_counts_a_held_lease_freed():
    engine = _engine()
    entry = Entry("x", 7, None, "r")
    steps = _grants.release_entries(engine, "o/1/2", 0, [entry], [True])
    freed, made = drive(steps, replies(lost(), [[ReleaseReply.NOT_HELD]]))
    assert freed == [True]  # the lost run released it; the second found nothing
    assert [op.once for op in made if isinstance(op, Send)] == [True, False]
    assert scripts(made) == ["release", "release"]


def test_a_release_refused_by_redis_is_a_backend_error_and_not_sent_again():
    engine = _engine()
    steps = _grants.release_entries(engine, "o/1/2", 0, [Entry("x", 7, None, "r")], None)
    with pytest.raises(LeaseBackendError, match="failed to release"):
        drive(steps, replies(refused()))
    assert BOOK.held("o/1/2", engine.resource_keys("r").exclusive) == set()
