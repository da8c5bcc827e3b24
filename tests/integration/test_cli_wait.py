"""``celery leases wait RESOURCE``, run for real against a real holder.

Each test starts the command as an operator would (``python -m celery -A <app> leases wait``)
in a subprocess, waits until it is subscribed to the resource's release channel (an event of
Redis, not a sleep), then lets the holder go or not. Deadlines are generous: a loaded machine
may take seconds to start a ``celery`` process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from celery_leases._identity import Identity
from celery_leases._lease import Want
from celery_leases._sync import subscriber as _subscribers
from celery_leases._sync.driver import LeaseStore
from tests.support.polling import wait_until

HOLDER = Identity("holder@host", "inca", 4242)
#: seconds a wait command may take to start, subscribe or end on a loaded machine
SLOW: float = 60.0


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    """A directory holding the smallest Celery app (``waitapp``) for ``-A``."""
    (tmp_path / "waitapp.py").write_text('from celery import Celery\napp = Celery("waitapp")\n')
    return tmp_path


@pytest.fixture
def start_wait(
    app_dir: Path, leases_redis_url: str, leases_prefix: str
) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Factory: ``start_wait(resource, *options, url=None)`` -> the running command."""
    started: list[subprocess.Popen[str]] = []

    def start(resource: str, *options: str, url: str | None = None) -> subprocess.Popen[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_LEASES_")}
        env.update(
            CELERY_LEASES_REDIS_URL=url or leases_redis_url,
            CELERY_LEASES_KEY_PREFIX=leases_prefix,
            # shorter than the listens below: a listen longer than the socket timeout
            # must not break (redis-py 8's default is 5 s)
            CELERY_LEASES_SOCKET_TIMEOUT="1",
            PYTHONPATH=str(app_dir),
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "waitapp", "leases", "wait", resource, *options],
            cwd=app_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _subscribed(client: redis.Redis, store: LeaseStore, resource: str) -> bool:
    channel = store.resource_keys(resource).channel
    ((_, count),) = client.pubsub_numsub(channel)
    return int(count) > 0


def _ended(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=SLOW)
    return proc.returncode, out, err


def test_a_release_ends_the_wait_with_exit_0(
    start_wait, leases_store: LeaseStore, leases_redis: redis.Redis
):
    held = leases_store.acquire([Want("res:1")], HOLDER, 120.0)
    proc = start_wait("res:1")
    wait_until(lambda: _subscribed(leases_redis, leases_store, "res:1"), SLOW, "the subscription")
    assert proc.poll() is None, proc.communicate()
    leases_store.release(held)
    code, out, err = _ended(proc)
    assert (code, out.strip()) == (0, "res:1: free"), err


def test_the_holders_expiry_ends_the_wait_with_exit_0(
    start_wait, leases_store: LeaseStore, leases_redis: redis.Redis
):
    ttl = 8.0  # long enough for the command to start first; nobody renews it
    leases_store.acquire([Want("res:2")], HOLDER, ttl)
    granted = time.monotonic()
    proc = start_wait("res:2")
    wait_until(lambda: _subscribed(leases_redis, leases_store, "res:2"), SLOW, "the subscription")
    if time.monotonic() - granted >= ttl:
        pytest.fail("the command took longer to start than the lease lives: raise the ttl")
    assert proc.poll() is None, proc.communicate()
    code, out, err = _ended(proc)
    assert (code, out.strip()) == (0, "res:2: free"), err
    assert time.monotonic() - granted >= ttl - 0.5  # woken by the expiry, not before it
    assert leases_store.holders("res:2") == []


def test_a_timeout_ends_the_wait_with_exit_75_taking_nothing(start_wait, leases_store: LeaseStore):
    (held,) = leases_store.acquire([Want("res:3")], HOLDER, 120.0)
    proc = start_wait("res:3", "--timeout", "1.5")
    code, out, err = _ended(proc)
    assert code == 75, (out, err)
    assert err.strip() == "res:3: still held after 1.5 s"
    assert [h.token for h in leases_store.holders("res:3")] == [held.token]
    assert leases_store.waiter_counts(["res:3"]) == [0]  # no place in the waiter queue


def test_a_free_resource_ends_the_wait_at_once(start_wait):
    code, out, err = _ended(start_wait("res:4", "--timeout", "30"))
    assert (code, out.strip()) == (0, "res:4: free"), err


def test_redis_unreachable_is_exit_69_and_one_line(start_wait):
    code, out, err = _ended(start_wait("res:5", url="redis://127.0.0.1:1/0"))
    assert code == 69, (out, err)
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith("Error: redis at redis://127.0.0.1:1/0 failed to wait for a release")


@pytest.mark.parametrize("direct", [True, False], ids=["direct-read", "redis-py-read"])
def test_a_listen_longer_than_the_socket_timeout_holds(
    make_leases_store: Callable[..., LeaseStore], monkeypatch: pytest.MonkeyPatch, direct: bool
):
    """The wait the command runs, in process: its listen (to the holder's expiry, about 3 s)
    outlasts a 1 s socket timeout, on the direct socket read and on redis-py's path (TLS, or
    no hiredis)."""
    if not direct:
        monkeypatch.setattr(_subscribers, "direct_parser", lambda conn: None)
    store = make_leases_store(socket_timeout=1.0)
    ttl = 3.0
    store.acquire([Want("res:6")], HOLDER, ttl)
    granted = time.monotonic()
    assert store.wait_until_free("res:6", SLOW) is True
    assert time.monotonic() - granted >= ttl - 0.5  # the expiry ended it, not an error
