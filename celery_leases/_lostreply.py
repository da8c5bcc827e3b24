"""Script calls whose reply may be lost: what each one does when it does not know the outcome.

A script call whose connection fails or times out after the request was sent may have run in
Redis. redis-py's retry would simply send it again, and a grant script run twice finds its
own first grant in the way. So every script call is made with one attempt (a
:class:`~celery_leases._protocol.Send` with ``once``; the drivers' clients then do not
retry, see ``_one_attempt``), and a call whose outcome is unknown (a
:class:`~celery_leases._protocol.Failure` with ``lost``) is followed by the recovery
:data:`POLICIES` names for its script:

- ``idempotent``: sent again; running it twice leaves what running it once leaves, and the
  caller reads the second reply knowing that the first one may have run (e.g. a beat claim
  whose winner is this replica is its win).
- ``read-back``: the keys are read, and the caller recognises what its own call did: a grant
  whose registry entry bears the call's own id (see :func:`grant_recovery`); a grant of its
  owner id that merely no live lease of this process holds is never taken for its own.
- ``give-back``: what may have been granted is released (token-checked), then the call is
  sent once more.

The calls that recover by sending again go through :func:`resend_if_lost`; the grant calls
also keep the :class:`GrantBook`. The core operations decide with the functions of this
module, whichever driver carries them out. Nothing here imports redis or asyncio.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ._keys import holder_parts, holder_value
from ._protocol import Call, Failure, Send, Steps

__all__ = (
    "BOOK",
    "POLICIES",
    "GrantBook",
    "GrantRecovery",
    "grant_recovery",
    "own_beat_win",
    "parse_holder",
    "release_recovered",
    "requeue_recovered",
    "resend_if_lost",
)

#: the recovery of each script call, when its reply is lost (see the module docstring)
POLICIES: Final[Mapping[str, str]] = {
    "acquire (grant)": "read-back: adopt the own grant (half its horizon left), else give it "
    "back and send again",
    "acquire (home call, no resources)": "idempotent: sent again",
    "acquire + WAIT (min_replicas)": "read-back, give-back: release the own grant, send again",
    "release": "idempotent: sent again; a lease still counted held when sent is reported freed",
    "leave": "idempotent: sent again (a ticket leaves a queue once; the next head may be woken "
    "twice, which costs it one attempt)",
    "renew (heartbeat)": "idempotent: the next renewal runs it again (the asyncio renewal "
    "client's retry may replay it: it extends the same leases again)",
    "unique_claim": "idempotent: sent again; 'already queued for this task' is this call's claim "
    "(a throttle window naming this task is passed; a replace finds its claim, not the old)",
    "unique_handover": "read-back: adopt the own grant, else give it back and send again (a "
    "keep_last hand-on is consumed by the same call: with the grant, or not at all)",
    "unique_requeue": "read-back: the key queued for the task with our token means it ran",
    "unique_unclaim": "idempotent: sent again (token-checked)",
    "beat_claim": "idempotent: sent again; a run whose recorded winner is this replica is won",
    "commit_receipt": "idempotent: sent again (holder-checked)",
    "forget_owner, expired_owners, clock": "idempotent: redis-py's own retry",
    "lifetime_check": "idempotent: redis-py's own retry; the first run records the server's "
    "identity (starting a grace if it changed), a replay finds it recorded and changes nothing",
    "limit": "none: not sent again; a lost admission stays counted (the limit errs on the safe "
    "side: it may admit less, never more) and the caller gets LeaseBackendError",
    "limit_refund": "none: not sent again; a lost refund leaves the admission counted",
    "limit_penalize": "idempotent: the caller may call again (the later end wins)",
    "park": "not sent again: the delivery is requeued (Reject), never retried; a park that "
    "ran parked the task under this message's tombstone, and the requeued delivery finds it "
    "parked and is dropped (the hand-on publishes it)",
    "park_gate": "not sent again: the delivery is requeued (Reject): a gate that ran consumed "
    "the hand-on for this message, which passes the gate again when redelivered (the gate "
    "records the consumer of a hand-on)",
    "handon": "not sent again: a hand-on that ran is a reservation nobody publishes for; it "
    "runs out (handon_timeout) and the task goes back to its queue, handed on again later",
    "handon_takeover": "not sent again: a takeover that ran took the dead owner's hand-ons "
    "out of its registry, and their messages are lost with the reply; each reservation runs "
    "out (handon_timeout) and its task goes back to its queue, handed on again later",
    "unreserve": "idempotent: not sent again, as nothing waits for it; a second run finds "
    "no reservation of the task (a lost one leaves it to run out after handon_timeout)",
    "unpark": "idempotent: the operator runs it again (a second run finds nothing parked)",
    "park_limit": "not sent again: as park (the delivery is requeued; a park that ran makes "
    "the redelivery find the task parked, and be dropped)",
    "handon_limit": "not sent again: a hand-on that ran is one nobody publishes for; it runs "
    "out (handon_timeout) and the task goes back to its queue, handed on again later",
    "revoke": "idempotent: sent again (the client may retry); a second run keeps the first's "
    "deadline",
    "fenced_write": "idempotent: the caller's client retries; a replay writes the same value "
    "with the same token again, or is refused because a newer token wrote since, and either "
    "way the newest token's write stands",
}


# --- the recovery by sending again ---------------------------------------------------------
def resend_if_lost(calls: Sequence[Call]) -> Steps[tuple[list[Any], bool]]:
    """``calls`` with one attempt; if the reply was lost, sent again (the client may retry).

    For the scripts whose recovery is ``idempotent`` (:data:`POLICIES`). Returns the replies
    and whether the first reply was lost (the caller may read the second one knowing that
    the first may have run). A failure of the second send is raised as the
    :class:`~celery_leases._protocol.Failure` it is.
    """
    try:
        return (yield Send(calls)), False
    except Failure as failure:
        if not failure.lost:
            raise
    return (yield Send(calls, once=False)), True


# --- what this process holds ----------------------------------------------------------------
@dataclass(slots=True)
class _Slot:
    inflight: int = 0  # grant calls sent whose outcome this process has not recorded yet
    recovering: int = 0  # of those, the ones whose reply was lost
    began: int = 0  # GrantBook sequence number of the last call that began
    tokens: set[int] = field(default_factory=set)  # tokens of leases returned to callers


class GrantBook:
    """The grants of this process, per (owner id, exclusive key of the resource).

    Leases are not reentrant, but two threads (or coroutines) of one process share its owner
    id and may each hold a shared lease, or one of them the resource. A recovery tells its
    own lost grant from theirs by the call id its grant's registry entry bears (see
    :func:`grant_recovery`), never by what this book holds: a token that looks unclaimed
    here may be one a sibling released a moment ago (issue 26, part 8). The book only
    makes a recovery read Redis once the calls in flight on its resources are over (every
    grant call is counted while in flight; :meth:`quiet` returns a sequence number,
    :meth:`unchanged` tells whether a call began during the read), and keeps the tokens of
    the process's live leases for the inspection of what it holds.

    Process-wide (two stores of one process may hold the same resource under one owner id);
    a forked child starts empty (see :func:`os.register_at_fork`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[tuple[str, str], _Slot] = {}
        self._seq = 0

    def reset(self) -> None:
        """Forget everything (a forked child holds nothing of its parent's)."""
        self._lock = threading.Lock()
        self._slots = {}
        self._seq = 0

    def begin(self, owner: str, keys: Sequence[str]) -> None:
        """A grant call on ``keys`` is about to be sent."""
        with self._lock:
            for key in keys:
                slot = self._slots.get((owner, key))
                if slot is None:
                    slot = self._slots[(owner, key)] = _Slot()
                slot.inflight += 1
                self._seq += 1
                slot.began = self._seq

    def end(self, owner: str, keys: Sequence[str], *, recovered: bool = False) -> None:
        """The call is over (its grants, if any, are recorded with :meth:`hold`)."""
        with self._lock:
            for key in keys:
                slot = self._slots.get((owner, key))
                if slot is None:
                    continue
                slot.inflight -= 1
                if recovered:
                    slot.recovering -= 1
                self._drop_if_empty(owner, key, slot)

    def granted(
        self, owner: str, keys: Sequence[str], tokens: Sequence[int], *, ended: bool
    ) -> None:
        """The call on ``keys`` granted ``tokens`` (one per key), returned to its caller:
        :meth:`hold` for each, and (``ended``) :meth:`end`, in one step."""
        with self._lock:
            slots = self._slots
            for key, token in zip(keys, tokens, strict=True):
                slot = slots.get((owner, key))
                if slot is None:
                    slot = slots[(owner, key)] = _Slot()
                slot.tokens.add(token)
                if ended:
                    slot.inflight -= 1

    def lost(self, owner: str, keys: Sequence[str]) -> None:
        """The call's reply was lost: it is being recovered (still in flight)."""
        with self._lock:
            for key in keys:
                slot = self._slots.get((owner, key))
                if slot is not None:
                    slot.recovering += 1

    def hold(self, owner: str, key: str, token: int) -> None:
        """``token`` was returned to a caller: it is a live lease of this process."""
        self.granted(owner, [key], [token], ended=False)

    def drop(self, owner: str, key: str, token: int) -> None:
        """The lease of ``token`` is being released (or was never kept)."""
        with self._lock:
            slot = self._slots.get((owner, key))
            if slot is not None:
                slot.tokens.discard(token)
                self._drop_if_empty(owner, key, slot)

    def _drop_if_empty(self, owner: str, key: str, slot: _Slot) -> None:
        if slot.inflight <= 0 and not slot.tokens:
            del self._slots[(owner, key)]

    def quiet(self, owner: str, keys: Sequence[str]) -> int | None:
        """When every call in flight on ``keys`` is a lost one (being recovered): a sequence
        number for :meth:`unchanged`; else None."""
        with self._lock:
            if all(
                (s := self._slots.get((owner, k))) is None or s.inflight <= s.recovering
                for k in keys
            ):
                return self._seq
            return None

    def unchanged(self, owner: str, keys: Sequence[str], seq: int) -> bool:
        """True if no grant call on ``keys`` began since :meth:`quiet` returned ``seq``."""
        with self._lock:
            return all((s := self._slots.get((owner, k))) is None or s.began <= seq for k in keys)

    def alone(self, owner: str, keys: Sequence[str]) -> bool:
        """True when the caller's is the only lost call on ``keys``."""
        with self._lock:
            return all(
                (s := self._slots.get((owner, k))) is None or s.recovering <= 1 for k in keys
            )

    def held(self, owner: str, key: str) -> set[int]:
        """The tokens of the live leases of this process on ``key``."""
        with self._lock:
            slot = self._slots.get((owner, key))
            return set() if slot is None else set(slot.tokens)


#: the grants of this process
BOOK: Final = GrantBook()
os.register_at_fork(after_in_child=BOOK.reset)


# --- decisions ----------------------------------------------------------------------------------
def parse_holder(value: object) -> tuple[int, str] | None:
    """``"<token> <owner>"`` (a lease key's value or a shared member) as (token, owner)."""
    text, owner = holder_parts(value)
    return (int(text), owner) if text.isdigit() and owner else None


@dataclass(frozen=True)
class GrantRecovery:
    """What to do about a grant call whose reply was lost.

    Attributes:
        adopt: the tokens of the call's grant, one per resource in call order (the call
            ran and granted: use them as its reply), or None.
        give_back: ``(resource, mode, token)`` of orphan grants of this owner to release
            before the call is sent again.
    """

    adopt: list[int] | None
    give_back: list[tuple[str, str, int]]


def grant_recovery(
    wants: Sequence[tuple[str, str]],
    found: Mapping[str, Sequence[tuple[str, int]]],
    mine: Mapping[str, Sequence[tuple[str, int]]],
    *,
    may_adopt: bool = True,
) -> GrantRecovery:
    """Decide about a lost grant call, from what it can prove it granted.

    Args:
        wants: ``(resource, mode)`` the call asked for, in call order.
        found: per resource, ``(mode, token)`` of every live grant of this owner id Redis has.
        mine: per resource, ``(mode, token)`` of the owner's registry entries that bear the
            lost call's own id (acquire.lua writes it into the entries of its grants).
        may_adopt: False to give back what the call granted (min_replicas: a grant the
            replicas did not confirm is not kept; or too little of its horizon is left).

    The grant script is all or nothing, and it records each grant with the call's id: the
    call ran and granted if and only if each resource has one entry of it, of the mode
    asked. It is adopted if Redis still has each of those grants. A grant of this owner
    without the call's id is another call's (a sibling thread's live lease, one it has just
    released, another lost call's orphan): never adopted, never given back here.
    """
    picks = [list(mine.get(r, ())) for r, _ in wants]
    if (
        may_adopt
        and wants
        and all(
            len(p) == 1 and p[0][0] == mode and p[0] in found.get(r, ())
            for p, (r, mode) in zip(picks, wants, strict=True)
        )
    ):
        return GrantRecovery([p[0][1] for p in picks], [])
    give_back = [(r, m, t) for (r, _), p in zip(wants, picks, strict=True) for m, t in p]
    return GrantRecovery(None, give_back)


def own_beat_win(won: bool, run: int, winner: str, replica: str, last_won: int | None) -> bool:
    """Whether a beat claim sent again after a lost reply is this replica's win.

    The claim records its winner: a run whose winner is this replica was won by the call
    whose reply was lost, unless this replica had already counted that run as won (a claim
    of the same run on a later tick is no new win: the run was sent then).
    """
    return won or (winner == replica and run != last_won)


def release_recovered(freed: Sequence[bool], counted_held: Sequence[bool]) -> list[bool]:
    """The outcome of a release sent again after a lost reply.

    The second run finds no lease the first one released, and says "not ours": a lease
    this process still counted as held when the release was first sent (Redis keeps a
    lease at least that long) was ours, so it was released by the lost run.
    """
    return [f or c for f, c in zip(freed, counted_held, strict=True)]


def requeue_recovered(value: object, token: int, owner: str, queued: str) -> bool | None:
    """What a claim key read after a lost unique_requeue says the call did.

    Args:
        value: the claim key's value now.
        token: the running holder's token; ``owner``: its owner id.
        queued: the queued owner part for the task (``"%queued/<escaped task id>"``).

    Returns:
        True: it ran (the claim is queued for the task, with our token); None: it did not
        run (still ours, running): send it again; False: the claim is no longer ours.
    """
    if value is None:
        return False
    if str(value) == holder_value(token, queued):
        return True
    if str(value) == holder_value(token, owner):
        return None
    return False
