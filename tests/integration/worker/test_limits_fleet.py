"""The fleet test of rate limits: real workers, a real broker, one key's backlog.

Four worker processes (two ``celery worker`` of two prefork children), key A at 10/s and key
B at 100/m, 600 tasks of A and then 50 of B sent at once, ``on_busy="retry"`` (each refused
task is sent again with the limiter's exact wait as its countdown). Every task stamps its
start with the Redis clock. On a Redis broker and on RabbitMQ:

- in no 1-second window more than 10 admissions of A (the Redis time the limiter admitted
  each at, which the task records), and no more than 10 starts (TIME in the body) in any
  window of 1 s less the spread of the admission-to-start delays (a few ms);
- A sustains at least 9 starts a second, first start to last;
- B is not slowed by A's backlog: every B starts in the first half of A's run;
- every task runs exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from tests.support.polling import wait_until
from tests.support.workers import WorkerProc, amqp_url_or_skip, worker_factory

pytestmark = pytest.mark.worker

APP = "tests.integration.worker.limits_app"
A_TASKS, B_TASKS = 600, 50
US = 1_000_000
#: 600 tasks at 10/s take a minute; a loaded machine gets three
DEADLINE = 240.0


@pytest.fixture
def start_limits_worker(
    request: pytest.FixtureRequest, worker_env: dict[str, str], tmp_path: Path
) -> Iterator[Callable[..., WorkerProc]]:
    with worker_factory(request.node, APP, worker_env, tmp_path, "l") as start:
        yield start


def _starts(client: redis.Redis, prefix: str, kind: str) -> list[tuple[int, str, int]]:
    """``(start, task id, admission)`` of each run of ``kind``, Redis us, by start."""
    raw = client.lrange(f"{{{prefix}:ledger}}:starts:{kind}", 0, -1)
    return sorted((int(at), task_id, int(adm)) for at, task_id, adm in (s.split() for s in raw))


def most_in_a_second(stamps: list[int]) -> int:
    return most_in_a_window(stamps, US)


def most_in_a_window(stamps: list[int], window_us: int) -> int:
    """The most stamps (sorted, us) in any half-open window of ``window_us``."""
    most = start = 0
    for i, at in enumerate(stamps):
        while stamps[start] <= at - window_us:
            start += 1
        most = max(most, i - start + 1)
    return most


@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_a_fleet_keeps_a_at_10_per_second_and_b_is_not_slowed(
    broker: str,
    start_limits_worker: Callable[..., WorkerProc],
    worker_env: dict[str, str],
    leases_redis_url: str,
    leases_prefix: str,
    queue: str,
) -> None:
    url = amqp_url_or_skip() if broker == "amqp" else leases_redis_url
    env = {"LEASES_TEST_BROKER": url}
    workers = [start_limits_worker("prefork", 2, env=env) for _ in range(2)]
    client = Celery("limits-sender", broker=url, set_as_current=False)
    client.conf.task_default_queue = queue
    ledger = redis.Redis.from_url(leases_redis_url, decode_responses=True)
    try:
        with client.producer_or_acquire() as producer:
            a_ids = [
                client.send_task(
                    "tests.integration.worker.limits_app.call_a",
                    ["tenant"],
                    queue=queue,
                    producer=producer,
                ).id
                for _ in range(A_TASKS)
            ]
            b_ids = [
                client.send_task(
                    "tests.integration.worker.limits_app.call_b",
                    ["tenant"],
                    queue=queue,
                    producer=producer,
                ).id
                for _ in range(B_TASKS)
            ]
        runs_key = f"{{{leases_prefix}:ledger}}:runs"
        wait_until(
            lambda: ledger.hlen(runs_key) >= A_TASKS + B_TASKS,
            DEADLINE,
            f"{A_TASKS + B_TASKS} tasks run",
            step=1.0,
        )
        a = _starts(ledger, leases_prefix, "A")
        b = _starts(ledger, leases_prefix, "B")
        runs = ledger.hgetall(runs_key)
        assert sorted(runs) == sorted(a_ids + b_ids)
        assert set(runs.values()) == {"1"}, "every task runs exactly once"
        assert len(a) == A_TASKS
        assert len(b) == B_TASKS

        stamps = [at for at, _, _ in a]
        # the limiter's guarantee, exact: the admissions (Redis time, in the script)
        admissions = sorted(adm for _, _, adm in a)
        assert most_in_a_second(admissions) <= 10
        # the starts, stamped with TIME in the body, come a few ms after their admission, and
        # that delay varies on a loaded machine (a descheduled process): a 1-second window of
        # starts may catch one more from the next burst. Within the delays' spread they are
        # as exact: no window of 1 s less that spread holds more than 10 starts.
        delays = [start - adm for start, _, adm in a]
        spread = max(delays) - min(delays)
        assert most_in_a_window(stamps, US - spread) <= 10
        span = (stamps[-1] - stamps[0]) / US
        rate = (A_TASKS - 1) / span
        assert rate >= 9.0, f"A ran at {rate:.2f}/s"
        # B is not held back by A's backlog: all of B has started in the first half of A's
        # run (held back, it would end with A's last seconds). What B waits for is the worker
        # getting through A's 600 first deliveries, which a loaded machine slows (11.6 and
        # 13.3 s at load 15, 26 s once at load 20), while the limiter keeps A's run at 60 s
        assert b[-1][0] - stamps[0] < span * US / 2, (b[-1][0] - stamps[0]) / US
        print(
            f"\n{broker}: A at {rate:.2f}/s over {span:.1f}s; B done in "
            f"{(b[-1][0] - stamps[0]) / US:.1f}s; most A in a second: admitted "
            f"{most_in_a_second(admissions)}, started {most_in_a_second(stamps)}; start "
            f"delays {min(delays) / 1000:.1f} to {max(delays) / 1000:.1f} ms"
        )
    finally:
        if broker == "amqp":
            with client.connection_for_write() as conn:
                conn.default_channel.queue_delete(queue)
        client.close()
        ledger.close()
        for w in workers:
            w.stop()
