"""``celery leases limits``: every active rate limit, its window and its overrides."""

from __future__ import annotations

from typing import Final

import click

from ._cli_base import Command, echo_json, json_option, leases_of
from ._limits import limit_json, list_limits
from ._render import table

#: the columns of the table (``--json``: see :func:`~celery_leases._limits.limit_json`)
HEADERS: Final = ("LIMIT", "RATE", "OVERRIDE", "USED", "LEFT", "NEXT", "RESETS", "PENALTY")


def _seconds(value: float) -> str:
    return "now" if value <= 0 else f"{value:.3f}s"


@click.command("limits", cls=Command)
@json_option
@click.pass_context
def limits(ctx: click.Context, as_json: bool) -> None:
    """List every rate limit that holds a window, an override or a penalty.

    Read from each slot group's index of limits (it prunes itself), never by a keyspace
    scan: the rate in force (an override wins over the declared rate), the cost used in the
    current window and left now, when a cost of 1 is next admitted and when the window is
    empty, and the penalty in force.
    """
    store = leases_of(ctx).store
    rows = store.run(list_limits(store.engine))
    if as_json:
        echo_json([limit_json(r) for r in rows])
        return
    if not rows:
        click.echo("no active rate limits")
        return
    cells = [
        (
            r.name,
            r.rate,
            r.override or "-",
            r.used,
            r.left,
            _seconds(r.next_admit),
            _seconds(r.resets),
            "-" if r.penalty <= 0 else f"{r.penalty:.3f}s",
        )
        for r in rows
    ]
    click.echo(table(HEADERS, cells, limits={"LIMIT": 60}))


COMMANDS: Final = (limits,)
