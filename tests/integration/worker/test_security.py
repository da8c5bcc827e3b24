"""Real workers, the ``celery leases`` CLI and beat as the documented ACL user, over TLS; and
no password in any worker log or CLI output.

Leases live on a private server (ACL SETUSER never runs on the shared one); the broker, the
result backend and the tasks' ledger stay on the shared test Redis.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_leases import LeaseBackendError, LeaseBusy, Leases, Shared
from celery_leases._identity import Identity
from celery_leases._lease import Want
from celery_leases._redis_server import RedisServer
from tests.support.acl import USER, CommandLog, allowed_commands, create_documented_user
from tests.support.tls import Certs, tls_url

from .conftest import WorkerProc, wait_until
from .test_cli import Cli, assert_one_line_error

pytestmark = pytest.mark.worker

#: the tour's settings: renewals every 0.5 s, a reconcile pass every second
FAST = {"CELERY_LEASES_TTL": "1.5", "CELERY_LEASES_RECONCILE_INTERVAL": "1"}
#: what a password looks like in these tests: easy to find in a log
SECRET = "Kx9-leak-canary-pw"
#: commands that log in; Redis lets every user run them, so the ACL line has no rule for them
LOGIN = {"hello", "auth"}


@pytest.fixture
def cli(worker_env: dict[str, str]) -> Cli:
    """``celery -A worker_app leases ...`` with the test's environment."""
    return Cli(dict(worker_env))


def _leases(app_name: str, url: str, prefix: str, **settings: Any) -> Leases:
    return Leases(
        Celery(app_name, set_as_current=False), redis_url=url, key_prefix=prefix, **settings
    )


def test_a_worker_the_cli_beat_and_once_need_exactly_the_documented_acl_over_tls(
    make_tls_server: Callable[..., RedisServer],
    start_worker: Callable[..., WorkerProc],
    worker_app: Any,
    send: Any,
    ledger: Any,
    cli: Cli,
    leases_prefix: str,
) -> None:
    server = make_tls_server()
    admin = redis.Redis.from_url(server.url)
    password = create_documented_user(admin, prefix=leases_prefix, password=SECRET)
    admin.script_flush()  # every client's first script call takes the SCRIPT LOAD fallback
    url = tls_url(server, user=USER, password=password)
    env = {**FAST, "CELERY_LEASES_REDIS_URL": url}
    here = _leases("acl-tour", url, leases_prefix, ttl=1.5)
    store = here.store

    with CommandLog(server.url) as log:
        w = start_worker("prefork", 2, env=env)  # start-up cleanup, reconcile, heartbeats

        # tasks: an exclusive lease renewed for 2 s, shared and limited leases, a waiter woken
        # by a release
        first = send(worker_app.guarded, "a", 2.0)
        many = send(worker_app.multi, "m", "s", "l")
        holder = send(worker_app.sleeper, "w", 2.0)
        ledger.wait_event("started:w")
        waiter = send(worker_app.busy_wait, "w")
        assert first.get(timeout=30)["leases"][0][0] == "res:a"
        assert [x[0] for x in many.get(timeout=30)["leases"]] == [
            "multi:m",
            "shared:s",
            "limited:l",
        ]
        assert holder.get(timeout=30)["leases"][0][0] == "res:w"
        assert waiter.get(timeout=30)["leases"][0][0] == "res:w"

        # the worker's reconcile frees a dead owner's lease (its liveness runs out in 1.5 s)
        dead = Identity("dead@nowhere", "0", 1)
        store.acquire([Want("orphan:1")], dead, ttl=60)
        wait_until(lambda: store.holders("orphan:1") == [], 30, "the worker's reconcile")

        # once and receipts, a beat claim, busy holds, from this process as the same user
        assert here.once("input:1", lambda: {"n": 1}) == {"n": 1}
        assert here.receipt("input:1") == {"n": 1}
        assert here.forget("input:1")
        won, *_ = store.beat_claim("entry", due_ms=None, bucket=60.0, replica="r1", keep=60)
        assert won
        # a shared lease with two holders, and a third turned away by its limit
        two = Shared("sh:1", limit=2)
        with here.hold(two), here.hold(two), pytest.raises(LeaseBusy), here.hold(two):
            pass
        (lease,) = here.acquire([Want("held:1")])  # the CLI frees it below: no `with`
        try:
            with pytest.raises(LeaseBusy), here.hold("held:1", wait=0.2):
                pass
            # the CLI, as the same user through TLS, while this process holds held:1 (the
            # worker's reconcile lease may show up too: it runs every second)
            listed = [x for x in cli.json("ls", env=env) if x["resource"] == "held:1"]
            assert [x["token"] for x in listed] == [lease.token]
            assert cli.json("show", "held:1", env=env)["holders"][0]["token"] == lease.token
            assert any(o["leases"] for o in cli.json("owners", env=env))
            assert cli.json("stats", env=env)["leases"]["held"] >= 1
            report = wait_until(lambda: _reconcile(cli, env), 30, "a reconcile of our own")
            assert json.loads(report.stdout)["errors"] == []
            forced = cli("release", "held:1", "--force", "--yes", env=env)
            assert forced.returncode == 0, forced.stderr
            assert cli.json("audit", env=env)[0]["resource"] == "held:1"
        finally:
            here.release([lease])
        w.stop()  # warm shutdown: the worker gives back what it holds
    here.store.close()

    refused = [(e["reason"], e["object"]) for e in admin.acl_log()]
    assert refused == [], refused
    ran = log.commands() - LOGIN
    allowed = allowed_commands(admin)
    admin.close()
    assert ran <= allowed, ran - allowed
    # every command the documented line allows was needed: the line is the least that works
    assert allowed - ran == set(), f"allowed but never used: {sorted(allowed - ran)}"
    # the clients logged in as the user (the server has no plain-text port)
    assert any(line.startswith("HELLO 3 AUTH") for line in log.lines)
    worker_log = w.log()
    assert not re.search(r"(ERROR|WARNING).*leases:", worker_log), worker_log[-5000:]
    _assert_no_secret(worker_log)


