"""The owner registry's entries and the values of lease keys, as the scripts write them.

An owner's registry (one set per slot group) lists what it holds, one entry per lease:
``"<mode> <token> <task id or -> <resource>"``, with the id of the grant call that made it
after the task field, ``"<mode> <token> <task>%c<call> <resource>"`` (acquire.lua writes it,
release.lua and the cleanups remove it; a lost reply's recovery adopts only a grant whose
entry bears its own call's id); for an exclusive lease a release hands over directly,
``"h <ticket> <task id or -> <resource>"``, which the waiter writes when it leaves its order
(lua/_waiters.lua) and which stands only for the lease a release handed to that very ticket,
as the resource's handed tickets record it (its token is not known in advance; the entry is
written with the token once the waiter learns it: acquire.lua, renew.lua); and the member
``"~"`` (:data:`KEEPER`), which keeps the set and its expiry while the owner holds nothing
(see lua/_registry.lua); and a parked task's hand-on not yet published,
``"p <Redis us> <escaped task id> <mode> <limit> <resource>"`` (:class:`HandOn`: handon.lua
writes it; handon_limit.lua writes a rate limit's as ``"p <us> <task> r 0 <limit name>"``; its
writer removes it once it published the task, a cleanup of a writer that died
first takes the hand-on over). A reader that knows none of these kinds (:func:`parse_entry`
gives None: an older version reading a newer entry) keeps the entry and skips it. An
exclusive lease key's value is ``"<token> <owner id>"``, or, for a queued unique claim,
``"<token> %queued/<escaped task id>"``. A waiter's ticket with its order, the member of a
waiter queue, is ``"<id> <ttl ms> <task> <owner>"`` (:func:`ticket_text`). This module reads
and writes those texts, and nothing else does. No I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Final, NamedTuple

from ._keys import escape, holder_parts, unescape

if TYPE_CHECKING:
    from ._lease import Held

__all__ = (
    "CALL_MARK",
    "HANDON_MARK",
    "KEEPER",
    "PARKED_OWNER",
    "QUEUED_OWNER",
    "TICKET_SLACK_MS",
    "Entry",
    "HandOn",
    "counted_held",
    "entry_text",
    "held_entry",
    "parse_entry",
    "parse_handon",
    "split_holder",
    "task_field",
    "task_in_registry",
    "ticket_text",
)

#: the member of every registry that is no entry: it keeps the set, and its expiry, through
#: the releases of all the owner's leases (lua/_registry.lua); a cleanup that emptied the
#: registry removes it
KEEPER: Final = "~"

#: between an entry's task field and the id of the grant call that made the entry: an escaped
#: task id never holds it (escape() writes "%" with two upper-case hex digits). A lost grant's
#: recovery adopts only a grant whose entry bears its own call's id (lua/acquire.lua)
CALL_MARK: Final = "%c"

#: the owner part of a parked task's reservation, ``"0 %parked/<escaped task id>"`` (a hand-on
#: writes it as the lease's holder, for that task only: lua/handon.lua, acquire.lua)
PARKED_OWNER: Final = "%parked/"

#: the owner part of a queued claim's value: "%queued/<escaped task id>". No owner id starts
#: so: an owner id starts with an escaped node name, where "%" is always followed by hex.
QUEUED_OWNER: Final = "%queued/"


def split_holder(value: object) -> tuple[str, int] | str | None:
    """An exclusive key's value, read: ``(owner, token)``, or the task id of a queued unique
    claim, or None (no holder, or a value this release cannot read)."""
    if value is None:
        return None
    token, owner = holder_parts(value)
    if owner.startswith(QUEUED_OWNER):
        return unescape(owner.removeprefix(QUEUED_OWNER)) or None
    if not token.isdigit() or not owner:
        return None
    return owner, int(token)


def task_in_registry(
    members: Iterable[object], resource: str, token: int, mode: str = "x"
) -> str | None:
    """The task id that a registry's ``members`` record for ``resource``/``token`` (held
    exclusive, or shared with ``mode="s"``); an exclusive lease handed over directly is
    recorded without its token (``"h ..."``): its entry counts when no other does."""
    handed = None
    for member in members:
        entry = parse_entry(str(member))
        if entry is None or (entry.mode, entry.resource) != (mode, resource):
            continue
        if entry.token == token:
            return entry.task_id
        if entry.ticket:
            handed = entry.task_id
    return handed


class Entry(NamedTuple):
    """One owner-registry entry: what a lease holder recorded at the grant.

    ``ticket``: not 0 for a handed lease's entry (``"h <ticket> ..."``), whose ``token`` is
    0 when read from a registry (release.lua then releases only the lease handed to that
    ticket, as the handed tickets record it), and the lease's token when its holder
    releases it.
    """

    mode: str
    token: int
    task_id: str | None
    resource: str
    ticket: int = 0
    #: a lease handed to its holder, released by it: the ticket it was handed to, as queued
    handed: str = ""
    #: the id of the grant call that made it (:data:`CALL_MARK`; "": none, as in an entry
    #: written by an older version)
    call: str = ""

    @property
    def text(self) -> str:
        """The entry as stored in the registry set."""
        if self.ticket:
            return entry_text("h", self.ticket, self.task_id, self.resource)
        return entry_text(self.mode, self.token, self.task_id, self.resource, self.call)


def held_entry(held: Held) -> Entry:
    """The registry entry of ``held``."""
    return Entry(held.mode, held.token, held.task_id, held.resource, held.ticket, call=held.call)


def counted_held(held: Held, now: float) -> bool:
    """True if ``held`` still counts as held at ``now`` (so Redis surely still has it)."""
    return not held.lost and now < held.deadline


def entry_text(
    mode: str, token: int | str, task_id: str | None, resource: str, call: str = ""
) -> str:
    """``"<mode> <token> <task> <resource>"``, as acquire.lua writes it; with the grant
    call's id, ``"<mode> <token> <task>%c<call> <resource>"``."""
    return f"{mode} {token} {task_field(task_id, call)} {resource}"


