"""Task-throughput benchmark: a leased tiny task against a plain one, on the same worker.

    python -m bench.tasks              # solo and prefork -c 2, 5 rounds x 1000 tasks each kind
    python -m bench.tasks --quick      # 2 rounds x 300
    python -m bench.tasks --help

It is a benchmark, not a test: it prints tasks/s and the ratio leased/plain per pool, marks each
pool's target PASS or MISS, and exits 0 either way. The targets (``POOL_TARGETS``): solo, what a
lease adds to a task (leased minus plain seconds a task) is at most 1.2x one ``hold()`` cycle,
timed by this process after each round against the same server; prefork -c 2, leased >= 0.9 x
plain tasks/s.

Each pool gets one real ``celery worker`` subprocess running the worker-test app
(``tests.integration.worker.worker_app``): ``plain(x)`` returns its argument; ``leased_tiny(rid)``
does the same under an exclusive lease on ``tiny:<rid>``, every rid distinct, so no task ever
waits for another. A second worker of the same pool runs with the redelivery guard on
(``CELERY_LEASES_REDELIVERY_GUARD=true``) for the third kind, ``guarded``: ``plain(x)`` there.
Rounds interleave the kinds (plain, leased, guarded, then leased, guarded, plain, ...), so a slow
spell of the machine hits all alike.

A round measures the worker alone: its messages are published to a fresh queue that no one
consumes, then the worker is told to consume it (remote control ``add_consumer``), so it never
waits for the publisher. The rate is ``(n - 1) / (last date_done - first date_done)`` from the
results the worker stored. By default a private redis-server on a free loopback port holds
broker, result backend and leases, so the numbers are ours alone, and each round also records
what it cost the server per task: the commands it ran (INFO commandstats, those inside scripts
included), the lease scripts' calls and their usec, and the server's main-thread CPU time (INFO
cpu), each for leased and plain tasks; leased minus plain is the library's cost.

The tables go to stdout and ``bench/results/tasks.md`` (raw samples: ``tasks.json``), the plot
``docs/img/bench-tasks.svg`` is redrawn (``bench/plot.py``), and the run replaces the ``## Task
throughput`` section of ``docs/benchmarks.md`` (appended if there is none).
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import socket
import sys
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import redis

from . import plot
from ._common import (
    CommandStats,
    Worker,
    machine_info,
    median,
    redis_target,
    replace_section,
    spawn_worker,
    write_json,
)

REPO: Final = Path(__file__).resolve().parents[1]
RESULTS_DIR: Final = REPO / "bench" / "results"
DOCS: Final = REPO / "docs" / "benchmarks.md"
SECTION: Final = "## Task throughput"
APP: Final = "tests.integration.worker.worker_app"
TARGET: Final = 0.9  # prefork: leased >= 0.9 x plain tasks/s
COST_TARGET: Final = 1.2  # solo: the lease's time a task <= 1.2 x one hold() cycle
#: each pool's target: "ratio" (leased/plain >= TARGET) or "cost" (lease <= COST_TARGET x hold())
POOL_TARGETS: Final = {"solo": "cost", "prefork": "ratio"}
#: hold() cycles timed after each round (the yardstick of the "cost" target)
HOLD_CYCLES: Final = 300
POOLS: Final = {"solo": 1, "prefork": 2}
START_TIMEOUT: Final = 60.0
ROUND_TIMEOUT: Final = 300.0


def progress(message: str) -> None:
    print(f"[bench.tasks] {message}", file=sys.stderr, flush=True)


def worker_env(url: str, prefix: str, idle_queue: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_LEASES_")}
    env.update(
        {
            "LEASES_TEST_BROKER": url,
            "LEASES_TEST_BACKEND": url,
            "LEASES_TEST_LEDGER": url,
            "LEASES_TEST_QUEUE": idle_queue,
            "CELERY_LEASES_REDIS_URL": url,
            "CELERY_LEASES_KEY_PREFIX": prefix,
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def load_app(env: dict[str, str]) -> ModuleType:
    """Import the worker-test app in this process, configured like the workers."""
    for key in ("LEASES_TEST_BROKER", "LEASES_TEST_BACKEND", "LEASES_TEST_LEDGER"):
        os.environ[key] = env[key]
    os.environ["LEASES_TEST_QUEUE"] = env["LEASES_TEST_QUEUE"]
    os.environ["CELERY_LEASES_KEY_PREFIX"] = env["CELERY_LEASES_KEY_PREFIX"]
    os.environ["CELERY_LEASES_REDIS_URL"] = env["CELERY_LEASES_REDIS_URL"]
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import tests.integration.worker.worker_app as worker_app

    return worker_app


#: the kinds of a round: the plain task, the leased one, and the plain one on a guarded worker
KINDS: Final = ("plain", "leased", "guarded")


def start_worker(
    worker_app: ModuleType,
    pool: str,
    concurrency: int,
    env: dict[str, str],
    run_id: str,
    log_dir: Path,
    *,
    guard: bool = False,
) -> Worker:
    name = f"{pool}-guard" if guard else pool
    hostname = f"bench-{name}-{run_id}@{socket.gethostname()}"
    log_path = log_dir / f"tasks-worker-{name}-{run_id}.log"
    if guard:
        env = {**env, "CELERY_LEASES_REDELIVERY_GUARD": "true"}
    worker = spawn_worker(APP, pool, concurrency, hostname, log_path, env, REPO)
    deadline = time.monotonic() + START_TIMEOUT
    while not worker_app.app.control.ping(destination=[hostname], timeout=0.5):
        if worker.proc.poll() is not None or time.monotonic() > deadline:
            worker.stop()
            raise SystemExit(f"worker {hostname} did not come up:\n{worker.log_tail()}")
    return worker


#: the script calls. Their commandstats usec is the scripts' whole server time; each command a
#: script runs is counted again in its own entry (and EXEC's usec holds its queued commands),
#: so the usec of all commands cannot be summed: the total is the server's CPU time instead.
SCRIPTS: Final = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall")


@dataclass(frozen=True)
class ServerSnapshot:
    """What the server has done so far: INFO commandstats and its main thread's CPU time."""

    stats: CommandStats
    cpu_us: float

    @classmethod
    def take(cls, admin: redis.Redis) -> ServerSnapshot:
        stats = CommandStats.take(admin)
        cpu = admin.info("cpu")
        user = cpu.get("used_cpu_user_main_thread", cpu.get("used_cpu_user", 0.0))
        system = cpu.get("used_cpu_sys_main_thread", cpu.get("used_cpu_sys", 0.0))
        return cls(stats, (float(user) + float(system)) * 1e6)


