"""``celery leases web`` run for real: a subprocess of the CLI, a real worker, a real browser.

The view is started as an operator would (``python -m celery -A <app> leases web --bind
127.0.0.1:<free port>``) on the test's key prefix, while a real worker holds leases
(``worker_app.sleeper`` holds ``res:<rid>`` as it sleeps). The browser test drives Debian's
``chromium`` with playwright; it is skipped when either is missing, and fails under ``CI``.

With ``LEASES_SCREENSHOTS=<dir>`` the browser test saves the screenshots of docs/web.md there
(``scripts/screenshots`` runs it so, into docs/img).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import APP, REPO, wait_until
from .test_cli import LIVE, Cli

pytestmark = pytest.mark.worker

TOKEN = "s3cret-token-for-the-test"
CHROMIUM = os.environ.get("LEASES_CHROMIUM", "/usr/bin/chromium")
#: what changes between two reads of the same leases: the clocks (and the view's escaped copy)
MOVING = ("expires_in", "liveness", "renewed_ago", "shown")
#: names a terminal or a page would not show as they are: a bidi override, a newline, a tab
HOSTILE = ("res:\u202eevil", "res:a\nb", "res:a\tb")
#: the same, as the CLI's tables show them (celery_leases._text.printable)
HOSTILE_SHOWN = ("res:\\u202eevil", "res:a\\nb", "res:a\\tb")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class View:
    """One ``celery leases web`` subprocess."""

    proc: subprocess.Popen[str]
    url: str
    log: Path

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.post(self.url + path, timeout=10, **kwargs)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def start_view(
    worker_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., View]]:
    """Factory: ``start_view(*args)`` starts ``celery leases web`` and waits for /healthz."""
    views: list[View] = []

    def start(*args: str) -> View:
        port = free_port()
        log = tmp_path / f"web-{len(views)}.log"
        argv = [sys.executable, "-m", "celery", "-A", APP, "leases", "web"]
        argv += ["--bind", f"127.0.0.1:{port}", *args]
        with log.open("w") as out:
            proc = subprocess.Popen(
                argv,
                cwd=REPO,
                env={**worker_env, **LIVE},
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
            )
        view = View(proc, f"http://127.0.0.1:{port}", log)
        views.append(view)

        def up() -> bool:
            assert proc.poll() is None, f"the web view exited:\n{log.read_text()}"
            try:
                return view.get("/healthz").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, 30, "the web view to answer /healthz")
        return view

    yield start
    for view in views:
        view.stop()
    failed = any(
        getattr(request.node, f"rep_{when}", None) is not None
        and getattr(request.node, f"rep_{when}").failed
        for when in ("setup", "call")
    )
    if failed:
        for view in views:
            sys.stderr.write(f"\n===== log of the web view {view.url} =====\n")
            sys.stderr.write(view.log.read_text()[-20000:])


def steady(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` without the fields that move with the clock between two reads."""
    return [{k: v for k, v in row.items() if k not in MOVING} for row in rows]


def resources(view: View) -> list[str]:
    return sorted(x["resource"] for x in view.get("/api/leases").json())


