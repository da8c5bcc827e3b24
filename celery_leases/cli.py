"""``celery leases``: see who holds what, and free what a dead holder left behind.

The commands run against the ``-A`` app's settings (its ``Leases(app)``, or one made from
``app.conf.leases_*``, ``CELERY_LEASES_*`` and the defaults)::

    celery -A proj leases ls [--owner NODE] [--resource PATTERN] [--json]
    celery -A proj leases show RESOURCE [--json]
    celery -A proj leases history [--resource R] [--node N] [-n K] [--json]
    celery -A proj leases top [--interval S] [-n ROWS] [--once]
    celery -A proj leases health [--node NODE]
    celery -A proj leases release RESOURCE [--force] [--yes]
    celery -A proj leases owners [--json]
    celery -A proj leases reconcile [--json]
    celery -A proj leases stats [--json]
    celery -A proj leases audit [-n N] [--json]
    celery -A proj leases wait RESOURCE [--timeout S]
    celery -A proj leases limits [--json]

- ``ls``: every held lease, found through the owners index and each owner's registry (never a
  keyspace scan): resource, mode (``exclusive``/``shared``), fencing token, owner, node, the
  holding task's id, seconds left on the lease, and whether its owner is alive. Registry
  entries whose lease already ran out (or was released or taken over) are left out: they hold
  nothing, and the next reconcile or cleanup removes them; ``stats`` counts them. ``--owner``
  takes a node name (a worker hostname such as ``celery@pod-7``) or one full owner id;
  ``--resource`` an ``fnmatch`` pattern, case-sensitive (``'repo:*'``). ``--json`` prints a
  list of objects with ``resource``, ``mode``, ``token``, ``owner``, ``node``, ``task_id``,
  ``task_name``, ``expires_in``, ``alive``, ``liveness``, ``status`` and ``renewed_ago``. The
  task name is asked of the live workers (remote control, at most 1 s): the registry records
  the id only. The LIVENESS column says ``alive`` only while the owner renews on time,
  ``renewed N s ago`` once it missed renewals (killed, stalled or idle) until its liveness runs
  out, then ``dead``. Names are escaped and shortened in the table, whole in ``--json``.
  Claims of tasks declared ``unique=`` show as resources ``celery_leases:unique:<key>``: a
  running one as the exclusive lease of the worker process that runs it, a queued one (its
  task not started yet; read from each slot group's index of queued claims) with mode
  ``queued``, no owner or node (null), and its task's id.
  ``--owner`` leaves queued claims out (no process holds them).
- ``show RESOURCE``: the holders of one resource, read from its own keys, with each owner's
  liveness and the task id from that owner's registry entry, then its record: since when it
  is held (from the token), its last renewal, its changes of hands, its waiters and its last
  events (the last three need the ``history`` setting). ``--json`` prints the record as one
  object (``holders``, ``granted_at``, ``renewed_at``, ``transitions``, ``waiters``,
  ``history``).
- ``history``: the last events (``granted``, ``busy``, ``released``, ``expired``, ``freed``,
  ``forced``, ``lost``), fleet-wide or of one ``--resource`` or ``--node``; needs the
  ``history`` setting.
- ``top``: a live view of held leases, their waiters and busy attempts per second;
  ``--once`` prints one frame.
- ``health``: exit 0 when Redis answers and, with ``--node``, that node is alive (its worker
  marks itself so at every reaper pass, or one of its processes renews on time); 1 when Redis
  does not answer, 2 when the node is stale. For Kubernetes probes.
- ``release RESOURCE``: frees the resource's leases whose owner is dead (its liveness ran out,
  or it is no longer registered). If any holder is alive it changes nothing and exits 1, naming
  the live owner, unless ``--force``; ``--force`` asks before freeing a live owner's lease
  unless ``--yes``. A live holder learns of it at its next renewal (``LeaseLost``, interrupting
  a task body by default). Every release is logged (a forced one at WARNING, through celery's
  logger) and appended to the audit list in Redis, ``forced`` telling whether the owner was
  alive.
- ``owners``: every registered owner by node, its liveness (as in ``ls``; ``--json`` adds
  ``status`` and ``renewed_ago`` to the seconds left, negative once it ran out) and the number
  of leases it holds. An owner whose liveness ran out is dead, or alive
  but idle: a process holding nothing does not renew its liveness; a reconcile forgets it.
  One that holds nothing on a node whose worker marked itself alive (with the owner's
  incarnation, as ``health --node`` reads it) shows ``idle``, not late or dead.
- ``reconcile``: one orphan-reconcile pass now (what workers do every ``reconcile_interval``):
  frees the leases of owners whose liveness ran out, and reports them.
- ``stats``: owners alive and dead, leases held (exclusive, shared), stale registry entries,
  per node.
- ``audit``: the last ``N`` releases made with ``release`` (default 20; the list keeps 1000).
- ``wait RESOURCE``: blocks until the resource has no holder (exit 0) or ``--timeout`` passes
  (exit 75); it takes no lease and no place in the queue. For scripts and init containers.
- ``limits``: every rate limit with a window, an override or a penalty (from each slot
  group's self-pruning index, never a scan): its rate in force, the override, the cost used
  in the window and left now, when it next admits and resets, the penalty. ``--json``
  prints objects with ``name``, ``rate``, ``declared``, ``override``, ``used``, ``left``,
  ``next_admit``, ``resets`` and ``penalty`` (seconds). See docs/limits.md.

``--force`` and ``--yes`` are never read from the environment (celery's CLI would otherwise
take ``CELERY_LEASES_RELEASE_FORCE``), nor is any other option of these commands.

Exit status: 0 done; 1 refused, nothing held, aborted, or a reconcile that could not clean
every owner (``health``: Redis does not answer); 2 bad usage (``health``: the node is
stale); 69 Redis could not be reached or failed; 75 another process is reconciling (try
again; ``wait``: still held at its timeout); 78 invalid settings. Errors are one line on
stderr, URLs without their password.

.. versionadded:: 0.1
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import click
from celery import signals as _signals
from celery.utils.log import get_logger

from . import _cli_inspect, _cli_limits, _cli_parked, _cli_repair, _cli_watch
from ._cli_base import EX_CONFIG
from .app import find_leases
from .task import unleased_tasks

if TYPE_CHECKING:
    from celery import Celery

__all__ = ("leases",)

logger = get_logger(__name__)


# --- the commands ---------------------------------------------------------------------------
@click.group(name="leases")
def leases() -> None:
    """Inspect leases and free those of dead holders (celery_leases)."""
    if not logging.root.handlers:
        # celery's loggers end in a NullHandler outside a worker: without this, the WARNING
        # of a forced release (and a reconcile's errors) would reach no one
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")


# The commands live by concern in _cli_inspect, _cli_watch and _cli_repair, each listing its
# own in COMMANDS. A new command is a click.command(cls=_cli_base.Command) there (or here,
# with @leases.command), and in its module's COMMANDS.
for _module in (_cli_inspect, _cli_watch, _cli_repair, _cli_limits, _cli_parked):
    for _command in _module.COMMANDS:
        leases.add_command(_command)


# --- a worker whose tasks carry lease options nothing would read -----------------------------
def unleased_problem(app: Celery) -> str | None:
    """Why a worker of ``app`` must not start: tasks that set lease options on an app without
    ``Leases(app)`` (nothing would take their leases); None when there are none."""
    if find_leases(app) is not None:
        return None
    tasks = unleased_tasks(app)
    if not tasks:
        return None
    listed = "; ".join(f"{name} ({', '.join(options)})" for name, options in tasks.items())
    which = "the task" if len(tasks) == 1 else "the tasks"
    return (
        f"celery_leases: refusing to start: {which} {listed} of app {app.main!r} set lease "
        "options, but the app has no Leases(app), so nothing would take their leases and "
        "copies would run at once. Create it next to the app (from celery_leases import "
        "Leases; Leases(app)), or declare them with base=LeasedTask. See "
        "docs/tasks.md#without-baseleasedtask."
    )


def on_worker_init(sender: Any = None, **kwargs: Any) -> None:
    """``worker_init``: refuse to start (exit 78) a worker whose tasks carry lease options on
    an app without ``Leases(app)``.

    The exception to "a handler never raises": it ends the process on purpose, with
    ``SystemExit``, which Celery's signal dispatch does not swallow. Anything else that goes
    wrong here is logged and the worker starts.
    """
    try:
        problem = unleased_problem(sender.app)
    except Exception:
        logger.exception("leases: could not check the worker's tasks for lease options")
        return
    if problem is not None:
        click.echo(problem, err=True)
        raise SystemExit(EX_CONFIG)


# The style exception of this module (docs/architecture.md, "Rules"): importing it connects a
# signal. Celery's CLI imports this module, the package's celery.commands entry point, in every
# `celery` process, so a `celery worker` sees tasks whose lease options an app without
# Leases(app) would silently ignore, even when the app's code never imports celery_leases.
_signals.worker_init.connect(on_worker_init, dispatch_uid="celery_leases.unleased", weak=False)