@dataclass(frozen=True)
class RoundStats:
    """One round of one kind: its rate and, on a private server, its Redis work per task."""

    rate: float
    commands: float  # every command the server ran, those run by scripts and EXEC included
    scripts: float  # EVALSHA (and EVAL, FCALL) calls
    script_us: float  # commandstats usec of those calls: the scripts' whole server time
    cpu_us: float  # the server's main-thread CPU time (user + sys)
    by_command: dict[str, float]


def round_stats(rate: float, before: ServerSnapshot, after: ServerSnapshot, n: int) -> RoundStats:
    """Per task, between two snapshots: commands, script calls and their usec, server CPU us."""
    names = sorted(set(after.stats.stats) | set(before.stats.stats))
    by_command = {c: after.stats.calls_since(before.stats, c) / n for c in names}
    return RoundStats(
        rate=rate,
        commands=sum(by_command.values()),
        scripts=sum(by_command.get(c, 0.0) for c in SCRIPTS),
        script_us=sum(after.stats.usec_since(before.stats, c) for c in SCRIPTS) / n,
        cpu_us=(after.cpu_us - before.cpu_us) / n,
        by_command={c: v for c, v in by_command.items() if v},
    )


def run_round(
    worker_app: ModuleType, worker: Worker, kind: str, n: int, tag: str, admin: redis.Redis | None
) -> RoundStats:
    """Publish ``n`` tasks to a fresh queue and let the worker drain it.

    Returns tasks/s (by the results' date_done) and, with ``admin`` (a private server), what
    the round cost the server per task from the consume order to the last result: the
    worker's broker, result and lease work and this process's polling for the results.
    Publishing the tasks and forgetting their results fall outside.
    """
    app = worker_app.app
    queue = f"bench-{tag}"
    results = []
    with app.producer_or_acquire() as producer:
        for i in range(n):
            if kind in ("plain", "guarded"):  # guarded: the plain task on the guarded worker
                results.append(worker_app.plain.apply_async((i,), queue=queue, producer=producer))
            else:
                rid = f"{tag}-{i}"
                results.append(
                    worker_app.leased_tiny.apply_async((rid,), queue=queue, producer=producer)
                )
    before = ServerSnapshot.take(admin) if admin is not None else None
    replies = app.control.add_consumer(queue, destination=[worker.hostname], reply=True)
    if not replies:
        raise SystemExit(f"worker {worker.hostname} did not answer add_consumer")
    deadline = time.monotonic() + ROUND_TIMEOUT
    backend = app.backend
    ids = [r.id for r in results]
    done: dict[str, Any] = {}
    while len(done) < n:
        if worker.proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"round {tag} did not finish:\n{worker.log_tail()}")
        todo = [i for i in ids if i not in done]
        metas = backend.client.mget([backend.get_key_for_task(i) for i in todo])
        for task_id, raw in zip(todo, metas, strict=True):
            if raw is not None:
                meta = backend.decode_result(raw)
                if meta["status"] == "SUCCESS":
                    done[task_id] = meta
                elif meta["status"] in ("FAILURE", "REVOKED"):
                    raise SystemExit(f"{kind} task {task_id} ended {meta['status']}: {meta}")
        if len(done) < n:
            time.sleep(0.1)  # polling the backend slowly keeps its load off the measurement
    app.control.cancel_consumer(queue, destination=[worker.hostname], reply=True)
    after = ServerSnapshot.take(admin) if admin is not None else None
    for r in results:
        r.forget()
    stamps = sorted(_stamp(meta["date_done"]) for meta in done.values())
    span = stamps[-1] - stamps[0]
    rate = (n - 1) / span if span > 0 else float("inf")
    if before is None or after is None:
        nan = math.nan
        return RoundStats(rate, nan, nan, nan, nan, {})
    return round_stats(rate, before, after, n)


