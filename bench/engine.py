"""Engine benchmark: celery_leases against a raw floor, redis-py's Lock and python-redis-lock.

    scripts/bench                 # default run, about 80 s on 2 cores
    scripts/bench --quick         # about 30 s
    scripts/bench --profile       # also cProfile hold() cycles and print where the time goes
    python -m bench.engine --help

It is a benchmark, not a test: it prints ratios against a baseline measured in the same run,
in rounds that interleave the contenders against the same Redis (so noise hits all of them
alike), marks each target PASS or MISS, and exits 0 either way. By default it starts a private
redis-server on a free loopback port, so INFO commandstats counts our commands only.

(a) uncontended acquire+release cycles/s from one thread, and client round trips per cycle;
    its asyncio rows: ahold() against the same floor on redis.asyncio, and its Lock
(b) handoff delay: a holder in another process releases, a blocked waiter here takes over
(c) heartbeat cost: Redis calls per second while one process holds 1, 10, 100, 1000 leases
(d) waiter queues: 1, 10, 100, 1000 waiters (threads of this process) on one resource; per
    release the server's commands and time, the handoff delay, and FIFO order (overtaken)

The table goes to stdout, bench/results/engine.md and bench/results/engine.json; the plot
docs/img/benchmarks.svg is redrawn from them (bench/plot.py, best effort).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import itertools
import multiprocessing
import pstats
import random
import secrets
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Final

import redis
import redis.asyncio as aredis
import redis_lock
from celery import Celery

from celery_leases import LeaseLost, Leases, Shared, _grants, _releases
from celery_leases._lease import Want
from celery_leases._protocol import Script, words_of
from celery_leases._registry import Entry
from celery_leases._sync.heartbeat import heartbeat
from celery_leases._wire import pack

from . import plot
from ._common import (
    CommandStats,
    Row,
    WriteCounter,
    format_rate,
    machine_info,
    median,
    percentile,
    redis_target,
    render_markdown,
    render_text,
    timed,
    write_json,
    write_text,
)

RESULTS_DIR: Final = Path(__file__).resolve().parent / "results"
HEARTBEAT_THREAD: Final = "celery-leases-heartbeat"

#: the floor's release: delete the key only if it still holds our token
COMPARE_AND_DELETE: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

LEGEND: Final = (
    "RT = client round trips (redis-py socket writes of the measuring thread; (c): of the "
    "heartbeat thread). server = INFO commandstats usec of the commands the client sent "
    "(private server only). Ratios compare medians measured in the same run."
)

# targets
CYCLE_RATIO_TARGET: Final = 0.95  # hold() >= 0.95x the raw floor
CYCLE_ROUND_TRIPS_TARGET: Final = 2.0  # and 2 round trips per acquire+release
ACYCLE_RATIO_TARGET: Final = 0.95  # ahold() >= 0.95x the raw floor on redis.asyncio
FLAT_TOLERANCE: Final = 0.1  # heartbeat calls/s within +-10% of the 1-lease case

# the contenders' keys, in table order
HOLD: Final = "hold"
HOLD_HISTORY: Final = "hold-history"
#: the history setting of the "history on" row (entries kept per slot group)
BENCH_HISTORY: Final = 10_000
FLOOR: Final = "floor"
REDIS_PY: Final = "redis-py"
PRL: Final = "prl"
BARE: Final = "bare"
CALLS: Final = "hold-calls"
LABELS: Final = {
    HOLD: "celery_leases hold()",
    FLOOR: "raw floor (SET NX PX + CAD script)",
    BARE: "two bare round trips (the floor's, on one connection)",
    CALLS: "hold()'s two script calls, sent bare (no library code)",
    REDIS_PY: "redis-py Lock",
    PRL: "python-redis-lock",
    HOLD_HISTORY: f"celery_leases hold(), history on ({BENCH_HISTORY:,} kept)",
}
# the asyncio contenders of (a)
AHOLD: Final = "ahold"
AFLOOR: Final = "afloor"
AREDIS_PY: Final = "aredis-py"
ALABELS: Final = {
    AHOLD: "celery_leases ahold()",
    AFLOOR: "asyncio floor (SET NX PX + CAD script)",
    AREDIS_PY: "redis.asyncio Lock",
}
WAIT_LABELS: Final = {
    HOLD: "celery_leases hold(wait=10)",
    PRL: "python-redis-lock (BLPOP)",
    REDIS_PY: "redis-py Lock (poll 0.1 s)",
}


@dataclass(frozen=True)
class Config:
    rounds: int
    cycles: int
    slice_cycles: int
    warmup: int
    count_cycles: int
    handoffs: int
    hold_before_release: float
    release_jitter: float
    window: float
    counts: tuple[int, ...]
    seed: int
    waiters: tuple[int, ...] = (1, 10, 100, 1000)
    chains: int = 1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Config:
        quick = bool(args.quick)
        return cls(
            rounds=args.rounds or (5 if quick else 7),
            cycles=args.cycles or (1000 if quick else 4000),
            slice_cycles=100 if quick else 200,
            warmup=100 if quick else 300,
            count_cycles=100 if quick else 300,
            handoffs=args.handoffs or (12 if quick else 50),
            hold_before_release=0.05,
            release_jitter=0.1,
            window=args.window or (2.0 if quick else 6.0),
            counts=tuple(args.counts),
            seed=args.seed,
            waiters=tuple(args.waiters),
            chains=args.chains or (1 if quick else 3),
        )


def progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def make_leases(url: str, prefix: str, **settings: Any) -> Leases:
    app = Celery("bench", broker=url, set_as_current=False)
    return Leases(app, redis_url=url, key_prefix=prefix, **settings)


# --- (a) uncontended cycles ---------------------------------------------------------------------
@dataclass(frozen=True)
class CycleContender:
    key: str
    cycle: Callable[[], None]
    #: commands the client itself sends (INFO commandstats also counts those inside scripts)
    top_level: tuple[str, ...]


def cycle_contenders(
    url: str, leases: Leases, run_id: str, history_leases: Leases | None = None
) -> list[CycleContender]:
    def name(key: str) -> str:
        return f"bench:{run_id}:a:{key}"

    hold_name = name(HOLD)

    def hold_cycle() -> None:
        with leases.hold(hold_name, ttl=30.0):
            pass

    history_name = name(HOLD_HISTORY)
    with_history = history_leases or leases

    def hold_history_cycle() -> None:
        with with_history.hold(history_name, ttl=30.0):
            pass

    floor_client = redis.Redis.from_url(url)
    compare_and_delete = floor_client.register_script(COMPARE_AND_DELETE)
    floor_key = name(FLOOR)
    tokens = itertools.count(1)

    def floor_cycle() -> None:
        token = str(next(tokens))
        if not floor_client.set(floor_key, token, nx=True, px=30_000):
            raise RuntimeError(f"raw floor: {floor_key} was not free")
        if compare_and_delete(keys=[floor_key], args=[token]) != 1:
            raise RuntimeError(f"raw floor: {floor_key} was not ours at release")

    # the floor's two commands written and read on one connection, without redis-py's
    # per-command machinery: the physical floor of an acquire and a release from Python
    bare_pool = redis.Redis.from_url(url).connection_pool
    bare_conn = bare_pool.get_connection()
    bare_key = name(BARE)
    cad_sha = compare_and_delete.sha

    def bare_cycle() -> None:
        token = str(next(tokens))
        conn: Any = bare_conn  # redis-py's Connection methods are untyped
        conn.send_packed_command(conn.pack_command("SET", bare_key, token, "NX", "PX", 30_000))
        if conn.read_response() is None:
            raise RuntimeError(f"bare round trips: {bare_key} was not free")
        conn.send_packed_command(conn.pack_command("EVALSHA", cad_sha, 1, bare_key, token))
        if conn.read_response() != 1:
            raise RuntimeError(f"bare round trips: {bare_key} was not ours at release")

    calls_cycle = hold_calls_cycle(url, leases, name(CALLS))

    rpy_client = redis.Redis.from_url(url)
    rpy_name = name(REDIS_PY)

    def rpy_cycle() -> None:
        lock = rpy_client.lock(rpy_name, timeout=30)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"redis-py Lock: {rpy_name} was not free")
        lock.release()

    prl_client = redis.Redis.from_url(url)
    prl_name = name(PRL)

    def prl_cycle() -> None:
        lock = redis_lock.Lock(prl_client, prl_name, expire=30)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"python-redis-lock: {prl_name} was not free")
        lock.release()

    return [
        CycleContender(HOLD, hold_cycle, ("evalsha",)),
        CycleContender(FLOOR, floor_cycle, ("set", "evalsha")),
        CycleContender(BARE, bare_cycle, ("set", "evalsha")),
        CycleContender(CALLS, calls_cycle, ("evalsha",)),
        CycleContender(REDIS_PY, rpy_cycle, ("set", "evalsha")),
        CycleContender(PRL, prl_cycle, ("set", "evalsha")),
        *(
            [CycleContender(HOLD_HISTORY, hold_history_cycle, ("evalsha",))]
            if history_leases is not None
            else []
        ),
    ]


def hold_calls_cycle(url: str, leases: Leases, resource: str) -> Callable[[], None]:
    """hold()'s own two script calls on ``resource``, written and read on one connection.

    The same acquire.lua and release.lua calls, built by the library's own core (the home
    call included, as hold() sends it with a ttl of the ttl setting), then sent with none of
    the library's code around them: no request generators, grant book, heartbeat, Lease
    objects or signals. Against hold() it splits the gap to the floor into the calls
    themselves (their round trips and server time) and the library's Python around them.
    """
    engine = leases.store.engine
    ident = leases.identity()
    want = Want(resource)
    group = engine.resource_keys(resource).group
    call = _grants.acquire_call(engine, group, [want], ident, 30.0, True)
    conn: Any = redis.Redis.from_url(url).connection_pool.get_connection()
    acquire = pack(conn, words_of(Script("acquire", call.keys, call.args)))
    keys = _releases.release_keys(engine, ident.owner, group, [Entry("x", 0, None, resource)])

    def cycle() -> None:
        conn.send_packed_command(acquire)
        reply = conn.read_response()
        if int(reply[0]) != 1:
            raise RuntimeError(f"hold()'s calls: {resource} was not free ({reply!r})")
        entry = Entry("x", int(reply[1]), None, resource)
        args = _releases.release_args(engine, ident.owner, [entry])
        conn.send_packed_command(pack(conn, words_of(Script("release", keys, args))))
        if conn.read_response() != [1]:
            raise RuntimeError(f"hold()'s calls: {resource} was not ours at release")

    return cycle


def rotated(items: Sequence[Any], by: int) -> list[Any]:
    by %= len(items)
    return [*items[by:], *items[:by]]


def bench_cycles(
    cfg: Config, contenders: list[CycleContender], admin: redis.Redis
) -> dict[str, dict[str, Any]]:
    """Interleaved rounds, then a short pass that counts writes.

    Each round gives every contender ``cfg.cycles`` cycles, cut into slices of
    ``cfg.slice_cycles`` that take turns (in an order that rotates), so a slow spell of the
    machine (a CPU migration, a noisy neighbour) lands on all contenders alike.
    """
    for contender in contenders:
        timed(contender.cycle, cfg.warmup)  # connections, SCRIPT LOAD, the heartbeat thread
    rates: dict[str, list[float]] = {c.key: [] for c in contenders}
    server_us: dict[str, list[float]] = {c.key: [] for c in contenders}
    slices = max(1, cfg.cycles // cfg.slice_cycles)
    per_slice = cfg.cycles // slices
    for rnd in range(cfg.rounds):
        seconds = dict.fromkeys(rates, 0.0)
        usec = dict.fromkeys(rates, 0)
        before = CommandStats.take(admin)
        for turn in range(slices):
            for contender in rotated(contenders, rnd + turn):
                seconds[contender.key] += timed(contender.cycle, per_slice)
                after = CommandStats.take(admin)
                usec[contender.key] += sum(after.usec_since(before, c) for c in contender.top_level)
                before = after
        for key in rates:
            rates[key].append(slices * per_slice / seconds[key])
            server_us[key].append(usec[key] / (slices * per_slice))
        summary = ", ".join(f"{k} {rates[k][-1]:,.0f}/s" for k in rates)
        progress(f"(a) round {rnd + 1}/{cfg.rounds}: {summary}")
    round_trips: dict[str, float] = {}
    with WriteCounter() as writes:
        for contender in contenders:
            before_writes = writes.of_thread()
            timed(contender.cycle, cfg.count_cycles)
            round_trips[contender.key] = (writes.of_thread() - before_writes) / cfg.count_cycles
    return {
        c.key: {
            "rates": rates[c.key],
            "median": median(rates[c.key]),
            "server_us_per_cycle": median(server_us[c.key]),
            "round_trips_per_cycle": round_trips[c.key],
        }
        for c in contenders
    }


def cycle_rows(cfg: Config, res: dict[str, dict[str, Any]], private: bool) -> list[Row]:
    """The sync rows of (a): hold() against the redis-py floor (and two bare round trips)."""
    bare = f"{res[HOLD]['median'] / res[BARE]['median']:.2f}x two bare round trips"
    calls = res[HOLD]["median"] / res[CALLS]["median"]
    lib = 1e6 / res[HOLD]["median"] - 1e6 / res[CALLS]["median"]
    extra = {HOLD: f"{bare}; {calls:.2f}x its own calls sent bare ({lib:.0f} us of library code)"}
    keys: tuple[str, ...] = (HOLD, FLOOR, BARE, CALLS, REDIS_PY, PRL)
    if HOLD_HISTORY in res:
        keys += (HOLD_HISTORY,)
        h, plain = res[HOLD_HISTORY], res[HOLD]
        extra[HOLD_HISTORY] = f"{h['median'] / plain['median']:.2f}x hold() without history" + (
            f", server +{h['server_us_per_cycle'] - plain['server_us_per_cycle']:.1f} us"
            if private
            else ""
        )
    return _rows_against(
        cfg,
        res,
        private,
        keys,
        LABELS,
        floor="floor",
        target=CYCLE_RATIO_TARGET,
        extra=extra,
    )


def _rows_against(
    cfg: Config,
    res: dict[str, dict[str, Any]],
    private: bool,
    keys: tuple[str, ...],
    labels: dict[str, str],
    *,
    floor: str,
    target: float,
    extra: dict[str, str] | None = None,
) -> list[Row]:
    """The rows of (a) for ``keys``: the first is ours (held to ``target`` x the second, the
    ``floor``), the second the baseline, the rest for comparison."""
    ours, base = keys[0], keys[1]
    floor_rate = res[base]["median"]
    prefix = "" if floor == "floor" else "asyncio "
    metric = f"{prefix}cycles/s (median of {cfg.rounds}x{cfg.cycles})"
    rows = []
    for key in keys:
        r = res[key]
        ratio = r["median"] / floor_rate
        details = [
            f"{r['round_trips_per_cycle']:.2f} RT/cycle",
            f"{1e6 / r['median']:.0f} us/cycle",
        ]
        if private:
            details.append(f"server {r['server_us_per_cycle']:.1f} us/cycle")
        details.append(f"rounds {min(r['rates']):,.0f}-{max(r['rates']):,.0f}")
        if extra and key in extra:
            details.append(extra[key])
        if key == ours:
            ok = (
                ratio >= target and round(r["round_trips_per_cycle"], 2) == CYCLE_ROUND_TRIPS_TARGET
            )
            verdict_text = f">= {target:.2f}x {floor}, 2 RT: {verdict(ok)}"
            r["pass"] = ok
        elif key == base:
            verdict_text = "baseline" if floor == "floor" else f"baseline ({prefix.strip()})"
        else:
            verdict_text = "-"
        rows.append(
            Row(
                "a",
                labels[key],
                metric,
                format_rate(r["median"]),
                f"{ratio:.2f}x {floor}",
                "; ".join(details),
                verdict_text,
                data={"contender": key, **r, "ratio": ratio},
            )
        )
    return rows


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


# --- (a) asyncio: uncontended cycles on one event loop ----------------------------------------
@dataclass(frozen=True)
class AsyncCycleContender:
    key: str
    cycle: Callable[[], Awaitable[None]]
    top_level: tuple[str, ...]


def async_cycle_contenders(
    url: str, leases: Leases, run_id: str
) -> tuple[list[AsyncCycleContender], list[aredis.Redis]]:
    """The asyncio contenders, and the clients to close on the loop when done."""

    def name(key: str) -> str:
        return f"bench:{run_id}:a:{key}"

    hold_name = name(AHOLD)

    async def ahold_cycle() -> None:
        async with leases.ahold(hold_name, ttl=30.0):
            pass

    floor_client = aredis.Redis.from_url(url)
    compare_and_delete = floor_client.register_script(COMPARE_AND_DELETE)
    floor_key = name(AFLOOR)
    tokens = itertools.count(1)

    async def afloor_cycle() -> None:
        token = str(next(tokens))
        if not await floor_client.set(floor_key, token, nx=True, px=30_000):
            raise RuntimeError(f"asyncio floor: {floor_key} was not free")
        if await compare_and_delete(keys=[floor_key], args=[token]) != 1:
            raise RuntimeError(f"asyncio floor: {floor_key} was not ours at release")

    rpy_client = aredis.Redis.from_url(url)
    rpy_name = name(AREDIS_PY)

    async def arpy_cycle() -> None:
        lock = rpy_client.lock(rpy_name, timeout=30)
        if not await lock.acquire(blocking=False):
            raise RuntimeError(f"redis.asyncio Lock: {rpy_name} was not free")
        await lock.release()

    contenders = [
        AsyncCycleContender(AHOLD, ahold_cycle, ("evalsha",)),
        AsyncCycleContender(AFLOOR, afloor_cycle, ("set", "evalsha")),
        AsyncCycleContender(AREDIS_PY, arpy_cycle, ("set", "evalsha")),
    ]
    return contenders, [floor_client, rpy_client]


async def atimed(cycle: Callable[[], Awaitable[None]], count: int) -> float:
    """Seconds that ``count`` awaited calls of ``cycle`` take."""
    start = time.perf_counter()
    for _ in range(count):
        await cycle()
    return time.perf_counter() - start


class AsyncWriteCounter:
    """Counts asyncio client round trips: redis.asyncio's ``send_packed_command`` calls.

    The asyncio twin of :class:`WriteCounter`. Everything on the loop counts (one loop, one
    thread; the asyncio heartbeat renews every 10 s at ttl 30 s, so its share is nil).
    """

    def __init__(self) -> None:
        self.count = 0
        self._owner: Any = aredis.connection.AbstractConnection
        self._original: Any = None

    def __enter__(self) -> AsyncWriteCounter:
        original = self._original = self._owner.__dict__["send_packed_command"]

        async def send_packed_command(conn: Any, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return await original(conn, *args, **kwargs)

        self._owner.send_packed_command = send_packed_command
        return self

    def __exit__(self, *exc: object) -> None:
        self._owner.send_packed_command = self._original


async def _abench_cycles(
    cfg: Config, contenders: list[AsyncCycleContender], admin: redis.Redis
) -> dict[str, dict[str, Any]]:
    """:func:`bench_cycles` on the running loop: the same interleaved slices and rounds."""
    for contender in contenders:
        await atimed(contender.cycle, cfg.warmup)  # connections, SCRIPT LOAD, the heartbeat
    rates: dict[str, list[float]] = {c.key: [] for c in contenders}
    server_us: dict[str, list[float]] = {c.key: [] for c in contenders}
    slices = max(1, cfg.cycles // cfg.slice_cycles)
    per_slice = cfg.cycles // slices
    for rnd in range(cfg.rounds):
        seconds = dict.fromkeys(rates, 0.0)
        usec = dict.fromkeys(rates, 0)
        before = CommandStats.take(admin)  # a sync call, outside the timed slices
        for turn in range(slices):
            for contender in rotated(contenders, rnd + turn):
                seconds[contender.key] += await atimed(contender.cycle, per_slice)
                after = CommandStats.take(admin)
                usec[contender.key] += sum(after.usec_since(before, c) for c in contender.top_level)
                before = after
        for key in rates:
            rates[key].append(slices * per_slice / seconds[key])
            server_us[key].append(usec[key] / (slices * per_slice))
        summary = ", ".join(f"{k} {rates[k][-1]:,.0f}/s" for k in rates)
        progress(f"(a, asyncio) round {rnd + 1}/{cfg.rounds}: {summary}")
    round_trips: dict[str, float] = {}
    for contender in contenders:
        with AsyncWriteCounter() as writes:
            await atimed(contender.cycle, cfg.count_cycles)
        round_trips[contender.key] = writes.count / cfg.count_cycles
    return {
        c.key: {
            "rates": rates[c.key],
            "median": median(rates[c.key]),
            "server_us_per_cycle": median(server_us[c.key]),
            "round_trips_per_cycle": round_trips[c.key],
        }
        for c in contenders
    }


def bench_async_cycles(
    cfg: Config, url: str, leases: Leases, admin: redis.Redis, run_id: str
) -> dict[str, dict[str, Any]]:
    """(a) on one event loop of its own: ahold() against the asyncio floor and Lock."""

    async def main() -> dict[str, dict[str, Any]]:
        contenders, clients = async_cycle_contenders(url, leases, run_id)
        try:
            return await _abench_cycles(cfg, contenders, admin)
        finally:
            await leases.aclose()
            for client in clients:
                await client.aclose()

    return asyncio.run(main())


def async_cycle_rows(cfg: Config, res: dict[str, dict[str, Any]], private: bool) -> list[Row]:
    """The asyncio rows of (a): ahold() against the asyncio floor."""
    return _rows_against(
        cfg,
        res,
        private,
        (AHOLD, AFLOOR, AREDIS_PY),
        ALABELS,
        floor="asyncio floor",
        target=ACYCLE_RATIO_TARGET,
    )


# --- (b) handoff delay ----------------------------------------------------------------------------
def holder_main(url: str, prefix: str, conn: Connection) -> None:
    """The holder process: take a lease when told, hold it a while, record the time, release.

    Messages in: ``("hold", kind, name, seconds)``, ``("stop",)``.
    Messages out: ``("held",)`` then ``("released", monotonic time just before release)``, or
    ``("error", text)``.
    """
    leases = make_leases(url, prefix)
    client = redis.Redis.from_url(url)
    while True:
        message = conn.recv()
        if message[0] == "stop":
            break
        _, kind, name, seconds = message
        try:
            release = take(kind, name, leases, client)
        except Exception as exc:
            conn.send(("error", f"holder could not take {name}: {exc!r}"))
            continue
        conn.send(("held",))
        time.sleep(seconds)
        released_at = time.monotonic()
        try:
            release()
        except Exception as exc:
            conn.send(("error", f"holder could not release {name}: {exc!r}"))
            continue
        conn.send(("released", released_at))
    client.close()


def take(kind: str, name: str, leases: Leases, client: redis.Redis) -> Callable[[], object]:
    """Acquire ``name`` without waiting; return the function that releases it."""
    if kind == HOLD:
        held = leases.hold(name, ttl=30.0)
        held.__enter__()
        return lambda: held.__exit__(None, None, None)
    if kind == PRL:
        prl = redis_lock.Lock(client, name, expire=30)
        if not prl.acquire(blocking=False):
            raise RuntimeError("busy")
        return prl.release  # type: ignore[no-any-return]
    if kind == REDIS_PY:
        lock = client.lock(name, timeout=30)
        if not lock.acquire(blocking=False):
            raise RuntimeError("busy")
        release: Callable[[], object] = lock.release
        return release
    raise ValueError(kind)


def waiters(url: str, leases: Leases) -> dict[str, Callable[[str], float]]:
    """Blocking acquire of a busy name; each returns the monotonic time it held the lease."""
    client = redis.Redis.from_url(url)

    def hold_wait(name: str) -> float:
        with leases.hold(name, ttl=30.0, wait=10.0):
            return time.monotonic()

    def prl_wait(name: str) -> float:
        lock = redis_lock.Lock(client, name, expire=30)
        if not lock.acquire(blocking=True, timeout=10):
            raise RuntimeError(f"python-redis-lock: no handoff of {name} within 10 s")
        got = time.monotonic()
        lock.release()
        return got

    def rpy_wait(name: str) -> float:
        lock = client.lock(name, timeout=30, sleep=0.1, blocking_timeout=10)
        if not lock.acquire():
            raise RuntimeError(f"redis-py Lock: no handoff of {name} within 10 s")
        got = time.monotonic()
        lock.release()
        return got

    return {HOLD: hold_wait, PRL: prl_wait, REDIS_PY: rpy_wait}


def _expect(conn: Connection, kind: str, timeout: float = 30.0) -> tuple[Any, ...]:
    try:
        if not conn.poll(timeout):
            raise RuntimeError(f"the holder process sent no {kind!r} within {timeout:.0f}s")
        message: tuple[Any, ...] = conn.recv()
    except (EOFError, OSError) as exc:
        msg = f"the holder process is gone ({exc!r}); its traceback is above"
        raise RuntimeError(msg) from None
    if message[0] != kind:
        raise RuntimeError(f"holder: {message}")
    return message


def bench_handoff(
    cfg: Config, url: str, leases: Leases, prefix: str, run_id: str
) -> dict[str, dict[str, Any]]:
    """Interleaved handoffs from a holder process to a waiter in this process."""
    rng = random.Random(cfg.seed)
    wait_for = waiters(url, leases)
    kinds = [HOLD, PRL, REDIS_PY]
    delays: dict[str, list[float]] = {k: [] for k in kinds}
    trips: dict[str, list[int]] = {k: [] for k in kinds}
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=holder_main, args=(url, prefix, child), name="bench-holder")
    proc.start()
    child.close()
    try:
        with WriteCounter() as writes:
            for i in range(-2, cfg.handoffs):  # two warm-up handoffs each, not recorded
                for kind in rotated(kinds, i):
                    name = f"bench:{run_id}:b:{kind}:{i}"
                    # a random release phase, so a polling waiter is met at any point of its nap
                    pause = cfg.hold_before_release + rng.uniform(0, cfg.release_jitter)
                    parent.send(("hold", kind, name, pause))
                    _expect(parent, "held")
                    before = writes.of_thread()
                    got = wait_for[kind](name)
                    sent = writes.of_thread() - before
                    _, released_at = _expect(parent, "released")
                    if got < released_at:
                        raise RuntimeError(f"{kind}: waiter held {name} before the release")
                    if i >= 0:
                        delays[kind].append(got - released_at)
                        trips[kind].append(sent)
                if i >= 0 and (i + 1) % 10 == 0:
                    progress(f"(b) {i + 1}/{cfg.handoffs} handoffs each")
        parent.send(("stop",))
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        parent.close()
    return {
        k: {
            "delays_ms": [d * 1000 for d in delays[k]],
            "median_ms": median(delays[k]) * 1000,
            "p99_ms": percentile(delays[k], 99) * 1000,
            "waiter_round_trips": median([float(t) for t in trips[k]]),
        }
        for k in kinds
    }


def handoff_rows(cfg: Config, res: dict[str, dict[str, Any]]) -> list[Row]:
    base = res[PRL]["median_ms"]
    rows = []
    for key in (HOLD, PRL, REDIS_PY):
        r = res[key]
        ratio = r["median_ms"] / base
        details = (
            f"p99 {r['p99_ms']:.2f} ms; n={len(r['delays_ms'])}; "
            f"waiter {r['waiter_round_trips']:.0f} RT/handoff"
        )
        if key == HOLD:
            ok = r["median_ms"] <= base
            target = f"median <= python-redis-lock: {verdict(ok)}"
            r["pass"] = ok
        elif key == PRL:
            target = "baseline"
        else:
            target = "-"
        rows.append(
            Row(
                "b",
                WAIT_LABELS[key],
                "handoff ms (median)",
                f"{r['median_ms']:.2f}",
                f"{ratio:.2f}x prl",
                details,
                target,
                data={"contender": key, **r, "ratio": ratio},
            )
        )
    return rows


# --- (c) heartbeat cost -------------------------------------------------------------------------
def _await_renewal(count: Callable[[], int], patience: float) -> None:
    start = count()
    deadline = time.monotonic() + patience
    while count() == start:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no heartbeat renewal within {patience:.1f}s")
        time.sleep(0.002)


def bench_heartbeat(
    cfg: Config, leases: Leases, admin: redis.Redis, run_id: str
) -> dict[int, dict[str, Any]]:
    """Hold N leases (one hold() of a list, ttl 3 s) and count the heartbeat's calls.

    Both ends of the window sit at the same phase of the renew cycle (a fixed offset after a
    renewal), so the window spans whole renew intervals and the rate has no +-1 call jitter.
    """
    ttl = 3.0
    interval = leases.store.horizon(ttl) / 3
    offset = 0.3 * interval  # long after the renewal's reply, long before the next one
    beat = heartbeat()
    out: dict[int, dict[str, Any]] = {}
    with WriteCounter() as writes:
        for n in cfg.counts:
            names: list[str | Shared] = [f"bench:{run_id}:c:{n}:{i}" for i in range(n)]
            lost = False
            try:
                with leases.hold(names, ttl=ttl):
                    _await_renewal(lambda: beat.renewals, 3 * interval + 1)
                    time.sleep(offset)
                    s0, r0 = CommandStats.take(admin), beat.renewals
                    w0, t0 = writes.of_name(HEARTBEAT_THREAD), time.monotonic()
                    time.sleep(cfg.window)
                    _await_renewal(lambda: beat.renewals, 3 * interval + 1)
                    time.sleep(offset)
                    s1, r1 = CommandStats.take(admin), beat.renewals
                    w1, t1 = writes.of_name(HEARTBEAT_THREAD), time.monotonic()
            except LeaseLost:
                lost = True
            seconds = t1 - t0
            calls = s1.calls_since(s0, "evalsha")
            renewals = r1 - r0
            out[n] = {
                "seconds": seconds,
                "evalsha_calls": calls,
                "renewals": renewals,
                "writes": w1 - w0,
                "calls_per_s": calls / seconds,
                "renewals_per_s": renewals / seconds,
                "writes_per_s": (w1 - w0) / seconds,
                "calls_per_renewal": calls / renewals if renewals else float("nan"),
                "round_trips_per_renewal": (w1 - w0) / renewals if renewals else float("nan"),
                "server_us_per_call": s1.usec_since(s0, "evalsha") / calls if calls else 0.0,
                "expected_per_s": 1 / interval,
                "interval": interval,
                "lost": lost,
            }
            progress(f"(c) {n} leases: {calls / seconds:.2f} calls/s")
    return out


def heartbeat_rows(cfg: Config, res: dict[int, dict[str, Any]], private: bool) -> list[Row]:
    # On a shared server other clients' EVALSHA would count too: use our own writes there.
    rate_key = "calls_per_s" if private else "writes_per_s"
    metric = "heartbeat calls/s" + ("" if private else " (client writes)")
    base = res[cfg.counts[0]][rate_key]
    rows = []
    for n in cfg.counts:
        r = res[n]
        ratio = r[rate_key] / base
        details = [
            f"{r['renewals_per_s']:.2f} renewals/s",
            f"{r['calls_per_renewal']:.2f} calls, {r['round_trips_per_renewal']:.2f} RT/renewal",
        ]
        if private:
            details.append(f"server {r['server_us_per_call']:,.0f} us/call")
        if r["lost"]:
            details.append("LOST a lease")
        one_call = round(r["round_trips_per_renewal"], 2) == 1.0
        if n == cfg.counts[0]:
            ok = one_call and not r["lost"]
            target = f"baseline; 1 call per renewal: {verdict(ok)}"
        else:
            ok = abs(ratio - 1) <= FLAT_TOLERANCE and one_call and not r["lost"]
            target = f"flat (1 +- {FLAT_TOLERANCE:.1f}x): {verdict(ok)}"
        r["pass"] = ok
        rows.append(
            Row(
                "c",
                f"{n} lease{'s' if n != 1 else ''}",
                f"{metric} over {r['seconds']:.1f} s (expect {r['expected_per_s']:.2f})",
                f"{r[rate_key]:.2f}",
                f"{ratio:.2f}x 1 lease" if n != cfg.counts[0] else "1.00x (baseline)",
                "; ".join(details),
                target,
                data={"leases": n, **r, "ratio": ratio},
            )
        )
    return rows


# --- (d) waiter queues -------------------------------------------------------------------------
def _server_totals(client: redis.Redis) -> tuple[int, int]:
    """(calls, usec) of every command the server ran so far, INFO itself left out."""
    stats = CommandStats.take(client).stats
    calls = sum(c for name, (c, _) in stats.items() if name != "info")
    usec = sum(u for name, (_, u) in stats.items() if name != "info")
    return calls, usec


def _queued(client: redis.Redis, key: str) -> int:
    return int(client.zcard(key))


def waiter_chain(leases: Leases, admin: redis.Redis, resource: str, n: int) -> dict[str, Any]:
    """One chain: ``n`` + 1 threads queue in a known order, then each release hands over to one.

    The bench holds ``resource``; waiter i starts once waiter i-1 is seen in the queue. Then
    the bench releases, and each waiter, once granted, notes the time and releases at once,
    so the lease goes down the queue. Counted on the server from the release of waiter 0 (with
    ``n`` waiters queued behind it) to the last grant: n releases and n handoffs, each release
    by a holder that waited for its lease as the next one does (the bench's own release,
    of a lease that no wait was handed, is left out).
    """
    queue_key = leases.store.keys.waiters(resource)
    lock = threading.Lock()
    granted: list[tuple[int, float, float]] = []  # (waiter, granted at, releasing at)
    errors: list[BaseException] = []
    last = threading.Event()  # the last grant came: counted before its release
    gate = threading.Event()

    totals: list[tuple[int, int]] = []  # the server's, as waiter 0 releases

    def waiter(i: int) -> None:
        try:
            with leases.hold(resource, wait=120, ttl=60):
                t = time.perf_counter()
                if i == 0:
                    totals.append(_server_totals(admin))
                with lock:
                    granted.append((i, t, time.perf_counter()))
                    done = len(granted) == n + 1
                if done:
                    last.set()
                    gate.wait(300)
        except BaseException as exc:  # reported below
            errors.append(exc)

    first = leases.acquire([Want(resource)], ttl=120)
    threads = []
    for i in range(n + 1):
        thread = threading.Thread(target=waiter, args=(i,), daemon=True)
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + 30
        while _queued(admin, queue_key) < i + 1:
            if time.monotonic() > deadline or errors:
                raise RuntimeError(f"waiter {i} never queued: {errors}")
            time.sleep(0.0005)
    time.sleep(0.05)  # every waiter asleep on its channel
    leases.release(first)
    last.wait(300)
    calls1, usec1 = _server_totals(admin)
    gate.set()
    for thread in threads:
        thread.join(300)
    if errors or len(granted) != n + 1:
        raise RuntimeError(f"the chain broke: {len(granted)} of {n + 1} granted; {errors[:3]}")
    ((calls0, usec0),) = totals
    order = [i for i, _, _ in granted]
    delays = [granted[k][1] - granted[k - 1][2] for k in range(1, n + 1)]
    overtaken, highest = 0, -1
    for i in order:
        if highest > i:
            overtaken += 1  # someone queued after it was granted first
        highest = max(highest, i)
    return {
        "waiters": n,
        "releases": n,
        "calls_per_release": (calls1 - calls0) / n,
        "usec_per_release": (usec1 - usec0) / n,
        "handoff_ms": [d * 1000 for d in delays],
        "overtaken": overtaken,
    }


def bench_waiters(
    cfg: Config, url: str, admin: redis.Redis, run_id: str
) -> dict[int, dict[str, Any]]:
    # each waiting thread keeps a subscriber connection from the client's pool, and redis-py
    # caps a pool at 100 by default (the library sets no cap of its own): room for the most
    leases = make_leases(url, f"bench-{run_id}-d")
    leases.store.client.connection_pool.max_connections = 2 * max(cfg.waiters) + 50
    # warm: the owner's first grant registers it, and starts the heartbeat thread
    leases.release(leases.acquire([Want(f"warm-{run_id}")], ttl=60))
    out: dict[int, dict[str, Any]] = {}
    for n in cfg.waiters:
        chains = []
        for c in range(cfg.chains):
            progress(f"(d) {n} waiter(s), chain {c + 1} of {cfg.chains}")
            chains.append(waiter_chain(leases, admin, f"queue-{run_id}-{n}-{c}", n))
        delays = [d for chain in chains for d in chain["handoff_ms"]]
        out[n] = {
            "calls_per_release": median([ch["calls_per_release"] for ch in chains]),
            "usec_per_release": median([ch["usec_per_release"] for ch in chains]),
            "first_handoff_ms": median([ch["handoff_ms"][0] for ch in chains]),
            "median_ms": median(delays),
            "p99_ms": percentile(delays, 99),
            "overtaken": sum(ch["overtaken"] for ch in chains),
            "handoffs": len(delays),
        }
    return out


def waiter_rows(cfg: Config, res: dict[int, dict[str, Any]], private: bool) -> list[Row]:
    base = res[cfg.waiters[0]]
    rows = []
    for n in cfg.waiters:
        r = res[n]
        ratio = r["calls_per_release"] / base["calls_per_release"]
        flat = ratio <= 1 + FLAT_TOLERANCE and r["overtaken"] == 0
        if n == cfg.waiters[0]:
            target = "baseline" if r["overtaken"] == 0 else f"FIFO: {verdict(False)}"
        else:
            target = f"flat within {FLAT_TOLERANCE:.0%}, none overtaken: {verdict(flat)}"
        r["pass"] = flat
        server = f"server {r['usec_per_release']:.0f} us/release; " if private else ""
        details = (
            f"{server}handoff median {r['median_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms, "
            f"first {r['first_handoff_ms']:.2f} ms; overtaken {r['overtaken']}; "
            f"n={r['handoffs']}"
        )
        rows.append(
            Row(
                "d",
                f"hold(wait=...), {n} waiter(s)",
                "commands/release",
                f"{r['calls_per_release']:.1f}",
                f"{ratio:.2f}x {cfg.waiters[0]}",
                details,
                target,
                data={"waiters": n, **r, "ratio": ratio},
            )
        )
    return rows


# --- profile ------------------------------------------------------------------------------------
def profile_hold(cfg: Config, contender: CycleContender, out_dir: Path, limit: int = 30) -> str:
    """cProfile ``cfg.cycles`` hold() cycles in this thread (the heartbeat thread is not seen)."""
    profiler = cProfile.Profile()
    profiler.enable()
    timed(contender.cycle, cfg.cycles)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(limit)
    stats.sort_stats("cumulative").print_stats("celery_leases", limit)
    path = out_dir / "engine-hold.prof"
    stats.dump_stats(str(path))
    return out.getvalue() + f"\n(full profile in {path}; open it with python -m pstats)\n"


# --- main ---------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a short run (about 30 s)")
    parser.add_argument(
        "--redis-url",
        default=None,
        help="a loopback Redis to use instead of a private server (commandstats then also "
        "counts other clients)",
    )
    parser.add_argument("--rounds", type=int, default=0, help="rounds in (a)")
    parser.add_argument("--cycles", type=int, default=0, help="cycles per round in (a)")
    parser.add_argument("--handoffs", type=int, default=0, help="handoffs per contender in (b)")
    parser.add_argument("--window", type=float, default=0.0, help="seconds measured in (c)")
    parser.add_argument(
        "--counts",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 10, 100, 1000],
        help="lease counts in (c), comma-separated; the first is the baseline",
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the release jitter in (b)")
    parser.add_argument(
        "--waiters",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 10, 100, 1000],
        help="waiter counts in (d), comma-separated; the first is the baseline",
    )
    parser.add_argument("--chains", type=int, default=0, help="release chains per count in (d)")
    parser.add_argument(
        "--only", default="abcd", help="which parts to run, e.g. 'a' or 'bd' (default: abcd)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also cProfile hold() cycles and print the top"
    )
    parser.add_argument(
        "--out-dir", default=str(RESULTS_DIR), help="where engine.md and engine.json go"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config.from_args(args)
    run_id = secrets.token_hex(4)
    prefix = f"bench-{run_id}"
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with redis_target(args.redis_url) as (url, private):
        progress(f"redis at {url} ({'private server' if private else 'given by --redis-url'})")
        admin = redis.Redis.from_url(url)
        leases = make_leases(url, prefix)
        machine = machine_info(admin)
        rows: list[Row] = []
        raw: dict[str, Any] = {}
        history_leases = make_leases(url, f"{prefix}-h", history=BENCH_HISTORY)
        contenders = cycle_contenders(url, leases, run_id, history_leases)
        try:
            if "a" in args.only:
                raw["a"] = bench_cycles(cfg, contenders, admin)
                rows += cycle_rows(cfg, raw["a"], private)
                raw["a-asyncio"] = bench_async_cycles(cfg, url, leases, admin, run_id)
                rows += async_cycle_rows(cfg, raw["a-asyncio"], private)
            if "b" in args.only:
                raw["b"] = bench_handoff(cfg, url, leases, prefix, run_id)
                rows += handoff_rows(cfg, raw["b"])
            if "c" in args.only:
                raw["c"] = bench_heartbeat(cfg, leases, admin, run_id)
                rows += heartbeat_rows(cfg, raw["c"], private)
            if "d" in args.only:
                raw["d"] = bench_waiters(cfg, url, admin, run_id)
                rows += waiter_rows(cfg, raw["d"], private)
            profile = profile_hold(cfg, contenders[0], out_dir) if args.profile else ""
        finally:
            if not private:  # leave nothing behind on somebody else's server
                for key in admin.scan_iter(match=f"*{run_id}*", count=1000):
                    admin.unlink(key)
        admin.close()
    elapsed = time.monotonic() - started
    verdicts = {
        part: all(r.data.get("pass", True) for r in rows if r.part == part)
        for part in sorted({r.part for r in rows})
    }
    settings = leases.settings
    kind = "--quick" if args.quick else "default"
    if args.rounds or args.cycles or args.handoffs or args.window or args.only != "abcd":
        kind += " with overrides"
    header = [
        f"machine: {machine['cpus']} cores, {machine['cpu_model']}; {machine['platform']}; "
        f"load {machine['load']} at start",
        f"python {machine['python']}, redis-py {machine['redis_py']}, "
        f"server {machine['server']} ({'private' if private else 'shared'})",
        f"run: {kind}, {elapsed:.0f} s, {machine['date']}: "
        f"(a) {cfg.rounds} rounds x {cfg.cycles} cycles, (b) {cfg.handoffs} handoffs each, "
        f"(c) {cfg.window:.0f} s windows, (d) {cfg.chains} chain(s) per count; "
        f"lost_margin {settings.lost_margin}, "
        f"slot_groups {settings.slot_groups}",
    ]
    summary = "targets: " + ", ".join(f"({p}) {verdict(ok)}" for p, ok in verdicts.items())
    print("\n".join(header))
    print()
    print(render_text(rows))
    print()
    print(summary)
    print(LEGEND)
    if profile:
        print()
        print(profile)
    md = "\n".join(
        [
            "# Engine benchmark results",
            "",
            *(f"- {line}" for line in header),
            "",
            render_markdown(rows),
            "",
            summary,
            "",
            LEGEND,
            "",
        ]
    )
    write_text(str(out_dir / "engine.md"), md)
    write_json(
        str(out_dir / "engine.json"),
        {
            "machine": machine,
            "config": {**asdict(cfg), "quick": bool(args.quick), "private_server": private},
            "elapsed_s": elapsed,
            "rows": [{k: v for k, v in asdict(r).items() if k != "data"} for r in rows],
            "results": {part: {str(k): v for k, v in value.items()} for part, value in raw.items()},
            "verdicts": {p: verdict(ok) for p, ok in verdicts.items()},
            "targets": {"cycle": CYCLE_RATIO_TARGET, "acycle": ACYCLE_RATIO_TARGET},
        },
    )
    progress(f"wrote {out_dir / 'engine.md'} and {out_dir / 'engine.json'}")
    plot.refresh(out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
