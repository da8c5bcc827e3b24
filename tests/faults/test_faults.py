"""Fault injection: leased tasks on a fleet of real workers while one fault at a time strikes.

Each scenario runs a few hundred ``work`` tasks on a dozen resources (so tasks contend) over
three workers (prefork, threads, prefork), injects its fault several times while they run,
and checks in the ledger (tests/faults/ledger.py):

- overlaps: 0 wherever the guarantee holds;
- lost tasks: 0 (acks_late + reject_on_worker_lost; retries by policy are counted apart). A
  task received by a worker and never finished is ours and fails the scenario. A task whose
  message no worker ever received was lost by the broker: a failure on RabbitMQ (acks_late is
  at-least-once there), reported but not failed on kombu's Redis transport, which can lose a
  message to a kill -9 of a worker (it pops it before it records it as unacknowledged; see
  docs/faults.md, "What the broker can lose");
- the fenced store: where the guarantee cannot hold (Redis restarted empty without a restart
  grace), the stale holder's writes are refused, because fencing tokens keep growing across
  the data loss.

See docs/faults.md for what each scenario shows and a measured run.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis

from tests.faults.conftest import TTL, Fleet, ScenarioReport, check_losses, hold_for
from tests.support.polling import wait_until
from tests.support.proxy import LossyProxy

pytestmark = [
    pytest.mark.faults,
    pytest.mark.worker,
    pytest.mark.filterwarnings("always::tests.faults.conftest.BrokerLostMessages"),
]

#: work tasks per scenario, and the resources they share (few, so that tasks contend)
TASKS = 600
RESOURCES = 12


def standard_fleet(fleet: Fleet, clock: bool = False) -> list[Any]:
    """prefork x3, threads x4, prefork x2; with ``clock`` the first one's wall clock can jump."""
    workers = [
        fleet.add("prefork", 3, env={"FAULTS_CLOCK": "1"} if clock else None),
        fleet.add("threads", 4),
        fleet.add("prefork", 2),
    ]
    fleet.ready()
    return workers


def at(fleet: Fleet, fraction: float) -> None:
    """Wait until ``fraction`` of the scenario's work tasks completed."""
    fleet.wait_completed(int(fraction * TASKS))


def explain(fleet: Fleet, counts: Any) -> str:
    return (
        f"overlaps: {fleet.ledger.overlap_log()[:5]}; failed: {list(counts.failed.items())[:5]}; "
        f"rejected writes: {fleet.ledger.rejected()[:5]}"
    )


def check_guarantees(fleet: Fleet, reports: list[ScenarioReport], note: str = "") -> Any:
    """The checks of every scenario where the guarantee holds."""
    counts, losses = fleet.finish(reports, note)
    why = explain(fleet, counts)
    assert counts.overlaps == 0, why
    check_losses(fleet, losses, why)
    assert counts.failed == {}, why
    assert counts.token_regressions == 0, why
    # no overlap, so no holder ever wrote after a newer one
    assert counts.writes_rejected == 0, why
    return counts


@pytest.mark.parametrize("broker", ["amqp", "redis"])
def test_kill_9_of_workers_and_children(
    broker: str, make_fleet: Any, reports: list[ScenarioReport]
) -> None:
    """On RabbitMQ and on kombu's Redis transport (visibility_timeout 15 s, swept every 1 s).

    On Redis a kill -9 of a worker's main process can lose the message it was taking from the
    queue (popped, not yet recorded as unacknowledged): reported as lost by the broker.
    """
    fleet = make_fleet("kill-9" if broker == "amqp" else "kill-9-redis", broker=broker)
    a, b, c = standard_fleet(fleet)
    fleet.send_work(TASKS, RESOURCES, seed=1)

    at(fleet, 0.10)
    fleet.kill_child(a)
    at(fleet, 0.25)
    fleet.kill_worker(b)  # the threads worker: restarted under the same name
    b.start(wait=False)
    at(fleet, 0.40)
    fleet.kill_child(c)
    at(fleet, 0.55)
    fleet.kill_worker(a)  # a prefork worker that never comes back: reconcile or TTL frees it
    fleet.add("prefork", 3)
    at(fleet, 0.70)
    fleet.kill_child(c)
    at(fleet, 0.85)
    fleet.kill_worker(c)
    c.start(wait=False)

    counts = check_guarantees(fleet, reports)
    assert counts.dead_holders > 0 or all(not f.in_flight for f in fleet.faults)


