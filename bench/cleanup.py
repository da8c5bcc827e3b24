"""Cleanup benchmark: start-up cleanup and reconcile cost versus leases held and keyspace size.

    python -m bench.cleanup                    # both axes, 7 repeats; about 1-2 min on 2 cores
    python -m bench.cleanup --quick            # 3 repeats, up to 1,000 leases and 100,000 keys
    python -m bench.cleanup --only leases      # one axis: leases or keys
    python -m bench.cleanup --help

It is a benchmark, not a test: it prints ratios against a baseline measured in the same run,
marks its targets PASS or MISS, and exits 0 either way.

A dead predecessor (one owner: node ``pod-N``, an earlier incarnation) holds N exclusive leases
beside K unrelated keys. Contenders, each on a fresh set-up, in rotating order per repeat:

- ``cleanup_node``: the start-up cleanup a worker runs at ``worker_ready`` (the node's owner
  set, then each earlier incarnation's registry, its release, forgetting the owner);
- ``cleanup_owner``: the same for one known owner (the dead-child reaper's path);
- ``reconcile``: the periodic pass, once that owner's liveness has run out;
- baseline ``SCAN``: what cleanup code without an owner registry does: ``SCAN MATCH
  <prefix's lease keys> COUNT 1000`` over the whole keyspace, ``GET`` each match (pipelined per
  page) and a compare-and-delete script (pipelined) for those of the dead owner.

Axes: (L) N = 1, 10, 100, 1,000, 10,000 at K = 10,000; (K) K = 100, 10,000, 100,000, 1,000,000
at N = 100. The unrelated keys are made with ``DEBUG POPULATE`` (pipelined ``MSET`` when the
server refuses DEBUG) on a PRIVATE redis-server that the benchmark starts and stops; it never
runs against a shared server. Measured: wall time (median of the repeats), the commands the
server ran (INFO commandstats deltas, those run inside Lua scripts included; exact), SCAN calls,
and client round trips. The table goes to stdout, ``bench/results/cleanup.{md,json}``, the
``## Cleanup and reconcile cost`` section of ``docs/benchmarks.md``, and the plot
``docs/img/bench-cleanup.svg``.
"""

from __future__ import annotations

import argparse
import math
import secrets
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import redis

from celery_leases._cleanup import _RELEASE_BATCH
from celery_leases._identity import Identity
from celery_leases._lease import Want
from celery_leases._redis_server import RedisServer
from celery_leases._sync.driver import LeaseStore
from celery_leases.config import resolve_settings
from tests.support.servers import ensure_server_binary

from . import plot
from ._common import (
    WriteCounter,
    machine_info,
    median,
    replace_section,
    write_json,
    write_text,
)

REPO: Final = Path(__file__).resolve().parents[1]
RESULTS_DIR: Final = REPO / "bench" / "results"
DOCS: Final = REPO / "docs" / "benchmarks.md"
SECTION: Final = "## Cleanup and reconcile cost"
ACQUIRE_BATCH: Final = 1000  # resources per set-up acquire call
LEASE_TTL: Final = 600.0  # the dead owner's leases outlive the run
LIVENESS: Final = 0.05  # the dead owner's liveness (settings.ttl of its store), seconds
UNRELATED: Final = "unrelated"

NODE_CLEANUP: Final = "cleanup_node"
OWNER_CLEANUP: Final = "cleanup_owner"
RECONCILE: Final = "reconcile"
SCAN: Final = "scan"
CONTENDERS: Final = (NODE_CLEANUP, OWNER_CLEANUP, RECONCILE, SCAN)
LABELS: Final = {
    NODE_CLEANUP: "start-up cleanup (cleanup_node)",
    OWNER_CLEANUP: "cleanup_owner",
    RECONCILE: "reconcile",
    SCAN: "baseline: SCAN the keyspace",
}

