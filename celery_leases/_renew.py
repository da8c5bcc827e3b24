"""Renewals, written once: one renewal's renew.lua calls and what their replies mean. No I/O."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ._keys import escaped_node_of_owner, unescape
from ._lease import Held
from ._protocol import (
    Command,
    Failure,
    ReplicaShortfall,
    Script,
    Send,
    SendWithin,
    Steps,
)
from ._registry import entry_text, held_entry

if TYPE_CHECKING:
    from ._engine import LeaseEngine


logger = logging.getLogger(__name__)


class RenewPlan(NamedTuple):
    """The renew.lua calls of one renewal: ``(indices into held, keys, args)`` per group."""

    calls: list[tuple[list[int], list[str], list[Any]]]
    sent: float  # monotonic time the renewal was planned (no later than it reaches Redis)
    registry: dict[int, float]  # slot group -> registry expiry the call sets, in seconds


def renew(engine: LeaseEngine, held: Sequence[Held], owner: str, timeout: float) -> Steps[set[int]]:
    """Renew ``held`` (all of one owner) and refresh the owner's liveness.

    One script call per slot group, sent together in one round trip per node, under a
    deadline of ``timeout`` seconds (:class:`~celery_leases._protocol.SendWithin`: the
    heartbeat uses the time left before the first lease would count as lost). Idempotent
    after a lost reply: the driver never resends it (the caller hears of the failure), and
    the next renewal runs it again, token-checked; run twice it only extends the same
    leases twice.

    Returns:
        the indices (into ``held``) of leases Redis no longer has for us.
    """
    plan = renew_calls(engine, held, owner)
    scripts = [Script("renew", keys, args) for _, keys, args in plan.calls]
    try:
        replies, acked = yield SendWithin(scripts, timeout)
        for count in acked:  # one WAIT reply per node (none without min_replicas)
            engine.check_replicated(count, "renewal")
    except Failure as failure:
        raise engine.backend_error("renew", failure) from failure.cause
    except ReplicaShortfall as exc:
        raise engine.backend_error("renew", exc) from exc
    lost = renew_outcome(engine, plan, replies, owner, held)
    if lost and engine.history:
        yield from record_lost(engine, [held[i] for i in sorted(lost)])
    return lost


def record_lost(engine: LeaseEngine, lost: Sequence[Held]) -> Steps[None]:
    """Write a ``lost`` event for each of ``lost`` (a renewal found them gone) to the history.

    The rare path, so written here rather than in renew.lua; a failure is only logged (the
    lease is lost either way, and its holder is told).
    """
    hist, rhist, keep = engine.history_args
    calls: list[Command] = []
    for h in lost:
        text = entry_text(h.mode, h.token, h.task_id, h.resource)  # as granted, with its token
        fields = ("e", "lost", "x", text, "o", h.owner)
        key = engine.resource_keys(h.resource).history
        calls += [
            Command(("XADD", engine.keys.history(h.group), "MAXLEN", "~", hist, "*", *fields)),
            Command(("XADD", key, "MAXLEN", "~", rhist, "*", *fields)),
            Command(("PEXPIRE", key, keep)),
        ]
    try:
        yield Send(calls, once=True)
    except Failure as failure:
        logger.warning("leases: could not record %d lost lease(s): %s", len(lost), failure.cause)


def renew_calls(engine: LeaseEngine, held: Sequence[Held], owner: str) -> RenewPlan:
    """The renew.lua calls of :func:`renew`, one per slot group."""
    by_group: dict[int, list[int]] = {0: []}
    for i, h in enumerate(held):
        by_group.setdefault(h.group, []).append(i)
    longest = max([h.ttl for h in held] + [engine.settings.ttl])
    sent = time.monotonic()
    # A registry's expiry is never cut short here: another renewer of the same owner (the
    # asyncio heartbeat next to the thread, or the other way round) may hold longer leases
    # in it. t0 the thread renews a lease of ttl=3600 (registry: 4 h); t1 the asyncio
    # heartbeat renews one of ttl=30 (registry: 2 min); t2 the process dies; t3 the registry
    # runs out, and no cleanup finds the first lease for the next hour.
    registry: dict[int, float] = {}
    calls: list[tuple[list[int], list[str], list[Any]]] = []
    for group, idx in sorted(by_group.items()):
        left = engine.registry_until.get((owner, group), 0.0) - sent
        registry[group] = max(4 * longest, left)
        keys = [engine.registry_key(owner, group)]
        args: list[Any] = [owner, engine.ms(registry[group])]
        if group == 0:
            node = escaped_node_of_owner(owner)
            keys += engine.home_keys(unescape(node))
            args += ["1", engine.liveness, node]
        else:
            args += ["0", 0, ""]
        for i in idx:
            h = held[i]
            rk = engine.resource_keys(h.resource)
            keys += [rk.exclusive if h.mode == "x" else rk.shared, rk.revocation]
            args += [h.mode, h.token, engine.ms(h.ttl), held_entry(h).text]
        calls.append((idx, keys, args))
    return RenewPlan(calls, sent, registry)


def renew_outcome(
    engine: LeaseEngine, plan: RenewPlan, replies: Sequence[Any], owner: str, held: Sequence[Held]
) -> set[int]:
    """The indices of the leases renew.lua's ``replies`` report lost; records the renewal,
    and the revocations it reports on the leases of ``held`` (:meth:`Held.revoke`)."""
    lost: set[int] = set()
    for (idx, _, _), reply in zip(plan.calls, replies, strict=True):
        for n in reply:
            if isinstance(n, list):  # {index, ms left until the deadline, reason}: revoked
                i, left, reason = n
                h = held[idx[int(i) - 1]]
                h.revoke(
                    str(reason, "utf-8", "replace") if isinstance(reason, bytes) else reason,
                    plan.sent,
                    int(left) / 1000,
                )
            else:
                lost.add(idx[int(n) - 1])
    # this call refreshed the owner's liveness and its registries' expiry
    sent = plan.sent
    engine.registered[owner] = max(engine.registered.get(owner, sent), sent)
    for group, registry_s in plan.registry.items():
        engine.registry_until[(owner, group)] = sent + registry_s
    return lost
