"""The errors celery_leases raises.

Catch :class:`LeaseError` to handle every one of them::

    LeaseError                  root; catch this one
    ├── LeaseConfigError        also a ValueError: invalid settings or task options
    ├── LeaseBusy               another holder has it; .resource, .retry_after,
    │                           .holder_task, .same_owner (a nested hold)
    │   ├── DuplicateTask       a unique task's key is claimed by a queued or running copy;
    │   │                       .key, .task_id, .state
    │   └── RateLimited         a rate limit admits nobody more now; .resource (the limit),
    │                           .retry_after (the exact wait)
    ├── LeaseLost               our lease expired or was taken over; .resource, .held_for
    │   └── LeaseRevoked        leases.revoke() asked the holder to let go; .reason, .deadline
    ├── StaleFence              a fenced write was refused: a newer token was accepted;
    │                           .name, .token, .last
    └── LeaseBackendError       Redis failed or could not be reached; raised from the redis error;
                                .maybe_claimed (.task_id, .key) for a unique send

No raw ``redis`` exception escapes the public API: each is wrapped in
:class:`LeaseBackendError` with the original as ``__cause__``.
"""

from __future__ import annotations

__all__ = (
    "DuplicateTask",
    "LeaseBackendError",
    "LeaseBusy",
    "LeaseConfigError",
    "LeaseError",
    "LeaseLost",
    "LeaseRevoked",
    "RateLimited",
    "StaleFence",
)


class LeaseError(Exception):
    """Root of every error raised by celery_leases."""


class LeaseConfigError(LeaseError, ValueError):
    """A setting or a task's lease option is invalid."""


class LeaseBusy(LeaseError):
    """Another holder has the resource (or the shared limit is reached).

    Attributes:
        resource: the (first) resource that was busy.
        retry_after: seconds until the current holder's lease runs out unless renewed; a
            hint for when trying again could succeed, never a promise.
        waited: seconds spent waiting before giving up.
        holder_task: the id of the task that holds the resource, when the holder is a
            leased task and Redis could tell (an exclusive lease); else None.
        same_owner: True when the holder is the very process that asked (a nested ``hold``
            of a resource it already holds): leases are not reentrant.

    The details are kept in ``args`` (not just in the message), so the exception survives
    Celery's JSON result serialisation, which rebuilds an exception as ``cls(*args)``.
    """

    def __init__(
        self,
        resource: str,
        retry_after: float | None = None,
        waited: float = 0.0,
        holder_task: str | None = None,
        same_owner: bool = False,
    ) -> None:
        # holder_task (and same_owner) join args only when known: the 3-tuple of earlier
        # releases stays what every busy without a known holder pickles to, for workers of
        # either release
        if same_owner:
            super().__init__(resource, retry_after, waited, holder_task, True)
        elif holder_task is None:
            super().__init__(resource, retry_after, waited)
        else:
            super().__init__(resource, retry_after, waited, holder_task)
        self.resource = resource
        self.retry_after = retry_after
        self.waited = waited
        self.holder_task = holder_task
        self.same_owner = same_owner

    def __str__(self) -> str:
        if self.same_owner:
            task = f", task {self.holder_task}" if self.holder_task else ""
            msg = (
                f"lease on {self.resource!r} is held by this same owner (this process{task}): "
                "leases are not reentrant, a nested hold of a resource the process already "
                "holds is busy until the outer one is released"
            )
            if self.waited > 0:
                msg += f" (waited {self.waited:.1f}s)"
            return msg
        holder = f"task {self.holder_task}" if self.holder_task else "another owner"
        msg = f"lease on {self.resource!r} is held by {holder}"
        if self.waited > 0:
            msg += f" (waited {self.waited:.1f}s)"
        return msg


