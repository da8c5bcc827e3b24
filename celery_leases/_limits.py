"""Fleet-wide rate limits: :class:`Rate`, and the core of admission, refund, override,
penalty and listing (generators over ``lua/limit*.lua``; no I/O here).

"N/period" means: at most N admissions, weighted by cost, in ANY window of the period's
length, on the Redis clock, across every process (see docs/limits.md). The state of one
limit is its limit log: a sliding log of its admissions (a ZSET scored by Redis
microseconds) and their cost sum, pruned at each call and gone one period after the last
admission. The limit index of each slot group lists the limits that may hold state.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from ._engine import LeaseEngine
from ._lease import check_name_size
from ._protocol import Command, Script, Steps, clock_us, pairs
from ._scripts import LimitReply
from .exceptions import LeaseConfigError, RateLimited

__all__ = (
    "PERIODS",
    "Admitted",
    "LimitRow",
    "LimitWant",
    "Rate",
    "admit",
    "admitted_in",
    "checks",
    "limit_json",
    "list_limits",
    "next_admit",
    "parse_rate",
    "penalize",
    "refund",
    "set_rate",
    "settle",
)

#: the periods a rate may name, in seconds
PERIODS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE: Final = re.compile(r"(\d+)/([smh])")
#: the most admissions a rate may allow per period: the log holds up to N entries
MAX_N: Final = 1_000_000
_US: Final = 1_000_000


def parse_rate(rate: object, what: str) -> tuple[int, float]:
    """``(N, period in seconds)`` of a rate ``"N/s"``, ``"N/m"`` or ``"N/h"``.

    Raises:
        LeaseConfigError: ``rate`` is not such a text; the message names ``what`` and the
            bad value.
    """
    match = _RATE.fullmatch(rate.strip()) if isinstance(rate, str) else None
    if match is None:
        msg = (
            f"{what}: rate {rate!r} is not 'N/s', 'N/m' or 'N/h' "
            "(N admissions per second, minute or hour, e.g. '10/s')"
        )
        raise LeaseConfigError(msg)
    n = int(match.group(1))
    if not 1 <= n <= MAX_N:
        msg = f"{what}: rate {rate!r} must allow from 1 to {MAX_N} per period, not {n}"
        raise LeaseConfigError(msg)
    return n, PERIODS[match.group(2)]


def check_cost(cost: object, n: int, what: str) -> int:
    """``cost`` checked: a whole number from 1 to ``n`` (a cost above N is never admitted)."""
    if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
        msg = f"{what}: cost must be a whole number >= 1, not {cost!r}"
        raise LeaseConfigError(msg)
    if cost > n:
        msg = f"{what}: cost {cost} is more than the rate allows per period ({n}): never admitted"
        raise LeaseConfigError(msg)
    return cost


@dataclass(frozen=True)
class Rate:
    """A fleet-wide rate limit for a task: at most N admissions (by cost) in any window.

    ``Rate(template, "N/s" | "N/m" | "N/h", cost=1)``, given to a ``LeasedTask`` as
    ``rate=`` or ``rates=[...]``. ``template`` is a ``str.format`` template over the task's
    arguments, like a lease's (``"api:{account}"``): each rendered name is its own limit.
    Every process of the fleet counts against the same limit, on the Redis clock. ::

        @app.task(base=LeasedTask, rate=Rate("api:{account}", "10/s"))
        def call_api(account, payload): ...

    Raises:
        LeaseConfigError: an invalid template, rate or cost (at once, naming the bad value).

    .. versionadded:: 0.2
    """

    template: str
    rate: str
    cost: int = 1
    n: int = field(init=False, repr=False, compare=False)
    period: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.template, str) or not self.template:
            msg = f"Rate() needs a non-empty name template, got {self.template!r}"
            raise LeaseConfigError(msg)
        what = f"Rate({self.template!r})"
        n, period = parse_rate(self.rate, what)
        check_cost(self.cost, n, what)
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "period", period)


class LimitWant(NamedTuple):
    """One limit to pass: its rendered name, N, period (us) and cost, and the template it
    came from (``""`` outside a task; the metrics label)."""

    name: str
    n: int
    period_us: int
    cost: int
    template: str = ""


class Admitted(NamedTuple):
    """An admission: the limit's name, its log member (for a refund) and its Redis time."""

    name: str
    member: str
    at_us: int


def want(name: str, rate: object, cost: object, template: str = "") -> LimitWant:
    """A checked :class:`LimitWant` for ``limit(name, rate, cost=...)``."""
    if not isinstance(name, str) or not name:
        msg = f"a limit needs a non-empty name, not {name!r}"
        raise LeaseConfigError(msg)
    check_name_size(name, "limit name")
    what = f"limit {name!r}"
    n, period = parse_rate(rate, what)
    return LimitWant(name, n, int(period * _US), check_cost(cost, n, what), template)