def test_api_leases_is_what_ls_json_prints(
    start_worker: Any,
    start_view: Callable[..., View],
    worker_app: Any,
    send: Any,
    ledger: Any,
    worker_env: dict[str, str],
) -> None:
    w = start_worker("prefork", 2, env=LIVE)
    a = send(worker_app.sleeper, "a", 120)
    b = send(worker_app.sleeper, "b", 120)
    ledger.wait_event("started:a")
    ledger.wait_event("started:b")
    cli = Cli({**worker_env, **LIVE})
    view = start_view()

    api = view.get("/api/leases").json()
    assert steady(api) == steady(cli.json("ls"))
    assert sorted(x["resource"] for x in api) == ["res:a", "res:b"]
    assert {x["task_id"] for x in api} == {a.id, b.id}
    assert {x["node"] for x in api} == {w.hostname}
    assert all(x["alive"] for x in api)
    # the filters are ls's --resource and --owner
    only_a = view.get("/api/leases", params={"resource": "res:a"}).json()
    assert steady(only_a) == steady(cli.json("ls", "--resource", "res:a"))
    assert [x["resource"] for x in only_a] == ["res:a"]
    by_node = view.get("/api/leases", params={"owner": w.hostname}).json()
    assert steady(by_node) == steady(cli.json("ls", "--owner", w.hostname))
    assert view.get("/api/leases", params={"owner": "nobody@nowhere"}).json() == []
    owners = view.get("/api/owners").json()
    assert steady(owners) == steady(cli.json("owners"))
    assert {o["node"] for o in owners} == {w.hostname}

    # read-only by default: the release is refused, even with a token, and changes nothing
    refused = view.post(
        "/api/leases/release",
        json={"resource": "res:a"},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert refused.status_code == 403
    assert resources(view) == ["res:a", "res:b"]

    page = view.get("/")
    assert page.status_code == 200
    assert "<title>celery leases</title>" in page.text
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert view.get("/api/config").json()["release"] is False
    # another Host name (a DNS-rebinding page) gets nothing
    assert view.get("/api/leases", headers={"Host": "attacker.example"}).status_code == 400
    beat = view.get("/api/beat").json()
    assert beat == {"entries": [], "claims": []}  # the test app has no beat_schedule


def test_release_needs_the_bearer_token(
    start_worker: Any,
    start_view: Callable[..., View],
    worker_app: Any,
    send: Any,
    ledger: Any,
    test_leases: Any,
) -> None:
    start_worker("prefork", 2, env=LIVE)
    send(worker_app.sleeper, "c", 120)
    ledger.wait_event("started:c")
    view = start_view("--allow-release", "--token", TOKEN)
    assert view.get("/api/config").json()["release"] is True

    def release(headers: dict[str, str], body: object = None) -> httpx.Response:
        return view.post("/api/leases/release", json=body or {"resource": "res:c"}, headers=headers)

    missing = release({})
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Bearer")
    assert release({"Authorization": "Basic " + TOKEN}).status_code == 401
    assert release({"Authorization": "Bearer wrong"}).status_code == 403
    assert release({"Authorization": f"Bearer {TOKEN}x"}).status_code == 403
    assert resources(view) == ["res:c"]  # nothing was released
    ok = {"Authorization": f"Bearer {TOKEN}"}
    assert release(ok, {"resource": ""}).status_code == 400
    assert release(ok, {"resource": "res:nothing"}).status_code == 404

    done = release(ok)
    assert done.status_code == 200, done.text
    (freed,) = done.json()["released"]
    assert freed["resource"] == "res:c"
    assert freed["released"] is True
    assert test_leases.store.holders("res:c") == []
    # the same audit record as `celery leases release --force`
    (record,) = test_leases.store.audit_log(1)
    assert record["resource"] == "res:c"
    assert record["forced"] is True
    assert "web view, client 127.0.0.1" in record["by"]


def test_allow_release_without_a_token_is_refused(worker_env: dict[str, str]) -> None:
    cli = Cli({**worker_env, **LIVE})
    result = cli("web", "--bind", f"127.0.0.1:{free_port()}", "--allow-release")
    assert result.returncode == 2
    assert "--allow-release needs --token" in result.stderr
    public = cli("web", "--bind", f"0.0.0.0:{free_port()}")
    assert public.returncode == 2
    assert "not a loopback address" in public.stderr


def _browser_or_skip() -> Any:
    """playwright's sync API with Debian's chromium, or a skip (a failure under CI)."""
    why = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        why = "the playwright package is not installed"
    if why is None and not os.access(CHROMIUM, os.X_OK):
        why = f"no chromium at {CHROMIUM} (apt-get install chromium)"
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"{why} (CI is set, so the browser test must run)")
        pytest.skip(why)
    return sync_playwright


