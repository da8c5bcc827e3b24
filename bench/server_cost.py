"""Server cost benchmark: where the Redis server's work in one hold() cycle goes, part by part.

    python -m bench.server_cost              # about 80 s on 2 cores; needs valgrind
    python -m bench.server_cost --quick      # about 70 s
    python -m bench.server_cost --help

It is a measurement, not a test: it prints what it measured and exits 0 (1 without valgrind).

A hold() cycle sends two script calls: acquire.lua (with the owner's home call, as every
grant of a lease whose ttl is at least the ttl setting sends it) and release.lua. Their keys
and arguments are made here by the library's own code (``_grants.acquire_call``,
``_releases.release_keys``, ``_releases.release_args``), so they are what hold() sends.
Each contender runs N cycles against a PRIVATE redis-server that runs under valgrind's
callgrind, and the server's instructions for N2 cycles less those for N1 cycles, over
N2 - N1, are its instructions per cycle: the same on every run, unlike server microseconds
on a shared VM. Only what runs within ``processInputBuffer`` is counted: parsing, the
commands and scripts themselves.

The contenders are the shipped scripts, the raw floor of the engine benchmark (SET NX PX,
then a compare-and-delete script), the two calls with bodies that only return (what the
calls and their keys and arguments cost), and the shipped scripts with one guarantee's work
taken out, each (never shipped: only measured, to say what each guarantee costs). The table
goes to stdout, ``bench/results/server_cost.{md,json}`` and the ``## Server work of a hold()
cycle`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import redis

from celery_leases import _grants, _releases, _scripts
from celery_leases._engine import LeaseEngine
from celery_leases._identity import Identity
from celery_leases._lease import Want
from celery_leases._redis_server import free_port
from celery_leases._registry import Entry
from celery_leases.config import resolve_settings
from tests.support.servers import ensure_server_binary

from ._common import Row, render_markdown, render_text, replace_section, write_json, write_text
from .engine import COMPARE_AND_DELETE

__all__ = ("main",)

HEADING: Final = "## Server work of a hold() cycle"
RESULTS: Final = Path(__file__).parent / "results"
DOCS: Final = Path(__file__).parents[1] / "docs" / "benchmarks.md"


@dataclass(frozen=True)
class Contender:
    key: str
    label: str
    acquire: str  # acquire.lua's source as sent, or "" for the raw floor
    release: str
    home: bool = True
    grace: bool = True  # the restart check's GET (restore_grace / restart_grace)


def without(source: str, part: str, replacement: str) -> str:
    """``source`` with ``part`` replaced (it must be there: a script that changed says so)."""
    if part not in source:
        raise SystemExit(f"bench.server_cost: the shipped script no longer has {part!r}")
    return source.replace(part, replacement, 1)


def contenders() -> list[Contender]:
    a, r = _scripts.ACQUIRE, _scripts.RELEASE
    queue_check = "redis.call('EXISTS', xkey, skey, wkey)"
    wake = (
        "if wake_head(wkey, ekey, clock, wprefix, trust, nil, token, hkey, hand, i, key, ckey,\n"
        "        entry) == 0 then"
    )
    return [
        Contender("floor", "raw floor (SET NX PX + CAD script)", "", COMPARE_AND_DELETE),
        Contender("shipped", "hold(): acquire.lua + release.lua", a, r),
        Contender("calls", "the two calls, bodies that only return", "return {1, 1}", "return {1}"),
        Contender("no_grace", "without the restart check (GET)", a, r, grace=False),
        Contender(
            "no_counter",
            "without the token counter (SET GET PX)",
            without(
                a,
                "local token, text = next_token(ckey, now_us, now_text, memory)",
                "local token, text = now_us, now_text",
            ),
            r,
        ),
        Contender(
            "no_registry",
            "without the owner registry (SADD, SREM)",
            without(a, "record_grants(KEYS[2], entries, ARGV[8])", ""),
            without(r, "listed = redis.call('SREM', KEYS[1], entry)", "listed = 1"),
        ),
        Contender("no_home", "without the home call (liveness ZADD GT)", a, r, home=False),
        Contender(
            "no_queue",
            "without the waiter queue (its EXISTS key, ZRANGE)",
            without(a, queue_check, "redis.call('EXISTS', xkey, skey)"),
            without(r, wake, "if true then"),
        ),
        Contender(
            "no_publish",
            "without the release channel's PUBLISH",
            a,
            without(r, "redis.call('PUBLISH', channel, token)", ""),
        ),
    ]


def cycles_runner(contender: Contender, prefix: str) -> Callable[[redis.Redis, int], None]:
    """What runs ``n`` cycles of ``contender`` on a client."""
    if not contender.acquire:

        def floor(client: redis.Redis, n: int) -> None:
            cad = client.register_script(contender.release)
            for i in range(n):
                token = f"{1796186147437216 + i} owner"
                client.set(f"{prefix}floor", token, nx=True, px=30_000)
                cad(keys=[f"{prefix}floor"], args=[token])

        return floor

    settings = resolve_settings(
        None,
        redis_url="redis://127.0.0.1:1/0",  # never connected: only key names and arguments
        key_prefix=prefix,
        restore_grace=None if contender.grace else 0.0,
    )
    engine = LeaseEngine(settings)
    ident = Identity("bench-server-cost", "inc", os.getpid())
    ttl = settings.ttl

    def run(client: redis.Redis, n: int) -> None:
        # as in hold(): the registry's expiry is sent once, then known to be long enough
        engine.registry_until[(ident.owner, 0)] = time.monotonic() + 4 * ttl
        acquire = client.script_load(contender.acquire)
        release = client.script_load(contender.release)
        want = Want("res")
        for _ in range(n):
            call = _grants.acquire_call(engine, 0, [want], ident, ttl, contender.home)
            reply = client.evalsha(acquire, len(call.keys), *call.keys, *call.args)
            token = int(reply[1])
            entry = Entry("x", token, None, "res")
            keys = _releases.release_keys(engine, ident.owner, 0, [entry])
            args = _releases.release_args(engine, ident.owner, [entry])
            client.evalsha(release, len(keys), *keys, *args)
            if contender.key == "calls":
                client.delete(engine.resource_keys("res").exclusive)  # as the others' release

    return run


def server_instructions(run: Callable[[redis.Redis, int], None], n: int) -> int:
    """Instructions a callgrind-run redis-server executes in all, with ``run(client, n)``."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-server-cost-") as tmp:
        out = Path(tmp) / "callgrind.out"
        proc = subprocess.Popen(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                # only the commands' own work: not the timer's (it runs by the clock, and
                # under valgrind a cycle takes milliseconds), nor the socket writes
                "--toggle-collect=processInputBuffer",
                ensure_server_binary(),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=port, socket_timeout=120)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    proc.kill()
                    msg = "bench.server_cost: redis-server under valgrind never answered"
                    raise SystemExit(msg) from None
                time.sleep(0.1)
        try:
            run(client, n)
        finally:
            with contextlib.suppress(redis.ConnectionError):  # the shutdown closes it
                client.shutdown(nosave=True)
            proc.wait(120)
        match = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.M)
        if match is None:
            raise SystemExit("bench.server_cost: callgrind wrote no total")
        return int(match.group(1))


