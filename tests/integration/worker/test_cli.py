"""``celery leases ...`` run for real: subprocesses of the celery CLI against real workers.

Every command is run as an operator would, ``python -m celery -A <app> leases ...``, on the
test's key prefix, while a real worker holds leases (``worker_app.sleeper`` holds ``res:<rid>`` as
it sleeps). Live holders run with a 60 s TTL so that nothing expires under the test; a node
that dies for good runs with a 2 s liveness and ``worker_app.long_lease`` (a 60 s lease), so its
owners are dead long before its leases would run out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from celery_leases import LeaseLost, Shared
from celery_leases._inspect import Holder
from celery_leases._keys import Keyspace, escape
from celery_leases.worker import RECONCILE_RESOURCE
from tests.support.reserved import hold_reserved

from .conftest import APP, REPO, kill_whole_worker, wait_until

pytestmark = pytest.mark.worker

#: live holders: nothing expires during the test, no periodic reconcile interferes
LIVE = {"CELERY_LEASES_TTL": "60", "CELERY_LEASES_RECONCILE_INTERVAL": "0"}
#: a node about to die: its owners' liveness runs out 2 s after the kill (leases live 60 s)
DOOMED = {"CELERY_LEASES_TTL": "2", "CELERY_LEASES_RECONCILE_INTERVAL": "0"}
SECRET = "hunter2pw"


@dataclass
class Cli:
    """Runs ``celery -A <app> leases <args>`` in a subprocess with the test's environment."""

    env: dict[str, str]
    app: str = APP

    def __call__(
        self, *args: str, env: dict[str, str] | None = None, stdin: str = ""
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", self.app, "leases", *args],
            cwd=REPO,
            env={**self.env, **(env or {})},
            input=stdin,  # never the terminal: a prompt reads EOF and aborts
            capture_output=True,
            text=True,
            timeout=60,
        )

    def json(self, *args: str, **kwargs: Any) -> Any:
        result = self(*args, "--json", **kwargs)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)


@pytest.fixture
def cli(worker_env: dict[str, str]) -> Cli:
    return Cli(dict(worker_env))


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int | None = None) -> str:
    """A failure is a non-zero exit and one line on stderr, never a traceback."""
    assert result.returncode != 0, result.stdout
    if code is not None:
        assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def holders(test_leases: Any, resource: str) -> list[tuple[str, int]]:
    return [(h.owner, h.token) for h in test_leases.store.holders(resource)]


def test_ls_show_owners_and_stats_describe_a_live_worker(
    start_worker: Any, worker_app: Any, send: Any, ledger: Any, cli: Cli
) -> None:
    w = start_worker("prefork", 2, env=LIVE)
    try:
        a = send(worker_app.sleeper, "a", 120)
        b = send(worker_app.sleeper, "b", 120)
        ledger.wait_event("started:a")
        ledger.wait_event("started:b")

        listed = cli.json("ls")
        by_resource = {lease["resource"]: lease for lease in listed}
        assert sorted(by_resource) == ["res:a", "res:b"]
        la = by_resource["res:a"]
        assert la["node"] == w.hostname
        assert la["owner"].startswith(escape(w.hostname) + "/")
        assert int(la["owner"].rsplit("/", 1)[1]) in w.children()  # the pool child holds it
        assert la["task_id"] == a.id
        assert by_resource["res:b"]["task_id"] == b.id
        assert la["mode"] == "exclusive"
        assert la["alive"] is True
        assert isinstance(la["token"], int)
        assert 0 < la["expires_in"] <= 60

        # --owner: a node name, or one owner id; --resource: an fnmatch pattern
        assert len(cli.json("ls", "--owner", w.hostname)) == 2
        assert cli.json("ls", "--owner", "nobody@nowhere") == []
        assert [x["resource"] for x in cli.json("ls", "--owner", la["owner"])] == ["res:a"]
        assert [x["resource"] for x in cli.json("ls", "--resource", "res:a")] == ["res:a"]
        assert len(cli.json("ls", "--resource", "res:*")) == 2
        assert cli.json("ls", "--resource", "other:*", "--owner", w.hostname) == []

        table = cli("ls")
        assert table.returncode == 0, table.stderr
        header, *rows = table.stdout.splitlines()
        assert header.split()[:3] == ["RESOURCE", "MODE", "TOKEN"]
        (row_a,) = [r for r in rows if r.startswith("res:a ")]
        assert w.hostname in row_a
        assert a.id in row_a
        assert "alive" in row_a

        (shown,) = cli.json("show", "res:a")["holders"]
        assert (shown["owner"], shown["token"], shown["task_id"]) == (
            la["owner"],
            la["token"],
            a.id,
        )
        assert shown["alive"] is True
        assert a.id in cli("show", "res:a").stdout
        missing = cli("show", "res:nope")
        assert "res:nope" in assert_one_line_error(missing, 1)

        owners = [o for o in cli.json("owners") if o["node"] == w.hostname]
        assert sorted(o["owner"] for o in owners if o["leases"]) == sorted(
            x["owner"] for x in listed
        )
        assert sum(o["leases"] for o in owners) == 2
        assert all(o["alive"] and o["liveness"] > 0 for o in owners if o["leases"])
        assert w.hostname in cli("owners").stdout

        stats = cli.json("stats")
        assert stats["leases"] == {"held": 2, "exclusive": 2, "shared": 0}
        assert stats["owners"]["alive"] >= 2
        assert stats["nodes"][w.hostname]["exclusive"] == 2
        assert "2 held (2 exclusive, 0 shared)" in cli("stats").stdout
    finally:
        kill_whole_worker(w)


