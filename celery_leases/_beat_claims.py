"""Beat claims: which replica won one due run of a beat entry, so each run is sent once
across replicas (docs/beat.md), judged on the Redis clock.

Each operation is a generator of protocol requests (see ``_protocol``), carried out by a
driver (its ``run``). A lost reply's recovery is decided with ``_lostreply``. No I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from ._engine import LeaseEngine
from ._lostreply import own_beat_win, resend_if_lost
from ._protocol import Call, Command, Failure, Script, Steps
from ._scripts import BeatClaimReply

__all__ = (
    "SKIPPED_BY",
    "BeatClaim",
    "BeatRun",
    "beat_claim",
    "beat_runs",
    "claim_beat_run",
    "parse_beat_claim",
)

#: why beat_claim.lua did not claim a run newer than the last claimed one (see BeatClaim)
Refusal = Literal["", "early", "future", "skipped", "missed"]
#: the marker of a run recorded as skipped (after an outage), before the replica's name
SKIPPED_BY: Final = "skipped:"
_REFUSALS: Final[dict[int, Refusal]] = {
    BeatClaimReply.EARLY: "early",
    BeatClaimReply.FUTURE: "future",
    BeatClaimReply.SKIPPED: "skipped",
    BeatClaimReply.MISSED: "missed",
}


@dataclass(frozen=True)
class BeatRun:
    """The last claimed run of one beat entry, as its claim key records it."""

    entry: str
    kind: str  # "cron" (run = due time in ms) or "every" (run = Redis-time bucket)
    run: int
    replica: str  # the replica that won (sent) it
    expires_in: float  # seconds the claim is still remembered


def parse_beat_claim(value: str) -> tuple[int, int | None, str] | None:
    """``(run id, Redis ms of the claim or None, winner)`` of a claim key's value, or None.

    The value is ``"<run id> <Redis ms> <replica>"``; a key written before the Redis ms was
    recorded holds ``"<run id> <replica>"`` (a replica name never starts with a digit).
    """
    run, _, rest = value.partition(" ")
    if not run.lstrip("-").isdigit():
        return None
    ms, _, replica = rest.partition(" ")
    if ms.isdigit():
        return int(run), int(ms), replica
    return int(run), None, rest


def beat_runs(engine: LeaseEngine, entries: Sequence[str]) -> Steps[list[BeatRun]]:
    """The last claimed run of each of ``entries`` (beat entry names) that has one.

    The entries come from the caller (the app's ``beat_schedule``): claims are found by
    name, never by a keyspace scan. One round trip.
    """
    wanted = [(entry, kind) for entry in entries for kind in ("cron", "every")]
    calls: list[Call] = []
    for entry, kind in wanted:
        key = engine.keys.beat_claim(entry, kind)
        calls += (Command(("GET", key)), Command(("PTTL", key)))
    if not calls:
        return []
    replies = yield from engine.send("read beat claims", calls)
    out: list[BeatRun] = []
    for i, (entry, kind) in enumerate(wanted):
        value, pttl = replies[2 * i], replies[2 * i + 1]
        parsed = None if value is None else parse_beat_claim(str(value))
        if parsed is not None:
            run, _, replica = parsed
            out.append(BeatRun(entry, kind, run, replica, max(int(pttl), 0) / 1000))
    return out


@dataclass(frozen=True)
class BeatClaim:
    """The outcome of one beat claim.

    ``refused`` says why a run newer than the last claimed one was not claimed: ``"early"``
    (an interval run less than half an interval after the last claim, on the Redis clock),
    ``"future"`` (a crontab run due further ahead of the Redis clock than the tolerance);
    ``retry_ms`` is then the Redis time from which it may be claimed. After an outage:
    ``"skipped"`` (the run, ``run``, was missed outside the catch-up window: recorded as
    skipped, sent by no one; an interval's next run is due at ``retry_ms``) or ``"missed"``
    (a crontab run whose next run is due too: claim the latest due run with ``latest``).
    ``catch_up``: won as the one catch-up run after an outage.
    """

    won: bool
    run: int
    now_ms: int  # the Redis clock when the claim was judged
    winner: str  # the replica that won this run ('' if not known)
    refused: Refusal = ""
    retry_ms: int | None = None
    catch_up: bool = False


def beat_claim(
    engine: LeaseEngine,
    entry: str,
    *,
    due_ms: int | None,
    bucket: float | None,
    replica: str,
    keep: float,
) -> Steps[tuple[bool, int, int, str]]:
    """Claim one due run of beat entry ``entry`` (see :func:`claim_beat_run`).

    Returns:
        ``(won, run id, Redis time in ms, winner of that run)``.
    """
    claim = yield from claim_beat_run(
        engine, entry, due_ms=due_ms, bucket=bucket, replica=replica, keep=keep
    )
    return claim.won, claim.run, claim.now_ms, claim.winner


def claim_beat_run(
    engine: LeaseEngine,
    entry: str,
    *,
    due_ms: int | None,
    bucket: float | None,
    replica: str,
    keep: float,
    tolerance: float = 0.0,
    catch_up: float | Literal[""] | None = "",
    next_due_ms: int | None = None,
    latest: bool = False,
) -> Steps[BeatClaim]:
    """Claim one due run of beat entry ``entry``, judged on the Redis clock.

    Args:
        due_ms: the run's due time in ms (crontab), or None to claim the current bucket
            of ``bucket`` seconds on the Redis clock (interval schedules).
        replica: the claimant's name, recorded with the claim.
        keep: seconds the claim is remembered after it was made.
        tolerance: crontab: seconds a run may be due ahead of the Redis clock and still be
            claimed.
        catch_up: after an outage (runs were due that nobody claimed), the seconds within
            which the latest missed due time still gets one catch-up run; None: no catch-up
            (the missed runs are skipped); ``""``: outages are not looked for.
        next_due_ms: crontab: the due time of the run after ``due_ms`` (finds an outage).
        latest: crontab: ``due_ms`` is the latest due run of an outage (after ``"missed"``).
    """
    kind = "every" if due_ms is None else "cron"
    policy = catch_up if catch_up == "" else "none" if catch_up is None else engine.ms(catch_up)
    args: list[Any] = [
        "" if due_ms is None else str(due_ms),
        engine.ms(bucket or 1.0),
        engine.ms(keep),
        replica,
        str(max(0, round(tolerance * 1000))),
        policy,
        "" if next_due_ms is None else str(next_due_ms),
        "latest" if latest else "",
    ]
    keys = [engine.keys.beat_claim(entry, kind)]
    try:
        # idempotent: sent again, it loses to the lost call if that one won; the claim
        # records the winner, so this replica recognises its own win (own_beat_win)
        (reply,), lost = yield from resend_if_lost([Script("beat_claim", keys, args)])
    except Failure as failure:
        raise engine.backend_error("claim a beat run", failure) from failure.cause
    code = int(reply[0])
    won = code == BeatClaimReply.WON
    run, now, winner = int(reply[1]), int(reply[2]), str(reply[3])
    retry = str(reply[4]) if len(reply) > 4 else ""
    if lost:
        won = own_beat_win(won, run, winner, replica, engine.beat_won.get(keys[0]))
    if won:
        engine.beat_won[keys[0]] = run
        catch = len(reply) > 5 and str(reply[5]) == "1"
        return BeatClaim(True, run, now, replica, catch_up=catch)
    refused = _REFUSALS.get(code, "")
    return BeatClaim(False, run, now, winner, refused, int(retry) if retry else None)