def test_the_page_shows_a_worker_lease_and_releases_it(
    start_worker: Any,
    start_view: Callable[..., View],
    worker_app: Any,
    send: Any,
    ledger: Any,
    test_leases: Any,
    worker_env: dict[str, str],
) -> None:
    sync_playwright = _browser_or_skip()
    w = start_worker("prefork", 2, env=LIVE)
    held = send(worker_app.sleeper, "page", 120)
    send(worker_app.sleeper, "other", 120)
    ledger.wait_event("started:page")
    ledger.wait_event("started:other")
    view = start_view("--allow-release", "--token", TOKEN)
    shots = os.environ.get("LEASES_SCREENSHOTS")
    cli = Cli({**worker_env, **LIVE})

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 600})
            page.goto(view.url + "/")
            row = page.locator('tr[data-resource="res:page"]')
            row.wait_for(timeout=20_000)
            text = row.inner_text()
            assert w.hostname in text
            assert held.id in text
            assert "alive" in text
            page.locator('tr[data-resource="res:other"]').wait_for()
            if shots:
                page.screenshot(path=str(Path(shots) / "web-leases.png"), full_page=True)
                page.click('nav button[data-tab="owners"]')
                page.locator("#owners table").wait_for()
                page.screenshot(path=str(Path(shots) / "web-owners.png"), full_page=True)
                page.click('nav button[data-tab="leases"]')
            # the history tab: the records, or what this version says without them
            page.click('nav button[data-tab="history"]')
            history = page.locator("#history")
            wait_until(lambda: history.inner_text().strip() != "", 20, "the history tab")
            if view.get("/api/config").json()["history"] is False:
                assert "history not available in this version" in history.inner_text()
            page.click('nav button[data-tab="leases"]')
            # the filters narrow the table
            page.fill("#f-resource", "other")
            row.wait_for(state="detached")
            page.fill("#f-resource", "")
            row.wait_for()

            # without a token the page asks for one and sends nothing
            row.locator("button.release").click()
            assert "token" in page.locator("#message").inner_text()
            assert not page.locator("#confirm").is_visible()
            page.fill("#token", TOKEN)

            # hostile names (held here, out of the screenshots): the CLI's table writes them
            # escaped, one line each
            with test_leases.hold(list(HOSTILE), ttl=30):
                listed = cli("ls")
                assert listed.returncode == 0, listed.stderr
                for raw, escaped in zip(HOSTILE, HOSTILE_SHOWN, strict=True):
                    assert escaped in listed.stdout
                    assert raw not in listed.stdout
                # the page: distinct rows, each shown exactly as the CLI shows it, and so in the
                # release confirmation
                names = page.locator("#leases tbody tr td:first-child")

                seen: list[str] = []

                def hostile_drawn() -> bool:
                    seen[:] = names.all_inner_texts()
                    return set(HOSTILE_SHOWN) <= set(seen)

                try:
                    wait_until(hostile_drawn, 20, f"the rows {HOSTILE_SHOWN}")
                except AssertionError as exc:
                    raise AssertionError(f"{exc}; the rows drawn: {seen}") from None
                drawn = names.all_inner_texts()
                for escaped in HOSTILE_SHOWN:
                    assert drawn.count(escaped) == 1, drawn
                for raw in HOSTILE:
                    assert raw not in drawn
                evil = page.locator("#leases tbody tr", has_text=HOSTILE_SHOWN[0])
                evil.locator("button.release").click()
                dialog = page.locator("#confirm")
                dialog.wait_for(state="visible")
                assert page.locator("#confirm-resource").inner_text() == HOSTILE_SHOWN[0]
                assert "\u202e" not in dialog.inner_text()
                page.click("#confirm-cancel")
                dialog.wait_for(state="hidden")
                newline = page.locator("#leases tbody tr", has_text=HOSTILE_SHOWN[1])
                newline.locator("button.release").click()
                dialog.wait_for(state="visible")
                assert page.locator("#confirm-resource").inner_text() == HOSTILE_SHOWN[1]
                page.click("#confirm-cancel")
                dialog.wait_for(state="hidden")
            wait_until(
                lambda: not set(HOSTILE_SHOWN) & set(names.all_inner_texts()),
                20,
                "the hostile rows to go once released",
            )
            row.locator("button.release").click()
            dialog.wait_for(state="visible")
            assert "res:page" in dialog.inner_text()
            assert held.id in dialog.inner_text()
            if shots:
                page.screenshot(path=str(Path(shots) / "web-release.png"))
            # cancel first: still held
            page.click("#confirm-cancel")
            dialog.wait_for(state="hidden")
            assert [h.resource for h in test_leases.store.holders("res:page")] == ["res:page"]
            row.locator("button.release").click()
            dialog.wait_for(state="visible")
            page.click("#confirm-release")
            page.locator("#message.ok").wait_for(timeout=20_000)
            assert "released res:page" in page.locator("#message").inner_text()
            row.wait_for(state="detached", timeout=20_000)  # the next refresh drops it
        finally:
            browser.close()

    # gone in Redis; the other lease is untouched
    assert test_leases.store.holders("res:page") == []
    assert [h.resource for h in test_leases.store.holders("res:other")] == ["res:other"]
    # the holder learns at its next renewal (LeaseLost interrupts the body by default)
    wait_until(lambda: held.state == "FAILURE", 60, "the released task to fail with LeaseLost")


