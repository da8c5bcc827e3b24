"""Every Redis key and channel name celery_leases uses, built here and nowhere else."""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Final, NamedTuple

__all__ = (
    "REDELIVERY_PREFIX",
    "UNIQUE_PREFIX",
    "Keyspace",
    "OwnerParts",
    "escape",
    "escaped_node_of_owner",
    "fenced_keys",
    "holder_parts",
    "holder_value",
    "node_of_owner",
    "owner_id",
    "pid_of_owner",
    "split_owner",
    "unescape",
)

_UNSAFE: Final = re.compile(r"[%{}\x00-\x20\x7f]")
#: the resource name of a unique claim is this prefix + the rendered unique key
UNIQUE_PREFIX: Final = "celery_leases:unique:"
#: the resource name of a redelivery guard is this prefix + the task id (see redelivery.md)
REDELIVERY_PREFIX: Final = "celery_leases:redelivery:"


def escape(name: str) -> str:
    """Make ``name`` safe as the last part of a key, injectively.

    ``%``, braces, white space and control characters become ``%XX`` (of their UTF-8 bytes), so
    no name can open or close a Redis Cluster hash tag, and two different names never give the
    same text. Other characters, unicode included, are kept as they are.
    """
    return _UNSAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode()), name)


def unescape(text: str) -> str:
    """Invert :func:`escape`."""
    return re.sub(
        r"(%[0-9A-F]{2})+",
        lambda m: bytes.fromhex(m.group().replace("%", "")).decode(),
        text,
    )


