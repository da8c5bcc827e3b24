"""Build the wheel and sdist, install the wheel into a fresh venv and run a leased task there.

A packaging mistake (a Lua script or ``py.typed`` left out of the wheel, a missing dependency,
the ``celery leases`` entry point not registered) passes every test that runs from the source
tree; this catches it. Run by ``scripts/test`` on a full run, or on its own:

    python scripts/wheel_smoke.py [--redis-url URL] [--keep]

The Redis is ``--redis-url``, else ``$CELERY_LEASES_TEST_REDIS_URL``, else
``redis://127.0.0.1:6379/15``. It is used as broker, result backend and lease store, every key
under one random prefix (kombu's ``global_keyprefix`` for the broker and results), and only the
keys under that prefix are deleted at the end. Exit status 0 when every step passed; otherwise
the failing step is printed with the worker's log, and the status is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]

#: the whole run must stay well under CI's patience; each step has its own share
STEP_TIMEOUT = 120.0

APP_SOURCE = '''\
"""The smoke test's app: imported by the worker, the CLI and the sender, from the fresh venv."""

import os
import time

import redis
from celery import Celery

from celery_leases import LeasedTask, Leases, current_leases

URL = os.environ["SMOKE_REDIS_URL"]
PREFIX = os.environ["SMOKE_PREFIX"]
# kombu and the result backend put every key of theirs under the run's prefix, so the clean-up
# can delete exactly this run's keys on a shared Redis
_KOMBU = {"global_keyprefix": PREFIX + "-kombu:"}

app = Celery("smokeapp", broker=URL, backend=URL)
app.conf.broker_transport_options = _KOMBU
app.conf.result_backend_transport_options = _KOMBU
app.conf.task_default_queue = PREFIX + "-queue"
app.conf.worker_hijack_root_logger = False
leases = Leases(app, key_prefix=PREFIX)


@app.task(base=LeasedTask, lease="smoke:{n}", on_busy="fail")
def slow(n):
    """Hold the lease until the smoke test has seen it listed (or 30 s), then report it."""
    (lease,) = current_leases()
    client = redis.Redis.from_url(URL)
    try:
        deadline = time.monotonic() + 30
        while not client.exists(PREFIX + "-go") and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        client.close()
    lease.check()
    return {"resource": lease.resource, "token": lease.token}
