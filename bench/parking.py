"""Parked tasks: the time from a release to a busy task's start, defer against wait and retry.

One prefork worker (2 processes) of ``tests.integration.parking.park_app``; the benchmark holds
an exclusive lease, sends tasks that find it busy, releases it and measures (on the Redis
clock) until the next task's body starts:

- ``defer`` with 1, 100 and 10,000 tasks parked on the resource: the gaps of the hand-on chain
  (a task's end, its release and hand-on, the next one's publish and start), the first ones
  while the queue still holds about N;
- ``wait`` (one task blocking a slot, woken by the release) and ``retry`` (one task retrying
  with the default backoff), the same release-to-start time.

The target: defer stays flat (the median with 10,000 parked within 2x the one with 1).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Final

import redis

from bench._common import (
    Row,
    median,
    percentile,
    redis_target,
    render_markdown,
    render_text,
    spawn_worker,
    write_json,
    write_text,
)
from celery_leases._lease import Want

REPO: Final = Path(__file__).resolve().parents[1]
APP: Final = "tests.integration.parking.park_app"
PREFIX: Final = "bench-park"
QUEUE: Final = "bench-parking"
GAPS: Final = 30  # chain gaps measured per size
TIMEOUT: Final = 600.0


def progress(message: str) -> None:
    print(f"[bench.parking] {message}", file=sys.stderr, flush=True)


def load_app(url: str) -> ModuleType:
    env = {
        "LEASES_TEST_BROKER": url,
        "LEASES_TEST_LEDGER": url,
        "LEASES_TEST_QUEUE": QUEUE,
        "CELERY_LEASES_REDIS_URL": url,
        "CELERY_LEASES_KEY_PREFIX": PREFIX,
        "PAPP_SLOW": "0",
    }
    os.environ.update(env)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import tests.integration.parking.park_app as park_app

    return park_app


def wait_for(what: str, check: object, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def starts(client: redis.Redis, park_app: ModuleType, tenant: str) -> list[tuple[str, int, int]]:
    """``(event, n, Redis us)`` of ``tenant``'s bodies, in order."""
    out = []
    for raw in client.lrange(park_app.ledger_key(PREFIX), 0, -1):
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        e, t, n, _, _, us = text.split(" ")
        if t == tenant:
            out.append((e, int(n), int(us)))
    return out


def redis_us(client: redis.Redis) -> int:
    s, us = client.time()
    return int(s) * 1_000_000 + int(us)


def bench_defer(park_app: ModuleType, client: redis.Redis, size: int) -> list[float]:
    tenant = f"defer{size}"
    ext = park_app.app.leases
    excl = park_app.app.tasks["park_app.excl"]
    (lease,) = ext.acquire([Want(f"excl:{tenant}")], ttl=60)
    for n in range(size):
        excl.delay(tenant, n)
    queue = ext.store.keys.parked(f"excl:{tenant}")
    wait_for(f"{size} tasks parked", lambda: client.zcard(queue) >= size)
    progress(f"defer: {size} parked")
    t0 = redis_us(client)
    ext.release([lease])
    want = min(size, GAPS + 1)
    wait_for(
        "the chain", lambda: sum(1 for e in starts(client, park_app, tenant) if e[0] == "s") >= want
    )
    evs = starts(client, park_app, tenant)
    first = next(us for e, _, us in evs if e == "s")
    gaps = [(first - t0) / 1000]
    last_end = None
    for e, _, us in evs:
        if e == "e":
            last_end = us
        elif last_end is not None:
            gaps.append((us - last_end) / 1000)
            last_end = None
    # the rest of the queue is dropped: its tasks are not timed
    for task_id in client.zrange(queue, 0, -1):
        ext.store.client.hdel(ext.store.keys.park_state(0), task_id)
        ext.store.client.hdel(ext.store.keys.park_messages(0), task_id)
    client.delete(queue)
    return gaps[: GAPS + 1]


def bench_other(park_app: ModuleType, client: redis.Redis, policy: str, rounds: int) -> list[float]:
    ext = park_app.app.leases
    task = park_app.app.tasks[f"park_app.excl_{policy}"]
    out = []
    for r in range(rounds):
        tenant = f"{policy}{r}"
        (lease,) = ext.acquire([Want(f"excl:{tenant}")], ttl=60)
        task.delay(tenant, 0)
        time.sleep(2.0 + r * 0.37)  # it found the lease busy: waiting, or between retries
        t0 = redis_us(client)
        ext.release([lease])
        wait_for(f"{policy} start", lambda t=tenant: starts(client, park_app, t))
        out.append((starts(client, park_app, tenant)[0][2] - t0) / 1000)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.parking", description=__doc__)
    parser.add_argument("--redis-url", help="a loopback Redis instead of a private server")
    parser.add_argument("--sizes", default="1,100,10000", help="parked tasks per run")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    with redis_target(args.redis_url) as (url, _private):
        park_app = load_app(url)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_LEASES_")}
        env.update(
            LEASES_TEST_BROKER=url, LEASES_TEST_LEDGER=url, LEASES_TEST_QUEUE=QUEUE,
            CELERY_LEASES_REDIS_URL=url, CELERY_LEASES_KEY_PREFIX=PREFIX, PAPP_SLOW="0",
            PYTHONUNBUFFERED="1",
        )  # fmt: skip
        log = Path(tempfile.mkdtemp(prefix="bench-parking-")) / "worker.log"
        host = f"bench-parking-{os.getpid()}@{socket.gethostname()}"
        worker = spawn_worker(APP, "prefork", 2, host, log, env, REPO)
        client = redis.Redis.from_url(url)
        try:
            wait_for("the worker", lambda: park_app.app.control.ping([host], timeout=0.5), 60)
            rows = []
            medians = {}
            for size in sizes:
                gaps = bench_defer(park_app, client, size)
                medians[size] = median(gaps)
                rows.append(_row("defer", size, gaps))
            for policy in ("wait", "retry"):
                rows.append(_row(policy, 1, bench_other(park_app, client, policy, 5)))
            flat = medians[max(sizes)] <= 2 * medians[min(sizes)]
            rows.append(
                Row("parking", "defer", "flat", "ok" if flat else "MISS",
                    f"{medians[max(sizes)] / medians[min(sizes)]:.2f}",
                    f"median at {max(sizes)} / at {min(sizes)} parked", "<= 2.00")
            )  # fmt: skip
            print(render_text(rows))
            results = REPO / "bench" / "results"
            write_text(str(results / "parking.md"), render_markdown(rows) + "\n")
            write_json(
                str(results / "parking.json"),
                {"rows": [{**vars(r), "data": r.data} for r in rows]},
            )
        finally:
            worker.stop()
            client.close()
    return 0


def _row(policy: str, size: int, ms: list[float]) -> Row:
    return Row(
        "parking",
        policy,
        f"release->start, {size} busy",
        f"{median(ms):.1f} ms",
        "",
        f"p90 {percentile(ms, 90):.1f} ms, n={len(ms)}",
        "",
        {"ms": ms},
    )


if __name__ == "__main__":
    raise SystemExit(main())