@dataclass(frozen=True)
class Keyspace:
    """Key names under one ``key_prefix`` spread over ``slot_groups`` hash-slot groups.

    Every key of group ``g`` starts with the hash tag ``{<prefix>:<g>}``, so all keys one Lua
    script touches share one slot on a Redis Cluster. Group 0 is the *home* group: it also holds
    the owner index (liveness) and the per-node owner sets. A resource's group is a CRC32 of its
    name, the same in every process.
    """

    prefix: str
    slot_groups: int = 1

    def group_of(self, resource: str) -> int:
        """The slot group holding ``resource``'s keys."""
        if self.slot_groups == 1:
            return 0
        return zlib.crc32(resource.encode()) % self.slot_groups

    def tag(self, group: int) -> str:
        """The hash tag that starts every key of ``group``."""
        return f"{{{self.prefix}:{group}}}"

    # --- per resource -------------------------------------------------------------------
    def exclusive(self, resource: str) -> str:
        """STRING ``"<token> <owner>"`` of the exclusive holder, with the lease's PX."""
        return f"{self.tag(self.group_of(resource))}:x:{escape(resource)}"

    def shared(self, resource: str) -> str:
        """ZSET of shared holders ``"<token> <owner>"`` scored by expiry (Redis ms)."""
        return f"{self.tag(self.group_of(resource))}:s:{escape(resource)}"

    def counter(self, resource: str) -> str:
        """STRING: the last fencing token granted for ``resource``."""
        return f"{self.tag(self.group_of(resource))}:n:{escape(resource)}"

    def channel(self, resource: str) -> str:
        """Pub/Sub channel on which a release of ``resource`` is announced."""
        return f"{self.tag(self.group_of(resource))}:c:{escape(resource)}"

    def waiters(self, resource: str) -> str:
        """ZSET: the waiter queue of ``resource``, tickets ``"<mode><ticket>"`` scored by
        when they first queued (Redis clock in microseconds)."""
        return f"{self.tag(self.group_of(resource))}:q:{escape(resource)}"

    def ticket_expiry(self, resource: str) -> str:
        """ZSET: the same tickets as :meth:`waiters`, scored by when they run out (Redis ms)."""
        return f"{self.tag(self.group_of(resource))}:qe:{escape(resource)}"

    def handed(self, resource: str) -> str:
        """ZSET: the tickets of waiters a release handed ``resource`` to, scored by the token,
        kept while their expiry in :meth:`ticket_expiry` lasts (see lua/_waiters.lua)."""
        return f"{self.tag(self.group_of(resource))}:qh:{escape(resource)}"

    def revocation(self, resource: str) -> str:
        """STRING ``"<deadline ms> <token> <reason>"``: the revocation mark of ``resource``
        (lua/revoke.lua), expiring at its deadline (Redis ms)."""
        return f"{self.tag(self.group_of(resource))}:rv:{escape(resource)}"

    def per_resource(
        self, resource: str
    ) -> tuple[str, str, str, str, str, str, str, str, str, int]:
        """``(exclusive, shared, counter, channel, waiters, ticket_expiry, handed,
        resource_history, record, group)`` of ``resource``: the names of the methods of those
        names, escaping the name once for all nine."""
        group = self.group_of(resource)
        base = f"{self.tag(group)}:"
        name = escape(resource)
        return (
            f"{base}x:{name}",
            f"{base}s:{name}",
            f"{base}n:{name}",
            f"{base}c:{name}",
            f"{base}q:{name}",
            f"{base}qe:{name}",
            f"{base}qh:{name}",
            f"{base}h:{name}",
            f"{base}rec:{name}",
            group,
        )

    @property
    def waiter_channel_prefix(self) -> str:
        """What every waiter's own channel starts with (the ticket follows)."""
        return f"{self.tag(0)}:cw:"

    def waiter_channel(self, ticket: str) -> str:
        """Pub/Sub channel on which the waiter holding ``ticket`` is woken (its turn came)."""
        return self.waiter_channel_prefix + ticket

    def resource_history(self, resource: str) -> str:
        """STREAM: the last events of ``resource`` (the ``history`` setting; see _inspect)."""
        return f"{self.tag(self.group_of(resource))}:h:{escape(resource)}"

    def record(self, resource: str) -> str:
        """HASH ``transitions``, ``ttl`` (ms, of the last grant): what the history setting
        keeps of ``resource`` besides its events."""
        return f"{self.tag(self.group_of(resource))}:rec:{escape(resource)}"

    def resource_keys(self, resource: str) -> tuple[str, str, str]:
        """``(exclusive, shared, counter)`` keys of ``resource``."""
        return self.exclusive(resource), self.shared(resource), self.counter(resource)

    def limit_keys(self, name: str) -> tuple[str, str, str, str, int]:
        """``(log, state, override, penalty, group)`` of the rate limit ``name``: ZSET of its
        admissions ``"<seq>:<cost>"`` scored by Redis us; HASH ``sum``, ``seq``, ``n``, ``p``
        (the last admission's declared rate); HASH ``n``, ``p``, ``rate`` of a
        ``set_rate`` override; STRING: Redis us until which a penalty admits nobody."""
        group = self.group_of(name)
        base = f"{self.tag(group)}:"
        escaped = escape(name)
        return (
            f"{base}rl:{escaped}",
            f"{base}rs:{escaped}",
            f"{base}ro:{escaped}",
            f"{base}rp:{escaped}",
            group,
        )

    # --- per group ----------------------------------------------------------------------
    def limit_index(self, group: int) -> str:
        """ZSET of the rate limits of ``group`` that may hold state, scored by the Redis us
        when they go idle (pruned by every admission: ``celery leases limits`` reads it)."""
        return f"{self.tag(group)}:rate-index"

    def limit_overrides(self, group: int) -> str:
        """SET of the rate limits of ``group`` with a ``set_rate`` override."""
        return f"{self.tag(group)}:rate-overrides"

    def registry(self, owner: str, group: int) -> str:
        """SET of ``"<mode> <token> <resource>"`` entries: what ``owner`` holds in ``group``."""
        return f"{self.tag(group)}:reg:{owner}"

    def epoch(self, group: int) -> str:
        """STRING: Redis time (ms) when this group was first used; gone after a data loss.

        Read (and written) only by versions before :meth:`lifetime`, with restart_grace set;
        named here so that the key layout of a rolling deploy stays known."""
        return f"{self.tag(group)}:epoch"

    def lifetime(self, group: int) -> str:
        """STRING ``"<grace until, Redis time in ms> <run_id>/<master_replid>"``: the server
        lifetime that last checked this group, and until when nothing is granted in it (see
        lua/_lifetime.lua)."""
        return f"{self.tag(group)}:life"

    def history(self, group: int) -> str:
        """STREAM: the last events of every resource of ``group`` (the ``history`` setting);
        a fleet-wide read merges the groups' streams."""
        return f"{self.tag(group)}:h"

    # --- home group ---------------------------------------------------------------------
    @property
    def owners(self) -> str:
        """ZSET of every owner, scored by the Redis time (ms) its liveness runs out."""
        return f"{self.tag(0)}:owners"

    def node(self, node: str) -> str:
        """SET of the owner ids ever registered under ``node`` and not yet cleaned."""
        return f"{self.tag(0)}:node:{escape(node)}"

    @property
    def nodes(self) -> str:
        """SET of escaped node names that have owners (lets tools list nodes without SCAN)."""
        return f"{self.tag(0)}:nodes"

    def node_alive(self, node: str) -> str:
        """STRING: the incarnation of the live worker ``node``, set by its main process at
        every reaper pass with a PX of the ttl setting (``celery leases health --node``)."""
        return f"{self.tag(0)}:alive:{escape(node)}"

    @property
    def audit(self) -> str:
        """LIST of JSON records of operators' releases (``celery leases release``), newest first."""
        return f"{self.tag(0)}:audit"

    def once_resource(self, name: str) -> str:
        """The resource whose exclusive lease guards ``once(name, ...)``."""
        return f"celery_leases:once:{name}"

    def unique_resource(self, key: str) -> str:
        """The resource whose exclusive lease is the claim of unique key ``key``.

        Queued, its key holds ``"<token> %queued/<task id>"`` and no owner records it; once a
        worker took it over it is an ordinary lease of that worker process.
        """
        return UNIQUE_PREFIX + key

    def unique_window(self, resource: str) -> str:
        """STRING: the escaped task id of the last send of a claim resource accepted under
        ``unique_mode="throttle"``, with the ``unique_window`` as its PX."""
        return f"{self.tag(self.group_of(resource))}:uw:{escape(resource)}"

    def unique_replaced(self, resource: str) -> str:
        """ZSET: escaped task ids whose queued claim of a claim resource a later send took
        (``unique_mode="replace"``), scored by when they are forgotten (Redis ms)."""
        return f"{self.tag(self.group_of(resource))}:ur:{escape(resource)}"

    def unique_newest(self, resource: str) -> str:
        """HASH: escaped task id -> the newest arguments (a parked message, JSON) sent for
        that queued run of a claim resource (``unique_mode="keep_last"``)."""
        return f"{self.tag(self.group_of(resource))}:uo:{escape(resource)}"

    def park_keys(self, resource: str) -> list[str]:
        """The parked FIFO of ``resource`` and its group's parked states, messages, done."""
        group = self.group_of(resource)
        return [
            self.parked(resource),
            self.park_state(group),
            self.park_messages(group),
            self.park_done(group),
        ]

    def unique_queued(self, group: int) -> str:
        """ZSET of the claim resources queued in ``group``, scored by expiry (Redis ms)."""
        return f"{self.tag(group)}:unique-queued"

    def redelivery_resource(self, task_id: str, retries: int) -> str:
        """The resource whose lease guards one delivery of a task (the redelivery guard).

        ``redelivery:<task id>``, and ``redelivery:<task id>#<retries>`` for a retry: a retry
        is a new message with the same task id, never a copy of the one it retries.
        """
        suffix = f"#{retries}" if retries else ""
        return f"{REDELIVERY_PREFIX}{task_id}{suffix}"

    def delivery_done(self, task_id: str, retries: int) -> str:
        """STRING: the state in which a delivery of a task ended (the redelivery guard's
        completion record), in the slot group of its guard lease."""
        resource = self.redelivery_resource(task_id, retries)
        return f"{self.tag(self.group_of(resource))}:done:{escape(resource)}"

    # --- parked tasks (on_busy="defer", see _parking.py) ------------------------------
    def parked(self, resource: str) -> str:
        """ZSET: the tasks parked on ``resource`` (escaped task ids), scored by when they
        parked (Redis clock in microseconds): its FIFO."""
        return f"{self.tag(self.group_of(resource))}:pq:{escape(resource)}"

    def parked_limit(self, name: str) -> str:
        """ZSET: the tasks parked on the rate limit ``name`` (scored by when they parked) and
        its hand-ons in flight (scored by when they run out), in the limit's slot group."""
        return f"{self.tag(self.group_of(name))}:pq-rate:{escape(name)}"

    def park_state(self, group: int) -> str:
        """HASH: escaped task id -> ``p`` (parked) or ``h`` (handed on) of the group's tasks."""
        return f"{self.tag(group)}:park-state"

    def park_messages(self, group: int) -> str:
        """HASH: escaped task id -> the message (JSON) that publishes a parked task again."""
        return f"{self.tag(group)}:park-msg"

    def park_done(self, group: int) -> str:
        """ZSET: escaped ids of parked tasks whose hand-on a copy consumed (or that were
        unparked), scored by when (Redis ms): later copies are dropped."""
        return f"{self.tag(group)}:park-done"

    def park_due(self, group: int) -> str:
        """ZSET: ``"<mode> <limit> <resource>"`` of the group's resources with parked tasks,
        scored by when the pump looks at them next (Redis ms)."""
        return f"{self.tag(group)}:park-due"

    def receipt(self, name: str) -> str:
        """STRING (JSON) receipt of ``once(name, ...)``, in the slot group of its lease."""
        group = self.group_of(self.once_resource(name))
        return f"{self.tag(group)}:receipt:{escape(name)}"

    def beat_claim(self, entry: str, kind: str) -> str:
        """STRING ``"<run id> <Redis ms of the claim> <replica>"``: the last claimed run of a
        beat entry.

        ``kind`` is ``"cron"`` (run id = due time in ms) or ``"every"`` (Redis-time bucket).
        """
        return self.named(f"beat-{kind}", entry)

    def named(self, kind: str, name: str) -> str:
        """A key for a named object of another part (``once`` receipts, beat claims).

        ``kind`` is a fixed word chosen by the code; ``name`` is user data and is escaped.
        """
        group = self.group_of(f"{kind}:{name}")
        return f"{self.tag(group)}:{kind}:{escape(name)}"