def task_field(task_id: str | None, call: str = "") -> str:
    """An entry's task field: the escaped task id or ``-``, then ``%c<call>`` with a call id."""
    task = escape(task_id) if task_id else "-"
    return f"{task}{CALL_MARK}{call}" if call else task


def parse_entry(member: str) -> Entry | None:
    """A registry member as an :class:`Entry`; None if it cannot be read (a cleanup keeps it)."""
    mode, _, rest = member.partition(" ")
    token, _, rest = rest.partition(" ")
    task, _, resource = rest.partition(" ")
    task, _, call = task.partition(CALL_MARK)
    if mode not in ("x", "s", "h") or not token.isdigit() or not task or not resource:
        return None
    task_id = None if task == "-" else unescape(task)
    if mode == "h":
        return Entry("x", 0, task_id, resource, int(token))
    return Entry(mode, int(token), task_id, resource, call=call)


#: the kind of a hand-on's registry entry (:class:`HandOn`), before its first space
HANDON_MARK: Final = "p"


class HandOn(NamedTuple):
    """A hand-on recorded in its writer's registry (handon.lua), not yet published."""

    #: the Redis clock (us) when it was made: a cleanup that spares leases granted from a
    #: time on spares the hand-ons made from then on too
    stamp: int
    #: the parked task's id, escaped (as the parked tasks' hashes name it)
    task: str
    #: "x" or "s" (a lease's), "r" (a rate limit's: ``resource`` is the limit's name)
    mode: str
    limit: int
    resource: str
    #: the entry as stored in the registry set
    text: str


def parse_handon(member: str) -> HandOn | None:
    """A registry member ``"p <us> <task> <mode> <limit> <resource>"`` as a :class:`HandOn`;
    None if it is not one (or cannot be read: a cleanup keeps it)."""
    parts = member.split(" ", 5)
    if len(parts) != 6 or parts[0] != HANDON_MARK:
        return None
    _, stamp, task, mode, limit, resource = parts
    if not stamp.isdigit() or not task or mode not in ("x", "s", "r") or not limit.isdigit():
        return None
    if not resource:
        return None
    return HandOn(int(stamp), task, mode, int(limit), resource, member)


#: milliseconds a queued ticket outlives the wait its waiter was told: the waiter's next
#: attempt (which refreshes it) comes by then, unless it died or hangs
TICKET_SLACK_MS: Final = 3000


def ticket_text(ticket_id: object, ttl_ms: int, task_id: str | None, owner: str) -> str:
    """A ticket with its order, ``"<id> <ttl ms> <task> <owner>"`` (lua/_waiters.lua)."""
    return f"{ticket_id} {ttl_ms} {escape(task_id) if task_id else '-'} {owner}"
