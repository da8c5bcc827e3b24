"""Rate limits on a real Redis: the window guarantee under a hammering, the exact wait,
overrides, penalties, and admissions taken all or nothing with a task's leases.

Every admission is stamped with the Redis time the script admitted it at (the ``at`` of the
``limit_admitted`` signal), so "at most N in any window" is checked on the clock the limit
promises it on.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from bench.limits import most_in_any_window  # one window count for the bench and tests
from celery_leases import LeaseBusy, LeasedTask, Leases, Rate, RateLimited, signals
from celery_leases._limits import LimitWant, admit, list_limits, next_admit
from celery_leases.exceptions import LeaseConfigError
from tests.support.polling import wait_until
from tests.support.topologies import leases_factory
from tests.support.topology import LocalCluster

US = 1_000_000


@pytest.fixture
def stamps() -> Iterator[list[tuple[str, int, int]]]:
    """``(name, at_us, cost)`` of every admission this process makes while the test runs."""
    seen: list[tuple[str, int, int]] = []
    lock = threading.Lock()

    def on_admitted(sender: object = None, **kw: Any) -> None:
        with lock:
            seen.append((kw["name"], round(kw["at"] * US), kw["cost"]))

    signals.limit_admitted.connect(on_admitted, weak=False, dispatch_uid="test-limits")
    yield seen
    signals.limit_admitted.disconnect(dispatch_uid="test-limits")


def _hammer(url: str, prefix: str, name: str, rate: str, costs: list[int]) -> None:
    """In a process of its own: say it is ready, wait for the test's go (the Unix time to
    stop at), then take ``name`` over and over until then; push ``"<at_us> <cost>"`` of each
    admission to a list in Redis."""
    leases = Leases(Celery("hammer", set_as_current=False), redis_url=url, key_prefix=prefix)
    client = redis.Redis.from_url(url)
    client.rpush(f"{{{prefix}}}:ready", 1)
    # the go is polled, not BLPOPed: redis-py 8's 5 s socket timeout would cut a long block
    deadline = time.monotonic() + 120
    while (go := client.get(f"{{{prefix}}}:go")) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if go is None:
        return
    until = float(go)
    i = 0
    while time.time() < until:
        cost = costs[i % len(costs)]
        i += 1
        got: list[str] = []

        def on_admitted(sender: object = None, **kw: Any) -> None:
            got.append(f"{round(kw['at'] * US)} {kw['cost']}")  # noqa: B023

        signals.limit_admitted.connect(on_admitted, weak=False, dispatch_uid="hammer")
        try:
            leases.limit(name, rate, cost=cost, wait=max(0.0, until - time.time()))
        except RateLimited:
            break
        finally:
            signals.limit_admitted.disconnect(dispatch_uid="hammer")
        client.rpush(f"{{{prefix}}}:stamps", *got)


@pytest.mark.parametrize("costs", [[1], [1, 3, 2]], ids=["cost-1", "mixed-costs"])
def test_no_window_holds_more_than_n_and_the_backlog_uses_the_limit(
    make_leases: Callable[..., Leases],
    leases_redis_url: str,
    leases_prefix: str,
    leases_redis: redis.Redis,
    stamps: list[tuple[str, int, int]],
    costs: list[int],
) -> None:
    leases = make_leases()
    name, rate, n = "hammer:1", "20/s", 20
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_hammer, args=(leases_redis_url, leases_prefix, name, rate, costs))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    # the 4 s of hammering start once both processes are up: spawning and importing them can
    # take longer than that on a loaded machine, and they must hammer beside the threads
    wait_until(
        lambda: leases_redis.llen(f"{{{leases_prefix}}}:ready") == len(procs),
        120,
        "the hammering processes to start",
    )
    until = time.time() + 4.0
    leases_redis.set(f"{{{leases_prefix}}}:go", repr(until), ex=600)

    def thread_hammer(k: int) -> None:
        i = k
        while time.time() < until:
            i += 1
            try:
                leases.limit(name, rate, cost=costs[i % len(costs)], wait=until - time.time())
            except (RateLimited, LeaseConfigError):
                return

    threads = [threading.Thread(target=thread_hammer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    mine = [(at, cost) for _, at, cost in stamps]
    theirs = [
        (int(at), int(cost))
        for at, cost in (
            s.split() for s in leases_redis.lrange(f"{{{leases_prefix}}}:stamps", 0, -1)
        )
    ]
    assert theirs, "the other processes were admitted too"
    everything = mine + theirs
    assert most_in_any_window(everything, US) <= n
    # under a backlog the limit is used: from the first admission, >= 90 % of N per second
    # over every whole second the hammering lasted (its last second may be cut short)
    first = min(at for at, _ in everything)
    for second in range(3):
        start = first + second * US
        used = sum(c for at, c in everything if start <= at < start + US)
        assert used >= 0.9 * n, (second, used)


def test_retry_after_is_exact_and_a_retry_then_is_admitted(
    make_leases: Callable[..., Leases], stamps: list[tuple[str, int, int]]
) -> None:
    leases = make_leases()
    for _ in range(5):
        leases.limit("exact", "5/s")

    # the wait is exactly when the oldest admission leaves the window, on the Redis clock
    store = leases.store
    keys = store.keys.limit_keys("exact")
    reply = store.client.evalsha(
        store.client.script_load(open_script("limit")),
        5,
        *keys[:4],
        store.keys.limit_index(keys[4]),
        *(5, US, 1, "exact", "0"),  # N, period, cost, name, only look
    )
    code, wait_us, _, _, now = (int(x) for x in reply)
    ((_, oldest),) = store.client.zrange(keys[0], 0, 0, withscores=True)
    assert code == 0
    assert wait_us == int(oldest) + US - now > 0
    assert 0 < store.run(next_admit(store.engine, LimitWant("exact", 5, US, 1))) <= wait_us / US

    with pytest.raises(RateLimited) as refused:
        leases.limit("exact", "5/s")
    assert isinstance(refused.value, LeaseBusy)
    assert refused.value.resource == "exact"
    wait = refused.value.retry_after
    assert 0 < wait <= 1.0
    time.sleep(wait)
    leases.limit("exact", "5/s")  # admitted: the first admission has left the window
    first, last = stamps[0][1], stamps[-1][1]
    assert last - first >= US


def open_script(name: str) -> str:
    from celery_leases import _scripts

    return _scripts.ALL[name]


def test_a_key_never_seen_costs_nothing_and_an_idle_one_vanishes(
    make_leases: Callable[..., Leases], leases_redis: redis.Redis, leases_prefix: str
) -> None:
    leases = make_leases()
    store = leases.store
    with pytest.raises(LeaseConfigError):
        leases.limit("idle", "2/s", cost=3)
    assert store.run(next_admit(store.engine, LimitWant("never", 2, US, 1))) == 0
    assert leases_redis.keys(f"*{leases_prefix}*rl:never") == []
    leases.limit("idle", "2/s")
    log, state, _, _, group = store.keys.limit_keys("idle")
    assert 0 < leases_redis.pttl(log) <= 1001
    assert 0 < leases_redis.pttl(state) <= 1001
    assert 0 < leases_redis.pttl(store.keys.limit_index(group)) <= 1001


def test_set_rate_overrides_at_once_and_its_removal_restores_the_declared_rate(
    make_leases: Callable[..., Leases],
) -> None:
    leases, other = make_leases(), make_leases()  # two processes' worth of clients
    for _ in range(2):
        leases.limit("ovr", "2/m")
    with pytest.raises(RateLimited):
        leases.limit("ovr", "2/m")
    other.set_rate("ovr", "4/m")
    leases.limit("ovr", "2/m")  # admitted: the override is in force fleet-wide, at once
    leases.limit("ovr", "2/m")
    with pytest.raises(RateLimited) as refused:
        leases.limit("ovr", "2/m")
    assert refused.value.retry_after > 50  # the window of a minute
    (row,) = leases.store.run(list_limits(leases.store.engine))
    assert (row.name, row.rate, row.override, row.used, row.left) == ("ovr", "4/m", "4/m", 4, 0)
    other.set_rate("ovr", None)
    with pytest.raises(RateLimited):
        leases.limit("ovr", "2/m")
    (row,) = leases.store.run(list_limits(leases.store.engine))
    assert (row.rate, row.override) == ("2/m", None)
    with pytest.raises(LeaseConfigError, match="'2/d'"):
        other.set_rate("ovr", "2/d")
    # an override below a cost asked: an error, not an endless refusal
    other.set_rate("ovr", "1/m")
    with pytest.raises(LeaseConfigError, match="override"):
        leases.limit("ovr", "5/m", cost=2)


def test_penalize_admits_nobody_until_it_ends(make_leases: Callable[..., Leases]) -> None:
    leases = make_leases()
    leases.limit("pen", "100/s")
    assert leases.penalize("pen", retry_after=1.0) == pytest.approx(1.0)
    assert leases.penalize("pen", retry_after=0.2) > 0.5  # a longer one in force is kept
    with pytest.raises(RateLimited) as refused:
        leases.limit("pen", "100/s")
    assert 0.5 < refused.value.retry_after <= 1.0
    (row,) = leases.store.run(list_limits(leases.store.engine))
    assert row.left == 0
    assert row.penalty > 0.5
    time.sleep(refused.value.retry_after)
    leases.limit("pen", "100/s")
    with pytest.raises(LeaseConfigError):
        leases.penalize("pen", retry_after=-1)


def test_wait_sleeps_the_exact_wait_and_gives_up_when_it_cannot_help(
    make_leases: Callable[..., Leases], stamps: list[tuple[str, int, int]]
) -> None:
    leases = make_leases()
    leases.limit("w", "1/s")
    with pytest.raises(RateLimited):
        leases.limit("w", "1/s", wait=0.3)  # the room comes in ~1 s: no point waiting
    leases.limit("w", "1/s", wait=5)
    assert stamps[-1][1] - stamps[0][1] >= US


# --- tasks: all or nothing with the leases ---------------------------------------------------
@pytest.fixture
def task_app(make_leases: Callable[..., Leases]) -> tuple[Celery, Leases]:
    app = Celery("limits-tasks", set_as_current=False)
    app.conf.task_always_eager = False
    return app, make_leases(app=app)


def test_a_busy_lease_leaves_no_admission(task_app: tuple[Celery, Leases]) -> None:
    app, leases = task_app
    ran: list[int] = []

    @app.task(base=LeasedTask, lease="doc:{doc}", rate=Rate("api:{account}", "1/m"), on_busy="fail")
    def sync(account: int, doc: int) -> None:
        ran.append(doc)

    with leases.hold("doc:1"), pytest.raises(LeaseBusy) as busy:
        sync.apply(args=(7, 1), throw=True)
    assert not isinstance(busy.value, RateLimited)
    sync.apply(args=(7, 1), throw=True)  # the limit still has its one admission
    assert ran == [1]
    with pytest.raises(RateLimited):
        sync.apply(args=(7, 2), throw=True)
    with leases.hold("doc:2", wait=0):  # the refused task kept no lease
        pass


def test_a_second_limit_refusing_refunds_the_first_and_frees_the_leases(
    task_app: tuple[Celery, Leases],
) -> None:
    app, leases = task_app
    ran: list[str] = []

    @app.task(
        base=LeasedTask,
        lease="doc:{doc}",
        rates=[Rate("a:{doc}", "1/m"), Rate("b", "1/m")],
        on_busy="fail",
    )
    def both(doc: str) -> None:
        ran.append(doc)

    leases.limit("b", "1/m")  # b is full for a minute
    with pytest.raises(RateLimited) as refused:
        both.apply(args=("x",), throw=True)
    assert refused.value.resource == "b"
    assert refused.value.retry_after > 50
    store = leases.store
    rows = {r.name: r for r in store.run(list_limits(store.engine))}
    assert "a:x" not in rows or rows["a:x"].used == 0  # refunded
    leases.limit("a:x", "1/m")  # its one admission is still there
    with leases.hold("doc:x", wait=0):  # and no lease was kept
        pass
    assert ran == []


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A counter of round trips to Redis made by this process: each request written to a
    socket (a command, a pipeline, or a lane's direct call) counts one."""
    import redis.connection

    from celery_leases._sync import lanes

    count = [0]
    send = redis.connection.AbstractConnection.send_packed_command
    direct = lanes._direct

    def counted_send(self: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return send(self, *args, **kwargs)

    def counted_direct(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return direct(*args, **kwargs)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted_send)
    monkeypatch.setattr(lanes, "_direct", counted_direct)
    return count


def test_a_limit_rides_in_the_round_trip_of_the_lease(
    task_app: tuple[Celery, Leases], round_trips: list[int], stamps: list[tuple[str, int, int]]
) -> None:
    app, leases = task_app

    @app.task(base=LeasedTask, lease="rt:{k}", rate=Rate("rt-api:{k}", "1000/s"), on_busy="fail")
    def rt_both(k: int) -> int:
        return k

    @app.task(base=LeasedTask, lease="rt:{k}", on_busy="fail")
    def rt_lease_only(k: int) -> int:
        return k

    counts = {}
    for task in (rt_lease_only, rt_both):
        for k in range(3):  # connections made, scripts known, the owner's home call done
            task.apply(args=(k,), throw=True)
        before = round_trips[0]
        assert task.apply(args=(99,), throw=True).get() == 99
        counts[task] = round_trips[0] - before
    print(f"round trips: lease only {counts[rt_lease_only]}, 1 lease + 1 limit {counts[rt_both]}")
    assert counts[rt_lease_only] == 2  # the grant, the release
    assert counts[rt_both] == 2  # the grant with the limit check riding in it, the release
    assert [name for name, _, _ in stamps].count("rt-api:99") == 1

    # all or nothing still: a busy lease takes its admission back, a refusal frees the lease
    @app.task(base=LeasedTask, lease="rt2:{k}", rate=Rate("rt2-api:{k}", "1/m"), on_busy="fail")
    def rt_one(k: int) -> int:
        return k

    with leases.hold("rt2:1"), pytest.raises(LeaseBusy):
        rt_one.apply(args=(1,), throw=True)
    store = leases.store
    rows = {r.name: r for r in store.run(list_limits(store.engine))}
    assert "rt2-api:1" not in rows or rows["rt2-api:1"].used == 0
    assert rt_one.apply(args=(1,), throw=True).get() == 1
    with pytest.raises(RateLimited):
        rt_one.apply(args=(1,), throw=True)
    with leases.hold("rt2:1", wait=0):
        pass


def test_on_busy_wait_sleeps_until_the_limit_admits(
    task_app: tuple[Celery, Leases], stamps: list[tuple[str, int, int]]
) -> None:
    app, _ = task_app

    @app.task(base=LeasedTask, rate=Rate("slow", "2/s"), on_busy="wait", wait_timeout=10)
    def slow() -> str:
        return "done"

    for _ in range(5):
        assert slow.apply(throw=True).get() == "done"
    assert len(stamps) == 5
    assert stamps[-1][1] - stamps[0][1] >= 2 * US
    assert most_in_any_window([(at, c) for _, at, c in stamps], US) <= 2


def test_on_busy_skip_skips_and_the_admission_is_not_taken(task_app: tuple[Celery, Leases]) -> None:
    app, _leases = task_app

    @app.task(base=LeasedTask, rate=Rate("sk:{k}", "1/m"), on_busy="skip")
    def sk(k: int) -> int:
        return k

    assert sk.apply(args=(1,)).get() == 1
    assert sk.apply(args=(1,)).get() == {
        "celery_leases.skipped": {"resource": "sk:1", "holder_task": None}
    }


# --- a Redis Cluster --------------------------------------------------------------------------
def test_limits_on_a_redis_cluster_over_slot_groups(
    redis_cluster: LocalCluster, leases_prefix: str
) -> None:
    with leases_factory(redis_cluster.url, leases_prefix, slot_groups=8) as make:
        leases = make()
        keys = leases.store.keys
        names = []
        i = 0
        while len({keys.group_of(n) for n in names}) < 3:
            names.append(f"cl:{i}")
            i += 1
        for name in names:
            leases.limit(name, "1/m")
            with pytest.raises(RateLimited):
                leases.limit(name, "1/m")
        leases.penalize(names[0], retry_after=30)
        leases.set_rate(names[1], "3/m")
        leases.limit(names[1], "1/m")
        rows = {r.name: r for r in leases.store.run(list_limits(leases.store.engine))}
        assert set(rows) == set(names)
        assert rows[names[0]].penalty > 20
        assert (rows[names[1]].override, rows[names[1]].used) == ("3/m", 2)

        # all or nothing over groups: the refusal of one refunds the others
        store = leases.store
        fresh = [f"fresh:{k}" for k in range(20)]
        wants = [LimitWant(n, 1, 60 * US, 1) for n in [*fresh, names[2]]]
        with pytest.raises(RateLimited):
            store.run(admit(store.engine, wants))
        for name in fresh:
            leases.limit(name, "1/m")  # each still has its one admission

        # a task's limit riding with its lease, the two in different slot groups
        app = leases.app
        lease_name = next(f"cl-doc:{i}" for i in range(100) if keys.group_of(f"cl-doc:{i}") != 0)
        limit_name = next(
            f"cl-api:{i}"
            for i in range(100)
            if keys.group_of(f"cl-api:{i}") not in (0, keys.group_of(lease_name))
        )

        @app.task(base=LeasedTask, lease=lease_name, rate=Rate(limit_name, "1/m"), on_busy="fail")
        def cl_ride() -> str:
            return "ran"

        with leases.hold(lease_name), pytest.raises(LeaseBusy):
            cl_ride.apply(throw=True)
        assert cl_ride.apply(throw=True).get() == "ran"  # the busy lease kept no admission
        with pytest.raises(RateLimited):
            cl_ride.apply(throw=True)
        with leases.hold(lease_name, wait=0):  # the refused task kept no lease
            pass


# --- operators: the CLI and the metrics -------------------------------------------------------
def test_the_limits_command_lists_rate_override_and_penalty(
    make_leases: Callable[..., Leases], leases_redis_url: str, leases_prefix: str, tmp_path: Path
) -> None:
    leases = make_leases()
    for _ in range(3):
        leases.limit("api:42", "10/m")
    leases.set_rate("api:42", "50/m")
    leases.penalize("mail", retry_after=30)
    (tmp_path / "limapp.py").write_text('from celery import Celery\napp = Celery("limapp")\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_LEASES_")}
    env.update(
        CELERY_LEASES_REDIS_URL=leases_redis_url,
        CELERY_LEASES_KEY_PREFIX=leases_prefix,
        PYTHONPATH=str(tmp_path),
    )
    argv = [sys.executable, "-m", "celery", "-A", "limapp", "leases", "limits"]
    out = subprocess.run([*argv, "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert set(rows) == {"api:42", "mail"}
    assert rows["api:42"]["rate"] == "50/m"
    assert rows["api:42"]["declared"] == "10/m"
    assert rows["api:42"]["used"] == 3
    assert rows["api:42"]["left"] == 47
    assert rows["mail"]["penalty"] > 20
    assert rows["mail"]["left"] == 0
    table = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0].split()[:3] == ["LIMIT", "RATE", "OVERRIDE"]
    assert any(line.split()[:3] == ["api:42", "50/m", "50/m"] for line in table.stdout.splitlines())


def test_metrics_count_by_template_never_by_key(task_app: tuple[Celery, Leases]) -> None:
    from prometheus_client import CollectorRegistry

    from celery_leases.metrics import install

    app, leases = task_app
    registry = CollectorRegistry()
    installed = install(registry)
    try:

        @app.task(base=LeasedTask, rate=Rate("m:{k}", "1/m"), on_busy="fail")
        def m(k: int) -> None: ...

        for k in range(3):
            m.apply(args=(k,), throw=True)
        with pytest.raises(RateLimited):
            m.apply(args=(0,), throw=True)
        leases.limit("plain", "5/s")

        def sample(name: str, template: str) -> float | None:
            return registry.get_sample_value(f"celery_leases_{name}", {"template": template})

        assert sample("rate_admitted_total", "m:{k}") == 3
        assert sample("rate_limited_total", "m:{k}") == 1
        assert sample("rate_admitted_total", "-") == 1
        assert sample("rate_admitted_total", "m:0") is None
    finally:
        installed.uninstall()