def per_cycle(contender: Contender, small: int, large: int) -> float:
    run = cycles_runner(contender, f"bench-sc-{contender.key}")
    return (server_instructions(run, large) - server_instructions(run, small)) / (large - small)


def rows_of(results: dict[str, float], labels: dict[str, str]) -> list[Row]:
    shipped, floor = results["shipped"], results["floor"]
    rows = []
    for key, value in results.items():
        if key in ("floor", "shipped", "calls"):
            ratio = f"{value / floor:.2f}x floor"
            details = {
                "floor": "SET NX PX, then EVALSHA of the compare-and-delete script",
                "shipped": "EVALSHA acquire.lua (home call), EVALSHA release.lua",
                "calls": "the same keys and arguments: what the calls cost before any work",
            }[key]
        else:
            ratio = f"-{shipped - value:,.0f} ({(shipped - value) / shipped:.0%})"
            details = "the shipped cycle less this part"
        rows.append(
            Row(
                "s",
                labels[key],
                "server instructions / cycle",
                f"{value:,.0f}",
                ratio,
                details,
                "-",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.server_cost",
        description=__doc__.split("\n", 1)[0] if __doc__ else None,
    )
    parser.add_argument("--quick", action="store_true", help="fewer cycles (about 1 min)")
    parser.add_argument("--cycles", type=int, default=0, help="the larger run's cycles")
    parser.add_argument("--out-dir", default=str(RESULTS), help="where the results go")
    parser.add_argument("--docs", default=str(DOCS), help="the page whose section is rewritten")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("bench.server_cost: needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 1
    large = args.cycles or (300 if args.quick else 600)
    small = max(large // 6, 20)
    every = contenders()
    labels = {c.key: c.label for c in every}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        values = list(pool.map(lambda c: per_cycle(c, small, large), every))
    results = dict(zip(labels, values, strict=True))
    rows = rows_of(results, labels)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    head = (
        f"run: {when}, server instructions for {large} cycles less those for {small}, "
        f"callgrind on {ensure_server_binary()}"
    )
    print(head)
    print(render_text(rows))
    os.makedirs(args.out_dir, exist_ok=True)
    md = f"{head}\n\n{render_markdown(rows)}\n"
    write_text(os.path.join(args.out_dir, "server_cost.md"), md)
    write_json(
        os.path.join(args.out_dir, "server_cost.json"),
        {"run": head, "instructions_per_cycle": results, "labels": labels},
    )
    section = (
        f"{HEADING}\n\n_Written by `python -m bench.server_cost` ({when})._\n\n"
        f"{render_markdown(rows)}\n"
    )
    replace_section(Path(args.docs), HEADING, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
