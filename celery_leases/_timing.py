"""The heartbeat's timing under some settings: the renewal interval, and its checks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, NamedTuple

if TYPE_CHECKING:
    from .config import LeaseSettings


#: seconds the heartbeat waits before it tries a failed renewal again (at most)
RENEW_RETRY_AFTER: Final = 1.0


#: renewals per lease horizon: the heartbeat renews every ``horizon / RENEWALS_PER_HORIZON``
#: (a third), so two renewals in a row may fail before a lease counts as lost
RENEWALS_PER_HORIZON: Final = 3


def renewal_interval(horizon: float) -> float:
    """Seconds between two renewals of leases whose shortest horizon is ``horizon``."""
    return horizon / RENEWALS_PER_HORIZON


class Timing(NamedTuple):
    """The heartbeat's timing under some settings, as Kubernetes' leader election names it.

    ``horizon``: seconds after a confirmed renewal that a lease counts as held (the lease
    duration less the margin: ``ttl * (1 - lost_margin)``); ``every``: the renewal interval
    (:func:`renewal_interval`, a third of the horizon); ``slack``: the time a renewal sent on
    time has before its lease counts as lost (the renew deadline, ``horizon - every``).
    """

    horizon: float
    every: float
    slack: float


def timing(settings: LeaseSettings) -> Timing:
    """The :class:`Timing` of leases of the ``ttl`` setting (a shorter lease ttl is faster)."""
    horizon = settings.ttl * settings.margin_fraction
    every = renewal_interval(horizon)
    return Timing(horizon, every, horizon - every)


def _lead(settings: LeaseSettings, t: Timing) -> str:
    return (
        f"ttl {settings.ttl:g} s with lost_margin {settings.lost_margin:g} leaves "
        f"{t.horizon:.3g} s after each renewal; renewed every {t.every:.3g} s, a renewal has "
        f"{t.slack:.3g} s before its lease counts as lost"
    )


def timing_problem(settings: LeaseSettings) -> str | None:
    """Why the timing settings cannot work together, with the numbers; None if they can.

    Refused: ``min_replicas`` with a ``min_replicas_timeout`` that a renewal cannot wait
    for (every renewal waits for the replicas: one that must wait that long could never be
    confirmed before its lease counts as lost).
    """
    t = timing(settings)
    if settings.min_replicas and settings.min_replicas_timeout >= t.slack:
        return (
            f"{_lead(settings, t)}: min_replicas_timeout ({settings.min_replicas_timeout:g} s) "
            f"must be below {t.slack:.3g} s, or the ttl above "
            f"{settings.min_replicas_timeout * 3 / 2 / settings.margin_fraction:.3g} s"
        )
    return None


def timing_warnings(settings: LeaseSettings) -> list[str]:
    """Timing settings that work, but are risky: a grace shorter than the ttl, or a
    renewal with no room for a second try.

    A renewal that hangs is cut at its lease's deadline (its budget is the time left, at
    most ``socket_timeout``); if one attempt of ``socket_timeout`` plus the pause before a
    retry does not fit in the renewal's slack, one stalled connection loses the lease.
    A worker logs these at start-up (INFO).
    """
    t = timing(settings)
    out: list[str] = []
    for name in ("restart_grace", "restore_grace"):
        grace = getattr(settings, name)
        if grace and grace < settings.ttl:
            out.append(
                f"{name} ({grace:g} s) is below the ttl ({settings.ttl:g} s): a holder counts "
                "its lease held up to ttl after its last renewal, so a grant made when the "
                "grace ends may overlap a holder that has not learnt of the restart yet"
            )
    room = t.slack - min(t.every, RENEW_RETRY_AFTER)
    if settings.socket_timeout >= room:
        # the horizon that fits one attempt and the pause before the next in the slack
        sock = settings.socket_timeout
        needed = 3 * sock if sock <= RENEW_RETRY_AFTER else 1.5 * (sock + RENEW_RETRY_AFTER)
        ttl_needed = needed / settings.margin_fraction
        out.append(
            f"{_lead(settings, t)}: with socket_timeout {settings.socket_timeout:g} s a "
            f"renewal that hangs is not tried again before its lease counts as lost; "
            f"socket_timeout < {max(room, 0):.3g} s (or a ttl of {ttl_needed:.3g} s or more) "
            "leaves room for a second try"
        )
    return out
