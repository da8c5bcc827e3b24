"""The redelivery guard's pieces that need no worker: delivery ids, keys, the record's calls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from celery_leases import _receipts
from celery_leases._engine import LeaseEngine
from celery_leases._guard import (
    KeepAlive,
    RedeliveryGuard,
    _check_record_ttl,
    _Delivery,
    delivery_of,
)
from celery_leases._keys import REDELIVERY_PREFIX, Keyspace
from celery_leases._protocol import Command, Send
from celery_leases.config import LeaseSettings
from celery_leases.exceptions import LeaseConfigError
from tests.support.steps import drive, replies, scripts


def _engine() -> LeaseEngine:
    return LeaseEngine(LeaseSettings(redis_url="redis://127.0.0.1:1/0", key_prefix="unit"))


def _message(headers: dict[str, object], info: dict[str, object] | None = None) -> object:
    return SimpleNamespace(headers=headers, delivery_info=info or {})


def test_a_protocol_2_delivery_is_named_by_its_task_id_and_retries():
    message = _message({"task": "t", "id": "abc", "retries": 2})
    assert delivery_of(message, None) == ("abc", 2, False)


def test_the_redelivered_flag_of_rabbitmq_and_of_kombus_redis_restore_is_read():
    assert delivery_of(_message({"task": "t", "id": "a"}, {"redelivered": True}), None) == (
        "a",
        0,
        True,
    )
    restored = _message({"task": "t", "id": "a", "redelivered": True})
    assert delivery_of(restored, None) == ("a", 0, True)


def test_a_protocol_1_delivery_is_read_from_its_body():
    assert delivery_of(_message({}), {"id": "b", "retries": 1}) == ("b", 1, False)


def test_a_message_without_a_task_id_is_not_guarded():
    assert delivery_of(_message({"task": "t", "id": ""}), None) is None
    assert delivery_of(_message({}), None) is None


def test_a_retry_is_a_new_delivery_with_its_own_lease_and_record():
    keys = Keyspace("unit")
    first, retry = keys.redelivery_resource("id", 0), keys.redelivery_resource("id", 1)
    assert first == f"{REDELIVERY_PREFIX}id"
    assert retry == f"{REDELIVERY_PREFIX}id#1"
    assert keys.delivery_done("id", 0) != keys.delivery_done("id", 1)


def test_a_task_id_cannot_break_the_records_hash_tag():
    key = Keyspace("unit").delivery_done("x}{y", 0)
    assert key.startswith("{unit:")
    assert key.count("{") == 1
    assert key.count("}") == 1


def test_the_completion_record_is_one_set_with_an_expiry_and_one_get():
    engine = _engine()
    _, made = drive(_receipts.put_delivery_done(engine, "id", 0, "SUCCESS", 60), replies([True]))
    (op,) = made
    assert isinstance(op, Send)
    (command,) = op.calls
    assert isinstance(command, Command)
    assert command.words[2:] == ("SUCCESS", "PX", 60000)
    state, made = drive(_receipts.get_delivery_done(engine, "id", 0), replies([b"FAILURE"]))
    assert state == "FAILURE"
    assert scripts(made) == ["cmd:GET"]
    state, _ = drive(_receipts.get_delivery_done(engine, "id", 0), replies([None]))
    assert state is None


def test_the_guard_is_off_by_default_and_its_times_are_checked():
    settings = LeaseSettings(redis_url="redis://127.0.0.1:1/0")
    assert settings.redelivery_guard is False
    with pytest.raises((LeaseConfigError, ValueError), match="redelivery_record_ttl"):
        LeaseSettings(redis_url="redis://127.0.0.1:1/0", redelivery_record_ttl=0)
    with pytest.raises((LeaseConfigError, ValueError), match="redelivery_recheck"):
        LeaseSettings(redis_url="redis://127.0.0.1:1/0", redelivery_recheck=-1)


def test_the_keep_alive_counts_each_tag_as_often_as_it_is_held():
    keep = KeepAlive()
    keep.add("t")
    keep.add("t")  # a copy waits on the same delivery tag as the one that runs
    keep.discard("t")
    assert keep.held() == ["t"]
    keep.discard("t")
    keep.discard(None)
    assert keep.held() == []
    assert keep.attach(object()) is False  # not a Redis channel: nothing to keep fresh


class _Ext:
    """What the guard needs of Leases to settle deliveries: a release that records."""

    def __init__(self) -> None:
        self.released: list[list[object]] = []

    def release(self, leases: list[object]) -> list[object]:
        self.released.append(list(leases))
        return []


def _delivery(task_id: str, leases: list[object], tag: str) -> _Delivery:
    def nothing(*args: object, **kwargs: object) -> None:
        return None

    return _Delivery(
        nothing, object(), None, nothing, nothing, None, {}, task_id, 0, False, True, "t", tag,
        leases,
    )  # fmt: skip


def test_a_lost_connection_frees_what_did_not_start_and_keeps_what_runs():
    ext = _Ext()
    guard = RedeliveryGuard(ext, SimpleNamespace())  # type: ignore[arg-type]
    running = _delivery("run", ["lease-run"], "t1")
    eta = _delivery("eta", ["lease-eta"], "t2")
    waiting = _delivery("copy", [], "t3")  # a copy waiting for its first copy's outcome
    for d in (running, eta, waiting):
        guard.keepalive.add(d.tag)
        guard._open.add(d)
    guard.connection_lost({"run"})
    assert ext.released == [["lease-eta"]]
    assert guard.keepalive.held() == ["t1"]
    assert waiting.settled
    assert not running.settled
    assert guard._admit(waiting) is None  # its next look does nothing


@pytest.mark.parametrize(
    ("options", "warned"),
    [
        ({}, False),  # kombu's defaults: one hour, and a sweep every 100 s; the record: 2 h
        ({"visibility_timeout": 4 * 3600}, True),
    ],
)
def test_a_record_shorter_than_a_redelivery_is_warned_of(
    caplog: pytest.LogCaptureFixture, options: dict[str, object], warned: bool
):
    ext = SimpleNamespace(settings=SimpleNamespace(redelivery_record_ttl=7200.0))
    conf = SimpleNamespace(broker_url="redis://h:1/0", broker_transport_options=options)
    with caplog.at_level("WARNING", logger="celery_leases._guard"):
        _check_record_ttl(ext, conf)  # type: ignore[arg-type]
    assert ("redelivery_record_ttl" in caplog.text) is warned