def _stamp(value: Any) -> float:
    if isinstance(value, datetime):
        return value.timestamp()
    return datetime.fromisoformat(str(value)).timestamp()


@dataclass
class PoolResult:
    pool: str
    concurrency: int
    plain_rounds: list[RoundStats] = field(default_factory=list)
    leased_rounds: list[RoundStats] = field(default_factory=list)
    guarded_rounds: list[RoundStats] = field(default_factory=list)
    #: ms a hold() cycle took, timed by the bench process after each round
    hold_cycle_ms: list[float] = field(default_factory=list)

    def rounds_of(self, kind: str) -> list[RoundStats]:
        return {
            "plain": self.plain_rounds,
            "leased": self.leased_rounds,
            "guarded": self.guarded_rounds,
        }[kind]

    @property
    def plain(self) -> list[float]:
        return [r.rate for r in self.plain_rounds]

    @property
    def leased(self) -> list[float]:
        return [r.rate for r in self.leased_rounds]

    @property
    def guarded(self) -> list[float]:
        return [r.rate for r in self.guarded_rounds]

    @property
    def ratio(self) -> float:
        return median(self.leased) / median(self.plain)

    @property
    def lease_ms(self) -> float:
        """What a lease adds to a task: leased minus plain ms a task (medians, one worker)."""
        return 1000 / median(self.leased) - 1000 / median(self.plain)

    @property
    def cycle_ms(self) -> float:
        """ms of one hold() cycle in this pool's rounds (median; NaN when none was timed)."""
        return median(self.hold_cycle_ms) if self.hold_cycle_ms else math.nan

    @property
    def target_kind(self) -> str:
        return POOL_TARGETS.get(self.pool, "ratio")

    @property
    def passed(self) -> bool:
        if self.target_kind == "cost":
            return self.lease_ms <= COST_TARGET * self.cycle_ms
        return self.ratio >= TARGET

    @property
    def target_text(self) -> str:
        if self.target_kind == "cost":
            return f"lease <= {COST_TARGET}x hold() ({COST_TARGET * self.cycle_ms:.2f} ms)"
        return f"leased/plain >= {TARGET}"

    @property
    def guard_ratio(self) -> float:
        """Guarded over plain tasks/s (NaN when the run had no guarded rounds)."""
        return median(self.guarded) / median(self.plain) if self.guarded else math.nan

    def work(self, kind: str, metric: str) -> float:
        """The median over the rounds of one kind of a per-task metric of RoundStats."""
        rounds = self.rounds_of(kind)
        if not rounds:
            return math.nan
        return median([getattr(r, metric) for r in rounds])

    def lease_cost(self, metric: str, kind: str = "leased") -> float:
        """What the lease (or the guard) adds per task: minus plain, medians of the same run."""
        return self.work(kind, metric) - self.work("plain", metric)

    @property
    def counted(self) -> bool:
        return not math.isnan(self.work("leased", "commands"))

    def by_command(self, kind: str) -> dict[str, float]:
        """Per command, the median over the rounds of its calls per task."""
        rounds = self.rounds_of(kind)
        names = sorted({c for r in rounds for c in r.by_command})
        return {c: median([r.by_command.get(c, 0.0) for r in rounds]) for c in names}