def test_the_owners_tab_shows_an_idle_worker_alive(
    start_worker: Any,
    start_view: Callable[..., View],
    worker_app: Any,
    send: Any,
    ledger: Any,
    worker_env: dict[str, str],
) -> None:
    sync_playwright = _browser_or_skip()
    # the pool process renews its liveness only while it holds a lease: 6 s after its task it
    # has run out, while the worker marks its node alive every 2 s
    idle = {"CELERY_LEASES_TTL": "6", "CELERY_LEASES_RECONCILE_INTERVAL": "0"}
    w = start_worker("prefork", 1, env=idle)
    send(worker_app.sleeper, "idle", 0)
    ledger.wait_event("started:idle")
    view = start_view()  # with LIVE's settings: the view reads the node's mark all the same

    def ran_out() -> bool:
        rows = [o for o in view.get("/api/owners").json() if o["node"] == w.hostname]
        return bool(rows) and all(o["liveness"] < 0 for o in rows)

    wait_until(ran_out, 60, "the idle owner's liveness to run out")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 600})
            page.goto(view.url + "/")
            page.click('nav button[data-tab="owners"]')
            owners = page.locator("#owners")
            wait_until(lambda: w.hostname in owners.inner_text(), 20, "the owners tab")
            text = owners.inner_text()
            assert "idle (holds nothing; its node is alive)" in text, text
            assert "dead" not in text, text
            lines = [line for line in text.splitlines() if "owners alive" in line]
            assert lines, text
            assert all(" 0 of " not in line for line in lines), lines
            assert any("idle)" in line for line in lines), lines
        finally:
            browser.close()


def test_the_page_revokes_a_worker_lease_beside_the_release(
    start_worker: Any,
    start_view: Callable[..., View],
    worker_app: Any,
    send: Any,
    ledger: Any,
    test_leases: Any,
    leases_redis: Any,
) -> None:
    """The revoke action: the holder's task gets LeaseRevoked at its next renewal (a 3 s
    ttl: about a second) and lets go, long before the 60 s deadline given in the dialog."""
    sync_playwright = _browser_or_skip()
    start_worker(
        "prefork", 1, env={"CELERY_LEASES_TTL": "3", "CELERY_LEASES_RECONCILE_INTERVAL": "0"}
    )
    held = send(worker_app.sleeper, "revoked", 120)
    ledger.wait_event("started:revoked")
    view = start_view("--allow-release", "--token", TOKEN)

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 600})
            page.goto(view.url + "/")
            row = page.locator('tr[data-resource="res:revoked"]')
            row.wait_for(timeout=20_000)
            # without a token the page asks for one and sends nothing
            row.locator("button.revoke").click()
            assert "token" in page.locator("#message").inner_text()
            dialog = page.locator("#revoke")
            assert not dialog.is_visible()
            page.fill("#token", TOKEN)
            # cancel first: nothing is revoked
            row.locator("button.revoke").click()
            dialog.wait_for(state="visible")
            assert "res:revoked" in dialog.inner_text()
            assert held.id in dialog.inner_text()
            page.click("#revoke-cancel")
            dialog.wait_for(state="hidden")
            assert leases_redis.exists(test_leases.store.keys.revocation("res:revoked")) == 0
            row.locator("button.revoke").click()
            dialog.wait_for(state="visible")
            page.fill("#revoke-reason", "from the browser")
            page.fill("#revoke-deadline", "60")
            page.click("#revoke-send")
            page.locator("#message.ok").wait_for(timeout=20_000)
            assert (
                "revoked res:revoked: 1 holder(s) asked to let go"
                in page.locator("#message").inner_text()
            )
            row.wait_for(state="detached", timeout=30_000)  # the task let go
        finally:
            browser.close()

    wait_until(lambda: held.state == "FAILURE", 60, "the revoked task to end with LeaseRevoked")
    assert type(held.result).__name__ == "LeaseRevoked"
    assert held.result.reason == "from the browser"
