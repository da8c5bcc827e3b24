"""Signals sent by celery_leases, in Celery's style.

Connect a receiver as you would to a Celery signal::

    from celery_leases.signals import lease_lost

    @lease_lost.connect
    def page_someone(sender=None, resource=None, token=None, owner=None, **kwargs):
        ...

Every signal is sent with ``sender`` = the resource name and the keyword arguments listed
below (``task_id`` is None outside a task). Receivers run in the thread that sent
the signal (``lease_lost``: the heartbeat thread) and must not block for long; an exception in
a receiver is logged and never stops celery_leases.

- ``lease_acquired``: ``resource``, ``token``, ``owner``, ``ttl``, ``shared``, ``task_id``,
  ``elapsed`` (seconds the acquire took, waiting included; the same value for every lease of
  one all-or-nothing acquire)
- ``lease_busy``: ``resource``, ``retry_after``, ``task_id``, ``elapsed`` (seconds the
  acquire took before it gave up, waiting included), ``shared`` (the mode asked for),
  ``ttl``
- ``lease_released``: ``resource``, ``token``, ``owner``, ``held_for``, ``task_id``,
  ``elapsed`` (seconds the release took, its round trip to Redis included; the same value
  for every lease of one release)
- ``lease_lost``: ``resource``, ``token``, ``owner``, ``held_for``, ``task_id``

- ``unique_duplicate``: sent by a producer (``sender`` = the task name) that did not send a
  task declared ``unique=`` because its key is held: ``key``, ``task_id`` (of the copy not
  sent), ``holder_task_id`` (of the copy holding it, None if unknown), ``state`` (``queued``
  or ``running``), ``policy`` (the ``on_duplicate`` applied)

- ``redelivery_guarded``: sent by a worker's main process with the redelivery guard on
  (``sender`` = the task name) when a delivery meets another copy of its task: ``task_id``,
  ``retries``, ``outcome``: ``waiting`` (another copy holds it; this one waits for its
  outcome), ``dropped`` (that delivery already ended: this copy was acked and not run),
  ``ran`` (a waiting copy runs: the other one ended unfinished) or ``unguarded`` (the leases
  Redis failed; the delivery runs without the guard). See redelivery.md.

- ``limit_admitted``: sent when a rate limit admits (``sender`` = the :class:`Rate`'s
  template, ``"-"`` for ``leases.limit``): ``name`` (the rendered limit), ``cost``, ``at``
  (the Redis time of the admission, Unix seconds), ``task_id``
- ``limit_refused``: sent when a rate limit refuses (``sender`` as above): ``name``,
  ``retry_after`` (the exact wait), ``task_id``

``lease_released`` is sent once per lease given back by ``release()``, also for a lease that
was lost before (its ``lease_lost`` was sent already), and not at all when Redis could not be
reached to give it back.

.. versionadded:: 0.1
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = (
    "lease_acquired",
    "lease_busy",
    "lease_lost",
    "lease_released",
    "limit_admitted",
    "limit_refused",
    "redelivery_guarded",
    "unique_duplicate",
)

lease_acquired = Signal(name="lease_acquired")
lease_busy = Signal(name="lease_busy")
lease_released = Signal(name="lease_released")
lease_lost = Signal(name="lease_lost")
unique_duplicate = Signal(name="unique_duplicate")
redelivery_guarded = Signal(name="redelivery_guarded")
limit_admitted = Signal(name="limit_admitted")
limit_refused = Signal(name="limit_refused")
