"""Memory benchmark: what Redis keeps per distinct resource after its lease was released.

    python -m bench.memory                 # 1,000, 10,000 and 100,000 resources; about 1 min
    python -m bench.memory --quick         # 1,000 and 10,000
    python -m bench.memory --help

It is a benchmark, not a test: it prints what it measured and exits 0.

Each contender takes and releases a lease on N distinct resource names (``report:<i>``), one
after the other, on a fresh database of a PRIVATE redis-server that the benchmark starts and
stops. Then it reads Redis's ``used_memory`` and the number of keys (``DBSIZE``): what is
left per distinct resource once every lease is released. The contenders:

- ``hold()`` with ``token_memory`` at its default (86400 s): each resource's token counter
  stays a day after its last grant (docs/hold-and-once.md, "How tokens are made");
- ``hold()`` with ``token_memory = 0``: no counter;
- redis-py's ``Lock`` and python-redis-lock, for comparison (python-redis-lock leaves its
  signal list for 1 s after each release, and the count is taken at once).

``used_memory`` is read after the process's own leases are released and the owner's
registry is empty; the owner's liveness and node entries (a few hundred bytes, once per
process) are in the baseline, taken after one warm-up cycle. The table goes to stdout,
``bench/results/memory.{md,json}``, the ``## Memory left behind`` section of
``docs/benchmarks.md`` and the plot ``docs/img/bench-memory.svg``.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import redis
import redis_lock
from celery import Celery

from celery_leases import Leases
from celery_leases._redis_server import RedisServer
from tests.support.servers import ensure_server_binary

from . import plot
from ._common import machine_info, replace_section, write_json, write_text

SECTION: Final = "## Memory left behind"
DOCS: Final = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
#: (key, label) of each contender, in the order of the table and the plot
CONTENDERS: Final = (
    ("hold", "hold(), token_memory 86400 (default)"),
    ("hold0", "hold(), token_memory 0"),
    ("redis-py", "redis-py Lock"),
    ("prl", "python-redis-lock"),
)
LABELS: Final = dict(CONTENDERS)
#: how long what a contender leaves stays
KEPT: Final = {
    "hold": "kept 24 h after the last grant",
    "hold0": "nothing kept",
    "redis-py": "nothing kept",
    "prl": "each signal list expires 1 s after its release: what is left depends on the rate",
}
PER_DAY: Final = 10_000_000  # the example: distinct resources a day


def progress(message: str) -> None:
    print(f"bench.memory: {message}", file=sys.stderr, flush=True)


def cycles(key: str, url: str, prefix: str) -> tuple[Callable[[str], None], Callable[[], None]]:
    """(one take-and-release cycle on a name, close) of contender ``key``."""
    client = redis.Redis.from_url(url)
    if key in ("hold", "hold0"):
        app = Celery(f"bench-memory-{key}", set_as_current=False)
        memory = 86400.0 if key == "hold" else 0.0
        leases = Leases(app, redis_url=url, key_prefix=prefix, token_memory=memory)

        def hold_cycle(name: str) -> None:
            with leases.hold(name, ttl=30):
                pass

        def close() -> None:
            leases.store.close()
            client.close()

        return hold_cycle, close
    if key == "redis-py":

        def rpy_cycle(name: str) -> None:
            lock = client.lock(f"{prefix}:{name}", timeout=30)
            lock.acquire(blocking=False)
            lock.release()

        return rpy_cycle, client.close

    def prl_cycle(name: str) -> None:
        lock = redis_lock.Lock(client, f"{prefix}:{name}", expire=30)
        lock.acquire(blocking=False)
        lock.release()

    return prl_cycle, client.close


def measure(url: str, admin: redis.Redis, key: str, n: int) -> dict[str, Any]:
    """Bytes and keys left after ``n`` distinct resources were taken and released."""
    admin.flushdb()
    prefix = f"mem-{secrets.token_hex(3)}"
    cycle, close = cycles(key, url, prefix)
    try:
        cycle("warm-up")  # the owner's one-off entries, its connections, the scripts
        time.sleep(0.05)
        before = int(admin.info("memory")["used_memory"])
        keys_before = int(admin.dbsize())
        started = time.monotonic()
        for i in range(n):
            cycle(f"report:{i}")
        elapsed = time.monotonic() - started
        after = int(admin.info("memory")["used_memory"])
        keys_after = int(admin.dbsize())
    finally:
        close()
    left = max(after - before, 0)
    return {
        "n": n,
        "bytes": left,
        "bytes_per_resource": left / n,
        "keys_per_resource": (keys_after - keys_before) / n,
        "seconds": elapsed,
    }


def run(url: str, counts: Sequence[int]) -> dict[str, dict[str, dict[str, Any]]]:
    admin = redis.Redis.from_url(url)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        for key, _label in CONTENDERS:
            for n in counts:
                progress(f"{key}: {n:,} distinct resources")
                out.setdefault(key, {})[str(n)] = measure(url, admin, key, n)
    finally:
        admin.close()
    return out


def table(res: dict[str, dict[str, dict[str, Any]]], counts: Sequence[int]) -> str:
    """The Markdown table of ``res``: bytes and keys per resource at each N."""
    head = ["contender", *(f"bytes/resource at {n:,}" for n in counts), "keys/resource"]
    head.append(f"{PER_DAY // 1_000_000} M distinct a day")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    top = str(counts[-1])
    for key, label in CONTENDERS:
        points = res.get(key, {})
        if not points:
            continue
        per = [f"{points[str(n)]['bytes_per_resource']:,.0f}" for n in counts]
        keys = f"{points[top]['keys_per_resource']:.2f}"
        day = points[top]["bytes_per_resource"] * PER_DAY
        kept = KEPT[key]
        total = f"{day / 1e9:.2f} GB" if day >= 1e8 else f"{day / 1e6:.1f} MB"
        if key == "prl":
            total = "-"
        lines.append("| " + " | ".join([label, *per, keys, f"{total} ({kept})"]) + " |")
    return "\n".join(lines)


def docs_section(head: str, text: str) -> str:
    """The ``## Memory left behind`` section of docs/benchmarks.md."""
    intro = (
        "`python -m bench.memory` (`--quick` for a short run) takes and releases a lease on N\n"
        "distinct resource names, one after the other, on a fresh database of a private\n"
        "redis-server, then reads `used_memory` and `DBSIZE`: what Redis keeps per distinct\n"
        "resource once every lease is released (the owner's own entries, a few hundred bytes\n"
        "once per process, are in the baseline, taken after one warm-up cycle). The last\n"
        "column scales the largest run to 10 million distinct resources a day."
    )
    image = "![Memory left per distinct resource](img/bench-memory.svg)"
    return f"{SECTION}\n\n{intro}\n\n{image}\n\n{head}\n\n{text}\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.memory", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="1,000 and 10,000 resources only")
    parser.add_argument("--counts", type=int, nargs="+", help="the numbers of distinct resources")
    parser.add_argument("--out-dir", default=str(plot.RESULTS_DIR), help="where the results go")
    parser.add_argument("--docs", default=str(DOCS), help="the docs page whose section is replaced")
    parser.add_argument("--no-docs", action="store_true", help="leave docs/benchmarks.md alone")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    counts = args.counts or ([1_000, 10_000] if args.quick else [1_000, 10_000, 100_000])
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    server = RedisServer(binary=ensure_server_binary())
    server.start()
    try:
        progress(f"private redis-server at {server.url}")
        with redis.Redis.from_url(server.url) as admin:
            machine = machine_info(admin)
        res = run(server.url, counts)
    finally:
        server.stop()
    text = table(res, counts)
    head = (
        f"- machine: {machine['cpus']} cores, {machine['cpu_model']}; python {machine['python']}, "
        f"redis-py {machine['redis_py']}, server {machine['server']} (private)\n"
        f"- run: {machine['date']}, each contender on a fresh database; used_memory after every "
        "lease was released, less the baseline after one warm-up cycle"
    )
    print(head + "\n\n" + text)
    write_text(
        str(out_dir / "memory.md"), "# Memory benchmark results\n\n" + head + "\n\n" + text + "\n"
    )
    write_json(
        str(out_dir / "memory.json"),
        {"machine": machine, "counts": counts, "labels": LABELS, "results": res},
    )
    if not args.no_docs:
        replace_section(Path(args.docs), SECTION, docs_section(head, text))
    plot.refresh(out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