#: the baseline's release: delete the key only if it still names the dead holder
COMPARE_AND_DELETE: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def progress(message: str) -> None:
    print(f"[bench.cleanup] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Config:
    leases: tuple[int, ...]
    keys: tuple[int, ...]
    base_keys: int  # keyspace of the leases axis
    base_leases: int  # leases of the keyspace axis
    repeats: int
    slot_groups: int
    only: str

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Config:
        quick = bool(args.quick)
        leases = tuple(args.leases or ((1, 10, 100, 1000) if quick else (1, 10, 100, 1000, 10_000)))
        keys = tuple(
            args.keys or ((100, 10_000, 100_000) if quick else (100, 10_000, 100_000, 1_000_000))
        )
        for name, values in (("--leases", leases), ("--keys", keys)):
            if any(v < 1 for v in values) or list(values) != sorted(set(values)):
                raise SystemExit(f"{name} must be ascending positive numbers, not {values}")
        if args.only not in ("both", "leases", "keys"):
            raise SystemExit(f"--only must be both, leases or keys, not {args.only!r}")
        repeats = args.repeats or (3 if quick else 7)
        if repeats < 1 or args.slot_groups < 1 or args.base_keys < 0 or args.base_leases < 1:
            raise SystemExit("--repeats, --slot-groups and --base-leases must be >= 1")
        return cls(
            leases=leases,
            keys=keys,
            base_keys=args.base_keys,
            base_leases=args.base_leases,
            repeats=repeats,
            slot_groups=args.slot_groups,
            only=args.only,
        )


# --- the Redis under test -----------------------------------------------------------------------
@contextmanager
def debug_server() -> Iterator[RedisServer]:
    """A private server that accepts DEBUG from loopback, if the binary knows that option."""
    binary = ensure_server_binary()
    server = RedisServer(binary=binary, extra_args=["--enable-debug-command", "local"])
    try:
        server.start()
    except RuntimeError:  # redis 6 has no enable-debug-command (DEBUG is always on there)
        server = RedisServer(binary=binary)
        server.start()
    try:
        yield server
    finally:
        server.stop()


def populate(admin: redis.Redis, total: int) -> str:
    """Make ``unrelated:0`` .. ``unrelated:<total - 1>`` exist; returns how."""
    try:
        admin.execute_command("DEBUG", "POPULATE", total, UNRELATED, 16)  # type: ignore[no-untyped-call]
        return "DEBUG POPULATE"
    except redis.ResponseError:
        pass
    for start in range(0, total, 10_000):
        pipe = admin.pipeline(transaction=False)
        pipe.mset({f"{UNRELATED}:{i}": "x" * 16 for i in range(start, min(total, start + 10_000))})
        pipe.execute()
    return "pipelined MSET"


class Counts:
    """Commands the server ran between two snapshots (the measuring client's own left out)."""

    def __init__(self, admin: redis.Redis) -> None:
        self.admin = admin

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """command -> (calls, usec) so far."""
        stats = self.admin.info("commandstats")
        return {
            str(k).removeprefix("cmdstat_"): (int(v.get("calls", 0)), int(v.get("usec", 0)))
            for k, v in stats.items()
            if isinstance(v, dict)
        }

    @staticmethod
    def delta(
        before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
    ) -> tuple[dict[str, int], int]:
        """Calls per command, and the server time (usec) they took, between two snapshots."""
        calls: dict[str, int] = {}
        usec = 0
        for name, (n, us) in after.items():
            if name in ("info", "config", "dbsize"):
                continue
            n0, us0 = before.get(name, (0, 0))
            if n - n0:
                calls[name] = n - n0
                usec += us - us0
        return calls, usec


# --- set-up and contenders ----------------------------------------------------------------------
class Bench:
    def __init__(self, cfg: Config, url: str, prefix: str) -> None:
        self.cfg = cfg
        self.prefix = prefix
        self.admin = redis.Redis.from_url(url, decode_responses=True)
        self.counts = Counts(self.admin)
        self.store = self._store(url, ttl=30.0)
        # the dead owner's process: a liveness of 50 ms, so a reconcile may take it soon after
        self.dead_store = self._store(url, ttl=LIVENESS)
        self.client = redis.Redis.from_url(url, decode_responses=True)  # the baseline's
        self.cad = self.client.register_script(COMPARE_AND_DELETE)
        self.serial = 0
        for s in (self.store, self.dead_store):
            s.load_scripts()
            # a script call opens this thread's own connection for them (_lanes), with its
            # set-up (HELLO, CLIENT SETNAME, the restart check): before anything is counted
            s.expired_owners(1)
        self.client.script_load(COMPARE_AND_DELETE)
        self.client.ping()

    def _store(self, url: str, ttl: float) -> LeaseStore:
        settings = resolve_settings(
            None, redis_url=url, key_prefix=self.prefix, slot_groups=self.cfg.slot_groups, ttl=ttl
        )
        return LeaseStore(settings)

    def close(self) -> None:
        for s in (self.store, self.dead_store):
            s.close()
        self.client.close()
        self.admin.close()

    def setup(self, n: int, *, expire: bool) -> Identity:
        """A new dead owner holding ``n`` exclusive leases; with ``expire``, past its liveness."""
        self.serial += 1
        ident = Identity(f"pod-{self.serial}", "dead", 1)
        names = [f"job:{self.serial}:{i}" for i in range(n)]
        for start in range(0, n, ACQUIRE_BATCH):
            wants = [Want(name) for name in names[start : start + ACQUIRE_BATCH]]
            held = self.dead_store.try_acquire(wants, ident, LEASE_TTL)
            if not isinstance(held, list):
                raise RuntimeError(f"set-up: {held.resource} was busy")
        if expire:
            deadline = time.monotonic() + 10
            while ident.owner not in self.store.expired_owners():
                if time.monotonic() > deadline:
                    raise RuntimeError("set-up: the dead owner's liveness never ran out")
                time.sleep(LIVENESS / 2)
        return ident

    def check_freed(self, ident: Identity, n: int) -> None:
        """Every lease of the dead owner is free again, or the contender did not do its job."""
        sample = {0, n // 2, n - 1}
        for i in sample:
            if self.store.holders(f"job:{self.serial}:{i}"):
                raise RuntimeError(f"job:{self.serial}:{i} of {ident.owner} is still held")

    def run(self, contender: str, n: int) -> dict[str, Any]:
        """Set up, then measure one contender once: seconds, commands, round trips."""
        ident = self.setup(n, expire=contender == RECONCILE)
        action = self._action(contender, ident)
        dbsize = self.admin.dbsize()
        with WriteCounter() as writes:
            before = self.counts.snapshot()
            w0 = writes.of_thread()
            t0 = time.perf_counter()
            released = action()
            seconds = time.perf_counter() - t0
            w1 = writes.of_thread()
            after = self.counts.snapshot()
        if released != n:
            raise RuntimeError(f"{contender} released {released} of {n} leases")
        self.check_freed(ident, n)
        self.tidy(ident, n, registry=contender == SCAN)
        commands, usec = Counts.delta(before, after)
        return {
            "seconds": seconds,
            "dbsize": dbsize,
            "server_us": usec,
            "commands": sum(commands.values()),
            "by_command": commands,
            "scan_calls": commands.get("scan", 0) + commands.get("keys", 0),
            "round_trips": w1 - w0,
        }

    def tidy(self, ident: Identity, n: int, *, registry: bool) -> None:
        """Unmeasured: drop what a pass leaves by design, so the keyspace stays as sized.

        The token counters outlive their leases (a day), and the baseline leaves the
        registry and the owner's entries, which it knows nothing of.
        """
        if registry:
            self.store.cleanup_owner(ident.owner, dead=True)
        keys = self.store.keys
        for start in range(0, n, ACQUIRE_BATCH):
            names = [f"job:{self.serial}:{i}" for i in range(start, min(n, start + ACQUIRE_BATCH))]
            self.admin.unlink(*(keys.counter(name) for name in names))

    def _action(self, contender: str, ident: Identity) -> Callable[[], int]:
        store = self.store
        if contender == NODE_CLEANUP:
            return lambda: len(store.cleanup_node(ident.node, keep_incarnation="new").released)
        if contender == OWNER_CLEANUP:
            return lambda: len(store.cleanup_owner(ident.owner, dead=True).released)
        if contender == RECONCILE:
            return lambda: len(store.reconcile().released)
        return lambda: self.scan_cleanup(ident.owner)

    def scan_cleanup(self, owner: str) -> int:
        """The baseline: find the dead owner's leases by SCANning the keyspace."""
        pattern = f"{{{self.prefix}:*}}:x:*"
        client, freed = self.client, 0
        cursor = 0
        while True:
            cursor, keys = client.scan(cursor, match=pattern, count=1000)
            if keys:
                pipe = client.pipeline(transaction=False)
                for key in keys:
                    pipe.get(key)
                mine = [
                    (key, value)
                    for key, value in zip(keys, pipe.execute(), strict=True)
                    if value is not None and value.split(" ", 1)[1] == owner
                ]
                if mine:
                    pipe = client.pipeline(transaction=False)
                    for key, value in mine:
                        self.cad(keys=[key], args=[value], client=pipe)
                    freed += sum(int(x) for x in pipe.execute())
            if cursor == 0:
                return freed


# --- the run ------------------------------------------------------------------------------------
def rotated(items: Sequence[str], by: int) -> list[str]:
    by %= len(items)
    return [*items[by:], *items[:by]]


def measure_point(bench: Bench, n: int, repeats: int, what: str) -> dict[str, Any]:
    samples: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
    for rep in range(repeats):
        for contender in rotated(CONTENDERS, rep):
            samples[contender].append(bench.run(contender, n))
    out: dict[str, Any] = {"dbsize": samples[NODE_CLEANUP][0]["dbsize"]}
    for c, runs in samples.items():
        commands = sorted({r["commands"] for r in runs})
        out[c] = {
            "seconds": [r["seconds"] for r in runs],
            "ms": median([r["seconds"] for r in runs]) * 1000,
            "commands": median([float(r["commands"]) for r in runs]),
            "commands_range": [commands[0], commands[-1]],
            "by_command": runs[0]["by_command"],
            "server_us": median([float(r["server_us"]) for r in runs]),
            "scan_calls": median([float(r["scan_calls"]) for r in runs]),
            "round_trips": median([float(r["round_trips"]) for r in runs]),
        }
    summary = ", ".join(f"{c} {out[c]['ms']:.2f} ms" for c in CONTENDERS)
    progress(f"{what}: {summary}")
    return out


def bench_all(cfg: Config, bench: Bench) -> tuple[dict[int, Any], dict[int, Any], str]:
    """Both axes, in ascending keyspace size (populating only ever adds keys)."""
    leases_axis: dict[int, Any] = {}
    keys_axis: dict[int, Any] = {}
    sizes = set()
    if cfg.only in ("both", "leases"):
        sizes.add(cfg.base_keys)
    if cfg.only in ("both", "keys"):
        sizes.update(cfg.keys)
    how = "none"
    for size in sorted(sizes):
        if size:
            how = populate(bench.admin, size)
        if cfg.only in ("both", "keys") and size in cfg.keys:
            keys_axis[size] = measure_point(
                bench, cfg.base_leases, cfg.repeats, f"{size:,} keys, {cfg.base_leases} leases"
            )
        if cfg.only in ("both", "leases") and size == cfg.base_keys:
            for n in cfg.leases:
                leases_axis[n] = measure_point(
                    bench, n, cfg.repeats, f"{n:,} leases, {size:,} keys"
                )
    return leases_axis, keys_axis, how


# --- output -------------------------------------------------------------------------------------
def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def targets(cfg: Config, leases_axis: dict[int, Any], keys_axis: dict[int, Any]) -> list[str]:
    """The claims, checked on exact command counts (times are shown, never judged)."""
    out = []
    ours = (NODE_CLEANUP, OWNER_CLEANUP, RECONCILE)
    points = [*leases_axis.values(), *keys_axis.values()]
    no_scan = all(p[c]["scan_calls"] == 0 for p in points for c in ours)
    out.append(f"no SCAN or KEYS in cleanup_node, cleanup_owner, reconcile: {verdict(no_scan)}")
    if keys_axis:
        flat = all(
            len({tuple(keys_axis[k][c]["commands_range"]) for k in keys_axis}) == 1 for c in ours
        )
        out.append("same commands at every keyspace size (flat in the keyspace): " + verdict(flat))
    if len(leases_axis) >= 2:
        # O(leases held): commands = a * N + b, on the line through the two largest N, once
        # the release calls' own count is taken out: one script call per batch of
        # _RELEASE_BATCH leases, a step every _RELEASE_BATCH (exact with one slot group; a
        # group holding none of the leases skips its release call, so with more groups a
        # point may lie up to slot_groups - 1 commands below that line)
        ns = sorted(leases_axis)
        slack = cfg.slot_groups - 1 + 0.5

        def commands(n: int, c: str) -> float:
            return float(leases_axis[n][c]["commands"]) - math.ceil(n / _RELEASE_BATCH)

        linear = True
        for c in ours:
            n0, n1 = ns[-2], ns[-1]
            c0, c1 = commands(n0, c), commands(n1, c)
            slope = (c1 - c0) / (n1 - n0)
            for n in ns:
                off = commands(n, c) - (c1 - slope * (n1 - n))
                linear &= -slack < off < 0.5
        out.append(
            "commands grow linearly with the leases held (a * N + b, and one release call per "
            f"{_RELEASE_BATCH} leases): {verdict(linear)}"
        )
    return out


def _ms(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}" if value < 10 else f"{value:.1f}"


def tables(axis: dict[int, Any], what: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """Two tables for one axis: wall time, and the Redis work behind it."""
    time_heads = [what, "keys in Redis", *(f"{LABELS[c]} ms" for c in CONTENDERS)]
    time_heads.append("start-up cleanup / SCAN")
    work_heads = [what, *(f"{LABELS[c]}" for c in CONTENDERS), "start-up cleanup / SCAN"]
    time_rows, work_rows = [], []
    for x in sorted(axis):
        p = axis[x]
        ours, scan = p[NODE_CLEANUP], p[SCAN]
        time_rows.append(
            [
                f"{x:,}",
                f"{p['dbsize']:,}",
                *(_ms(p[c]["ms"]) for c in CONTENDERS),
                f"{ours['ms'] / scan['ms']:.3f}x",
            ]
        )
        cells = [f"{x:,}"]
        for c in CONTENDERS:
            d = p[c]
            scans = f", {d['scan_calls']:.0f} SCAN" if d["scan_calls"] else ""
            cells.append(
                f"{d['commands']:,.0f} cmds, {d['server_us']:,.0f} us, "
                f"{d['round_trips']:.0f} RT{scans}"
            )
        cells.append(
            f"{ours['commands'] / scan['commands']:.2f}x cmds, "
            f"{ours['server_us'] / scan['server_us']:.3f}x us"
        )
        work_rows.append(cells)
    return [
        ("time, ms (median)", time_heads, time_rows),
        ("Redis work: commands run, server time, client round trips (median)", work_heads,
         work_rows),
    ]  # fmt: skip


def render(heads: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    table = [heads, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(heads))]
    text = []
    for k, r in enumerate(table):
        text.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if k == 0:
            text.append("  ".join("-" * w for w in widths))
    return "\n".join(text)


def header(machine: dict[str, Any], cfg: Config, how: str, elapsed: float) -> list[str]:
    return [
        f"machine: {machine['cpus']} cores, {machine['cpu_model']}; {machine['platform']}; "
        f"load {machine['load']} at start",
        f"python {machine['python']}, redis-py {machine['redis_py']}, "
        f"server {machine['server']} (private)",
        f"run: {cfg.repeats} repeats per point, slot_groups {cfg.slot_groups}; leases axis at "
        f"{cfg.base_keys:,} unrelated keys, keyspace axis with {cfg.base_leases} leases; keys "
        f"made with {how}; {elapsed:.0f} s, {machine['date']}",
    ]


LEGEND: Final = (
    "ms = median wall time of one pass; keys in Redis = DBSIZE at the start of a pass (the "
    "unrelated keys, the dead owner's leases, token counters and registry); cmds = the commands "
    "the server ran for the pass (INFO commandstats; those run inside Lua scripts included; "
    "exact); us = their server time (commandstats usec: a SCAN call that walks 1,000 keys "
    "counts as one command but costs its time here); RT = client round trips (a pipeline counts "
    "once). The last column divides the start-up cleanup's numbers by the SCAN baseline's."
)

ABOUT: Final = (
    "`scripts/bench cleanup` (`python -m bench.cleanup`; `--quick` for a short run) measures "
    "what freeing a dead predecessor's leases costs. A dead owner (an earlier incarnation of "
    "node `pod-N`) holds N exclusive leases beside K unrelated keys, on a private redis-server "
    "(the unrelated keys made with `DEBUG POPULATE`). Contenders, each on a fresh set-up, in "
    "rotating order: the start-up cleanup a restarted worker runs "
    "(`cleanup_node(node, keep_incarnation=new)`), `cleanup_owner(owner, dead=True)` (the "
    "reaper's path), `reconcile()` once the owner's liveness ran out, and the baseline: what "
    "cleanup without an owner registry does, `SCAN MATCH <prefix lease keys> COUNT 1000` over "
    "the keyspace, a pipelined `GET` of each match and a pipelined compare-and-delete of the "
    "dead owner's. Every contender is checked to have freed all N leases. Two axes: N = 1 to "
    "10,000 at K = 10,000, and K = 100 to 1,000,000 at N = 100. Commands are exact (INFO "
    "commandstats on the private server), times the median of 7 repeats."
)


def docs_section(body: str) -> str:
    about = textwrap.fill(ABOUT, 100, break_on_hyphens=False, break_long_words=False)
    return "\n".join(
        [SECTION, "", about, "", "![Cleanup and reconcile cost](img/bench-cleanup.svg)", "", body]
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        try:
            return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not a comma-separated list of integers: {text!r}"
            ) from None

    parser = argparse.ArgumentParser(
        prog="python -m bench.cleanup",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="3 repeats, smaller maxima")
    parser.add_argument("--only", default="both", help="both (default), leases or keys")
    parser.add_argument("--leases", type=ints, default=None, help="leases axis, e.g. 1,10,100")
    parser.add_argument("--keys", type=ints, default=None, help="keyspace axis, e.g. 100,10000")
    parser.add_argument(
        "--base-keys", type=int, default=10_000, help="unrelated keys on the leases axis"
    )
    parser.add_argument("--base-leases", type=int, default=100, help="leases on the keys axis")
    parser.add_argument("--repeats", type=int, default=0, help="repeats per point (default 7)")
    parser.add_argument("--slot-groups", type=int, default=1, help="slot_groups setting")
    parser.add_argument("--out-dir", default=str(RESULTS_DIR), help="where cleanup.json goes")
    parser.add_argument("--docs", default=str(DOCS), help="the docs page to update")
    parser.add_argument("--no-docs", action="store_true", help="do not touch the docs page")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config.from_args(args)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = f"bench-cleanup-{secrets.token_hex(4)}"
    started = time.monotonic()
    with debug_server() as server:
        progress(f"private redis-server at {server.url}")
        bench = Bench(cfg, server.url, prefix)
        try:
            machine = machine_info(bench.admin)
            leases_axis, keys_axis, how = bench_all(cfg, bench)
        finally:
            bench.close()
    elapsed = time.monotonic() - started
    head = header(machine, cfg, how, elapsed)
    checks = targets(cfg, leases_axis, keys_axis)
    parts: list[tuple[str, list[tuple[str, list[str], list[list[str]]]]]] = []
    if leases_axis:
        parts.append(("Versus leases held", tables(leases_axis, "leases held")))
    if keys_axis:
        parts.append(("Versus keyspace size", tables(keys_axis, "unrelated keys")))
    print("\n".join(head))
    for title, tabs in parts:
        for sub, heads, rows in tabs:
            print(f"\n{title}, {sub}:\n{render(heads, rows, markdown=False)}")
    print()
    print("\n".join(f"target: {c}" for c in checks))
    print(LEGEND)
    body_lines = [*(f"- {line}" for line in head), ""]
    for title, tabs in parts:
        for sub, heads, rows in tabs:
            body_lines += [f"**{title}, {sub}:**", "", render(heads, rows, markdown=True), ""]
    body_lines += [*(f"- target: {c}" for c in checks), "", LEGEND, ""]
    body = "\n".join(body_lines)
    write_text(str(out_dir / "cleanup.md"), "# Cleanup benchmark results\n\n" + body)
    write_json(
        str(out_dir / "cleanup.json"),
        {
            "machine": machine,
            "config": asdict(cfg),
            "populated_with": how,
            "elapsed_s": elapsed,
            "leases": {str(k): v for k, v in leases_axis.items()},
            "keys": {str(k): v for k, v in keys_axis.items()},
            "targets": checks,
            "labels": LABELS,
        },
    )
    if not args.no_docs:
        replace_section(Path(args.docs), SECTION, docs_section(body))
    progress(f"wrote {out_dir / 'cleanup.json'}" + ("" if args.no_docs else f" and {args.docs}"))
    plot.refresh(out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
