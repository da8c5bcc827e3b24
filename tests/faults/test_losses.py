"""The fault suite tells a task the broker lost from one we lost (no workers: the ledger's
records and a real broker Redis, set by hand as the workers' signals would set them).

- never received by any worker (its last message) and gone from the broker: the broker's;
- received and never finished, or never received but still in the broker: ours.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.faults.conftest import BrokerLostMessages, Fleet, Losses, check_losses
from tests.faults.ledger import FIRST_MESSAGE

pytestmark = [pytest.mark.faults]


def ids(n: int) -> list[str]:
    return [str(uuid.uuid4()) for _ in range(n)]


def test_the_broker_losses_are_told_from_ours(make_fleet: Any) -> None:
    fleet: Fleet = make_fleet("losses", broker="redis")
    ledger = fleet.ledger
    done, failed, running, unseen, queued, retry_lost, retry_seen = ids(7)
    fleet.sent += [done, failed, running, unseen, retry_lost, retry_seen]
    # every first message but `unseen`'s and `queued`'s was received by a worker
    for task_id in (done, failed, running, retry_lost, retry_seen):
        ledger.received(task_id, FIRST_MESSAGE)
    ledger.done(done)
    ledger.failed(failed, "ValueError: counted apart")
    # a retry published by a worker: received for one task, never for the other
    ledger.published(retry_lost, "m2")
    ledger.published(retry_seen, "m2")
    ledger.received(retry_seen, "m2")
    # a message that waits in the broker's queue: not lost, not received yet
    fleet.sender.send_task(
        "tests.faults.faults_app.work", ("x", 0), queue=fleet.queue, task_id=queued
    )
    fleet.sent.append(queued)

    losses = fleet.losses()

    assert losses == Losses(
        by_broker=sorted([unseen, retry_lost]), ours=sorted([running, retry_seen, queued])
    )


def test_a_loss_of_ours_fails_on_either_broker(make_fleet: Any) -> None:
    fleet: Fleet = make_fleet("losses-ours", broker="redis")
    losses = Losses(by_broker=ids(1), ours=ids(1))
    with pytest.raises(AssertionError, match=r"1 received and never finished.*OUR bug"):
        check_losses(fleet, losses, "why")


def test_a_broker_loss_fails_on_rabbitmq_and_is_reported_on_redis(make_fleet: Any) -> None:
    lost = ids(2)
    redis_fleet: Fleet = make_fleet("losses-redis", broker="redis")
    with pytest.warns(BrokerLostMessages, match="2 task\\(s\\) lost by the broker"):
        check_losses(redis_fleet, Losses(by_broker=lost), "why")
    amqp_fleet = Fleet(
        "losses-amqp",
        server=redis_fleet.server,
        ledger=redis_fleet.ledger,
        broker="amqp",
        broker_url="amqp://guest:guest@127.0.0.1:5672//",
        env={},
        tmp_path=redis_fleet.tmp_path,
    )
    try:
        with pytest.raises(AssertionError, match="at-least-once"):
            check_losses(amqp_fleet, Losses(by_broker=lost), "why")
    finally:
        amqp_fleet.admin.close()
