"""``celery leases`` commands that repair: release, revoke and reconcile."""

from __future__ import annotations

from typing import Final, cast

import click
from celery.utils.log import get_logger

from ._census import MODES, holder_rows, operator_name, release_rows, revoke_json
from ._cli_base import (
    BackendFailure,
    Command,
    Failure,
    TryAgain,
    echo_json,
    json_option,
    leases_of,
    non_empty,
)
from ._identity import default_node, set_node
from ._render import printable
from .exceptions import LeaseError
from .worker import RECONCILE_RESOURCE, run_reconcile

#: the CLI's one logger (docs/cli.md names it)
logger = get_logger("celery_leases.cli")


@click.command("release", cls=Command)
@click.argument("resource")
@click.option(
    "--force",
    is_flag=True,
    allow_from_autoenv=False,
    help="Also free a lease whose owner is alive (it learns of it at its next renewal).",
)
@click.option(
    "--yes",
    "-y",
    is_flag=True,
    allow_from_autoenv=False,
    help="With --force: do not ask for confirmation.",
)
@click.pass_context
def release(ctx: click.Context, resource: str, force: bool, yes: bool) -> None:
    """Free the leases on RESOURCE of dead owners.

    A lease whose owner is alive is refused (exit 1) unless --force; --force asks before
    freeing it unless --yes. Every release is recorded in the audit list.
    """
    non_empty("RESOURCE", resource)
    store = leases_of(ctx).store
    rows = holder_rows(store, resource)
    if not rows:
        raise Failure(f"no lease is held on {resource!r}")
    live = [row for row in rows if row.alive]
    if live:
        who = "; ".join(
            f"{row.owner} (liveness {row.liveness or 0:.1f}s left, task {row.task_id or '-'})"
            for row in live
        )
        if not force:
            msg = (
                f"refusing to release {resource!r}: held by live owner {who}; "
                "use --force to release it anyway"
            )
            raise Failure(msg)
        if not yes:
            click.confirm(
                f"{resource!r} is held by live owner {who}. It loses the lease at its next "
                "renewal. Release it anyway?",
                abort=True,
            )
    for row, freed in release_rows(store, resource, rows, by=operator_name()):
        state = "live" if row.alive else "dead"
        shown, task = printable(resource), printable(row.task_id or "-")
        if freed and row.queued:
            click.echo(f"released {shown} (queued claim of task {task})")
        elif freed:
            click.echo(f"released {shown} ({MODES[row.mode]}) of {state} owner {row.owner}")
        else:
            click.echo(f"{shown} of {row.owner} was no longer held (released meanwhile)")


@click.command("revoke", cls=Command)
@click.argument("resource")
@click.option(
    "--reason",
    default="",
    allow_from_autoenv=False,
    help="Why: the holder gets it in LeaseRevoked.reason and its log.",
)
@click.option(
    "--deadline",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    allow_from_autoenv=False,
    help="Seconds until the lease is freed if the holder has not let go  [default: the ttl "
    "setting]",
)
@json_option
@click.pass_context
def revoke(
    ctx: click.Context, resource: str, reason: str, deadline: float | None, as_json: bool
) -> None:
    """Ask the holders of RESOURCE to let go.

    Each learns at its next renewal (LeaseRevoked, a LeaseLost, in its task body as its
    on_lost says, and from check()); the lease is freed when the holder releases it, or at
    the deadline at the latest, and the next holder gets a new fencing token. Exit 1 when
    nobody holds RESOURCE.
    """
    non_empty("RESOURCE", resource)
    store = leases_of(ctx).store
    done = revoke_json(store, resource, reason=reason, deadline=deadline, by=operator_name())
    holders = cast("list[dict[str, object]]", done["holders"])
    if as_json:
        echo_json(done)
    elif holders:
        for holder in holders:
            click.echo(
                f"revoked {printable(resource)} of {holder['owner']}: freed in at most "
                f"{done['deadline']:.1f}s"
            )
    if not holders:
        raise Failure(f"no lease is held on {resource!r}")


@click.command("reconcile", cls=Command)
@json_option
@click.pass_context
def reconcile(ctx: click.Context, as_json: bool) -> None:
    """Free the leases of dead owners now.

    One orphan-reconcile pass, as workers run every reconcile_interval: releases the leases
    of owners whose liveness ran out.
    """
    ext = leases_of(ctx)
    store = ext.store
    store.ping()  # a Redis that does not answer is an error, not "someone else reconciles"
    if ext.settings.node is None:
        # this process takes the reconcile lease as an owner of its own, never as a worker's
        # node (a worker of that name would free the lease at start-up)
        set_node(default_node("cli"))
    try:
        report = run_reconcile(ext)
    finally:
        try:  # drop this process's own registration again; it holds nothing now
            store.cleanup_owner(ext.identity().owner, dead=True)
        except LeaseError as exc:
            logger.debug("leases: could not forget the cli's owner: %s", exc)
    if report is None:
        holders = store.holders(RECONCILE_RESOURCE)
        if not holders:
            raise BackendFailure("the reconcile could not start (see the error above)")
        by = ", ".join(h.owner for h in holders)
        raise TryAgain(f"another process is reconciling ({by}); try again later")
    if as_json:
        echo_json(
            {
                "owners": report.owners,
                "released": [{"owner": o, "resource": r} for o, r in report.released],
                "expired": report.expired,
                "kept": [{"owner": o, "entry": e} for o, e in report.kept],
                "errors": [{"owner": o, "error": e} for o, e in report.errors],
                "handed_on": [{"owner": o, "task_id": t} for o, t, _ in report.handons],
            }
        )
    else:
        click.echo(
            f"reconciled {len(report.owners)} owner(s) whose liveness ran out: released "
            f"{len(report.released)} lease(s), removed {report.expired} stale registry "
            f"entr{'y' if report.expired == 1 else 'ies'}"
        )
        for owner, resource in report.released:
            click.echo(f"  released {printable(resource)} of {owner}")
        for owner, task_id, _ in report.handons:
            click.echo(f"  published parked task {task_id}, handed on by {owner}")
        for owner, entry in report.kept:
            click.echo(f"  kept an unreadable registry entry of {owner}: {entry!r}")
        for owner, error in report.errors:
            click.echo(f"  could not clean {owner}: {error}", err=True)
    if report.errors:
        ctx.exit(1)


COMMANDS: Final = (release, revoke, reconcile)