def owner_id(node: str, incarnation: str, pid: int) -> str:
    """The id of one lease-holding process: ``<escaped node>/<incarnation>/<pid>``."""
    return f"{escape(node)}/{incarnation}/{pid}"


class OwnerParts(NamedTuple):
    """An owner id, split: the node (unescaped), the incarnation and the pid as written."""

    node: str
    incarnation: str
    pid: str


def split_owner(owner: str) -> OwnerParts:
    """The parts of ``<escaped node>/<incarnation>/<pid>``.

    Raises:
        ValueError: ``owner`` has fewer than two slashes (not an owner id).
    """
    escaped, incarnation, pid = owner.rsplit("/", 2)
    return OwnerParts(unescape(escaped), incarnation, pid)


def escaped_node_of_owner(owner: str) -> str:
    """The node inside an owner id as written there (escaped, as in the node's key)."""
    return owner.rsplit("/", 2)[0]


def node_of_owner(owner: str) -> str:
    """The node name inside an owner id."""
    return unescape(escaped_node_of_owner(owner))


def pid_of_owner(owner: str) -> int | None:
    """The pid at the end of an owner id, or None when it is not a number."""
    pid = owner.rsplit("/", 1)[-1]
    return int(pid) if pid.isdigit() else None


def holder_value(token: int | str, owner: str) -> str:
    """A lease key's value or a shared member: ``"<token> <owner>"``."""
    return f"{token} {owner}"


def holder_parts(value: object) -> tuple[str, str]:
    """``"<token> <owner>"`` (a lease key's value or a shared member) as (token text, owner).

    The token is left as text: a queued unique claim's value and a value written by a
    future release are read by the caller, which decides what a non-number means.
    """
    token, _, owner = str(value).partition(" ")
    return token, owner


def fenced_keys(prefix: str, name: str) -> tuple[str, str]:
    """``(data, fence record)`` keys of the fenced-write target ``name`` under ``prefix``.

    ``{<prefix>:<name>}`` and ``{<prefix>:<name>}:fence``, both escaped: the whole data key is
    one hash tag, and the record carries the same tag, so a Redis Cluster keeps them in one
    slot whatever the name holds (escaped braces cannot end the tag early), and different
    names spread over the slots. A colon in the prefix is escaped too, so the first colon ends
    the prefix: store ``a`` name ``b:c`` and store ``a:b`` name ``c`` never share a key.
    """
    tag = f"{{{escape(prefix).replace(':', '%3A')}:{escape(name)}}}"
    return tag, f"{tag}:fence"