def _keys(engine: LeaseEngine, name: str) -> list[str]:
    log, state, override, penalty, group = engine.keys.limit_keys(name)
    return [log, state, override, penalty, engine.keys.limit_index(group)]


def _check(engine: LeaseEngine, w: LimitWant, mode: str) -> Script:
    return Script("limit", _keys(engine, w.name), (w.n, w.period_us, w.cost, w.name, mode))


def checks(engine: LeaseEngine, wants: Sequence[LimitWant]) -> list[Script]:
    """The script calls that admit ``wants`` (one per limit, in the order given), to send in
    one round trip: :func:`admit`'s own, or riding with a task's grant (``LeaseStore.riding``)."""
    return [_check(engine, w, "1") for w in wants]


def admitted_in(wants: Sequence[LimitWant], replies: Sequence[Any]) -> list[Admitted]:
    """The admissions the replies of :func:`checks` made (what a refund takes back)."""
    return [
        Admitted(w.name, str(r[1]), int(r[4]))
        for w, r in zip(wants, replies, strict=True)
        if int(r[0]) == LimitReply.ADMITTED
    ]


def admit(engine: LeaseEngine, wants: Sequence[LimitWant]) -> Steps[list[Admitted]]:
    """Admit every limit of ``wants`` or none (one round trip; a refusal refunds the others).

    Raises:
        RateLimited: a limit refused; ``.resource`` names the one that admits last,
            ``.retry_after`` is its exact wait (every refused limit has room by then).
        LeaseConfigError: a cost is above an override's N (never admitted).
        LeaseBackendError: Redis failed (a lost reply may leave an admission counted).
    """
    replies = yield from engine.send("check a rate limit", checks(engine, wants), once=True)
    return (yield from settle(engine, wants, replies))


def settle(
    engine: LeaseEngine, wants: Sequence[LimitWant], replies: Sequence[Any]
) -> Steps[list[Admitted]]:
    """The outcome of the replies of :func:`checks`: the admissions when every limit
    admitted; else the admissions made are refunded (one round trip) and the refusal raised
    (see :func:`admit`)."""
    admitted = admitted_in(wants, replies)
    refused: tuple[float, LimitWant] | None = None
    costly: tuple[LimitWant, int] | None = None
    for w, reply in zip(wants, replies, strict=True):
        code = int(reply[0])
        if code == LimitReply.REFUSED:
            wait = int(reply[1]) / _US
            if refused is None or wait > refused[0]:
                refused = (wait, w)
        elif code == LimitReply.TOO_COSTLY:
            costly = (w, int(reply[1]))
    if (refused is not None or costly is not None) and admitted:
        yield from refund(engine, admitted)
    if costly is not None:
        w, n = costly
        msg = (
            f"limit {w.name!r}: cost {w.cost} is more than its rate in force allows per "
            f"period ({n}, an override: see set_rate): never admitted"
        )
        raise LeaseConfigError(msg)
    if refused is not None:
        raise RateLimited(refused[1].name, refused[0])
    return admitted


def refund(engine: LeaseEngine, admitted: Sequence[Admitted]) -> Steps[int]:
    """Take back ``admitted`` (their task did not run); returns how many were still counted."""
    calls = []
    for a in admitted:
        log, state, _, _, _ = engine.keys.limit_keys(a.name)
        calls.append(Script("limit_refund", [log, state], [a.member]))
    replies = yield from engine.send("refund a rate limit", calls, once=True)
    return sum(int(r) for r in replies)


def next_admit(engine: LeaseEngine, w: LimitWant) -> Steps[float]:
    """Seconds until ``w.name`` next admits ``w.cost`` (0: now), admitting nothing.

    Exact on the Redis clock, unless another caller is admitted first or the rate in force
    changes (an override, a penalty). For a caller that waits outside the worker (a parked
    task) to know when to look again.
    """
    (reply,) = yield from engine.send("read a rate limit", [_check(engine, w, "0")])
    if int(reply[0]) == LimitReply.TOO_COSTLY:
        msg = f"limit {w.name!r}: cost {w.cost} is more than its rate in force allows"
        raise LeaseConfigError(msg)
    return int(reply[1]) / _US


def set_rate(engine: LeaseEngine, name: str, rate: str | None) -> Steps[None]:
    """Override the rate of limit ``name`` fleet-wide, at once; None removes the override."""
    keys = engine.keys
    _, _, override, _, group = keys.limit_keys(name)
    overrides = keys.limit_overrides(group)
    if rate is None:
        calls = [Command(("DEL", override)), Command(("SREM", overrides, name))]
    else:
        n, period = parse_rate(rate, f"set_rate({name!r})")
        calls = [
            Command(("HSET", override, "n", n, "p", int(period * _US), "rate", rate.strip())),
            Command(("SADD", overrides, name)),
        ]
    yield from engine.send("set a rate override", calls, transaction=True)


