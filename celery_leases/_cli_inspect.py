"""``celery leases`` commands that read: ls, show, history, owners, stats, audit."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, Final

import click

from ._census import (
    ROW_HEADERS,
    Renewals,
    holder_rows,
    idle_owners,
    lease_counts,
    liveness_text,
    ls_rows,
    named,
    owner_objects,
    seconds,
    take_census,
    text_table,
)
from ._cli_base import Command, Failure, app_of, echo_json, json_option, leases_of, non_empty
from ._inspect import AUDIT_KEEP
from ._keys import node_of_owner
from ._render import printable


@click.command("ls", cls=Command)
@click.option(
    "--owner",
    metavar="NODE",
    allow_from_autoenv=False,
    help="Only leases of owners on this node (a worker hostname), or of this owner id.",
)
@click.option(
    "--resource",
    "pattern",
    metavar="PATTERN",
    allow_from_autoenv=False,
    help="Only resources matching this fnmatch pattern (case-sensitive), e.g. 'repo:*'.",
)
@json_option
@click.pass_context
def ls(ctx: click.Context, owner: str | None, pattern: str | None, as_json: bool) -> None:
    """List every held lease.

    Found through the owners index and the owners' registries; leases that already ran out
    are left out.
    """
    non_empty("--owner", owner)
    non_empty("--resource", pattern)
    store = leases_of(ctx).store
    renewals = Renewals.of(store.settings)
    rows = ls_rows(app_of(ctx), store, owner=owner, pattern=pattern)
    if as_json:
        echo_json([row.as_json(renewals) for row in rows])
    elif not rows:
        click.echo("no leases held")
    else:
        click.echo(text_table(ROW_HEADERS, (row.cells(renewals) for row in rows)))


@click.command("show", cls=Command)
@click.argument("resource")
@json_option
@click.pass_context
def show(ctx: click.Context, resource: str, as_json: bool) -> None:
    """Show who holds RESOURCE, since when, who waits for it and what happened to it.

    Each holder with its owner's liveness and the id of the task that holds it; the grant
    and last renewal times, the changes of hands and the last events need the history
    setting.
    """
    non_empty("RESOURCE", resource)
    store = leases_of(ctx).store
    renewals = Renewals.of(store.settings)
    record = store.lease_record(resource)
    if not record["holders"] and not record["history"] and not record["waiters"]:
        raise Failure(f"no lease is held on {resource!r}")
    rows = holder_rows(store, resource) if record["holders"] else []
    if record["holders"] and not rows:  # released since the record was read
        raise Failure(f"no lease is held on {resource!r}")
    rows = named(app_of(ctx), rows)
    by_grant = {(row.owner, row.token): row for row in rows}
    for holder in record["holders"]:
        row = by_grant.get((holder["owner"] or "", holder["token"]))
        if row is None and holder["owner"] is None:  # a queued claim
            row = next((r for r in rows if r.queued and r.token == holder["token"]), None)
        if row is not None:
            shown = row.as_json(renewals)
            holder.update(
                {k: shown[k] for k in ("task_name", "alive", "liveness", "status", "expires_in")}
            )
            holder["owner_renewed_ago"] = shown["renewed_ago"]
            holder["task_id"] = holder["task_id"] or row.task_id
    if as_json:
        echo_json(record)
        return
    if rows:
        click.echo(text_table(ROW_HEADERS, (row.cells(renewals) for row in rows)))
    else:
        click.echo(f"{printable(resource)}: not held")
    now = record["now"]
    click.echo("")
    click.echo(f"granted:      {_when(record['granted_at'], now, 'at or before ')}")
    click.echo(f"renewed:      {_when(record['renewed_at'], now)}")
    transitions = record["transitions"]
    click.echo(f"transitions:  {'unknown (history off)' if transitions is None else transitions}")
    click.echo(f"waiters:      {record['waiters']}")
    if record["history"]:
        click.echo("")
        click.echo(_events_table(record["history"][:10], now))


def _when(at: float | None, now: float, prefix: str = "") -> str:
    """An epoch time as UTC and its age, or ``-``."""
    if at is None:
        return "-"
    stamp = datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="milliseconds")
    return f"{prefix}{stamp} ({seconds(max(now - at, 0.0))} ago)"


_EVENT_HEADERS: Final = ("AT", "AGO", "EVENT", "RESOURCE", "NODE", "TOKEN", "TASK_ID", "BY")


def _events_table(events: Sequence[dict[str, Any]], now: float) -> str:
    rows = (
        [
            datetime.fromtimestamp(e["at"], timezone.utc).strftime("%H:%M:%S.%f")[:-3],
            seconds(max(now - e["at"], 0.0)),
            e["event"],
            e["resource"] or "-",
            e["node"] or "-",
            e["token"] or "-",
            e["task_id"] or "-",
            e.get("by") or "-",
        ]
        for e in events
    )
    return text_table(_EVENT_HEADERS, rows)


@click.command("history", cls=Command)
@click.option(
    "--resource",
    metavar="RESOURCE",
    allow_from_autoenv=False,
    help="Only this resource's events (its own stream).",
)
@click.option(
    "--node",
    metavar="NODE",
    allow_from_autoenv=False,
    help="Only events of owners on this node (a worker hostname).",
)
@click.option(
    "-n",
    "count",
    type=click.IntRange(1, 100_000),
    default=20,
    show_default=True,
    allow_from_autoenv=False,
    help="How many of the newest events to show.",
)
@json_option
@click.pass_context
def history(
    ctx: click.Context, resource: str | None, node: str | None, count: int, as_json: bool
) -> None:
    """Show the last events: granted, released, expired, freed, lost, forced, busy.

    Newest first, fleet-wide (every slot group's stream) or of one resource. Written only
    with the history setting (0, the default, writes nothing).
    """
    non_empty("--resource", resource)
    non_empty("--node", node)
    store = leases_of(ctx).store
    events = store.history(resource=resource, node=node, count=count)
    if as_json:
        echo_json(events)
    elif events:
        click.echo(_events_table(events, store.redis_time()))
    elif not store.settings.history:
        click.echo("no history: the history setting is 0 (off); see docs/operations.md")
    else:
        click.echo("no events recorded")


@click.command("owners", cls=Command)
@json_option
@click.pass_context
def owners(ctx: click.Context, as_json: bool) -> None:
    """List the owners by node.

    With the seconds left on each one's liveness (negative: it ran out) and the number of
    leases it holds; an owner that holds nothing on a node whose worker is alive is idle.
    """
    store = leases_of(ctx).store
    renewals = Renewals.of(store.settings)
    census = take_census(store)
    counts = lease_counts(census)
    idle = idle_owners(store, census, renewals)
    listed = sorted(census.liveness, key=lambda o: (node_of_owner(o), o))
    if as_json:
        echo_json(owner_objects(census, renewals, idle))
    elif not listed:
        click.echo("no owners registered")
    else:
        rows = (
            [
                node_of_owner(owner),
                owner,
                liveness_text(census.liveness[owner], renewals, idle=owner in idle),
                counts.get(owner, 0),
            ]
            for owner in listed
        )
        click.echo(text_table(("NODE", "OWNER", "LIVENESS", "LEASES"), rows))


@click.command("stats", cls=Command)
@json_option
@click.pass_context
def stats(ctx: click.Context, as_json: bool) -> None:
    """Count owners and leases, per node.

    Owners alive and dead, leases held (exclusive, shared) and stale registry entries.
    """
    census = take_census(leases_of(ctx).store)
    nodes: dict[str, dict[str, int]] = {}

    def node(owner: str) -> dict[str, int]:
        return nodes.setdefault(
            node_of_owner(owner),
            {"owners_alive": 0, "owners_dead": 0, "exclusive": 0, "shared": 0, "stale": 0},
        )

    for owner, liveness in census.liveness.items():
        node(owner)["owners_alive" if liveness is not None and liveness > 0 else "owners_dead"] += 1
    for row in census.held:
        node(row.owner)["exclusive" if row.mode == "x" else "shared"] += 1
    for owner, n in census.stale.items():
        node(owner)["stale"] += n
    total = {k: sum(n[k] for n in nodes.values()) for k in ("owners_alive", "owners_dead")}
    exclusive = sum(n["exclusive"] for n in nodes.values())
    shared = sum(n["shared"] for n in nodes.values())
    stale = sum(census.stale.values())
    if as_json:
        echo_json(
            {
                "owners": {"alive": total["owners_alive"], "dead": total["owners_dead"]},
                "leases": {"held": exclusive + shared, "exclusive": exclusive, "shared": shared},
                "stale_entries": stale,
                "queued_claims": len(census.queued),
                "nodes": dict(sorted(nodes.items())),
            }
        )
        return
    click.echo(f"owners: {total['owners_alive']} alive, {total['owners_dead']} dead")
    click.echo(
        f"leases: {exclusive + shared} held ({exclusive} exclusive, {shared} shared), "
        f"{stale} stale registry entr{'y' if stale == 1 else 'ies'}"
    )
    if census.queued:
        click.echo(f"unique claims queued (tasks not started): {len(census.queued)}")
    if nodes:
        click.echo("")
        rows = (
            [name, n["owners_alive"], n["owners_dead"], n["exclusive"], n["shared"], n["stale"]]
            for name, n in sorted(nodes.items())
        )
        headers = ("NODE", "ALIVE", "DEAD", "EXCLUSIVE", "SHARED", "STALE")
        click.echo(text_table(headers, rows))


@click.command("audit", cls=Command)
@click.option(
    "-n",
    "--last",
    "last",
    type=click.IntRange(1, AUDIT_KEEP),
    default=20,
    show_default=True,
    allow_from_autoenv=False,
    help="How many of the newest records to show.",
)
@json_option
@click.pass_context
def audit(ctx: click.Context, last: int, as_json: bool) -> None:
    """Show the last releases made with `release`.

    Newest first; `forced` says the owner was alive when it was released.
    """
    records = leases_of(ctx).store.audit_log(last)
    if as_json:
        echo_json(records)
    elif not records:
        click.echo("no releases recorded")
    else:
        keys = ("at", "by", "resource", "owner", "task_id", "forced", "released")
        rows = ([_cell(record.get(k)) for k in keys] for record in records)
        click.echo(text_table([k.upper() for k in keys], rows))


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


COMMANDS: Final = (ls, show, history, owners, stats, audit)