def time_hold_cycles(worker_app: ModuleType, resource: str, count: int = HOLD_CYCLES) -> float:
    """ms a ``hold()`` cycle takes from this process, against the workers' server: the
    yardstick of what a lease adds to a task."""
    hold = worker_app.leases.hold
    with hold(resource):  # warm: scripts loaded, connection made
        pass
    started = time.perf_counter()
    for _ in range(count):
        with hold(resource):
            pass
    return (time.perf_counter() - started) * 1000 / count


def bench_pool(
    worker_app: ModuleType,
    worker: Worker,
    rounds: int,
    n: int,
    warmup: int,
    run_id: str,
    admin: redis.Redis | None,
    guarded: Worker | None = None,
) -> PoolResult:
    """The rounds of one pool; ``guarded`` is the worker of the ``guarded`` kind (if any)."""
    out = PoolResult(worker.pool, worker.concurrency)
    kinds = KINDS if guarded is not None else KINDS[:2]

    def on(kind: str) -> Worker:
        return guarded if kind == "guarded" and guarded is not None else worker

    for kind in kinds:  # warm-up: imports, script loading, heartbeat threads
        tag = f"{run_id}-{worker.pool}-warm-{kind}"
        run_round(worker_app, on(kind), kind, warmup, tag, admin)
    for r in range(rounds):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        for kind in order:
            tag = f"{run_id}-{worker.pool}-{r}-{kind}"
            stats = run_round(worker_app, on(kind), kind, n, tag, admin)
            out.rounds_of(kind).append(stats)
            out.hold_cycle_ms.append(time_hold_cycles(worker_app, f"bench-cycle:{tag}"))
            progress(
                f"{worker.pool} round {r + 1}/{rounds} {kind:6s} {stats.rate:8.0f} tasks/s"
                f"  {stats.commands:5.1f} Redis commands/task, server {stats.cpu_us:5.0f} us/task"
            )
    return out


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _table(heads: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> list[str]:
    if markdown:
        lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        return lines + ["| " + " | ".join(row) + " |" for row in rows]
    table = [tuple(heads), *(tuple(row) for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(heads))]
    text = []
    for k, line in enumerate(table):
        text.append("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
        if k == 0:
            text.append("  ".join("-" * w for w in widths))
    return text


def render(results: Sequence[PoolResult], header: Sequence[str], markdown: bool) -> str:
    """The header, the throughput table and (private server) the Redis work per task."""
    rates = [
        (
            f"{r.pool} (-c {r.concurrency})",
            f"{median(r.plain):,.0f}",
            f"{median(r.leased):,.0f}",
            f"{r.ratio:.2f}",
            f"{r.lease_ms:+.3f}",
            f"{r.cycle_ms:.3f}",
            r.target_text,
            verdict(r.passed),
            " / ".join(f"{lp:.2f}" for lp in _pair_ratios(r)),
            f"{median(r.guarded):,.0f}" if r.guarded else "-",
            f"{r.guard_ratio:.2f}" if r.guarded else "-",
        )
        for r in results
    ]
    heads = (
        "pool",
        "plain tasks/s",
        "leased tasks/s",
        "leased/plain",
        "lease ms/task",
        "hold() ms/cycle",
        "target",
        "verdict",
        "per-round ratios",
        "guarded tasks/s",
        "guarded/plain",
    )
    lines = [*(f"- {line}" for line in header)] if markdown else [*header]
    lines += ["", *_table(heads, rates, markdown)]
    counted = [r for r in results if r.counted]
    if counted:
        work = [
            (
                f"{r.pool} (-c {r.concurrency})",
                f"{r.work('plain', 'commands'):.1f}",
                f"{r.work('leased', 'commands'):.1f}",
                f"{r.lease_cost('commands'):+.1f}",
                f"{r.work('leased', 'scripts'):.2f}",
                f"{r.work('plain', 'cpu_us'):,.0f}",
                f"{r.work('leased', 'cpu_us'):,.0f}",
                f"{r.lease_cost('cpu_us'):+,.0f}",
                f"{r.work('leased', 'script_us'):,.0f}",
                _signed(r.lease_cost("commands", "guarded"), "+.1f"),
                _signed(r.lease_cost("cpu_us", "guarded"), "+,.0f"),
            )
            for r in counted
        ]
        work_heads = (
            "pool",
            "Redis cmds/task plain",
            "leased",
            "lease's cmds",
            "EVALSHA/task",
            "server us/task plain",
            "leased",
            "lease's us",
            "scripts' us/task",
            "guard's cmds",
            "guard's us",
        )
        lines += ["", *_table(work_heads, work, markdown)]
        for r in counted:
            lines += ["", f"{r.pool}: the lease's commands per task, by command: {_extra(r)}"]
            if r.guarded_rounds:
                lines += [
                    "",
                    f"{r.pool}: the guard's commands per task, by command: {_extra(r, 'guarded')}",
                ]
    elif results:
        lines += ["", "Redis work per task: n/a (a shared server: its counts are not ours alone)"]
    return "\n".join(lines)


def _signed(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else format(value, spec)


def _extra(r: PoolResult, kind: str = "leased") -> str:
    """``kind`` minus plain calls per task, per command (those of at least 0.1), most first."""
    plain, leased = r.by_command("plain"), r.by_command(kind)
    extra = {c: leased.get(c, 0.0) - plain.get(c, 0.0) for c in set(plain) | set(leased)}
    shown = sorted((round(v, 1), c) for c, v in extra.items() if abs(v) >= 0.1)
    shown.sort(key=lambda x: -x[0])
    return ", ".join(f"{c.upper()} {v:+.1f}" for v, c in shown) or "none"


def _pool_json(r: PoolResult) -> dict[str, Any]:
    """One pool's raw samples and medians; NaN (no counts on a shared server) becomes null."""

    def clean(value: float) -> float | None:
        return None if math.isnan(value) else value

    def rounds(kind: str, metric: str) -> list[float | None]:
        return [clean(getattr(s, metric)) for s in r.rounds_of(kind)]

    out: dict[str, Any] = {
        "pool": r.pool,
        "concurrency": r.concurrency,
        "plain": r.plain,
        "leased": r.leased,
        "plain_median": median(r.plain),
        "leased_median": median(r.leased),
        "ratio": r.ratio,
        "lease_ms": r.lease_ms,
        "hold_cycle_ms": r.hold_cycle_ms,
        "hold_cycle_ms_median": clean(r.cycle_ms),
        "target_kind": r.target_kind,
        "target": COST_TARGET if r.target_kind == "cost" else TARGET,
        "pass": r.passed,
        "round_ratios": _pair_ratios(r),
        "guarded": r.guarded,
        "guarded_median": median(r.guarded) if r.guarded else None,
        "guard_ratio": clean(r.guard_ratio),
    }
    for metric, name in METRICS.items():
        for kind in KINDS:
            out[f"{kind}_{name}"] = rounds(kind, metric)
            out[f"{kind}_{name}_median"] = clean(r.work(kind, metric))
        out[f"lease_{name}"] = clean(r.lease_cost(metric))
        out[f"guard_{name}"] = clean(r.lease_cost(metric, "guarded"))
    for kind in KINDS:
        out[f"{kind}_by_command"] = r.by_command(kind)
    return out


#: RoundStats field -> its name in tasks.json (per task; ``_median`` and ``lease_`` variants)
METRICS: Final = {
    "commands": "calls_per_task",
    "scripts": "evalsha_per_task",
    "script_us": "script_us_per_task",
    "cpu_us": "server_us_per_task",
}


def _pair_ratios(r: PoolResult) -> list[float]:
    return [lease / plain for plain, lease in zip(r.plain, r.leased, strict=True)]


ABOUT: Final = (
    "`python -m bench.tasks` (`--quick` for a short run) measures what a lease costs a task. One "
    "real worker per pool (solo, prefork `-c 2`) runs `plain(x)` and `leased_tiny(rid)` from the "
    "worker-test app `tests/integration/worker/worker_app.py`: the same trivial body, the second "
    "under an exclusive lease, every rid distinct so that no task waits for another. Rounds "
    "interleave the two kinds on the same worker (plain, leased, then leased, plain, ...). A "
    "round (1,000 tasks by default) publishes its tasks to a fresh queue first and then tells the "
    "worker to consume it (remote control `add_consumer`), so the worker never waits for the "
    "publisher; the rate is `(n - 1) / (last - first date_done)` of the stored results. Workers "
    "run with `-l warning`, results stored. The value is the median of the rounds (5 by "
    "default). Targets: solo, what a lease adds to a task (leased minus plain ms a task) is at "
    "most 1.2x one `hold()` cycle, timed by the bench after each round against the same server; "
    "prefork `-c 2`, leased >= 0.9 x plain. Results also go to `bench/results/tasks.md` "
    "and `bench/results/tasks.json` (every round).",
    "By default a private redis-server holds broker, backend and leases, so the server's counters "
    "are ours alone, and the second table gives what a round cost the server per task, from the "
    "consume order to the last stored result (the worker's broker, result and lease work and the "
    "benchmark's polling for the results; publishing the tasks falls outside). **Redis cmds**: "
    "the commands the server ran (`INFO commandstats` calls, those run inside Lua scripts and "
    "`MULTI`/`EXEC` included). **EVALSHA**: the lease's script calls. **server us**: the CPU "
    "time of the server's main thread (`INFO cpu`, user plus system), which includes reading, "
    "parsing and answering each request. **scripts' us**: the `INFO commandstats` usec of the "
    "EVALSHA calls, the time the lease's scripts ran, their inner commands included. The usec "
    "of all commands cannot be added up for a total: Redis counts a command run by a script or "
    "an `EXEC` both in its own entry and in the script's or the `EXEC`'s time. **lease's**: "
    "leased minus plain, the medians of the same run: the library's cost per task; the line "
    "under the table splits the lease's commands by command. A lease adds two round trips to "
    "every task (the acquire and the release scripts): where one process does all of a task's "
    "Redis work (solo) they weigh the most; under prefork the children run them while the main "
    "process does the broker and result work.",
    "**guarded**: the plain task on a second worker of the same pool that runs with the "
    "[redelivery guard](redelivery.md) on, in the same rounds; **guard's**: guarded minus plain. "
    "The guard takes a lease, writes a completion record and releases the lease for every task, "
    "in the worker's main process.",
)
PLOT: Final = "![Task throughput and Redis work per task](img/bench-tasks.svg)"


def docs_section(body: str) -> str:
    about = [textwrap.fill(p, 100, break_on_hyphens=False, break_long_words=False) for p in ABOUT]
    return "\n\n".join([SECTION, *about, PLOT, body]) + "\n"


def update_docs(path: Path, section: str) -> None:
    """Replace the ``## Task throughput`` section of ``path``, or append it."""
    replace_section(path, SECTION, section)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tasks",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds x 300 tasks")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per pool (default 5)")
    parser.add_argument("--tasks", type=int, default=0, help="tasks per round (default 1000)")
    parser.add_argument(
        "--pools", default="solo,prefork", help="comma-separated: solo, prefork (default both)"
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="a loopback Redis to use instead of a private server (others' load then counts)",
    )
    parser.add_argument(
        "--out-dir", default=str(RESULTS_DIR), help="where tasks.md and tasks.json go"
    )
    parser.add_argument("--docs", default=str(DOCS), help="the docs page to update")
    parser.add_argument("--no-docs", action="store_true", help="do not touch the docs page")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    n = args.tasks or (300 if args.quick else 1000)
    warmup = max(50, n // 5)
    pools = [p.strip() for p in args.pools.split(",") if p.strip()]
    unknown = [p for p in pools if p not in POOLS]
    if unknown:
        raise SystemExit(f"unknown pool(s) {unknown}; choose from {sorted(POOLS)}")
    run_id = secrets.token_hex(4)
    prefix = f"bench-tasks-{run_id}"
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: list[PoolResult] = []
    with redis_target(args.redis_url) as (url, private):
        progress(f"redis at {url} ({'private server' if private else 'given by --redis-url'})")
        admin = redis.Redis.from_url(url)
        machine = machine_info(admin)
        env = worker_env(url, prefix, f"bench-{run_id}-idle")
        worker_app = load_app(env)
        try:
            for pool in pools:
                worker = start_worker(worker_app, pool, POOLS[pool], env, run_id, out_dir)
                guarded: Worker | None = None
                try:
                    guarded = start_worker(
                        worker_app, pool, POOLS[pool], env, run_id, out_dir, guard=True
                    )
                    progress(f"{pool} workers up ({worker.hostname}, {guarded.hostname})")
                    counter = admin if private else None
                    results.append(
                        bench_pool(worker_app, worker, rounds, n, warmup, run_id, counter, guarded)
                    )
                finally:
                    for w in (worker, guarded):
                        if w is not None:
                            w.stop()
                            w.log_path.unlink(missing_ok=True)
        finally:
            worker_app.app.close()
            worker_app.leases.store.close()
            if not private:  # leave nothing behind on somebody else's server
                for pattern in (f"*{prefix}*", f"*bench-{run_id}*"):
                    for key in admin.scan_iter(match=pattern, count=1000):
                        admin.unlink(key)
            admin.close()
    elapsed = time.monotonic() - started
    header = [
        f"machine: {machine['cpus']} cores, {machine['cpu_model']}; {machine['platform']}; "
        f"load {machine['load']} at start",
        f"python {machine['python']}, redis-py {machine['redis_py']}, "
        f"server {machine['server']} ({'private' if private else 'shared'})",
        f"run: {rounds} rounds x {n} tasks per kind and pool (+{warmup} warm-up), "
        f"{elapsed:.0f} s, {machine['date']}",
    ]
    summary = "targets: " + ", ".join(
        f"{r.pool} ({r.target_text}) {verdict(r.passed)}" for r in results
    )
    print(render(results, header, markdown=False))
    print()
    print(summary)
    body = render(results, header, markdown=True) + "\n\n" + summary
    tmp = out_dir / "tasks.md.tmp"
    tmp.write_text(f"# Task throughput results\n\n{body}\n")
    os.replace(tmp, out_dir / "tasks.md")
    write_json(
        str(out_dir / "tasks.json"),
        {
            "machine": machine,
            "config": {
                "rounds": rounds,
                "tasks": n,
                "warmup": warmup,
                "quick": bool(args.quick),
                "private_server": private,
            },
            "elapsed_s": elapsed,
            "target": TARGET,
            "pools": [_pool_json(r) for r in results],
        },
    )
    if not args.no_docs:
        update_docs(Path(args.docs), docs_section(body))
    progress(
        f"wrote {out_dir / 'tasks.md'}, {out_dir / 'tasks.json'}"
        + ("" if args.no_docs else f" and {args.docs}")
    )
    plot.refresh(out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