class DuplicateTask(LeaseBusy):
    """A task declared ``unique=`` was not sent: a copy with the same key is queued or running.

    Raised by ``apply_async``/``delay``/``send_task`` (and canvas) when the task's
    ``on_duplicate`` is ``"raise"``.

    Attributes:
        key: the rendered unique key.
        task_id: the id of the copy that holds the key (None if it could not be read).
        state: ``"queued"``, ``"running"`` or ``"throttled"`` (``unique_mode="throttle"``:
            ``task_id``'s send was accepted less than ``unique_window`` seconds ago).
        resource: the claim's resource name (``celery_leases:unique:<key>``).

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        key: str,
        task_id: str | None = None,
        state: str = "queued",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"celery_leases:unique:{key}", retry_after)
        self.args = (key, task_id, state, retry_after)
        self.key = key
        self.task_id = task_id
        self.state = state

    def __str__(self) -> str:
        holder = f"task {self.task_id}" if self.task_id else "another task"
        return f"not sent: unique key {self.key!r} is held by {holder} ({self.state})"


class RateLimited(LeaseBusy):
    """A rate limit (:class:`~celery_leases.Rate`, ``leases.limit``) admits nobody more now.

    Attributes:
        resource: the rendered name of the limit that refused (of several: the one that
            admits last).
        retry_after: seconds, on the Redis clock, until the limit has room for the cost
            asked: exact, not a hint (a retry then is admitted unless another caller takes
            the room first, or an override or a penalty changes the rate).
        waited: seconds spent waiting before giving up.

    .. versionadded:: 0.2
    """

    def __init__(self, resource: str, retry_after: float = 0.0, waited: float = 0.0) -> None:
        super().__init__(resource, retry_after, waited)
        self.retry_after: float = retry_after

    def __str__(self) -> str:
        msg = f"rate limit {self.resource!r} admits again in {self.retry_after:.3f}s"
        if self.waited > 0:
            msg += f" (waited {self.waited:.1f}s)"
        return msg


class LeaseLost(LeaseError):
    """The lease expired or was taken over while it was meant to be held.

    Attributes:
        resource: the resource whose lease was lost.
        held_for: seconds between the grant and the moment the loss was noticed.

    Like :class:`LeaseBusy`, the details live in ``args`` so Celery's JSON result backend
    rebuilds it intact.
    """

    def __init__(self, resource: str, held_for: float = 0.0) -> None:
        super().__init__(resource, held_for)
        self.resource = resource
        self.held_for = held_for

    def __str__(self) -> str:
        return (
            f"lease on {self.resource!r} was lost after {self.held_for:.1f}s; "
            "the work may have overlapped with another holder"
        )


class LeaseRevoked(LeaseLost):
    """``leases.revoke()`` asked the holder of the lease to let go.

    Raised inside the holder's task body (``on_lost="interrupt"``) at the renewal that
    learns of it, and by :meth:`Lease.check() <celery_leases.Lease.check>` from then on.
    The lease stays held until the holder releases it (leaving the body or the ``hold``
    block) or until the deadline, when Redis lets it run out and the next holder is
    granted it with a new fencing token: a write fenced with this lease's token after that
    is refused.

    Attributes:
        resource: the revoked resource.
        held_for: seconds between the grant and the moment the holder learnt of it.
        reason: the text the revoker gave (may be empty).
        deadline: seconds that were left, when the holder learnt of it, until the lease
            runs out (on the Redis clock; the holder counts it lost a little before).

    .. versionadded:: 0.2
    """

    def __init__(
        self, resource: str, held_for: float = 0.0, reason: str = "", deadline: float = 0.0
    ) -> None:
        super().__init__(resource, held_for)
        self.args = (resource, held_for, reason, deadline)
        self.reason = reason
        self.deadline = deadline

    def __str__(self) -> str:
        why = f" ({self.reason})" if self.reason else ""
        return (
            f"lease on {self.resource!r} was revoked{why} after {self.held_for:.1f}s; "
            f"unless released first, it was freed for the next holder {self.deadline:.1f}s later"
        )


class StaleFence(LeaseError):
    """A fenced write was refused: a newer fencing token was already accepted for its key.

    Raised by the fenced stores of :mod:`celery_leases.fence` when called with
    ``raise_stale=True``. The write changed nothing: the writer's lease was lost (it was
    paused or cut off past its TTL) and a later holder has written since.

    Attributes:
        name: the name the write was for.
        token: the refused fencing token.
        last: the last token the store accepted for ``name`` (larger than ``token``).

    .. versionadded:: 0.1
    """

    def __init__(self, name: str, token: int, last: int) -> None:
        super().__init__(name, token, last)
        self.name = name
        self.token = token
        self.last = last

    def __str__(self) -> str:
        return (
            f"fenced write to {self.name!r} with token {self.token} was refused: "
            f"token {self.last} was accepted since; a newer holder has written"
        )


class LeaseBackendError(LeaseError):
    """Redis failed, timed out or could not be reached.

    The message never contains a password: URLs are shown without credentials.

    Attributes:
        maybe_claimed: a unique task's send: the claim call may have run in Redis although
            its reply was lost (and its resend failed). Nothing was published; the claim, if
            it was made, is pending and frees its key within ``unique_confirm_window``, and
            this process gives it back by task id when Redis answers again (its next send of
            the key). False for every other error.
        task_id: with ``maybe_claimed``, the task id the claim may be queued for.
        key: with ``maybe_claimed``, the rendered unique key.
    """

    maybe_claimed: bool = False
    task_id: str | None = None
    key: str | None = None