#: the deferring task (on_busy="defer") of the parked-task scenario
DEFERRED = "tests.faults.faults_app.deferred"


@pytest.mark.parametrize("broker", ["amqp", "redis"])
def test_kill_9_with_parked_tasks(
    broker: str, make_fleet: Any, reports: list[ScenarioReport]
) -> None:
    """The kill -9 scenario with deferring tasks (on_busy="defer") beside the work tasks, on
    the same resources: parked in Redis, handed on by releases and the pump while pool
    children and whole workers are killed. Every deferring task completes exactly once,
    except that a task whose process was killed may run again (acks_late): each completion
    but one of a task is by a process that was killed."""
    fleet = make_fleet("kill-9-park" if broker == "amqp" else "kill-9-park-redis", broker=broker)
    a, b, c = standard_fleet(fleet)
    deferred: list[str] = []
    # 300 of each, interleaved, so that both kinds contend for the resources (a hand-on's
    # copy waits behind the whole backlog in the broker's queue: 600 of each took 3 minutes)
    for batch in range(6):
        fleet.send_work(TASKS // 12, RESOURCES, seed=10 + batch)
        deferred += fleet.send_work(TASKS // 12, RESOURCES, seed=20 + batch, task=DEFERRED)
    total = 2 * len(deferred)
    killed: set[int] = set()

    def at_(fraction: float) -> None:
        fleet.wait_completed(int(fraction * total), timeout=120)

    at_(0.10)
    killed.update(fleet.kill_child(a))
    at_(0.25)
    killed.update(fleet.kill_worker(b))  # the threads worker: restarted under the same name
    b.start(wait=False)
    at_(0.40)
    killed.update(fleet.kill_child(c))
    at_(0.55)
    killed.update(fleet.kill_worker(a))  # never comes back: its hand-ons are taken over
    fleet.add("prefork", 3)
    at_(0.70)
    killed.update(fleet.kill_child(c))
    at_(0.85)
    killed.update(fleet.kill_worker(c))
    c.start(wait=False)

    ledger = fleet.ledger
    parked, handed_on = ledger.count("parked"), ledger.count("handed_on")
    ran_handed_on = ledger.count("ran_handed_on")
    note = f"deferred {len(deferred)}: parked {parked}, handed on {handed_on}"
    counts = check_guarantees(fleet, reports, note)
    runs = ledger.deferred_completions()
    done = ledger.done_ids()
    once = sum(1 for t in deferred if len(runs.get(t, [])) == 1)
    twice = {t: pids for t, pids in runs.items() if len(pids) > 1}
    print(
        f"{fleet.name}: {len(deferred)} deferring tasks, {parked} parks, {handed_on} hand-ons "
        f"published, {ran_handed_on} runs from a hand-on, {once} completed once, "
        f"{len(twice)} more than once {twice}; kills: {len(fleet.faults)}"
    )
    # parking happened, and hand-ons ran
    assert parked > 0
    assert ran_handed_on > 0
    # none lost: the ones the broker lost (Redis transport) were reported by check_guarantees
    lost = set(deferred) - done
    assert not lost - set(fleet.losses().by_broker), sorted(lost)[:5]
    # none twice, but for a run in a process that was killed (acks_late reruns it)
    for task_id, pids in twice.items():
        assert sum(1 for p in pids if p not in killed) <= 1, (task_id, pids, sorted(killed))
        assert any(p in killed for p in pids), (task_id, pids)
    assert counts.overlaps == 0


def probe_started(fleet: Fleet, rid: str) -> int:
    """Wait until the probe on r:<rid> runs; return its fencing token."""
    events = wait_until(lambda: fleet.ledger.events(f"started:{rid}"), 30, f"probe {rid}")
    return int(events[0][1])


def test_redis_restart_with_data_loss(
    make_fleet: Any, make_leases: Any, reports: list[ScenarioReport]
) -> None:
    """restart_grace=0 (the default): a new holder can be granted while an old one still runs.

    Mutual exclusion cannot hold here; what protects the data is the fencing token, which
    keeps growing across the data loss (it is at least the Redis clock in microseconds).
    """
    fleet = make_fleet("restart")
    standard_fleet(fleet)
    ledger = fleet.ledger

    # A holder that cannot be stopped in time (on_lost="log") holds r:probe across a restart;
    # the test process is granted r:probe again at once, as any new holder would be.
    fleet.send("stubborn", "probe", 60.0)
    old_token = probe_started(fleet, "probe")
    fleet.server.restart()
    fleet.fault("restart (probe)")
    harness = make_leases(redis_url=fleet.server.url, key_prefix="faults-restart", ttl=TTL)
    with harness.hold("r:probe", wait=10) as lease:
        new_token = lease.token
        overlapped = ledger.enter("r:probe", new_token, "harness")
        try:
            assert ledger.write("r:probe", new_token, "harness")
            refused = wait_until(
                lambda: [e for e in ledger.events("write:probe") if e[1] == f"{old_token} 0"],
                10,
                "the old holder's next write to be refused",
            )
        finally:
            ledger.leave("r:probe", new_token, "harness")
    ledger.r.set(ledger.key("stop", "probe"), 1)
    assert new_token > old_token, "the fencing token went backwards across the data loss"
    assert overlapped == 1, "the old holder was not inside when the new one entered"
    assert refused
    fleet.wait_completed(1)  # the probe has stopped: its counts are final
    probe = ledger.counts()

    fleet.send_work(TASKS, RESOURCES, seed=2)
    for fraction in (0.2, 0.5, 0.8):
        at(fleet, fraction)
        fleet.server.restart()
        fleet.fault("restart")

    counts, losses = fleet.finish(
        reports,
        note=(
            "restart_grace=0: mutual exclusion cannot hold after a restart with data loss; "
            "the overlaps are old holders still inside when a new one entered, and the "
            "fenced store refused every write an old holder made after a newer token wrote "
            f"(the probe: {probe.overlaps} overlap, {probe.writes_rejected} writes refused)"
        ),
    )
    why = explain(fleet, counts)
    check_losses(fleet, losses, why)
    assert counts.failed == {}, why
    assert counts.token_regressions == 0, why
    assert counts.overlaps >= 1, why
    assert counts.writes_rejected >= 1, why
    for rejected in ledger.rejected():
        assert rejected["token"] < rejected["last"], rejected


def assert_probe_told_first(ledger: Any, harness: Any, old_token: int) -> None:
    """After a restart with a grace, ``harness`` takes ``r:probe`` from the stubborn probe:
    the old holder is told its lease is lost before the new one is granted, they never
    overlap, and the new token is newer."""
    with harness.hold("r:probe", wait=4 * TTL) as lease:
        granted_ms = ledger.now_ms()
        overlapped = ledger.enter("r:probe", lease.token, "harness")
        ledger.leave("r:probe", lease.token, "harness")
    lost = ledger.events("lost:probe")
    assert lost, "the old holder was never told its lease was lost"
    assert lost[0][0] <= granted_ms, "the new holder was granted before the old one knew"
    assert overlapped == 0
    assert lease.token > old_token


def test_redis_restart_with_restart_grace(
    make_fleet: Any, make_leases: Any, reports: list[ScenarioReport]
) -> None:
    """restart_grace=TTL: after a data loss nothing is granted until every old holder knows."""
    fleet = make_fleet("restart-grace", restart_grace=TTL)
    standard_fleet(fleet)
    ledger = fleet.ledger

    fleet.send("polite", "probe", 60.0)
    old_token = probe_started(fleet, "probe")
    fleet.server.restart()
    fleet.fault("restart (probe)")
    harness = make_leases(
        redis_url=fleet.server.url, key_prefix="faults-restart-grace", ttl=TTL, restart_grace=TTL
    )
    assert_probe_told_first(ledger, harness, old_token)

    fleet.send_work(TASKS, RESOURCES, seed=3)
    for fraction in (0.2, 0.5, 0.8):
        at(fleet, fraction)
        fleet.server.restart()
        fleet.fault("restart")
    check_guarantees(
        fleet,
        reports,
        note="restart_grace=ttl: no grant for ttl after Redis is found empty (recovery >= ttl)",
    )


def test_redis_restart_from_a_snapshot(
    make_fleet: Any, make_leases: Any, reports: list[ScenarioReport]
) -> None:
    """The defaults: after a restore from an RDB snapshot nothing is granted until every
    holder of a grant made after the snapshot knows it is gone (restore_grace = ttl)."""
    fleet = make_fleet("restart-snapshot")
    standard_fleet(fleet)
    ledger = fleet.ledger

    def snapshot() -> None:
        with redis.Redis.from_url(fleet.server.url, socket_timeout=30) as client:
            client.save()

    snapshot()
    fleet.send("polite", "probe", 60.0)  # granted after the snapshot: the restore loses it
    old_token = probe_started(fleet, "probe")
    fleet.server.restart(keep_data=True)
    fleet.fault("restart from a snapshot (probe)")
    harness = make_leases(redis_url=fleet.server.url, key_prefix="faults-restart-snapshot", ttl=TTL)
    assert_probe_told_first(ledger, harness, old_token)

    fleet.send_work(TASKS, RESOURCES, seed=4)
    for fraction in (0.2, 0.5, 0.8):
        at(fleet, fraction)
        snapshot()
        at(fleet, fraction + 0.05)  # grants made after the snapshot, lost by the restore
        fleet.server.restart(keep_data=True)
        fleet.fault("restart from a snapshot")
    check_guarantees(
        fleet,
        reports,
        note=(
            "defaults (restore_grace = ttl): no grant for ttl after Redis comes back from "
            "an RDB snapshot (recovery >= ttl)"
        ),
    )


def test_redis_paused_past_the_ttl(make_fleet: Any, reports: list[ScenarioReport]) -> None:
    fleet = make_fleet("pause")
    standard_fleet(fleet)
    fleet.send("polite", "probe", 60.0)
    probe_started(fleet, "probe")
    fleet.send_work(TASKS, RESOURCES, seed=4)
    for fraction in (0.1, 0.45, 0.8):
        at(fleet, fraction)
        fleet.server.pause()
        hold_for(1.5 * TTL)
        fleet.server.resume()
        fleet.fault("pause")
    assert fleet.ledger.events("lost:probe"), "the probe was not told its lease was lost"
    check_guarantees(fleet, reports, note=f"SIGSTOP for {1.5 * TTL:.0f}s (ttl {TTL:.0f}s)")


def test_connections_cut_with_client_kill(make_fleet: Any, reports: list[ScenarioReport]) -> None:
    fleet = make_fleet("client-kill")
    standard_fleet(fleet)
    fleet.send_work(TASKS, RESOURCES, seed=5)
    for fraction in (0.1, 0.3, 0.5, 0.7, 0.9):
        at(fleet, fraction)
        for _ in range(10):  # a storm: every connection cut, ten times in a second
            fleet.admin.client_kill_filter(_type="normal", skipme=True)
            fleet.admin.client_kill_filter(_type="pubsub", skipme=True)
            hold_for(0.1)
        fleet.fault("client kill")
    check_guarantees(fleet, reports, note="each fault: CLIENT KILL of every connection x10 in 1s")


def test_slow_redis_debug_sleep(make_fleet: Any, reports: list[ScenarioReport]) -> None:
    fleet = make_fleet("debug-sleep")
    standard_fleet(fleet)
    fleet.send_work(TASKS, RESOURCES, seed=6)
    at(fleet, 0.1)
    for _ in range(8):  # slow: Redis stalls 0.3 s out of every 0.4 s
        fleet.admin.execute_command("DEBUG", "SLEEP", 0.3)
        hold_for(0.1)
    fleet.fault("debug sleep 0.3s x8")
    for fraction, seconds in ((0.35, 1.0), (0.6, 1.5 * TTL), (0.85, 0.8 * TTL)):
        at(fleet, fraction)
        fleet.admin.execute_command("DEBUG", "SLEEP", seconds)
        fleet.fault(f"debug sleep {seconds}s")
    check_guarantees(
        fleet, reports, note=f"DEBUG SLEEP 0.3s x8, then 1s, {1.5 * TTL:.0f}s, {0.8 * TTL:.1f}s"
    )


def test_clock_jump_on_a_worker(make_fleet: Any, reports: list[ScenarioReport]) -> None:
    """The wall clock of one worker jumps an hour ahead, then two hours back, then right."""
    fleet = make_fleet("clock-jump")
    jumper, _, _ = standard_fleet(fleet, clock=True)
    fleet.send_work(TASKS, RESOURCES, seed=7)
    for fraction, offset in ((0.2, 3600.0), (0.5, -3600.0), (0.8, 0.0)):
        at(fleet, fraction)
        fleet.ledger.set_clock_offset(jumper.hostname, offset)
        fleet.fault(f"clock {offset:+.0f}s")
    check_guarantees(fleet, reports, note="time.time of every process of one prefork worker")


#: share of script replies the proxy loses in the lost-reply scenario
LOST_REPLY_SHARE = 0.05


def test_lost_script_replies(make_fleet: Any, reports: list[ScenarioReport]) -> None:
    """Every worker reaches Redis through a proxy that loses a share of all script replies.

    A lost reply's request has run in Redis (the proxy forwards it, then cuts the
    connection before the reply comes back): grants, releases, renewals and claims whose
    callers never heard the outcome. None of them may leave an orphan behind (the task that
    follows would wait, busy, until its TTL) or give one resource to two holders.
    """
    fleet = make_fleet("lost-reply")
    with LossyProxy("127.0.0.1", fleet.server.port, seed=8) as proxy:
        fleet.env["CELERY_LEASES_REDIS_URL"] = proxy.url()
        standard_fleet(fleet)
        fleet.send_work(TASKS, RESOURCES, seed=8)
        for start, end, held_back in ((0.1, 0.3, False), (0.4, 0.6, True), (0.7, 0.9, False)):
            at(fleet, start)
            if held_back:  # past the workers' socket timeout (1 s): a timeout after it ran
                proxy.delay_fraction(b"EVALSHA", LOST_REPLY_SHARE, 1.5)
            else:
                proxy.drop_fraction(b"EVALSHA", LOST_REPLY_SHARE)
            at(fleet, end)
            proxy.disarm()
            fleet.fault(f"{'held back' if held_back else 'lost'} replies {LOST_REPLY_SHARE:.0%}")
        counts = check_guarantees(
            fleet,
            reports,
            note=(
                f"{LOST_REPLY_SHARE:.0%} of all script replies lost (the request ran; cut at "
                f"10-30 % and 70-90 % of the tasks, held back 1.5 s at 40-60 %): "
                f"{proxy.lost} replies lost"
            ),
        )
    assert proxy.lost > 0, counts
