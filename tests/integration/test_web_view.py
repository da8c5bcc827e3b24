"""The web view's ASGI app served by uvicorn in a thread of this process, on a real Redis.

The view is given the CLI's own data functions (``_census.CensusData``), as ``celery leases web``
does; the subprocess, a real worker and the browser are in tests/integration/worker/test_web.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the web extra")

import httpx
import uvicorn
from celery import Celery

from celery_leases import LeaseLost, LeaseRevoked, Leases, Shared
from celery_leases._census import CensusData, owners_json
from celery_leases.web import Bind, create_app
from tests.support.polling import wait_until

TOKEN = "t0ken"


@pytest.fixture
def ext(make_leases: Any) -> Leases:
    app = Celery("web-view", set_as_current=False, broker="memory://")
    app.conf.beat_schedule = {
        "nightly": {"task": "t", "schedule": 60.0},
        "hourly": {"task": "t", "schedule": 3600.0},
    }
    return make_leases(app=app)


def client_of(ext: Leases, **kwargs: Any) -> Iterator[httpx.Client]:
    """The view of ``ext`` served on a free loopback port, and an HTTP client to it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    asgi = create_app(
        ext.store,
        CensusData(ext.app, ext.store),
        bind=Bind("127.0.0.1", port),
        beat_entries=sorted(ext.app.conf.beat_schedule),
        **kwargs,
    )
    server = uvicorn.Server(uvicorn.Config(asgi, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, name="web-view", daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 20, "uvicorn to start")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(20)


@pytest.fixture
def view(ext: Leases) -> Iterator[httpx.Client]:
    yield from client_of(ext, allow_release=True, token=TOKEN)


def test_beat_claims_are_read_by_entry_name(ext: Leases, view: httpx.Client) -> None:
    assert view.get("/api/beat").json() == {"entries": ["hourly", "nightly"], "claims": []}
    won, run, _, winner = ext.store.beat_claim(
        "nightly", due_ms=None, bucket=60.0, replica="beat-a", keep=120.0
    )
    assert won
    assert winner == "beat-a"
    body = view.get("/api/beat").json()
    (claim,) = body["claims"]
    assert (claim["entry"], claim["kind"], claim["run"], claim["replica"]) == (
        "nightly",
        "every",
        run,
        "beat-a",
    )
    assert 0 < claim["expires_in"] <= 120


def test_shared_holders_are_listed_and_all_released(ext: Leases, view: httpx.Client) -> None:
    # the holders learn of it as they leave their blocks
    with pytest.raises(LeaseLost), ext.hold([Shared("pool:1")]), ext.hold([Shared("pool:1")]):  # noqa: PT012
        listed = view.get("/api/leases").json()
        assert [(x["resource"], x["mode"]) for x in listed] == [("pool:1", "shared")] * 2
        done = view.post(
            "/api/leases/release",
            content=json.dumps({"resource": "pool:1"}),
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert done.status_code == 200, done.text
        assert [x["released"] for x in done.json()["released"]] == [True, True]
        assert ext.store.holders("pool:1") == []
        assert view.get("/api/leases").json() == []
    (first, second) = ext.store.audit_log(2)
    assert first["forced"]
    assert second["forced"]
    assert "(web view, client 127.0.0.1)" in first["by"]


def test_only_the_own_host_names_are_answered(view: httpx.Client) -> None:
    assert view.get("/api/leases", headers={"Host": "localhost:1"}).status_code == 200
    assert view.get("/healthz", headers={"Host": "rebound.example:80"}).status_code == 400
    got = view.post(
        "/api/leases/release",
        content='{"resource": "r"}',
        headers={"Host": "rebound.example", "Authorization": f"Bearer {TOKEN}"},
    )
    assert got.status_code == 400


def test_a_malformed_body_is_refused(view: httpx.Client) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for body in ("not json", "[]", '{"resource": 5}', '{"resource": "  "}'):
        assert view.post("/api/leases/release", content=body, headers=auth).status_code == 400


def test_history_and_a_lease_record_are_served(view: httpx.Client) -> None:
    # the view's Leases runs without the history setting: nothing recorded, nothing read
    got = view.get("/api/history")
    assert got.status_code == 200
    assert got.json() == []
    record = view.get("/api/lease", params={"resource": "r"})
    assert record.status_code == 200
    assert (record.json()["resource"], record.json()["holders"]) == ("r", [])
    assert record.json()["transitions"] is None
    assert view.get("/api/lease").status_code == 400
    config = view.get("/api/config").json()
    assert config["release"] is True
    assert config["history"] is True


def test_healthz_answers_503_when_redis_is_gone(make_leases: Any, make_redis_server: Any) -> None:
    server = make_redis_server()
    ext = make_leases(redis_url=server.url)
    for view in client_of(ext):
        assert view.get("/healthz").status_code == 200
        server.stop()
        got = view.get("/healthz")
        assert got.status_code == 503
        assert got.json()["ok"] is False
        assert view.get("/api/leases").status_code == 503


def test_release_without_a_token_is_refused_at_creation(ext: Leases) -> None:
    data = CensusData(ext.app, ext.store)
    with pytest.raises(ValueError, match="needs --token"):
        create_app(ext.store, data, bind=Bind("::1", 1), allow_release=True)


@pytest.mark.parametrize("missing", ["starlette", "uvicorn"])
def test_without_the_extra_the_command_names_it(leases_redis_url: str, missing: str) -> None:
    code = (
        "import sys\n"
        f"sys.modules[{missing!r}] = None  # as if the extra were not installed\n"
        "sys.argv = ['celery', '-A', 'tests.integration.worker.worker_app', 'leases', 'web']\n"
        "from celery.__main__ import main\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_LEASES_")}
    env.update({"LEASES_TEST_BROKER": leases_redis_url, "LEASES_TEST_BACKEND": leases_redis_url})
    env["CELERY_LEASES_REDIS_URL"] = leases_redis_url
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 1, out.stderr
    assert "needs the extra 'web'" in out.stderr
    assert "pip install 'celery-leases[web]'" in out.stderr
    assert "Traceback" not in out.stderr


def test_names_come_with_their_cli_form(ext: Leases, view: httpx.Client) -> None:
    # the page draws only "shown": the names escaped by the CLI's own function
    names = ["\u202eevil", "a\nb", "a\tb"]
    with ext.hold(names, ttl=30):
        listed = view.get("/api/leases").json()
        assert sorted(x["resource"] for x in listed) == sorted(names)
        assert sorted(x["shown"]["resource"] for x in listed) == ["\\u202eevil", "a\\nb", "a\\tb"]
        for row in listed:
            assert row["shown"]["owner"] == row["owner"]  # a plain name is shown as it is
        record = view.get("/api/lease", params={"resource": "a\nb"}).json()
        assert record["resource"] == "a\nb"
        assert record["shown"]["resource"] == "a\\nb"
        assert record["holders"]  # its holder, every text in it escaped in "shown"
        assert "a\nb" not in json.dumps(record["shown"], ensure_ascii=False)


def test_an_idle_owner_of_a_live_node_is_idle(make_leases: Any) -> None:
    # a process renews its liveness only while it holds something: once idle it runs out,
    # and only its node's mark of life (set by its worker at every reaper pass) says it is
    # alive, as `celery leases health --node` reads it
    app = Celery("web-idle", set_as_current=False, broker="memory://")
    ext = make_leases(app=app, ttl=1)
    with ext.hold("r"):
        pass
    ident = ext.identity()

    def mine() -> dict[str, Any]:
        (row,) = [o for o in owners_json(ext.store) if o["node"] == ident.node]
        return row

    wait_until(lambda: mine()["liveness"] < 0, 60, "the idle owner's liveness to run out")
    assert mine()["status"] == "expired"  # no mark: nothing says the node lives
    ext.store.mark_node_alive(ident.node, "an-older-incarnation")
    assert mine()["status"] == "expired"  # a mark of another incarnation of the node
    ext.store.mark_node_alive(ident.node, ident.incarnation)
    assert mine()["status"] == "idle"
    assert mine()["leases"] == 0
    for view in client_of(ext):
        ext.store.mark_node_alive(ident.node, ident.incarnation)
        (listed,) = [o for o in view.get("/api/owners").json() if o["node"] == ident.node]
        assert listed["status"] == "idle"
    # an owner that holds a lease is never idle
    with ext.hold("s", ttl=30):
        ext.store.mark_node_alive(ident.node, ident.incarnation)
        assert mine()["status"] != "idle"


def test_rate_limits_are_listed_with_what_the_cli_prints(ext: Leases, view: httpx.Client) -> None:
    assert view.get("/api/limits").json() == []
    ext.limit("api:\n42", "3/m")
    ext.set_rate("api:\n42", "5/m")
    (row,) = view.get("/api/limits").json()
    assert row["name"] == "api:\n42"
    assert row["shown"]["name"] == "api:\\n42"  # drawn escaped, as the CLI shows it
    assert (row["rate"], row["declared"], row["used"], row["left"]) == ("5/m", "3/m", 1, 4)
    assert "/api/limits" in view.get("/").text


def test_revoke_asks_the_holder_and_answers_what_the_cli_prints(make_leases: Any) -> None:
    ext = make_leases(app=Celery("web-revoke", set_as_current=False, broker="memory://"), ttl=1.5)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for view in client_of(ext, allow_release=True, token=TOKEN):
        with ext.hold("web:r") as lease:
            body = {"resource": "web:r", "reason": "from the page", "deadline": 30}
            assert view.post("/api/leases/revoke", json=body).status_code == 401
            for bad in ({"resource": "web:r", "deadline": 0}, {"resource": "web:r", "reason": 5}):
                got = view.post("/api/leases/revoke", json=bad, headers=auth)
                assert got.status_code == 400
                assert "revoke: " in got.json()["error"]
            nobody = view.post("/api/leases/revoke", json={"resource": "web:none"}, headers=auth)
            assert nobody.status_code == 404
            done = view.post("/api/leases/revoke", json=body, headers=auth)
            assert done.status_code == 200, done.text
            report = done.json()
            assert [h["token"] for h in report["holders"]] == [lease.token]
            assert report["reason"] == "from the page"
            assert 0 < report["deadline"] <= 30

            def revoked() -> str | None:
                try:
                    lease.check()
                except LeaseRevoked as exc:
                    return exc.reason
                return None

            assert wait_until(revoked, 20, "the holder to learn of it") == "from the page"
    # read-only: refused, whatever the token
    for view in client_of(ext):
        got = view.post("/api/leases/revoke", json={"resource": "web:r"}, headers=auth)
        assert got.status_code == 403