def penalize(engine: LeaseEngine, name: str, seconds: float) -> Steps[float]:
    """Admit nobody under ``name`` for ``seconds`` (a longer penalty in force is kept);
    returns the seconds the penalty in force still lasts."""
    _, _, _, penalty, group = engine.keys.limit_keys(name)
    index = engine.keys.limit_index(group)
    us = max(1, round(seconds * _US))
    call = Script("limit_penalize", [penalty, index], [us, name])
    (left,) = yield from engine.send("penalize a rate limit", [call], once=True)
    return int(left) / _US


class LimitRow(NamedTuple):
    """One limit as ``celery leases limits`` shows it (times in seconds)."""

    name: str
    rate: str  #: the rate in force ("10/s"; the last admission's declared one if none given)
    declared: str | None  #: the rate the last admission declared (None: none in the window)
    override: str | None
    used: int  #: cost admitted in the current window
    left: int  #: cost still admissible now (0 under a penalty)
    next_admit: float  #: seconds until a cost of 1 is admitted (0: now)
    resets: float  #: seconds until the window is empty (the key goes idle)
    penalty: float  #: seconds the penalty in force still lasts (0: none)


def limit_json(row: LimitRow) -> dict[str, Any]:
    """One limit as ``celery leases limits --json`` and the web view show it."""
    return {
        "name": row.name,
        "rate": row.rate,
        "declared": row.declared,
        "override": row.override,
        "used": row.used,
        "left": row.left,
        "next_admit": round(row.next_admit, 6),
        "resets": round(row.resets, 6),
        "penalty": round(row.penalty, 6),
    }


def _rate_text(n: int, period_us: int) -> str:
    unit = {_US: "s", 60 * _US: "m", 3600 * _US: "h"}.get(period_us)
    return f"{n}/{unit}" if unit else f"{n}/{period_us / _US:g}s"


def list_limits(engine: LeaseEngine) -> Steps[list[LimitRow]]:
    """Every limit that may hold state (from each slot group's self-pruning index) or has an
    override, with what is left of its window; never a keyspace scan."""
    keys = engine.keys
    groups = range(keys.slot_groups)
    calls: list[Any] = []
    for g in groups:
        index = keys.limit_index(g)
        calls += [
            Script("now", [index], []),
            Command(("ZRANGE", index, 0, -1, "WITHSCORES")),
            Command(("SMEMBERS", keys.limit_overrides(g))),
        ]
    replies = yield from engine.send("list rate limits", calls)
    names: dict[str, int] = {}
    for i in range(len(groups)):
        now = clock_us(replies[3 * i])
        for member, score in pairs(replies[3 * i + 1]):
            if score >= now:
                names[member] = now
        for member in replies[3 * i + 2] or ():
            names.setdefault(str(member), now)
    ordered = sorted(names)
    reads: list[Any] = []
    for name in ordered:
        log, state, override, penalty, _ = keys.limit_keys(name)
        reads += [
            Command(("HMGET", state, "n", "p")),
            Command(("HMGET", override, "n", "p", "rate")),
            Command(("GET", penalty)),
            Command(("ZRANGE", log, 0, -1, "WITHSCORES")),
        ]
    read: list[Any] = []
    if reads:
        read = yield from engine.send("read rate limits", reads)
    rows = []
    for i, name in enumerate(ordered):
        state, over, pen, log = read[4 * i : 4 * i + 4]
        rows.append(_row(name, names[name], state, over, pen, pairs(log)))
    return rows


def _row(
    name: str, now: int, state: Any, over: Any, pen: Any, log: list[tuple[str, float]]
) -> LimitRow:
    declared = None
    n, period = 0, _US
    if state[0] is not None and state[1] is not None:
        n, period = int(state[0]), int(state[1])
        declared = _rate_text(n, period)
    override = None
    if over[0] is not None and over[1] is not None:
        n, period = int(over[0]), int(over[1])
        override = str(over[2] or _rate_text(n, period))
    live = [(m, s) for m, s in log if s > now - period]
    used = sum(int(m.rsplit(":", 1)[1]) for m, _ in live)
    penalty = max(0, int(pen or 0) - now) / _US
    left = 0 if penalty else max(0, n - used)
    wait = 0.0
    if used + 1 > n and live:
        wait = max(0.0, (live[0][1] + period - now) / _US)
    resets = max(0.0, (live[-1][1] + period - now) / _US) if live else 0.0
    return LimitRow(
        name,
        override or declared or "-",
        declared,
        override,
        used,
        left,
        max(wait, penalty),
        resets,
        penalty,
    )