def _reconcile(cli: Cli, env: dict[str, str]) -> subprocess.CompletedProcess[str] | None:
    """``celery leases reconcile --json``; None while a worker's own pass holds the lease."""
    result = cli("reconcile", "--json", env=env)
    if result.returncode == 75:
        return None
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture
def user_server(make_redis_server: Callable[..., RedisServer], leases_prefix: str) -> RedisServer:
    """A private server with the documented user, its password ``SECRET``."""
    server = make_redis_server()
    admin = redis.Redis.from_url(server.url)
    create_documented_user(admin, prefix=leases_prefix, password=SECRET)
    admin.close()
    return server


def _user_url(server: RedisServer, password: str = SECRET) -> str:
    return f"redis://{USER}:{password}@127.0.0.1:{server.port}/15"


def _assert_no_secret(text: str, secret: str = SECRET) -> None:
    assert secret not in text, next(ln for ln in text.splitlines() if secret in ln)


def test_a_worker_with_a_wrong_password_never_logs_it(
    user_server: RedisServer, start_worker: Callable[..., WorkerProc], worker_app: Any, send: Any
) -> None:
    wrong = f"wrong-{SECRET}"
    env = {**FAST, "CELERY_LEASES_REDIS_URL": _user_url(user_server, wrong)}
    w = start_worker("prefork", 1, env=env, extra=["-l", "debug"], wait=False)
    # refused at start-up: the worker says why and waits, taking no task
    w.wait_for_log("the leases Redis does not answer at start-up (attempt 2)", 30)
    assert "ready." not in w.current_log()
    # the password becomes right: the worker starts; then wrong again, on new connections
    admin = redis.Redis.from_url(user_server.url)
    admin.execute_command("ACL", "SETUSER", USER, f">{wrong}")
    w.wait_ready()
    admin.execute_command("ACL", "SETUSER", USER, f"<{wrong}")
    admin.execute_command("CLIENT", "KILL", "USER", USER)
    admin.close()
    failed = send(worker_app.guarded, "a")
    with pytest.raises(LeaseBackendError, match="invalid username-password pair"):
        failed.get(timeout=30)
    w.wait_for_log("LeaseBackendError", 30)
    w.wait_for_log("reconcile could not start", 30)
    w.stop()
    log = w.log()
    assert "invalid username-password pair" in log  # the failures are there, with the reason
    assert f"{USER}:***@127.0.0.1:{user_server.port}" in log
    _assert_no_secret(log, wrong)
    _assert_no_secret(str(failed.traceback), wrong)


