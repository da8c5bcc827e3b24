"""The error hierarchy, pickling (errors cross process boundaries in Celery) and safe URLs."""

from __future__ import annotations

import pickle

import pytest
import redis
from celery import Celery
from celery.backends.base import BaseBackend

from celery_leases import (
    LeaseBackendError,
    LeaseBusy,
    LeaseConfigError,
    LeaseError,
    LeaseLost,
    StaleFence,
)
from celery_leases._redis_server import free_port
from celery_leases._sync.driver import LeaseStore
from celery_leases.config import resolve_settings, safe_url


@pytest.mark.parametrize(
    "cls", [LeaseBusy, LeaseLost, LeaseConfigError, LeaseBackendError, StaleFence]
)
def test_every_error_is_a_lease_error(cls):
    assert issubclass(cls, LeaseError)
    assert issubclass(LeaseError, Exception)


def test_config_error_is_a_value_error():
    assert issubclass(LeaseConfigError, ValueError)
    for cls in (LeaseBusy, LeaseLost, LeaseBackendError):
        assert not issubclass(cls, ValueError)


def test_busy_and_lost_are_distinct_branches():
    assert not issubclass(LeaseBusy, LeaseLost)
    assert not issubclass(LeaseLost, LeaseBusy)
    assert not issubclass(LeaseBackendError, (LeaseBusy, LeaseLost))


def test_busy_message_and_attributes():
    err = LeaseBusy("repo:7", retry_after=2.5, waited=3.25)
    assert (err.resource, err.retry_after, err.waited) == ("repo:7", 2.5, 3.25)
    assert "'repo:7'" in str(err)
    assert "3.2" in str(err)
    assert LeaseBusy("r").waited == 0.0
    assert "waited" not in str(LeaseBusy("r"))


def test_lost_message_and_attributes():
    err = LeaseLost("analysis:{1}", held_for=12.34)
    assert (err.resource, err.held_for) == ("analysis:{1}", 12.34)
    assert "'analysis:{1}'" in str(err)
    assert "12.3" in str(err)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_busy_survives_pickling(protocol):
    err = LeaseBusy("a\nb {c}", retry_after=None, waited=1.5)
    back = pickle.loads(pickle.dumps(err, protocol=protocol))
    assert type(back) is LeaseBusy
    assert (back.resource, back.retry_after, back.waited) == ("a\nb {c}", None, 1.5)
    assert str(back) == str(err)
    assert back.args == err.args


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_lost_survives_pickling(protocol):
    err = LeaseLost("ключ", held_for=7.0)
    back = pickle.loads(pickle.dumps(err, protocol=protocol))
    assert type(back) is LeaseLost
    assert (back.resource, back.held_for) == ("ключ", 7.0)
    assert str(back) == str(err)


@pytest.mark.parametrize("cls", [LeaseConfigError, LeaseBackendError, LeaseError])
def test_plain_errors_survive_pickling(cls):
    back = pickle.loads(pickle.dumps(cls("something failed")))
    assert type(back) is cls
    assert str(back) == "something failed"


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("redis://:hunter2@localhost:6379/0", "hunter2"),
        ("redis://user:hunter2@localhost:6379/0", "hunter2"),
        ("rediss://user:hunter2@host/0", "hunter2"),
        ("redis://user:p%40ss@host:6379/0", "p%40ss"),
        ("redis://:hunter2@[::1]:6379/0", "hunter2"),
        ("redis://localhost:6379/0?password=hunter2", "hunter2"),
        ("unix://:hunter2@/run/redis.sock?db=0", "hunter2"),
    ],
)
def test_safe_url_hides_passwords(url, secret):
    shown = safe_url(url)
    assert secret not in shown
    assert "***" in shown


@pytest.mark.parametrize(
    "url", ["redis://localhost:6379/0", "rediss://host/1", "redis://user@host:1/2"]
)
def test_safe_url_keeps_urls_without_password(url):
    assert safe_url(url) == url


def test_safe_url_keeps_host_port_and_db():
    assert safe_url("redis://u:pw@cache.internal:6380/4") == "redis://u:***@cache.internal:6380/4"
    # an IPv6 host keeps its brackets, so the URL still parses to the same host
    shown = safe_url("redis://:pw@[::1]:6379/0")
    assert shown == "redis://:***@[::1]:6379/0"


def test_backend_error_carries_the_cause_and_no_password():
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"  # nothing listens there
    store = LeaseStore(resolve_settings(None, redis_url=url, socket_connect_timeout=0.5))
    try:
        with pytest.raises(LeaseBackendError) as info:
            store.ping()
    finally:
        store.close()
    assert "hunter2" not in str(info.value)
    assert "127.0.0.1" in str(info.value)
    assert isinstance(info.value.__cause__, redis.RedisError)


@pytest.mark.parametrize(
    "err", [LeaseBusy("res:a", retry_after=1.5, waited=2.0), LeaseLost("res:a", held_for=3.0)]
)
def test_errors_survive_celerys_json_result_backend(err):
    backend = BaseBackend(Celery("exc-test", set_as_current=False), serializer="json")
    back = backend.exception_to_python(backend.prepare_exception(err, serializer="json"))
    assert type(back) is type(err)
    assert back.resource == "res:a"
    assert str(back) == str(err)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_stale_fence_survives_pickling(protocol):
    err = StaleFence("report:{42}", 17, 18)
    back = pickle.loads(pickle.dumps(err, protocol=protocol))
    assert type(back) is StaleFence
    assert (back.name, back.token, back.last) == ("report:{42}", 17, 18)
    assert str(back) == str(err)
    assert "'report:{42}'" in str(err)
    assert "17" in str(err)
    assert "18" in str(err)
    assert not issubclass(StaleFence, (LeaseBusy, LeaseLost, ValueError))


def test_stale_fence_survives_celerys_json_result_backend():
    err = StaleFence("r", 1, 2)
    backend = BaseBackend(Celery("exc-test", set_as_current=False), serializer="json")
    back = backend.exception_to_python(backend.prepare_exception(err, serializer="json"))
    assert type(back) is StaleFence
    assert (back.name, back.token, back.last) == ("r", 1, 2)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_busy_with_its_holders_task_survives_pickling(protocol):
    err = LeaseBusy("res:x", retry_after=2.0, waited=0.5, holder_task="t-1")
    back = pickle.loads(pickle.dumps(err, protocol=protocol))
    assert (back.resource, back.retry_after, back.waited, back.holder_task) == (
        "res:x",
        2.0,
        0.5,
        "t-1",
    )
    assert "held by task t-1" in str(back)
    assert str(back) == str(err)


def test_busy_without_a_known_holder_keeps_its_three_args():
    """Old and new workers rebuild each other's busy errors as ``cls(*args)``."""
    assert LeaseBusy("r", 1.0).args == ("r", 1.0, 0.0)
    assert LeaseBusy("r", 1.0).holder_task is None
    assert "another owner" in str(LeaseBusy("r"))


def test_busy_with_its_holders_task_survives_the_json_result_backend():
    backend = BaseBackend(Celery(set_as_current=False), serializer="json")
    err = LeaseBusy("res:x", retry_after=2.0, holder_task="t-1")
    back = backend.exception_to_python(backend.prepare_exception(err, "json"))
    assert isinstance(back, LeaseBusy)
    assert (back.resource, back.retry_after, back.holder_task) == ("res:x", 2.0, "t-1")
