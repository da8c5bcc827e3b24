"""``celery leases parked`` and ``celery leases unpark``: parked tasks (on_busy="defer")."""

from __future__ import annotations

import time
from typing import Final

import click

from ._cli_base import Command, Failure, echo_json, json_option, leases_of, non_empty
from ._parked import list_parked, unpark
from ._render import printable


@click.command("parked", cls=Command)
@click.argument("resource", required=False)
@json_option
@click.pass_context
def parked(ctx: click.Context, resource: str | None, as_json: bool) -> None:
    """List the tasks parked (on_busy="defer") on RESOURCE, or on every resource.

    In each resource's order: the first is handed on next. A task "handed on" was published
    again and holds a reservation of the lease until its copy starts.
    """
    if resource is not None:
        non_empty("RESOURCE", resource)
    ext = leases_of(ctx)
    rows = list_parked(ext, resource)
    if as_json:
        echo_json({"count": len(rows), "parked": rows})
        return
    if not rows:
        click.echo("no parked tasks")
        return
    now = time.time()
    click.echo(f"{len(rows)} parked task(s)")
    for row in rows:
        waited = max(0.0, now - float(row["since"])) if row["since"] else 0.0
        click.echo(
            f"{printable(str(row['resource']))}  {row['task_id']}  {row['task']}  "
            f"{row['state']}  {waited:.0f}s"
        )


@click.command("unpark", cls=Command)
@click.argument("task_id")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def unpark_command(ctx: click.Context, task_id: str, yes: bool) -> None:
    """Cancel the parked task TASK_ID: it is never published again, a copy already published
    is dropped when it arrives, and its result becomes REVOKED."""
    non_empty("TASK_ID", task_id)
    ext = leases_of(ctx)
    if not yes:
        click.confirm(f"cancel parked task {task_id}?", abort=True)
    if not unpark(ext, task_id):
        raise Failure(f"task {task_id} is not parked")
    click.echo(f"unparked {task_id} (REVOKED)")


COMMANDS: Final = (parked, unpark_command)
