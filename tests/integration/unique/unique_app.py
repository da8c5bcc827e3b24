"""The Celery app of the unique-task integration tests.

Real ``celery worker`` and ``celery beat`` processes run the module-level ``app``, configured
from the environment (``LEASES_TEST_BROKER``, ``LEASES_TEST_QUEUE``, ``LEASES_TEST_LEDGER``,
every ``CELERY_LEASES_*`` setting, and ``UAPP_BEAT_KEY`` for a beat entry). A test process
makes its own copy with :func:`make_app` on the same broker, queue and key prefix: the
producer's claims must live where the workers look for them.

Tasks record what they do in a ledger in Redis (``{<prefix>:ledger}:...``): ``events(name)``
lists, so a test can tell whether a body ran, and gates the test opens to let a body end.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any

from celery import Celery

from celery_leases import FencedRedis, LeasedTask, LeaseLost, Leases, current_claim
from tests.support.perprocess import PerProcessClient

BROKER = os.environ.get("LEASES_TEST_BROKER", "redis://127.0.0.1:6379/15")
QUEUE = os.environ.get("LEASES_TEST_QUEUE", "leases-unique-tests")
LEDGER_URL = os.environ.get("LEASES_TEST_LEDGER", BROKER)
#: how long a gated body waits for its gate at most
GATE_TIMEOUT = 240.0

ledger = PerProcessClient(LEDGER_URL)


def ledger_key(prefix: str, *parts: object) -> str:
    return f"{{{prefix}:ledger}}:" + ":".join(str(p) for p in parts)


def make_app(
    broker: str = BROKER,
    queue: str = QUEUE,
    beat_key: str | None = None,
    backend: str | None = None,
    tasks: bool = True,
    beat_entry: dict[str, Any] | None = None,
    **settings: Any,
) -> Celery:
    """A Celery app with the test tasks (unless not ``tasks``), ``Leases`` made with
    ``settings``."""
    app = Celery("unique_app", broker=broker, backend=backend or broker, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        result_expires=600,
        worker_prefetch_multiplier=1,
        timezone="UTC",
    )
    if beat_key:
        app.conf.beat_schedule = {
            "unique-every-second": {
                "task": "unique_app.gated",
                "schedule": timedelta(seconds=1),
                "args": [beat_key],
                **(beat_entry or {}),
            }
        }
    leases = Leases(app, **settings)
    prefix = leases.settings.key_prefix
    if not tasks:
        return app

    def record(name: str, value: object) -> None:
        ledger().rpush(ledger_key(prefix, "events", name), str(value))

    def redis_us() -> int:
        sec, usec = ledger().time()
        return int(sec) * 1_000_000 + int(usec)

    def cancellable_body(self: Any, key: str, tag: str, seconds: float, check: bool) -> str:
        """Records its start and end (Redis us) and its claim's token, works ``seconds`` in
        steps of 20 ms (``check``: checking its claim, recording when it learnt it was
        cancelled), then writes ``report:<key>`` fenced with its claim."""
        claim = current_claim()
        assert claim is not None
        record(f"started:{key}", f"{self.request.id} {os.getpid()} {tag}")
        record(f"times:{key}", f"start {redis_us()} {self.request.id} {claim.token}")
        learnt = False
        try:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                if check:
                    try:
                        claim.check()
                    except LeaseLost as exc:
                        if not learnt:
                            learnt = True
                            record(f"times:{key}", f"learnt {redis_us()} {type(exc).__name__}")
                time.sleep(0.02)
            fenced = FencedRedis(ledger(), prefix=f"{prefix}:fenced")
            wrote = fenced.set(f"report:{key}", tag, fence=claim)
            record(f"wrote:{key}", f"{self.request.id} {wrote}")
            record(f"finished:{key}", f"{self.request.id} {tag}")
            return tag
        finally:
            record(f"times:{key}", f"end {redis_us()} {self.request.id}")

    def wait_gate(key: str) -> None:
        r = ledger()
        deadline = time.monotonic() + GATE_TIMEOUT
        while not r.get(ledger_key(prefix, "gate", key)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {key} never opened")
            time.sleep(0.02)

    @app.task(name="unique_app.gated", shared=False, base=LeasedTask, bind=True, unique="job:{key}")
    def gated(self: Any, key: str, tag: str = "") -> str:
        """Announces it started, then runs until the test opens the gate of ``key``."""
        record(f"started:{key}", f"{self.request.id} {os.getpid()} {tag}")
        wait_gate(key)
        record(f"finished:{key}", self.request.id)
        return str(self.request.id)

    @app.task(name="unique_app.quick", shared=False, base=LeasedTask, bind=True, unique="job:{key}")
    def quick(self: Any, key: str, tag: str = "") -> str:
        record(f"started:{key}", f"{self.request.id} {os.getpid()} {tag}")
        return str(self.request.id)

    @app.task(
        name="unique_app.failing", shared=False, base=LeasedTask, bind=True, unique="job:{key}"
    )
    def failing(self: Any, key: str) -> None:
        record(f"started:{key}", self.request.id)
        raise ValueError(f"failing on purpose for {key}")

    @app.task(
        name="unique_app.sleeper", shared=False, base=LeasedTask, bind=True, unique="job:{key}"
    )
    def sleeper(self: Any, key: str, seconds: float = 60.0) -> str:
        """Announces it started, then sleeps (for revoke and kill -9)."""
        record(f"started:{key}", f"{self.request.id} {os.getpid()}")
        time.sleep(seconds)
        return "slept"

    @app.task(
        name="unique_app.retrying",
        shared=False,
        base=LeasedTask,
        bind=True,
        unique="job:{key}",
        max_retries=1,
    )
    def retrying(self: Any, key: str, countdown: float = 1.0) -> str:
        """Retries itself once; the second run waits for the gate of ``key``."""
        record(f"started:{key}", f"{self.request.id} {self.request.retries}")
        if self.request.retries == 0:
            raise self.retry(countdown=countdown)
        wait_gate(key)
        return f"done after {self.request.retries} retry"

    @app.task(
        name="unique_app.leased",
        shared=False,
        base=LeasedTask,
        bind=True,
        unique="job:{key}",
        lease="res:{key}",
        on_busy="retry",
    )
    def leased(self: Any, key: str) -> str:
        """Unique and leased: retries (busy policy) while a test holds ``res:<key>``."""
        record(f"started:{key}", f"{self.request.id} {self.request.retries}")
        return str(self.request.id)

    @app.task(
        name="unique_app.raising",
        shared=False,
        base=LeasedTask,
        unique="job:{key}",
        on_duplicate="raise",
    )
    def raising(key: str) -> str:
        return key

    @app.task(
        name="unique_app.ignoring",
        shared=False,
        base=LeasedTask,
        unique="job:{key}",
        on_duplicate="ignore",
    )
    def ignoring(key: str) -> str:
        return key

    @app.task(
        name="unique_app.hard_limited",
        shared=False,
        base=LeasedTask,
        unique="job:{key}",
        time_limit=2,
    )
    def hard_limited(key: str) -> str:
        record(f"started:{key}", os.getpid())
        time.sleep(30)
        return "not reached"

    @app.task(
        name="unique_app.replacing", shared=False, base=LeasedTask, bind=True, unique="job:{key}"
    )
    def replacing(self: Any, key: str) -> Any:
        """Replaces itself with ``quick`` of the same key (Task.replace keeps the task id)."""
        record(f"started:{key}", f"{self.request.id} replacing")
        wait_gate(key)
        return self.replace(quick.s(key, "replacement"))

    @app.task(
        name="unique_app.late",
        shared=False,
        base=LeasedTask,
        bind=True,
        unique="job:{key}",
        acks_late=True,
        reject_on_worker_lost=True,
    )
    def late(self: Any, key: str) -> str:
        """acks_late: the first run sleeps (to be killed), the redelivered one returns."""
        record(f"started:{key}", f"{self.request.id} {os.getpid()}")
        if ledger().llen(ledger_key(prefix, "events", f"started:{key}")) == 1:
            time.sleep(60)
        return str(self.request.id)

    @app.task(
        name="unique_app.cancellable",
        shared=False,
        base=LeasedTask,
        bind=True,
        unique="can:{key}",
        unique_cancel_deadline=20,
    )
    def cancellable(self: Any, key: str, tag: str = "", seconds: float = 0.0) -> str:
        """on_lost="interrupt": LeaseRevoked is raised in its loop when it is cancelled."""
        return cancellable_body(self, key, tag, seconds, False)

    @app.task(
        name="unique_app.stubborn",
        shared=False,
        base=LeasedTask,
        bind=True,
        unique="stub:{key}",
        on_lost="log",
        unique_cancel_deadline=4,
    )
    def stubborn(self: Any, key: str, tag: str = "", seconds: float = 0.0) -> str:
        """on_lost="log": works on when cancelled, learning it from its claim's check()."""
        return cancellable_body(self, key, tag, seconds, True)

    if not os.environ.get("UAPP_NO_MODE_TASKS"):  # tasks declared with a unique_mode

        @app.task(
            name="unique_app.throttled",
            shared=False,
            base=LeasedTask,
            bind=True,
            unique="thr:{key}",
            unique_mode="throttle",
            unique_window=30,
            on_duplicate="raise",
        )
        def throttled(self: Any, key: str, tag: str = "") -> str:
            record(f"started:{key}", f"{self.request.id} {os.getpid()} {tag}")
            return str(self.request.id)

        @app.task(
            name="unique_app.replaced",
            shared=False,
            base=LeasedTask,
            bind=True,
            unique="rep:{key}",
            unique_mode="replace",
            on_duplicate="raise",
        )
        def replaced(self: Any, key: str, tag: str = "") -> str:
            record(f"started:{key}", f"{self.request.id} {os.getpid()} {tag}")
            wait_gate(key)
            return tag

        @app.task(
            name="unique_app.kept",
            shared=False,
            base=LeasedTask,
            bind=True,
            unique="keep:{key}",
            unique_mode="keep_last",
        )
        def kept(self: Any, key: str, tag: str = "", seconds: float = 0.0) -> str:
            """Announces it started, sleeps ``seconds``, announces it finished."""
            record(f"started:{key}", f"{self.request.id} {os.getpid()} {tag}")
            time.sleep(seconds)
            record(f"finished:{key}", f"{self.request.id} {tag}")
            return tag

        @app.task(
            name="unique_app.kept_late",
            shared=False,
            base=LeasedTask,
            bind=True,
            unique="keeplate:{key}",
            unique_mode="keep_last",
            acks_late=True,
            reject_on_worker_lost=True,
        )
        def kept_late(self: Any, key: str, tag: str = "", seconds: float = 0.0) -> str:
            """keep_last with acks_late: sleeps ``seconds`` on its first delivery only (to be
            killed there), announces it started and finished."""
            record(f"started:{key}", f"{self.request.id} {os.getpid()} {tag}")
            if not (self.request.delivery_info or {}).get("redelivered"):
                time.sleep(seconds)
            record(f"finished:{key}", f"{self.request.id} {tag}")
            return tag

        @app.task(
            name="unique_app.debounced",
            shared=False,
            base=LeasedTask,
            bind=True,
            unique="deb:{key}",
            unique_mode="debounce",
            unique_window=3.0,
            unique_max_wait=30.0,
        )
        def debounced(self: Any, key: str, tag: str = "") -> str:
            record(f"started:{key}", f"{self.request.id} {os.getpid()} {tag}")
            return tag

    return app


app = make_app(
    beat_key=os.environ.get("UAPP_BEAT_KEY") or None,
    tasks=not os.environ.get("UAPP_NO_TASKS"),
    # the beat entry's "task", "args" and "options" (JSON), instead of gated(key)
    beat_entry=json.loads(os.environ.get("UAPP_BEAT_ENTRY") or "{}"),
)