def test_a_worker_whose_redis_goes_away_never_logs_the_password(
    user_server: RedisServer,
    start_worker: Callable[..., WorkerProc],
    worker_app: Any,
    send: Any,
    ledger: Any,
) -> None:
    # the password as a query option this time, the user in the user info
    url = f"redis://{USER}@127.0.0.1:{user_server.port}/15?password={SECRET}"
    w = start_worker(
        "prefork", 1, env={**FAST, "CELERY_LEASES_REDIS_URL": url}, extra=["-l", "debug"]
    )
    done = send(worker_app.guarded, "a")
    assert done.get(timeout=30)["leases"][0][0] == "res:a"  # it works with the password
    lost = send(worker_app.interrupted, "b", 60)
    ledger.wait_event("started:b")
    user_server.stop()  # the holder's renewals fail, its lease counts as lost
    assert lost.get(timeout=30) == "lost:res:b"
    refused = send(worker_app.guarded, "c")
    with pytest.raises(LeaseBackendError, match=r"Connection refused|connecting to"):
        refused.get(timeout=30)
    w.wait_for_log("reconcile could not start", 30)
    w.stop()
    log = w.log()
    assert "leases: acquired res:a" in log  # the INFO lines are there
    assert "leases: renewal of 1 lease(s) failed" in log
    assert "password=***" in log
    _assert_no_secret(log)
    _assert_no_secret(str(refused.traceback))


def test_the_cli_never_shows_the_password(
    user_server: RedisServer,
    make_tls_server: Callable[..., RedisServer],
    tls_certs: Certs,
    cli: Cli,
    leases_prefix: str,
) -> None:
    right = {"CELERY_LEASES_REDIS_URL": _user_url(user_server)}
    wrong = {"CELERY_LEASES_REDIS_URL": _user_url(user_server, f"wrong-{SECRET}")}
    tls = make_tls_server()
    no_cert = {
        "CELERY_LEASES_REDIS_URL": tls_url(tls, user=USER, password=SECRET, client_cert=False)
    }
    key_pw = {
        "CELERY_LEASES_REDIS_URL": tls_url(tls, client_cert=False)
        + f"&ssl_certfile={tls_certs.server.client_certfile}"
        + f"&ssl_keyfile={tls_certs.server.client_keyfile}&ssl_password={SECRET}"
        + "&ssl_ca_cert=typo"
    }
    here = _leases("cli-secrets", _user_url(user_server), leases_prefix)
    held = here.acquire([Want("held:1")])  # released by the CLI below, so not a `with`
    try:
        commands = [
            ["ls"], ["show", "held:1"], ["owners"], ["stats"], ["reconcile"],
            ["audit"], ["release", "held:1", "--force", "--yes"],
        ]  # fmt: skip
        for args in commands:
            ok = cli(*args, env=right)
            assert ok.returncode == 0, ok.stderr
            _assert_no_secret(ok.stdout + ok.stderr)
        for args in commands:
            failed = cli(*args, env=wrong)
            line = assert_one_line_error(failed, 69)
            assert "invalid username-password pair" in line, args
            _assert_no_secret(failed.stdout + failed.stderr, f"wrong-{SECRET}")
        for args in (["ls"], ["reconcile"]):
            failed = cli(*args, env=no_cert)
            line = assert_one_line_error(failed, 69)
            assert f":***@127.0.0.1:{tls.port}" in line
            _assert_no_secret(failed.stdout + failed.stderr)
        # the settings check at import of the app module (its Leases(app)): celery reports it
        bad = cli("ls", env=key_pw)
        assert bad.returncode != 0
        assert "redis-py does not take the URL option 'ssl_ca_cert'" in bad.stderr
        assert "ssl_password=***" in bad.stderr
        _assert_no_secret(bad.stdout + bad.stderr)
    finally:
        here.release(held)
        here.store.close()