def test_release_refuses_a_live_owner_and_force_releases_with_an_audit_record(
    start_worker: Any,
    worker_app: Any,
    send: Any,
    ledger: Any,
    cli: Cli,
    test_leases: Any,
    leases_redis: redis.Redis,
    leases_prefix: str,
) -> None:
    w = start_worker("prefork", 1, env=LIVE)
    try:
        send(worker_app.sleeper, "x", 120)
        ledger.wait_event("started:x")
        before = holders(test_leases, "res:x")
        ((owner, token),) = before

        refused = cli("release", "res:x")
        line = assert_one_line_error(refused, 1)
        assert owner in line
        assert "--force" in line
        assert holders(test_leases, "res:x") == before

        # --force is never taken from the environment (celery's CLI reads CELERY_<CMD>_<OPT>)
        from_env = cli("release", "res:x", env={"CELERY_LEASES_RELEASE_FORCE": "1"})
        assert from_env.returncode == 1
        assert holders(test_leases, "res:x") == before

        # --force asks first; "n" (or no terminal) keeps the lease
        declined = cli("release", "res:x", "--force", stdin="n\n")
        assert declined.returncode == 1
        assert "Release it anyway?" in declined.stdout
        assert holders(test_leases, "res:x") == before

        forced = cli("release", "res:x", "--force", "--yes")
        assert forced.returncode == 0, forced.stderr
        assert f"released res:x (exclusive) of live owner {owner}" in forced.stdout
        assert "WARNING" in forced.stderr
        assert "forced release of res:x" in forced.stderr
        assert holders(test_leases, "res:x") == []

        (record,) = cli.json("audit")
        assert record["resource"] == "res:x"
        assert (record["owner"], record["token"]) == (owner, token)
        assert record["forced"] is True
        assert record["released"] is True
        assert "@" in record["by"]
        assert record["at"]
        stored = leases_redis.lrange(Keyspace(leases_prefix).audit, 0, -1)
        assert [json.loads(text) for text in stored] == [record]
        assert "res:x" in cli("audit").stdout

        gone = cli("release", "res:x")
        assert "no lease is held on 'res:x'" in assert_one_line_error(gone, 1)
    finally:
        kill_whole_worker(w)


def test_a_dead_nodes_leases_are_released_without_force_and_by_reconcile(
    start_worker: Any, worker_app: Any, send: Any, ledger: Any, cli: Cli, test_leases: Any
) -> None:
    w = start_worker("prefork", 2, env=DOOMED)
    send(worker_app.long_lease, "d1", 120)
    send(worker_app.long_lease, "d2", 120)
    ledger.wait_event("started:d1")
    ledger.wait_event("started:d2")
    kill_whole_worker(w)  # kill -9: nothing is given back

    def dead_owners() -> list[str]:
        mine = [
            (o, left)
            for o, left in test_leases.store.owners()
            if o.startswith(escape(w.hostname) + "/")
        ]
        return [o for o, left in mine if left < 0] if len(mine) == 2 else []

    wait_until(lambda: len(dead_owners()) == 2, 15, "the killed node's owners to be dead")

    owners = [o for o in cli.json("owners") if o["node"] == w.hostname]
    assert [(o["alive"], o["leases"]) for o in owners] == [(False, 1), (False, 1)]
    assert all(o["liveness"] < 0 for o in owners)
    assert "dead" in cli("owners").stdout
    listed = cli.json("ls")
    assert sorted(x["resource"] for x in listed) == ["res:d1", "res:d2"]
    assert all(not x["alive"] and x["expires_in"] > 20 for x in listed)  # leases still there

    released = cli("release", "res:d1")
    assert released.returncode == 0, released.stderr
    assert "released res:d1 (exclusive) of dead owner" in released.stdout
    assert "WARNING" not in released.stderr
    assert holders(test_leases, "res:d1") == []
    assert cli.json("audit")[0]["forced"] is False

    report = cli.json("reconcile")
    assert [r["resource"] for r in report["released"]] == ["res:d2"]
    assert report["errors"] == []
    assert holders(test_leases, "res:d2") == []
    assert cli.json("ls") == []
    stats = cli.json("stats")
    assert stats["leases"]["held"] == 0
    # the reconcile forgot the dead owners, and the cli's own registration is gone too
    assert stats["owners"] == {"alive": 0, "dead": 0}


