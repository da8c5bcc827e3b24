"""Rate limit benchmark: is the limit kept, and used, under a backlog; what an admission costs.

    python -m bench.limits              # about 25 s
    python -m bench.limits --quick      # about 10 s
    python -m bench.limits --help

Callers (threads of this process) take one limit over and over with ``leases.limit(name,
rate, wait=...)``, far more than it admits: a backlog. Every admission is stamped with the
Redis time the script admitted it at (the ``at`` of the ``limit_admitted`` signal). For each
rate it reports:

- the most admissions in any window of the period, against N (target: at most N);
- the share of N used per period, from the first admission over every whole period of the
  run (target: at least 90 %);
- Redis commands and server time per admission (INFO commandstats, on a private server by
  default): the script calls (refused checks included) and the commands they ran.

It is a measurement, not a test: it prints the table, marks each target PASS or MISS and
exits 0 either way. Results: stdout, ``bench/results/limits.{md,json}`` and the ``## Rate
limits`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Final

import redis
from celery import Celery

from celery_leases import Leases, RateLimited, signals
from celery_leases._limits import parse_rate

from ._common import (
    CommandStats,
    Row,
    machine_info,
    redis_target,
    render_markdown,
    render_text,
    replace_section,
    write_json,
    write_text,
)

__all__ = ("main",)

HEADING: Final = "## Rate limits"
RESULTS: Final = Path(__file__).parent / "results"
DOCS: Final = Path(__file__).parents[1] / "docs" / "benchmarks.md"
US: Final = 1_000_000
#: the share of N a backlog must use per period
USE_TARGET: Final = 0.9


def most_in_any_window(stamps: list[tuple[int, int]], period_us: int) -> int:
    """The most cost of ``(at_us, cost)`` stamps in any half-open window of ``period_us``."""
    ordered = sorted(stamps)
    most = total = start = 0
    for at, cost in ordered:
        total += cost
        while ordered[start][0] <= at - period_us:
            total -= ordered[start][1]
            start += 1
        most = max(most, total)
    return most


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def run_one(
    leases: Leases, client: redis.Redis, rate: str, callers: int, seconds: float
) -> dict[str, Any]:
    """``callers`` threads hammer one limit of ``rate`` for ``seconds``; what was measured."""
    n, period = parse_rate(rate, "bench")
    name = f"bench:{rate}"
    stamps: list[tuple[int, int]] = []
    refused = [0]
    lock = threading.Lock()

    def on_admitted(sender: object = None, **kw: Any) -> None:
        if kw["name"] == name:
            with lock:
                stamps.append((round(kw["at"] * US), kw["cost"]))

    def on_refused(sender: object = None, **kw: Any) -> None:
        if kw["name"] == name:
            with lock:
                refused[0] += 1

    signals.limit_admitted.connect(on_admitted, weak=False, dispatch_uid="bench-limits-a")
    signals.limit_refused.connect(on_refused, weak=False, dispatch_uid="bench-limits-r")
    until = time.monotonic() + seconds

    def caller() -> None:
        while (left := until - time.monotonic()) > 0:
            try:
                leases.limit(name, rate, wait=left)
            except RateLimited:
                return

    before = CommandStats.take(client)
    threads = [threading.Thread(target=caller) for _ in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = CommandStats.take(client)
    signals.limit_admitted.disconnect(dispatch_uid="bench-limits-a")
    signals.limit_refused.disconnect(dispatch_uid="bench-limits-r")

    period_us = round(period * US)
    first = min(at for at, _ in stamps)
    whole = int((max(at for at, _ in stamps) - first) // period_us)
    used = [
        sum(c for at, c in stamps if first + k * period_us <= at < first + (k + 1) * period_us)
        for k in range(whole)
    ]
    admitted = len(stamps)
    commands = {
        cmd: after.calls_since(before, cmd)
        for cmd in after.stats
        if cmd not in ("info",) and after.calls_since(before, cmd)
    }
    evalsha = commands.get("evalsha", 0)
    inner = sum(v for k, v in commands.items() if k not in ("evalsha", "eval", "script|load"))
    usec = sum(after.usec_since(before, cmd) for cmd in ("evalsha", "eval"))
    return {
        "rate": rate,
        "n": n,
        "period": period,
        "callers": callers,
        "seconds": seconds,
        "admitted": admitted,
        "refused": refused[0],
        "most_in_window": most_in_any_window(stamps, period_us),
        "used_per_period": used,
        "min_share": min(used) / n if used else None,
        "evalsha_per_admission": evalsha / admitted,
        "inner_per_admission": inner / admitted,
        "usec_per_admission": usec / admitted,
        "commands": commands,
    }


def rows_of(results: list[dict[str, Any]]) -> list[Row]:
    rows = []
    for r in results:
        who = f"limit() {r['rate']}, {r['callers']} callers"
        n = r["n"]
        share = r["min_share"]
        rows += [
            Row(
                "l",
                who,
                "most admitted in any window",
                str(r["most_in_window"]),
                f"{r['most_in_window'] / n:.0%} of N",
                f"N = {n}; {r['admitted']} admitted, {r['refused']} refused in {r['seconds']:g} s",
                f"<= N: {verdict(r['most_in_window'] <= n)}",
                r,
            ),
            Row(
                "l",
                who,
                "share of N used per period (least)",
                "-" if share is None else f"{share:.1%}",
                "-",
                "admissions per whole period from the first: "
                + ", ".join(map(str, r["used_per_period"])),
                f">= {USE_TARGET:.0%}: {verdict(share is not None and share >= USE_TARGET)}",
            ),
            Row(
                "l",
                who,
                "script calls / admission",
                f"{r['evalsha_per_admission']:.2f}",
                "-",
                "EVALSHA of limit.lua, refused checks included (one per wait)",
                "-",
            ),
            Row(
                "l",
                who,
                "commands run by the script / admission",
                f"{r['inner_per_admission']:.1f}",
                "-",
                "TIME, HMGET, HGET, ZRANGEBYSCORE, GET, ZADD, ... as INFO commandstats counts",
                "-",
            ),
            Row(
                "l",
                who,
                "server us / admission",
                f"{r['usec_per_admission']:.1f}",
                "-",
                "INFO commandstats usec of the script calls, over admissions",
                "-",
            ),
        ]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.limits",
        description=__doc__.split("\n", 1)[0] if __doc__ else None,
    )
    parser.add_argument("--redis-url", help="a loopback Redis (default: a private server)")
    parser.add_argument("--quick", action="store_true", help="shorter runs (about 10 s)")
    parser.add_argument("--callers", type=int, default=8, help="threads taking the limit")
    parser.add_argument("--out-dir", default=str(RESULTS), help="where the results go")
    parser.add_argument("--docs", default=str(DOCS), help="the page whose section is rewritten")
    args = parser.parse_args(argv)
    seconds = 4.0 if args.quick else 10.0
    with redis_target(args.redis_url) as (url, private):
        client = redis.Redis.from_url(url)
        leases = Leases(Celery("bench-limits", set_as_current=False), redis_url=url)
        machine = machine_info(client)
        results = [
            run_one(leases, client, rate, args.callers, seconds) for rate in ("10/s", "200/s")
        ]
        leases.store.close()
        client.close()
    rows = rows_of(results)
    where = "private server" if private else url
    head = (
        f"run: {machine['date']}, {machine['cpus']} cores, load {machine['load']}; "
        f"server {machine['server']} ({where}); python {machine['python']}"
    )
    print(head)
    print(render_text(rows))
    os.makedirs(args.out_dir, exist_ok=True)
    write_text(
        os.path.join(args.out_dir, "limits.md"),
        f"# Rate limit benchmark results\n\n{head}\n\n{render_markdown(rows)}\n",
    )
    write_json(os.path.join(args.out_dir, "limits.json"), {"machine": machine, "results": results})
    section = (
        f"{HEADING}\n\n_Written by `python -m bench.limits` ({machine['date']})._ Callers take "
        "one limit far faster than it admits; each admission is stamped with the Redis time "
        "the script admitted it at.\n\n"
        f"{render_markdown(rows)}\n"
    )
    replace_section(Path(args.docs), HEADING, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
