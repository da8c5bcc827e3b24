"""The descriptions of the settings of parked and unique tasks (config.py's Fields use them)."""

from __future__ import annotations

from typing import Final

__all__ = (
    "HANDON_TIMEOUT",
    "ON_DUPLICATE",
    "PARK_PUMP_INTERVAL",
    "UNIQUE_CANCEL_DEADLINE",
    "UNIQUE_CONFIRM",
    "UNIQUE_CONFIRM_WINDOW",
    "UNIQUE_TTL",
)

HANDON_TIMEOUT: Final = (
    "on_busy='defer': seconds a lease stays reserved for a parked task that was handed on "
    "(published again), for its copy to start and take it; a reservation not claimed by then "
    "runs out, and the task goes back to the end of its resource's queue of parked tasks."
)
PARK_PUMP_INTERVAL: Final = (
    "on_busy='defer': seconds between two turns of each worker's pump, which hands on the "
    "resources whose holder ran out without a release (or whose hand-on ran out)."
)
UNIQUE_TTL: Final = (
    "Tasks with unique=: seconds a claim lives while its task waits in the queue (plus "
    "its countdown or ETA). It must exceed the longest time a task can wait before a "
    "worker starts it; a task lost in the broker, or whose producer died before "
    "publishing (with unique_confirm off), blocks its key at most this long."
)
UNIQUE_CONFIRM_WINDOW: Final = (
    "Tasks with unique=: seconds a new claim lives until its producer confirms it, "
    "once the message is published (the claim then lives unique_ttl). A claim whose "
    "publish failed, whose producer died, or whose reply was lost with Redis then "
    "unreachable frees its key within this window. It must exceed the time a publish "
    "takes, broker retries included."
)
UNIQUE_CONFIRM: Final = (
    "Tasks with unique= (and beat run markers): True: a send claims for "
    "unique_confirm_window and confirms the claim once its message is published (two script "
    "calls a published send). False: it claims for the queue TTL at once and sends no "
    "confirm (one call), and a producer killed between its claim and its publish, or a claim "
    "whose reply was lost with Redis then unreachable, blocks the key for unique_ttl instead "
    "of unique_confirm_window. A failed publish gives the claim back either way. Also the "
    "LeasedTask option unique_confirm."
)
ON_DUPLICATE: Final = (
    "Tasks with unique=: what the producer of a duplicate gets. existing: the "
    "AsyncResult of the task that holds the claim; raise: DuplicateTask; ignore: a "
    "result in state REJECTED (nothing is sent); cancel: a copy running is asked to stop "
    "(LeaseRevoked) and the send becomes the one follow-up run after it, a copy queued "
    "is answered as existing (unique_mode refuse or replace only)."
)
UNIQUE_CANCEL_DEADLINE: Final = (
    "Tasks with unique=, on_duplicate='cancel': seconds from the send that cancels a "
    "running copy until that copy's claim is force-released (Redis lets it run out then, "
    "and the follow-up is handed on) if the copy has not stopped. Also the LeasedTask "
    "option unique_cancel_deadline."
)