'''


class SmokeError(Exception):
    """One step of the smoke test failed; the message says which and why."""


def _step(message: str) -> None:
    print(f"==> wheel-smoke: {message}", flush=True)


def _run(
    cmd: Sequence[str | Path],
    what: str,
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = STEP_TIMEOUT,
) -> str:
    """Run ``cmd`` to the end; raise SmokeError naming ``what`` with its output if it fails."""
    try:
        proc = subprocess.run(
            [str(c) for c in cmd],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise SmokeError(f"{what}: no answer after {timeout:.0f} s") from exc
    if proc.returncode != 0:
        raise SmokeError(
            f"{what}: exit status {proc.returncode}\n"
            f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc.stdout


def _build(dist: Path) -> tuple[Path, Path]:
    """Build the sdist, then the wheel from that sdist, so the sdist is checked as well."""
    _step("python -m build (sdist, then the wheel from the sdist)")
    _run([sys.executable, "-m", "build", "--outdir", dist, ROOT], "python -m build")
    wheels = sorted(dist.glob("celery_leases-*.whl"))
    sdists = sorted(dist.glob("celery_leases-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        raise SmokeError(f"python -m build made {[p.name for p in dist.iterdir()]}")
    return wheels[0], sdists[0]


def _check_wheel_contents(wheel: Path) -> None:
    """Every file of the package in git is in the wheel, nothing else is (no dev servers, no
    installer), and the CLI entry point is declared."""
    _step(f"contents of {wheel.name}")
    listed = _run(["git", "ls-files", "celery_leases"], "git ls-files", cwd=ROOT).split()
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(
            (zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")),
            "",
        )
        # the wheel carries no dev infrastructure: nothing outside the package, no installer
        sources = {n: zf.read(n).decode() for n in names if n.endswith(".py")}
    missing = [name for name in listed if name not in names]
    if missing:
        raise SmokeError(f"the wheel lacks files that are in git: {missing}")
    stray = sorted(
        n for n in names if not n.startswith(("celery_leases/", "celery_leases-")) or "/" not in n
    )
    if stray:
        raise SmokeError(f"the wheel has files outside the package: {stray}")
    installers = sorted(
        n
        for n, text in sources.items()
        if any(word in text for word in ("apt-get", "ensure_server_binary", "LocalCluster"))
    )
    if installers or "celery_leases/_redis_topology.py" in names:
        raise SmokeError(f"the wheel ships dev infrastructure: {installers}")
    if "leases = celery_leases.cli:leases" not in entry_points:
        raise SmokeError(f"the wheel declares no celery.commands entry point:\n{entry_points}")


def _clean_env(venv: Path, app_dir: Path, url: str, prefix: str) -> dict[str, str]:
    """The environment of a process of the fresh venv: nothing of the developer's venv in it."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"} and not k.startswith("CELERY_")
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(app_dir)
    env["SMOKE_REDIS_URL"] = url
    env["SMOKE_PREFIX"] = prefix
    return env


def _leases_ls(venv: Path, app_dir: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    out = _run(
        [venv / "bin" / "celery", "-A", "smokeapp", "leases", "ls", "--json"],
        "celery -A smokeapp leases ls --json (from the fresh venv)",
        cwd=app_dir,
        env=env,
        timeout=60,
    )
    try:
        rows = json.loads(out)
    except ValueError as exc:
        raise SmokeError(f"celery leases ls --json printed no JSON:\n{out}") from exc
    if not isinstance(rows, list):
        raise SmokeError(f"celery leases ls --json printed no list:\n{out}")
    return rows


def _wait_ready(worker: subprocess.Popen[bytes], log: Path, deadline: float) -> None:
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            raise SmokeError(f"the worker exited with status {worker.returncode} before ready")
        if " ready." in log.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise SmokeError("the worker did not log 'ready.' within 60 s")


def _stop_worker(worker: subprocess.Popen[bytes]) -> int:
    """Warm shutdown (SIGTERM); SIGKILL if it has not ended after 30 s."""
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    return worker.returncode


def _delete_keys(url: str, prefix: str) -> int:
    """Delete this run's keys only: every key name that contains its random prefix."""
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"*{prefix}*", count=1000))
        if keys:
            client.unlink(*keys)
        return len(keys)
    finally:
        client.close()


def smoke(url: str, work: Path) -> None:
    """Every step, in order; raises SmokeError at the first that fails."""
    wheel, sdist = _build(work / "dist")
    _check_wheel_contents(wheel)

    venv = work / "venv"
    _step(f"fresh venv, pip install {wheel.name} 'celery[redis]'")
    _run([sys.executable, "-m", "venv", venv], "python -m venv")
    _run(
        [venv / "bin" / "python", "-m", "pip", "install", "-q", str(wheel), "celery[redis]"],
        "pip install of the wheel into the fresh venv",
    )

    prefix = f"wheel-smoke-{uuid.uuid4().hex[:12]}"
    app_dir = work / "app"
    app_dir.mkdir()
    (app_dir / "smokeapp.py").write_text(APP_SOURCE)
    env = _clean_env(venv, app_dir, url, prefix)

    where = _run(
        [venv / "bin" / "python", "-c", "import celery_leases; print(celery_leases.__file__)"],
        "import celery_leases in the fresh venv",
        cwd=app_dir,
        env=env,
    ).strip()
    if not where.startswith(str(venv)):
        raise SmokeError(f"the fresh venv imports celery_leases from {where}, not its own copy")

    log = work / "worker.log"
    node = f"{prefix}@localhost"
    _step(f"celery worker {node} (from the fresh venv)")
    with log.open("wb") as log_file:
        worker = subprocess.Popen(
            [
                str(venv / "bin" / "celery"),
                "-A",
                "smokeapp",
                "worker",
                "-n",
                node,
                "-c",
                "1",
                "-l",
                "info",
                # no broadcast traffic with other workers on the same Redis
                "--without-mingle",
                "--without-gossip",
            ],
            cwd=app_dir,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            # its own process group, so that a SIGKILL fallback takes the pool child too
            start_new_session=True,
        )
    try:
        try:
            _run_task(worker, log, venv, app_dir, env, url, prefix, node)
        except SmokeError as exc:
            _stop_worker(worker)
            raise SmokeError(f"{exc}\n--- worker log\n{log.read_text(errors='replace')}") from exc
        _step("stopping the worker (SIGTERM)")
        status = _stop_worker(worker)
        if status != 0:
            raise SmokeError(
                f"the worker exited with status {status} on SIGTERM\n"
                f"--- worker log\n{log.read_text(errors='replace')}"
            )
    finally:
        _stop_worker(worker)
        _delete_keys(url, prefix)
    _step(f"passed: {wheel.name} and {sdist.name}")


def _run_task(
    worker: subprocess.Popen[bytes],
    log: Path,
    venv: Path,
    app_dir: Path,
    env: dict[str, str],
    url: str,
    prefix: str,
    node: str,
) -> None:
    _wait_ready(worker, log, time.monotonic() + 60)

    _step("sending the leased task slow(7)")
    task_id = _run(
        [venv / "bin" / "python", "-c", "from smokeapp import slow; print(slow.delay(7).id)"],
        "slow.delay(7)",
        cwd=app_dir,
        env=env,
    ).strip()

    # The task holds its lease until the go key is set, so ls is sure to run while it is held.
    _step("celery -A smokeapp leases ls --json while it runs")
    deadline = time.monotonic() + 45
    while True:
        rows = _leases_ls(venv, app_dir, env)
        mine = [r for r in rows if r.get("resource") == "smoke:7"]
        if mine:
            break
        if worker.poll() is not None:
            raise SmokeError(f"the worker exited with status {worker.returncode}")
        if time.monotonic() > deadline:
            raise SmokeError(f"leases ls --json never listed smoke:7; last output: {rows}")
        time.sleep(0.5)
    row = mine[0]
    if node not in str(row.get("owner")) or row.get("task_id") != task_id:
        raise SmokeError(f"leases ls --json lists smoke:7 with a wrong owner or task: {row}")

    client = redis.Redis.from_url(url)
    try:
        client.set(f"{prefix}-go", "1", ex=120)
    finally:
        client.close()

    _step("waiting for the result")
    out = _run(
        [
            venv / "bin" / "python",
            "-c",
            "import json, sys; from smokeapp import app; "
            "print(json.dumps(app.AsyncResult(sys.argv[1]).get(timeout=45)))",
            task_id,
        ],
        "AsyncResult.get",
        cwd=app_dir,
        env=env,
        timeout=60,
    )
    result = json.loads(out)
    if result != {"resource": "smoke:7", "token": row["token"]}:
        raise SmokeError(f"the task returned {result}; expected smoke:7 with token {row['token']}")

    rows = _leases_ls(venv, app_dir, env)
    if any(r.get("resource") == "smoke:7" for r in rows):
        raise SmokeError(f"the lease is still listed after the task ended: {rows}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the smoke test; 0 when it passed, 1 (with what failed) when it did not."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("CELERY_LEASES_TEST_REDIS_URL", "redis://127.0.0.1:6379/15"),
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir for a look")
    args = parser.parse_args(argv)

    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="wheel-smoke-"))
    try:
        smoke(args.redis_url, work)
    except SmokeError as exc:
        print(f"wheel-smoke: FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if args.keep:
            print(f"wheel-smoke: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    _step(f"took {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