def test_shared_holders_are_listed_and_a_forced_release_reaches_them(
    cli: Cli, test_leases: Any
) -> None:
    # this test process holds two shared grants of s:1 (its heartbeat renews them)
    with ExitStack() as stack:
        a = stack.enter_context(test_leases.hold(Shared("s:1"), ttl=30))
        b = stack.enter_context(test_leases.hold(Shared("s:1"), ttl=30))
        owner = a._held.owner
        listed = cli.json("ls", "--resource", "s:*")
        assert sorted((x["mode"], x["token"], x["owner"]) for x in listed) == [
            ("shared", a.token, owner),
            ("shared", b.token, owner),
        ]
        assert all(x["alive"] and x["task_id"] is None for x in listed)
        assert len(cli.json("show", "s:1")["holders"]) == 2
        assert cli.json("stats")["leases"] == {"held": 2, "exclusive": 0, "shared": 2}
        assert cli("release", "s:1").returncode == 1
        forced = cli("release", "s:1", "--force", "--yes")
        assert forced.returncode == 0, forced.stderr
        assert forced.stdout.count("released s:1 (shared) of live owner") == 2
        assert test_leases.store.holders("s:1") == []
        assert [r["forced"] for r in cli.json("audit")] == [True, True]
        with pytest.raises(LeaseLost):  # the holder is told when it leaves the blocks
            stack.close()


def test_force_release_never_frees_a_grant_made_after_the_holder_it_names(
    test_leases: Any,
) -> None:
    store = test_leases.store
    with test_leases.hold("x:1") as first:
        old = Holder("x:1", "x", first.token, first._held.owner, 0.0)
    with test_leases.hold("x:1") as second:
        assert store.force_release("x:1", old) is False
        assert [h.token for h in store.holders("x:1")] == [second.token]


def test_errors_are_one_line_without_traceback_or_password(
    cli: Cli, leases_redis_url: str, tmp_path: Path, test_leases: Any
) -> None:
    unreachable = {"CELERY_LEASES_REDIS_URL": "redis://127.0.0.1:1/0"}
    for args in (
        ["ls"],
        ["show", "res:x"],
        ["release", "res:x", "--force", "--yes"],
        ["owners"],
        ["reconcile"],
        ["stats"],
        ["audit"],
    ):
        result = cli(*args, env=unreachable)
        assert "127.0.0.1:1" in assert_one_line_error(result, 69), args

    urls = [
        f"redis://:{SECRET}@127.0.0.1:1/0",
        f"redis://someone:{SECRET}@127.0.0.1:1/0",
        f"redis://127.0.0.1:1/0?password={SECRET}",
    ]
    real = urlsplit(leases_redis_url)
    if real.password is None and real.scheme == "redis":
        # the test Redis itself, with credentials it does not accept: an AUTH error
        urls.append(real._replace(netloc=f"someone:{SECRET}@{real.netloc}").geturl())
    for url in urls:
        result = cli("ls", env={"CELERY_LEASES_REDIS_URL": url})
        line = assert_one_line_error(result, 69)
        assert SECRET not in result.stdout + result.stderr
        assert "***" in line, line

    # an app without Leases(app): the cli makes one from the settings, and reports them
    (tmp_path / "plainapp.py").write_text('from celery import Celery\napp = Celery("plain")\n')
    plain = Cli({**cli.env, "PYTHONPATH": str(tmp_path)}, app="plainapp")
    assert plain.json("ls") == []
    for url in (f"http://someone:{SECRET}@example.invalid/0", "redis://127.0.0.1:notaport/0"):
        result = plain("ls", env={"CELERY_LEASES_REDIS_URL": url})
        assert "redis_url" in assert_one_line_error(result, 78)
        assert SECRET not in result.stdout + result.stderr

    # a reconcile while another process holds the reconcile lease: "try again", naming it
    with hold_reserved(test_leases, RECONCILE_RESOURCE, ttl=30) as lease:
        busy = cli("reconcile")
        line = assert_one_line_error(busy, 75)
        assert "another process is reconciling" in line
        assert lease._held.owner in line

    # bad usage
    assert cli("release").returncode == 2
    assert cli("ls", "--owner", "").returncode == 2
    assert cli("audit", "-n", "0").returncode == 2
