"""The Celery app of the parked-task tests (on_busy="defer"), run by real workers.

Configured from the environment (``LEASES_TEST_BROKER``, ``LEASES_TEST_QUEUE``,
``LEASES_TEST_LEDGER`` and the ``CELERY_LEASES_*`` settings). Each body records its start
and end, on the Redis clock, in a ledger list: ``"<event> <tenant> <n> <task id> <parked>
<Redis us>"``; ``PAPP_SLOW`` makes bodies sleep that long. Each rate limit admission is
recorded too, at the Redis time the limit script admitted it: ``"a <limit> -1 <task id> 0
<Redis us>"``. The publish of a parked task's copy (a hand-on) is recorded too, as event
``p`` (a ``before_task_publish`` handler).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery
from celery.signals import before_task_publish

from celery_leases import LeasedTask, Leases, Rate, Shared, signals
from tests.support.perprocess import PerProcessClient

BROKER = os.environ.get("LEASES_TEST_BROKER", "redis://127.0.0.1:6379/15")
QUEUE = os.environ.get("LEASES_TEST_QUEUE", "leases-parking-tests")
LEDGER_URL = os.environ.get("LEASES_TEST_LEDGER", BROKER)
PREFIX = os.environ.get("CELERY_LEASES_KEY_PREFIX", "leases")
SLOW = float(os.environ.get("PAPP_SLOW", "0.05"))
#: the result backend, when the broker is not Redis (RabbitMQ): the ledger's Redis
BACKEND = os.environ.get("LEASES_TEST_BACKEND") or None

ledger = PerProcessClient(LEDGER_URL)


def ledger_key(prefix: str) -> str:
    return f"{{{prefix}:ledger}}:events"


def make_app(
    broker: str = BROKER, queue: str = QUEUE, backend: str | None = None, **settings: object
) -> Celery:
    app = Celery("park_app", broker=broker, backend=backend or broker, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        result_expires=600,
        worker_prefetch_multiplier=1,
        task_acks_late=True,
        # a killed worker's unacked deliveries come back after this long (Redis transport)
        broker_transport_options={"visibility_timeout": 10},
    )
    Leases(app, **settings)

    def on_publish(headers: dict[str, Any] | None = None, body: Any = None, **kw: Any) -> None:
        parked = (headers or {}).get("lease_parked")
        if not parked or (headers or {}).get("task") != "park_app.erp":
            return
        (tenant, n), _, _ = body
        client = ledger()
        s, us = client.time()
        line = f"p {tenant} {n} {headers['id']} {parked} {s * 1_000_000 + us}"
        client.rpush(ledger_key(PREFIX), line)

    before_task_publish.connect(on_publish, weak=False, dispatch_uid="park_app.on_publish")

    def record(event: str, tenant: str, n: int, task: LeasedTask) -> None:
        client = ledger()
        s, us = client.time()
        parked = getattr(task.request, "lease_parked", None) or 0
        line = f"{event} {tenant} {n} {task.request.id} {parked} {s * 1_000_000 + us}"
        client.rpush(ledger_key(PREFIX), line)

    @app.task(
        base=LeasedTask, bind=True, name="park_app.erp", shared=False,
        lease=Shared("erp:{tenant}", limit=2), on_busy="defer",
    )  # fmt: skip
    def erp(self: LeasedTask, tenant: str, n: int) -> int:
        record("s", tenant, n, self)
        time.sleep(SLOW)
        record("e", tenant, n, self)
        return n

    @app.task(
        base=LeasedTask, bind=True, name="park_app.excl", shared=False, lease="excl:{tenant}",
        on_busy="defer",
    )  # fmt: skip
    def excl(self: LeasedTask, tenant: str, n: int) -> int:
        record("s", tenant, n, self)
        time.sleep(SLOW)
        record("e", tenant, n, self)
        return n

    @app.task(
        base=LeasedTask, bind=True, name="park_app.uniq", shared=False, lease="excl:{tenant}",
        unique="u:{tenant}", on_busy="defer",
    )  # fmt: skip
    def uniq(self: LeasedTask, tenant: str, n: int) -> int:
        record("s", tenant, n, self)
        record("e", tenant, n, self)
        return n

    # the benchmark's contenders (bench/parking.py): the same lease, the other busy policies
    @app.task(
        base=LeasedTask, bind=True, name="park_app.excl_wait", shared=False,
        lease="excl:{tenant}", on_busy="wait", wait_timeout=120,
    )  # fmt: skip
    def excl_wait(self: LeasedTask, tenant: str, n: int) -> int:
        record("s", tenant, n, self)
        record("e", tenant, n, self)
        return n

    @app.task(
        base=LeasedTask, bind=True, name="park_app.excl_retry", shared=False,
        lease="excl:{tenant}", on_busy="retry",
    )  # fmt: skip
    def excl_retry(self: LeasedTask, tenant: str, n: int) -> int:
        record("s", tenant, n, self)
        record("e", tenant, n, self)
        return n

    # parking on a rate limit: 5 starts a second per tenant, sleep-free bodies
    @app.task(
        base=LeasedTask, bind=True, name="park_app.rated", shared=False,
        rate=Rate("rl:{tenant}", "5/s"), on_busy="defer",
    )  # fmt: skip
    def rated(self: LeasedTask, tenant: str, n: int) -> int:
        record("s", tenant, n, self)
        record("e", tenant, n, self)
        return n

    # two leases: parked on the first, handed on, it may find the second busy and park again
    @app.task(
        base=LeasedTask, bind=True, name="park_app.pair", shared=False,
        leases=["pa:{tenant}", "pb:{tenant}"], on_busy="defer",
    )  # fmt: skip
    def pair(self: LeasedTask, tenant: str, n: int) -> int:
        record("s", tenant, n, self)
        record("e", tenant, n, self)
        return n

    @app.task(
        base=LeasedTask, bind=True, name="park_app.pa", shared=False, lease="pa:{tenant}",
        on_busy="defer",
    )  # fmt: skip
    def pa(self: LeasedTask, tenant: str, n: int) -> int:
        record("s", tenant, n, self)
        record("e", tenant, n, self)
        return n

    # one start a second per tenant: a newcomer's order against a parked task
    @app.task(
        base=LeasedTask, bind=True, name="park_app.rated_one", shared=False,
        rate=Rate("one:{tenant}", "1/s"), on_busy="defer",
    )  # fmt: skip
    def rated_one(self: LeasedTask, tenant: str, n: int) -> int:
        record("s", tenant, n, self)
        record("e", tenant, n, self)
        return n

    @app.task(bind=True, name="park_app.plain", shared=False)
    def plain(self: LeasedTask, tenant: str, n: int) -> int:
        record("s", tenant, n, self)
        record("e", tenant, n, self)
        return n

    return app


def _admitted(sender: object = None, **kw: object) -> None:
    at = round(float(kw["at"]) * 1_000_000)  # type: ignore[arg-type]
    ledger().rpush(ledger_key(PREFIX), f"a {kw['name']} -1 {kw['task_id']} 0 {at}")


if "LEASES_TEST_LEDGER" in os.environ:  # a worker of the tests (not the test process)
    signals.limit_admitted.connect(_admitted, weak=False, dispatch_uid="park_app")
app = make_app(backend=BACKEND)
