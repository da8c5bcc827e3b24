"""Fleet benchmark: 10,000 leased tasks over 50 resources on 4 worker processes.

    python -m bench.fleet                      # 5 rounds x 2,000 tasks per kind; ~2 min on 2 cores
    python -m bench.fleet --quick              # 2 rounds x 500
    python -m bench.fleet --redis-url redis://127.0.0.1:6379/15        # leases on a given Redis
    python -m bench.fleet --redis-url redis+cluster://127.0.0.1:7000 --slot-groups 16
    python -m bench.fleet --help

It is a benchmark, not a test: it prints ratios against a baseline measured in the same run and
exits 0 whatever they are.

Four ``celery worker -P solo`` processes (``--pool prefork`` runs one ``-c 4`` worker instead)
run the app ``bench/fleet_app.py``. ``leased(rid, ...)`` sleeps a short body (5 ms) under an
exclusive lease on ``fleet:<rid>``, ``on_busy="retry"`` with a small countdown (first retry
after 10-20 ms, doubling up to 0.5 s); ``rid`` is drawn at random from 50 resources, so two
tasks running at once often want the same one. The baseline, ``plain``, is the same task, same
body and same ``rid`` sequence, without the lease. A control kind, ``uncontended``, runs
``leased`` on resources no other task wants (``--no-uncontended`` skips it): the lease's own
cost, without busy retries. Each round publishes its tasks to a fresh
queue first and then tells every worker to consume it (remote control ``add_consumer``), so
the workers never wait for the publisher; the kinds take turns in an order that rotates per
round.

Measured, per kind: tasks/s end to end (tasks / (last body end - the consume order), the
median of the rounds, and tasks / the rounds' total time); for ``leased`` the acquire latency
(first acquire attempt to grant: the acquire call when the lease was free, else from the first
busy reply to the grant, countdowns and the retried message's queueing included) p50/p99/max
over every task, and the busy retries. On a private lease Redis also the commands the lease
Redis ran per task (INFO commandstats; scripts' inner commands included).

Redis servers: the broker and the tasks' ledger live on a private redis-server the benchmark
starts (``--broker-url`` puts the broker elsewhere, e.g. RabbitMQ; it is the same for both
kinds). Leases live on ``--redis-url`` (any URL the library accepts), or by default on a second
private server, so the lease Redis sees lease traffic only. Results merge into
``bench/results/fleet.json`` under a label (``single (private)``, ``single (given)`` or
``cluster``; ``--label`` to choose), and ``docs/benchmarks.md``'s ``## Fleet run`` section and
``docs/img/bench-fleet.svg`` are redrawn from every label there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import socket
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import redis

from celery_leases._redis_server import RedisServer
from celery_leases.config import safe_url
from tests.support.servers import ensure_server_binary
from tests.support.topology import LocalCluster

from . import plot
from ._common import (
    Worker,
    machine_info,
    median,
    percentile,
    replace_section,
    server_version,
    spawn_worker,
    write_json,
    write_text,
)

REPO: Final = Path(__file__).resolve().parents[1]
RESULTS_DIR: Final = REPO / "bench" / "results"
DOCS: Final = REPO / "docs" / "benchmarks.md"
SECTION: Final = "## Fleet run"
APP: Final = "bench.fleet_app"
#: plain: no lease; leased: a lease on one of ``resources``; uncontended: a lease on a resource
#: no other task wants (the lease's own cost, without busy retries)
KINDS: Final = ("plain", "leased", "uncontended")
START_TIMEOUT: Final = 60.0
ROUND_TIMEOUT: Final = 600.0
CLUSTER_LABEL: Final = "cluster"
CLUSTER_PLACEHOLDER: Final = "cluster: run by scripts/bench --cluster"


def progress(message: str) -> None:
    print(f"[bench.fleet] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Config:
    tasks: int  # per kind, over all rounds
    rounds: int
    warmup: int
    processes: int
    pool: str
    resources: int
    body: float
    retry_delay: float
    retry_max_delay: float
    slot_groups: int
    seed: int
    uncontended: bool

    @property
    def per_round(self) -> int:
        return self.tasks // self.rounds

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Config:
        quick = bool(args.quick)
        tasks = args.tasks or (1000 if quick else 10_000)
        rounds = args.rounds or (2 if quick else 5)
        if tasks < rounds:
            raise SystemExit(f"--tasks ({tasks}) must be at least --rounds ({rounds})")
        for name in ("processes", "resources"):
            if getattr(args, name) < 1:
                raise SystemExit(f"--{name} must be at least 1, not {getattr(args, name)}")
        if args.body < 0 or args.retry_delay <= 0 or args.retry_max_delay < args.retry_delay:
            raise SystemExit(
                "--body must be >= 0, --retry-delay > 0 and --retry-max-delay >= --retry-delay"
            )
        warmup = args.warmup if args.warmup >= 0 else min(200, max(tasks // rounds // 5, 10))
        return cls(
            tasks=tasks - tasks % rounds,
            rounds=rounds,
            warmup=warmup,
            processes=args.processes,
            pool=args.pool,
            resources=args.resources,
            body=args.body,
            retry_delay=args.retry_delay,
            retry_max_delay=args.retry_max_delay,
            slot_groups=args.slot_groups,
            seed=args.seed,
            uncontended=not args.no_uncontended,
        )


# --- workers ------------------------------------------------------------------------------------
def worker_env(
    cfg: Config, *, broker: str, ledger: str, lease_url: str, prefix: str, idle_queue: str
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_LEASES_")}
    env.update(
        {
            "BENCH_FLEET_BROKER": broker,
            "BENCH_FLEET_LEDGER": ledger,
            "BENCH_FLEET_QUEUE": idle_queue,
            "BENCH_FLEET_BODY": repr(cfg.body),
            "CELERY_LEASES_REDIS_URL": lease_url,
            "CELERY_LEASES_KEY_PREFIX": prefix,
            "CELERY_LEASES_SLOT_GROUPS": str(cfg.slot_groups),
            "CELERY_LEASES_RETRY_DELAY": repr(cfg.retry_delay),
            "CELERY_LEASES_RETRY_MAX_DELAY": repr(cfg.retry_max_delay),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def load_app(env: dict[str, str]) -> ModuleType:
    """Import the fleet app in this process, configured like the workers (it publishes)."""
    for key, value in env.items():
        if key.startswith(("BENCH_FLEET_", "CELERY_LEASES_")):
            os.environ[key] = value
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import bench.fleet_app as fleet_app

    return fleet_app


def start_workers(
    app: ModuleType, cfg: Config, env: dict[str, str], run_id: str, log_dir: Path
) -> list[Worker]:
    """Start the workers together, then wait until each answers a ping."""
    solo = cfg.pool == "solo"
    layout = [("solo", 1)] * cfg.processes if solo else [("prefork", cfg.processes)]
    workers: list[Worker] = []
    try:
        for i, (pool, concurrency) in enumerate(layout):
            hostname = f"fleet{i}-{run_id}@{socket.gethostname()}"
            log_path = log_dir / f"fleet-worker-{i}-{run_id}.log"
            workers.append(spawn_worker(APP, pool, concurrency, hostname, log_path, env, REPO))
        deadline = time.monotonic() + START_TIMEOUT
        for w in workers:
            while not app.app.control.ping(destination=[w.hostname], timeout=0.5):
                if w.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"worker {w.hostname} did not come up:\n{w.log_tail()}")
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers


# --- one round ----------------------------------------------------------------------------------
@dataclass
class RoundResult:
    kind: str
    n: int
    seconds: float
    immediate: list[float]  # acquire latencies (s) of leased tasks granted at the first try
    retried: list[float]  # ... and of those that found their lease busy first
    retries: int
    lease_commands: float | None  # per task, on a private lease Redis

    @property
    def rate(self) -> float:
        return self.n / self.seconds if self.seconds > 0 else float("inf")

    @property
    def latencies(self) -> list[float]:
        return self.immediate + self.retried


def lease_commands(admin: redis.Redis | None) -> int | None:
    """Commands the lease Redis ran so far (scripts' inner calls included), or None."""
    if admin is None:
        return None
    stats = admin.info("commandstats")
    return sum(
        int(v.get("calls", 0))
        for k, v in stats.items()
        if isinstance(v, dict) and not k.startswith(("cmdstat_info", "cmdstat_config"))
    )


def run_round(
    app: ModuleType,
    workers: Sequence[Worker],
    kind: str,
    rids: Sequence[int],
    tag: str,
    lease_admin: redis.Redis | None,
) -> RoundResult:
    """Publish ``len(rids)`` tasks to a fresh queue, let every worker drain it, read the ledger."""
    celery_app = app.app
    task = app.plain if kind == "plain" else app.leased
    queue = f"bench-fleet-{tag}"
    ledger: redis.Redis = app.ledger()
    key = app.done_key(tag)
    n = len(rids)
    with celery_app.producer_or_acquire() as producer:
        for seq, rid in enumerate(rids):
            task.apply_async((rid, tag, seq), queue=queue, producer=producer)
    hostnames = [w.hostname for w in workers]
    before = lease_commands(lease_admin)
    start = time.time()
    replies = celery_app.control.add_consumer(queue, destination=hostnames, reply=True)
    if len(replies) < len(hostnames):
        raise SystemExit(f"only {len(replies)} of {len(hostnames)} workers took {queue}")
    deadline = time.monotonic() + ROUND_TIMEOUT
    while ledger.llen(key) < n:
        dead = [w for w in workers if w.proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            who = dead[0] if dead else workers[0]
            msg = f"round {tag}: {ledger.llen(key)}/{n} done; log of {who.hostname}:\n"
            raise SystemExit(msg + who.log_tail())
        time.sleep(0.05)
    after = lease_commands(lease_admin)
    celery_app.control.cancel_consumer(queue, destination=hostnames, reply=True)
    records = [str(r).split() for r in ledger.lrange(key, 0, -1)]
    ledger.delete(key)
    seqs = {int(r[0]) for r in records}
    if len(records) != n or len(seqs) != n:
        raise SystemExit(f"round {tag}: {len(records)} records for {n} tasks ({len(seqs)} unique)")
    end = max(int(r[3]) for r in records) / 1e6
    leased = kind != "plain"
    return RoundResult(
        kind=kind,
        n=n,
        seconds=end - start,
        immediate=[int(r[1]) / 1e6 for r in records if leased and r[2] == "0"],
        retried=[int(r[1]) / 1e6 for r in records if leased and r[2] != "0"],
        retries=sum(int(r[2]) for r in records),
        lease_commands=None if before is None or after is None else (after - before) / n,
    )


# --- the run ------------------------------------------------------------------------------------
@dataclass
class KindResult:
    rounds: list[RoundResult] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        rates = [r.rate for r in self.rounds]
        latencies = [x for r in self.rounds for x in r.latencies]
        n = sum(r.n for r in self.rounds)
        commands = [r.lease_commands for r in self.rounds if r.lease_commands is not None]
        out: dict[str, Any] = {
            "tasks": n,
            "rates": rates,
            "rate_median": median(rates),
            "rate_overall": n / sum(r.seconds for r in self.rounds),
            "retries": sum(r.retries for r in self.rounds),
            "retried_tasks": sum(len(r.retried) for r in self.rounds),
            "lease_commands_per_task": median(commands) if commands else None,
        }
        if latencies:
            out["latency_ms"] = {
                "p50": percentile(latencies, 50) * 1000,
                "p90": percentile(latencies, 90) * 1000,
                "p99": percentile(latencies, 99) * 1000,
                "max": max(latencies) * 1000,
                "mean": sum(latencies) / len(latencies) * 1000,
            }
            for part in ("immediate", "retried"):
                values = [x for r in self.rounds for x in getattr(r, part)]
                out["latency_ms"][part] = {
                    "n": len(values),
                    "p50": percentile(values, 50) * 1000 if values else None,
                    "p99": percentile(values, 99) * 1000 if values else None,
                }
        return out


@contextmanager
def private_server(what: str) -> Iterator[RedisServer]:
    server = RedisServer(binary=ensure_server_binary())
    server.start()
    progress(f"{what}: private redis-server at {server.url}")
    try:
        yield server
    finally:
        server.stop()


def default_label(url: str | None) -> str:
    if url is None:
        return "single (private)"
    if "cluster" in url.split("://", 1)[0]:
        return CLUSTER_LABEL
    return "single (given)"


def delete_prefix(app: ModuleType, prefix: str) -> int:
    """Delete every key of ``prefix`` from the lease Redis, through the library's own client."""
    client = app.leases.store.client
    n = 0
    for key in list(client.scan_iter(match=f"{{{prefix}:*", count=1000)):
        n += int(client.unlink(key))
    return n


def bench(cfg: Config, args: argparse.Namespace, run_id: str, out_dir: Path) -> dict[str, Any]:
    prefix = f"bench-fleet-{run_id}"
    results = {kind: KindResult() for kind in KINDS}
    with ExitStack() as stack:
        aux = stack.enter_context(private_server("broker and ledger"))
        aux_client = redis.Redis.from_url(aux.url)
        stack.callback(aux_client.close)
        broker = args.broker_url or aux.url
        lease_admin: redis.Redis | None = None
        if args.local_cluster:
            progress("starting a local Redis Cluster (3 primaries) for the leases")
            lease_url = stack.enter_context(LocalCluster(masters=3)).url
        elif args.redis_url is None:
            lease_url = stack.enter_context(private_server("leases")).url
            lease_admin = redis.Redis.from_url(lease_url)
            stack.callback(lease_admin.close)
        else:
            lease_url = args.redis_url
        env = worker_env(
            cfg,
            broker=broker,
            ledger=aux.url,
            lease_url=lease_url,
            prefix=prefix,
            idle_queue=f"bench-fleet-{run_id}-idle",
        )
        app = load_app(env)
        stack.callback(app.app.close)
        lease_version = server_version(app.leases.store.client)
        machine = machine_info(aux_client)
        stack.callback(app.leases.store.close)
        if args.redis_url is not None and not args.local_cluster:  # leave nothing behind
            stack.callback(lambda: progress(f"deleted {delete_prefix(app, prefix)} lease keys"))
        workers = start_workers(app, cfg, env, run_id, out_dir)
        for w in workers:
            stack.callback(w.log_path.unlink, missing_ok=True)
            stack.callback(w.stop)
        progress(f"{len(workers)} worker(s) up: {cfg.pool}, {cfg.processes} processes")
        rng = random.Random(cfg.seed)
        warm = [rng.randrange(cfg.resources) for _ in range(cfg.warmup)]
        kinds = KINDS if cfg.uncontended else KINDS[:2]
        for kind in kinds:  # imports, connections, script loading, heartbeat threads
            rids = warm if kind != "uncontended" else unique_rids(cfg, -1, len(warm))
            run_round(app, workers, kind, rids, f"{run_id}-warm-{kind}", lease_admin)
        started = time.monotonic()
        for r in range(cfg.rounds):
            contended = [rng.randrange(cfg.resources) for _ in range(cfg.per_round)]
            for kind in rotated(kinds, r):
                rids = contended if kind != "uncontended" else unique_rids(cfg, r, cfg.per_round)
                res = run_round(app, workers, kind, rids, f"{run_id}-{r}-{kind}", lease_admin)
                results[kind].rounds.append(res)
                extra = ""
                if kind != "plain":
                    p50 = percentile(res.latencies, 50) * 1000
                    p99 = percentile(res.latencies, 99) * 1000
                    extra = (
                        f"  acquire p50 {p50:.2f} ms p99 {p99:.1f} ms  {res.retries} busy retries"
                    )
                progress(f"round {r + 1}/{cfg.rounds} {kind:11s} {res.rate:5.0f} tasks/s{extra}")
        measured = time.monotonic() - started
    plain, leased = results["plain"].summary(), results["leased"].summary()
    control: dict[str, Any] = {}
    if cfg.uncontended:
        free = control["uncontended"] = results["uncontended"].summary()
        control["uncontended_ratio"] = free["rate_median"] / plain["rate_median"]
    return {
        "label": args.label or ("cluster" if args.local_cluster else default_label(args.redis_url)),
        "lease_url": (
            "a local Redis Cluster (3 primaries, private)"
            if args.local_cluster
            else "a private redis-server"
            if args.redis_url is None
            else safe_url(lease_url)
        ),
        "key_prefix": prefix,
        "lease_server": lease_version,
        "private_lease_server": args.redis_url is None,
        "broker": safe_url(broker) if args.broker_url else "private redis-server",
        "machine": machine,
        "config": asdict(cfg),
        "measured_s": measured,
        "plain": plain,
        "leased": leased,
        "ratio": leased["rate_median"] / plain["rate_median"],
        "round_ratios": [lr / pr for pr, lr in zip(plain["rates"], leased["rates"], strict=True)],
        **control,
    }


def unique_rids(cfg: Config, round_no: int, n: int) -> list[int]:
    """Resource ids no other task of the run wants (the contended kinds use 0 .. resources-1)."""
    base = cfg.resources + (round_no + 1) * 10_000_000
    return list(range(base, base + n))


def rotated(items: Sequence[str], by: int) -> list[str]:
    by %= len(items)
    return [*items[by:], *items[:by]]


# --- output -------------------------------------------------------------------------------------
HEADS: Final = (
    "lease Redis",
    "workers",
    "plain tasks/s",
    "leased tasks/s",
    "leased/plain",
    "uncontended leased tasks/s (/plain)",
    "acquire p50 / p99 / max ms",
    "p50 granted at once / found busy first ms",
    "busy retries (tasks retried)",
    "lease cmds/task",
    "run",
)


def table_row(run: dict[str, Any]) -> tuple[str, ...]:
    cfg, plain, leased = run["config"], run["plain"], run["leased"]
    lat = leased["latency_ms"]
    n = leased["tasks"]
    workers = (
        f"{cfg['processes']} x solo" if cfg["pool"] == "solo" else f"prefork -c {cfg['processes']}"
    )
    cmds = leased.get("lease_commands_per_task")
    return (
        f"{run['label']} (Redis {run['lease_server']}, slot_groups {cfg['slot_groups']})",
        workers,
        f"{plain['rate_median']:,.0f}",
        f"{leased['rate_median']:,.0f}",
        f"{run['ratio']:.2f}; paired {median(run['round_ratios']):.2f} "
        f"({' / '.join(f'{x:.2f}' for x in run['round_ratios'])})",
        (
            f"{run['uncontended']['rate_median']:,.0f} ({run['uncontended_ratio']:.2f})"
            if "uncontended" in run
            else "-"
        ),
        f"{lat['p50']:.2f} / {lat['p99']:,.0f} / {lat['max']:,.0f}",
        f"{_opt(lat['immediate']['p50'], '.2f')} / {_opt(lat['retried']['p50'], ',.0f')}",
        f"{leased['retries']:,} ({leased['retried_tasks'] / n:.1%} of {n:,})",
        "n/a" if cmds is None else f"{cmds:.1f}",
        f"{run['machine']['date']}, load {run['machine']['load']}",
    )


def _opt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_table(runs: Sequence[dict[str, Any]], markdown: bool) -> str:
    rows = [table_row(r) for r in runs]
    if markdown:
        if not any(r["label"] == CLUSTER_LABEL for r in runs):
            rows.append((CLUSTER_PLACEHOLDER, *(["-"] * (len(HEADS) - 1))))
        lines = ["| " + " | ".join(HEADS) + " |", "|" + "---|" * len(HEADS)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        return "\n".join(lines)
    table = [HEADS, *rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADS))]
    text = []
    for k, line in enumerate(table):
        text.append("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
        if k == 0:
            text.append("  ".join("-" * w for w in widths))
    return "\n".join(text)


def header(run: dict[str, Any]) -> list[str]:
    m, cfg = run["machine"], run["config"]
    return [
        f"machine: {m['cpus']} cores, {m['cpu_model']}; {m['platform']}; load {m['load']} at start",
        f"python {m['python']}, redis-py {m['redis_py']}; broker {run['broker']} "
        f"(Redis {str(m['server']).split()[0]}); leases on {run['lease_url']}",
        f"run: {cfg['rounds']} rounds x {cfg['tasks'] // cfg['rounds']:,} tasks per kind "
        f"(+{cfg['warmup']} warm-up each), {cfg['resources']} resources, body "
        f"{cfg['body'] * 1000:.0f} ms, retry countdown {cfg['retry_delay']} s doubling to "
        f"{cfg['retry_max_delay']} s; {run['measured_s']:.0f} s measured, {m['date']}",
    ]


ABOUT: Final = (
    "`scripts/bench fleet` (`python -m bench.fleet`; `--quick` for a short run) runs 10,000 "
    "leased tasks over 50 resources on 4 worker processes against the same 10,000 tasks "
    "without leases. The workers are four `celery worker -P solo` processes, four nodes as in "
    "a fleet of pods: each has its own broker connection, heartbeat, start-up cleanup and "
    "reconcile bid, and leases are contended across nodes (one prefork `-c 4` worker, "
    "`--pool prefork`, would put all broker work on one main process, the bottleneck on 2 "
    "cores). `leased(rid)` sleeps 5 ms under an exclusive lease on `fleet:<rid>`, `rid` drawn "
    'at random from 50, `on_busy="retry"` with `retry_delay` 0.02 s (first countdown '
    "10-20 ms) doubling up to 0.5 s; `plain(rid)` is the same task without the lease, on the "
    "same `rid` sequence. A control kind, *uncontended*, runs `leased` on a resource no other "
    "task wants: the lease's own cost without busy retries. Each round (2,000 tasks of each "
    "kind) is published to a fresh queue first, then every worker is told to consume it; the "
    "kinds take turns in an order that rotates per round. tasks/s = tasks / (last "
    "body end - the consume order), median of the 5 rounds; leased/plain is the ratio of those "
    "medians, then the median of the per-round ratios (each leased round beside the plain one "
    "of its turn) and, in brackets, each round's. Acquire latency: first acquire attempt to "
    "grant, over all 10,000 leased tasks of the contended kind "
    "(a task that found its lease busy counts from that first busy reply, so its countdowns "
    "and the retried message's trip through the broker are included). Busy retries: retries "
    "of all tasks (and the share of tasks that retried at least once). Broker and the tasks' "
    "ledger are a private redis-server; leases a second private one, or `--redis-url` (then "
    "lease commands per task are not counted). Raw samples: `bench/results/fleet.json`."
)


def docs_section(runs: Sequence[dict[str, Any]]) -> str:
    about = textwrap.fill(ABOUT, 100, break_on_hyphens=False, break_long_words=False)
    lines = [SECTION, "", about, "", "![Fleet run](img/bench-fleet.svg)", ""]
    for run in runs:
        lines.append(f"`{run['label']}`:")
        lines.append("")
        lines += [f"- {h}" for h in header(run)]
        lines.append("")
    lines += [render_table(runs, markdown=True), ""]
    return "\n".join(lines)


def load_runs(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return {}
    runs = data.get("runs", {})
    return runs if isinstance(runs, dict) else {}


def ordered(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    # single-Redis rows first, the cluster row last
    return sorted(runs.values(), key=lambda r: (r["label"] == CLUSTER_LABEL, r["label"]))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fleet",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds x 500 tasks per kind")
    parser.add_argument("--tasks", type=int, default=0, help="tasks per kind (default 10000)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per kind (default 5)")
    parser.add_argument(
        "--warmup", type=int, default=-1, help="warm-up tasks per kind (default: 1/5 round)"
    )
    parser.add_argument("--processes", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument(
        "--pool",
        choices=("solo", "prefork"),
        default="solo",
        help="solo: that many solo workers (default); prefork: one worker -c that many",
    )
    parser.add_argument("--resources", type=int, default=50, help="distinct resources")
    parser.add_argument("--body", type=float, default=0.005, help="task body seconds (0.005)")
    parser.add_argument(
        "--retry-delay", type=float, default=0.02, help="lease retry_delay setting (0.02 s)"
    )
    parser.add_argument(
        "--retry-max-delay", type=float, default=0.5, help="lease retry_max_delay (0.5 s)"
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="the lease Redis, any URL the library takes (default: a private redis-server)",
    )
    parser.add_argument(
        "--local-cluster",
        action="store_true",
        help="put the leases on a private local Redis Cluster of 3 primaries started here",
    )
    parser.add_argument(
        "--slot-groups", type=int, default=1, help="slot_groups setting (raise it on a cluster)"
    )
    parser.add_argument(
        "--broker-url", default=None, help="the broker (default: a private redis-server)"
    )
    parser.add_argument(
        "--label", default=None, help="row label (default: from --redis-url; 'cluster' for one)"
    )
    parser.add_argument(
        "--no-uncontended",
        action="store_true",
        help="skip the control kind: leased tasks on resources no other task wants",
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the rid sequence")
    parser.add_argument("--out-dir", default=str(RESULTS_DIR), help="where fleet.json goes")
    parser.add_argument("--docs", default=str(DOCS), help="the docs page to update")
    parser.add_argument("--no-docs", action="store_true", help="do not touch the docs page")
    parser.add_argument(
        "--redraw",
        action="store_true",
        help="run nothing: redraw fleet.md, the docs section and the plot from fleet.json",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "fleet.json"
    runs = load_runs(path)
    if args.redraw:
        if not runs:
            raise SystemExit(f"--redraw: no runs in {path}")
    else:
        cfg = Config.from_args(args)
        if cfg.slot_groups < 1:
            raise SystemExit(f"--slot-groups must be at least 1, not {cfg.slot_groups}")
        run = bench(cfg, args, secrets.token_hex(4), out_dir)
        runs[run["label"]] = run
        write_json(str(path), {"runs": runs})
        print("\n".join(header(run)))
        print()
        print(render_table([run], markdown=False))
        print()
        free = f", uncontended/plain {run['uncontended_ratio']:.2f}" if "uncontended" in run else ""
        print(
            f"leased/plain {run['ratio']:.2f}{free} (median tasks/s of {cfg.rounds} interleaved "
            f"rounds); {run['leased']['retries']:,} busy retries for {run['leased']['tasks']:,} "
            "leased tasks"
        )
    md = ["# Fleet run results", "", render_table(ordered(runs), markdown=True), ""]
    write_text(str(out_dir / "fleet.md"), "\n".join(md))
    if not args.no_docs:
        replace_section(Path(args.docs), SECTION, docs_section(ordered(runs)))
    progress(f"wrote {path}" + ("" if args.no_docs else f" and {args.docs}"))
    plot.refresh(out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
