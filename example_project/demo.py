"""The demo: an analysis pipeline on two workers and two beat replicas, proven by a ledger.

Run it with ``scripts/demo`` (which finds or starts a Redis and sets ``REDIS_URL``). It starts

- two workers with different pools (prefork and threads), as two pods would;
- two ``celery beat`` replicas with ``LeasedScheduler``;
- a producer that sends every (analysis, step) twice, as two web replicas racing would;

shows live progress, stops everything, and ends with a summary that proves the point: every
task ran, no two copies of a step overlapped, the shared dataset never had more than its limit
of readers, each input was initialised once, and each beat run was sent once. It exits non-zero
if any of that fails, and leaves no process and no key of its own behind.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str]) -> None:
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen(
                self.argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        p = self.popen
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def wait_for(predicate: Any, timeout: float, what: str, procs: list[Proc]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for p in procs:
            if p.popen is not None and p.popen.poll() is not None:
                raise SystemExit(f"{p.name} exited early:\n{p.text()[-3000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--analyses", type=int, default=6, help="number of analyses (default 6)")
    parser.add_argument(
        "--beat-seconds",
        type=float,
        default=20.0,
        help="keep beat running at least this long (default 20)",
    )
    parser.add_argument("--keep", action="store_true", help="keep logs and keys for inspection")
    args = parser.parse_args(argv)

    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14")
    run = f"demo-{time.strftime('%H%M%S')}-{os.getpid()}"
    workdir = Path(tempfile.mkdtemp(prefix="celery-leases-demo-"))
    os.environ.update(
        REDIS_URL=url, DEMO_PREFIX=run, DEMO_QUEUE=f"{run}-q", DEMO_WORKDIR=str(workdir / "data")
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_LEASES_")}
    env["PYTHONUNBUFFERED"] = "1"

    from celery_leases.config import safe_url

    from . import tasks
    from .app import app, leases

    print(f"celery_leases demo: Redis {safe_url(url)}, key prefix {run!r}")
    py = [sys.executable, "-m", "celery", "-A", "example_project.app"]
    common = ["--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"]
    procs = [
        Proc("worker-a (prefork x2)",
             [*py, "worker", "-P", "prefork", "-c", "2", "-n", f"a-{run}@%h", *common],
             workdir / "worker-a.log"),
        Proc("worker-b (threads x4)",
             [*py, "worker", "-P", "threads", "-c", "4", "-n", f"b-{run}@%h", *common],
             workdir / "worker-b.log"),
        Proc("beat-1", [*py, "beat", "-s", str(workdir / "beat-1"), "--pidfile", "",
                        "--max-interval", "1", "-l", "info"], workdir / "beat-1.log"),
        Proc("beat-2", [*py, "beat", "-s", str(workdir / "beat-2"), "--pidfile", "",
                        "--max-interval", "1", "-l", "info"], workdir / "beat-2.log"),
    ]  # fmt: skip
    r = redis.Redis.from_url(url, decode_responses=True)
    ok = False
    started = time.monotonic()
    try:
        for p in procs:
            p.start(env)
        wait_for(lambda: all("ready." in p.text() for p in procs[:2]), 60, "workers", procs)
        print("  2 workers ready, 2 beat replicas ticking; sending every step twice")

        results = []
        for analysis in range(1, args.analyses + 1):
            for step in tasks.STEPS:
                for _ in range(2):  # two web replicas racing on the same object and step
                    results.append(tasks.run_step.delay(analysis, step))
        total = len(results)

        def status() -> tuple[int, int]:
            done = sum(1 for res in results if res.ready())
            held = sum(len(leases.store.owned(o)) for o, _ in leases.store.owners())
            return done, held

        last_line = ""
        deadline = time.monotonic() + 120
        while True:
            done, held = status()
            inits = sum(int(r.get(tasks.key("inits", a)) or 0) for a in range(1, args.analyses + 1))
            line = (
                f"  t={time.monotonic() - started:5.1f}s  tasks {done:3d}/{total}  "
                f"leases held {held:2d}  busy retries {int(r.get(tasks.key('busy')) or 0):3d}  "
                f"inits {inits:2d}  "
                f"beat runs {int(r.get(tasks.key('beat_runs')) or 0):2d}"
            )  # fmt: skip
            if line != last_line:
                print(line, flush=True)
                last_line = line
            beat_long_enough = time.monotonic() - started >= args.beat_seconds
            if done == total and beat_long_enough:
                break
            if time.monotonic() > deadline:
                print("  gave up waiting")
                break
            time.sleep(1.0)

        for p in procs[2:]:
            p.stop()
        time.sleep(0.5)  # let the last beat message be consumed
        wait_for(lambda: r.llen(f"{run}-q") == 0, 20, "the queue to drain", procs[:2])
        for p in procs[:2]:
            p.stop()

        ok = summary(r, tasks, results, procs, args.analyses, leases)
    finally:
        for p in procs:
            p.stop()
        if not ok:
            for p in procs:
                print(f"\n----- {p.name} (last lines) -----\n{p.text()[-2500:]}")
        if not args.keep:
            cleanup(r, run, results if "results" in locals() else [])
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"  kept logs in {workdir} and keys under {{{run}*")
        r.close()
        app.close()
    return 0 if ok else 1


def summary(r: redis.Redis, tasks: Any, results: list[Any], procs: list[Proc], analyses: int,
            leases: Any) -> bool:  # fmt: skip
    states = Counter(res.state for res in results)
    overlaps = int(r.get(tasks.key("overlaps")) or 0)
    max_readers = int(r.get(tasks.key("max_readers")) or 0)
    inits = [int(r.get(tasks.key("inits", a)) or 0) for a in range(1, analyses + 1)]
    receipts = [leases.receipt(f"analysis:{a}:input") for a in range(1, analyses + 1)]
    n_receipts = sum(1 for x in receipts if x)
    fences_ok = True
    for a in range(1, analyses + 1):
        for step in tasks.STEPS:
            seq = [int(t) for t in r.lrange(tasks.key("fences", a, step), 0, -1)]
            fences_ok &= seq == sorted(set(seq)) and len(seq) == 2
    claims: Counter[str] = Counter()
    sends = 0
    for p in procs[2:]:
        text = p.text()
        claims.update(re.findall(r"beat claimed sweep-scratch \(bucket (\d+)\)", text))
        sends += len(re.findall(r"Sending due task sweep-scratch", text))
    beat_runs = int(r.get(tasks.key("beat_runs")) or 0)
    left = sum(len(leases.store.owned(o)) for o, _ in leases.store.owners())
    busy = int(r.get(tasks.key("busy")) or 0)
    checks = [
        (f"tasks run: {states.get('SUCCESS', 0)}/{len(results)} succeeded",
         states.get("SUCCESS", 0) == len(results)),
        (f"overlapping copies of a step: {overlaps}", overlaps == 0),
        (f"busy leases met (retried later): {busy}", True),
        (f"most readers of the shared dataset at once: {max_readers} (limit 3)",
         0 < max_readers <= 3),
        (f"inputs initialised: {sum(inits)} for {analyses} analyses, receipts {n_receipts}",
         inits == [1] * analyses and all(receipts)),
        ("fencing tokens grew for every step", fences_ok),
        (f"beat runs: {sends} sent by 2 replicas, {len(claims)} runs claimed, "
         f"{max(claims.values(), default=0)} claim(s) per run at most, {beat_runs} executed",
         sends == len(claims) == beat_runs > 0 and max(claims.values(), default=0) == 1),
        (f"leases still held after shutdown: {left}", left == 0),
    ]  # fmt: skip
    print("\nsummary")
    for text, good in checks:
        print(f"  [{'ok' if good else 'FAIL'}] {text}")
    ok = all(good for _, good in checks)
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return ok


def cleanup(r: redis.Redis, run: str, results: list[Any]) -> None:
    """Delete only what this run created: its prefix, its queue, its results."""
    keys = list(r.scan_iter(match=f"{{{run}*", count=1000))
    keys += list(r.scan_iter(match=f"*{run}-q*", count=1000))
    keys += [f"celery-task-meta-{res.id}" for res in results]
    for i in range(0, len(keys), 500):
        r.unlink(*keys[i : i + 500])


if __name__ == "__main__":
    raise SystemExit(main())
