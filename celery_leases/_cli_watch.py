"""``celery leases`` commands that watch: top, health and the web view."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Final

import click
from celery.utils.log import get_logger
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ._census import (
    MODES,
    CensusData,
    Renewals,
    liveness_state,
    liveness_text,
    renewed_ago,
    seconds,
    take_census,
)
from ._cli_base import EX_TEMPFAIL, Command, Failure, app_of, leases_of, non_empty
from ._render import printable
from ._sync.driver import LeaseStore
from .config import safe_url
from .exceptions import LeaseBackendError

if TYPE_CHECKING:
    from ._sync.driver import LeaseStore

#: the CLI's one logger (docs/cli.md names it)
logger = get_logger("celery_leases.cli")


HEALTH_NO_REDIS: Final = 1
HEALTH_NODE_STALE: Final = 2


@click.command("health", cls=Command)
@click.option(
    "--node",
    metavar="NODE",
    allow_from_autoenv=False,
    help="Also require this node's liveness to be fresh (a worker hostname).",
)
@click.pass_context
def health(ctx: click.Context, node: str | None) -> None:
    """Exit 0 when Redis answers (and, with --node, NODE's liveness is fresh).

    For Kubernetes probes; needs no worker. Exit 1: Redis does not answer (the URL is shown
    without its password). Exit 2: NODE's worker has not marked itself alive within the ttl
    (its main process does every ttl / 3) and none of its processes renews a liveness on
    time (when one last did, or that none is registered).
    """
    non_empty("--node", node)
    store = leases_of(ctx).store
    try:
        store.ping()
    except LeaseBackendError as exc:
        click.echo(f"unhealthy: {exc}", err=True)
        ctx.exit(HEALTH_NO_REDIS)
    url = safe_url(store.settings.url)
    if node is None:
        click.echo(f"ok: redis at {url} answers")
        return
    renewals = Renewals.of(store.settings)
    marked = store.node_alive(node)
    if marked is not None:
        ago = renewed_ago(marked, renewals)
        when = "" if ago is None else f", marked {seconds(ago)} ago"
        click.echo(f"ok: redis at {url} answers; node {node} is alive (its worker{when})")
        return
    owners = store.node_owners(node)
    liveness = store.read_liveness(owners)
    known = [left for left in liveness.values() if left is not None]
    fresh = [left for left in known if liveness_state(left, renewals) == "alive"]
    if fresh:
        ago = renewed_ago(max(fresh), renewals)
        when = "" if ago is None else f", renewed {seconds(ago)} ago"
        click.echo(
            f"ok: redis at {url} answers; node {node} is alive ({len(fresh)} of "
            f"{len(owners)} owner(s) renewing{when})"
        )
        return
    latest = max(known, default=None)
    if latest is not None and latest > 0:
        ago = renewed_ago(latest, renewals)
        last = "" if ago is None else f"renewed {seconds(ago)} ago, "
        why = (
            f"{last}renewals are due every {seconds(renewals.every)}; its liveness runs "
            f"out in {seconds(latest)} (a killed, stalled or idle node)"
        )
    elif latest is not None:
        why = f"its liveness ran out {seconds(-latest)} ago"
    else:
        why = "it has no registered owner (never started, idle since its last cleanup, or gone)"
    click.echo(f"unhealthy: node {node} is stale: {why}", err=True)
    ctx.exit(HEALTH_NODE_STALE)


@click.command("top", cls=Command)
@click.option(
    "--interval",
    type=click.FloatRange(0.2, 3600),
    default=2.0,
    show_default=True,
    allow_from_autoenv=False,
    help="Seconds between frames.",
)
@click.option(
    "-n",
    "limit",
    type=click.IntRange(1, 10_000),
    default=30,
    show_default=True,
    allow_from_autoenv=False,
    help="Rows shown (the leases with the most waiters first).",
)
@click.option(
    "--once",
    is_flag=True,
    allow_from_autoenv=False,
    help="Print one frame and exit (no live view; for scripts and tests).",
)
@click.pass_context
def top(ctx: click.Context, interval: float, limit: int, once: bool) -> None:
    """A live view of held leases, their waiters and busy attempts per second.

    Drawn with rich (a dependency already: every table of these commands uses it).
    busy/s counts the busy events of the history over the last 10 s (history setting).
    """
    store = leases_of(ctx).store
    window = max(interval, 10.0)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # a pipe or a file: lines as wide as a wide terminal
    if once:
        console.print(_top_frame(store, limit, window))
        return
    with Live(_top_frame(store, limit, window), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(_top_frame(store, limit, window), refresh=True)
        except KeyboardInterrupt:
            pass


def _top_frame(store: LeaseStore, limit: int, window: float) -> Table:
    """One frame of ``top``: a rich Table of the held leases with the most waiters."""
    renewals = Renewals.of(store.settings)
    census = take_census(store)
    rows = census.held + census.queued
    waiters = store.waiter_counts([r.resource for r in rows]) if rows else []
    events, _ = store.recent_events(window) if store.settings.history else ([], 0.0)
    busy = sum(1 for e in events if e["event"] == "busy")
    alive = sum(1 for v in census.liveness.values() if v is not None and v > 0)
    rate = f"{busy / window:.1f}" if store.settings.history else "n/a (history off)"
    title = (
        f"{len(rows)} lease(s) held, {sum(waiters)} waiting, owners {alive} alive / "
        f"{len(census.liveness) - alive} dead, busy/s {rate} (last {window:.0f} s)"
    )
    table_ = Table(title=title, title_justify="left")
    for header in ("RESOURCE", "MODE", "NODE", "TASK_ID", "EXPIRES_IN", "LIVENESS", "WAITERS"):
        table_.add_column(header, no_wrap=header != "RESOURCE", min_width=len(header))
    ranked = sorted(zip(rows, waiters, strict=True), key=lambda rw: (-rw[1], rw[0].resource))
    for row, waiting in ranked[:limit]:
        cells = [
            printable(row.resource),
            "queued" if row.queued else MODES[row.mode],
            printable(row.node),
            printable(row.task_id or "-"),
            f"{row.expires_in:.1f}s",
            "queued" if row.queued else liveness_text(row.liveness, renewals),
            str(waiting),
        ]
        table_.add_row(*(Text(cell) for cell in cells))  # Text: no markup in user data
    if len(ranked) > limit:
        table_.caption = f"{len(ranked) - limit} more not shown (-n)"
    return table_


@click.command("web", cls=Command)
@click.option(
    "--bind",
    default="127.0.0.1:8765",
    show_default=True,
    metavar="HOST:PORT",
    allow_from_autoenv=False,
    help="Where to listen; a loopback address unless --public.",
)
@click.option(
    "--public",
    is_flag=True,
    allow_from_autoenv=False,
    help="Allow a --bind address that is not loopback (anyone who reaches it sees the leases).",
)
@click.option(
    "--allow-release",
    is_flag=True,
    allow_from_autoenv=False,
    help="Offer the forced release (POST /api/leases/release); needs --token or --token-file.",
)
@click.option(
    "--token",
    metavar="TOKEN",
    allow_from_autoenv=False,
    help="The bearer token a release needs (visible in ps: prefer --token-file).",
)
@click.option(
    "--token-file",
    type=click.File("r"),
    allow_from_autoenv=False,
    help="Read the bearer token from this file (its first line).",
)
@click.pass_context
def web(
    ctx: click.Context,
    bind: str,
    public: bool,
    allow_release: bool,
    token: str | None,
    token_file: Any,
) -> None:
    """Serve a live web view of the leases (needs the extra `web`).

    Read-only unless --allow-release; see celery_leases.web for its pages and endpoints.
    """
    try:
        from . import web as view
    except ImportError as exc:
        msg = f"the web view needs the extra 'web' (pip install 'celery-leases[web]'): {exc}"
        raise Failure(msg) from None
    if token_file is not None:
        if token is not None:
            raise click.UsageError("give --token or --token-file, not both")
        token = token_file.readline().strip()
    if token is not None and not token.strip():
        raise click.UsageError("the token must not be empty")
    if allow_release and token is None:
        raise click.UsageError("--allow-release needs --token or --token-file")
    try:
        where = view.check_bind(bind, public=public)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    app = app_of(ctx)
    ext = leases_of(ctx)
    ext.store.ping()  # a Redis that does not answer is an error at start-up, not on the page
    entries = sorted(str(name) for name in (app.conf.beat_schedule or {}))
    asgi = view.create_app(
        ext.store,
        CensusData(app, ext.store),
        bind=where,
        token=token,
        allow_release=allow_release,
        beat_entries=entries,
    )
    if not where.loopback:
        logger.warning(
            "leases: the web view listens on %s, not a loopback address: anyone who reaches "
            "it sees every lease",
            bind,
        )
    mode = "forced release enabled (bearer token)" if allow_release else "read-only"
    click.echo(f"celery leases web: {where.url}/ ({mode})", err=True)
    view.serve(asgi, where)


# --- wait: block until a resource is free ----------------------------------------------------
@click.command("wait", cls=Command)
@click.argument("resource")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    metavar="S",
    allow_from_autoenv=False,
    help="Give up after S seconds (exit 75). Default: wait as long as it takes.",
)
@click.pass_context
def wait(ctx: click.Context, resource: str, timeout: float | None) -> None:
    """Block until RESOURCE has no holder (exit 0), or until --timeout passes (exit 75).

    For scripts and Kubernetes init containers. It takes no lease and no place in the
    waiter queue; it is woken by a release (no polling), or by the holder's expiry at the
    latest. Exit 69: Redis could not be reached or failed.
    """
    non_empty("RESOURCE", resource)
    if leases_of(ctx).store.wait_until_free(resource, timeout):
        click.echo(f"{printable(resource)}: free")
        return
    click.echo(f"{printable(resource)}: still held after {timeout:g} s", err=True)
    ctx.exit(EX_TEMPFAIL)


COMMANDS: Final = (health, top, web, wait)
