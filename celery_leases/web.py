"""``celery leases web``: a small live web view of who holds what (the extra ``web``).

Install the extra and start it next to the app, as the other ``celery leases`` commands::

    pip install 'celery-leases[web]'
    celery -A proj leases web --bind 127.0.0.1:8765
    celery -A proj leases web --bind 127.0.0.1:8765 --allow-release --token-file /run/secrets/t

The page (``GET /``) lists the held leases (filtered by resource, node or task), the owners
and their nodes with their liveness, the unique claims, the rate limits, the beat claims of
the app's ``beat_schedule`` and the recent history, refreshed every two seconds. The JSON
behind it:

- ``GET /api/leases``: what ``celery leases ls --json`` prints (``?owner=NODE`` and
  ``?resource=PATTERN`` as ``--owner`` and ``--resource``);
- ``GET /api/owners``: what ``celery leases owners --json`` prints;
- ``GET /api/limits``: what ``celery leases limits --json`` prints (the rate limits);
- ``GET /api/parked``: how many tasks are parked on each resource (``on_busy="defer"``);
- ``GET /api/beat``: the last claimed run of each entry of the app's ``beat_schedule``;
- ``GET /api/history`` and ``GET /api/lease?resource=R``, where this version records them;
- ``GET /healthz``: 200 ``{"ok": true}`` while Redis answers, 503 otherwise.

Each object listed carries ``shown`` (see :func:`with_shown`): its texts as the CLI's tables
show them. The page draws names from it only.

``POST /api/leases/revoke`` with ``{"resource": R, "reason": T, "deadline": S}`` (reason and
deadline optional) asks every holder of ``R`` to let go, exactly as ``celery leases revoke R``
does (404 when nobody holds it), under the same switch and token as the release below.

``POST /api/leases/release`` with ``{"resource": R}`` frees every lease on ``R``, a live
holder's too, exactly as ``celery leases release R --force --yes`` does (same code, same log
line, same audit record, ``by`` naming the web view and the client's address). It is refused
(403) unless the view was started with ``--allow-release``, which needs ``--token`` (or
``--token-file``); a request without ``Authorization: Bearer <token>`` gets 401, a wrong token
403. The page asks for the token and for an explicit confirmation before it sends one.

The view binds to loopback unless ``--public`` is given (a non-loopback ``--bind`` without it
is refused at start-up), and answers only to the ``Host`` names of its bind address, so a web
page elsewhere cannot reach it through DNS rebinding. It is read-only by default.

.. versionadded:: 0.1
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from importlib.resources import files
from typing import TYPE_CHECKING, Any, Final, Protocol

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ._limits import limit_json, list_limits
from ._text import printable
from .exceptions import LeaseBackendError, LeaseError

if TYPE_CHECKING:
    from ._sync.driver import LeaseStore

__all__ = ("Bind", "WebData", "check_bind", "create_app", "page", "serve", "shown", "with_shown")

logger = logging.getLogger("celery_leases.web")

#: the most history records one request may ask for
HISTORY_MAX: Final = 500
_SCRIPT: Final = re.compile(r"<script>(.*?)</script>", re.S)


class WebData(Protocol):
    """What the view shows and does; ``celery leases web`` passes the CLI's own functions."""

    def leases(self, *, owner: str | None, pattern: str | None) -> list[dict[str, object]]:
        """What ``ls --json`` prints."""

    def owners(self) -> list[dict[str, object]]:
        """What ``owners --json`` prints."""

    def parked(self) -> dict[str, int]:
        """Resource -> how many tasks are parked on it (on_busy="defer")."""

    def release(self, resource: str, *, via: str) -> list[dict[str, object]]:
        """The forced release of ``release --force --yes``: one object per holder freed.

        ``via`` says how it was asked for; the audit record's ``by`` carries it.
        """

    def revoke(
        self, resource: str, *, reason: str, deadline: float | None, via: str
    ) -> dict[str, object]:
        """The revocation of ``revoke --json`` (``holders`` empty: nobody held it).

        ``via`` says how it was asked for; the log line's ``by`` carries it.
        """


@dataclass(frozen=True)
class Bind:
    """Where the view listens."""

    host: str
    port: int

    @property
    def loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name: it may resolve to anything
            return False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def check_bind(bind: str, *, public: bool) -> Bind:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as a :class:`Bind`.

    Raises:
        ValueError: it is malformed, or not a loopback address while ``public`` is False.
    """
    host, sep, port = bind.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        msg = f"--bind must be HOST:PORT (e.g. 127.0.0.1:8765), not {bind!r}"
        raise ValueError(msg)
    where = Bind(host, int(port))
    if not where.loopback and not public:
        msg = (
            f"--bind {bind} is not a loopback address: anyone who can reach it sees every "
            "lease; add --public to serve it there anyway"
        )
        raise ValueError(msg)
    return where


def page() -> str:
    """The view's one HTML page (its script inline)."""
    return files("celery_leases").joinpath("web.html").read_text(encoding="utf-8")


def _csp(html: str) -> str:
    """A Content-Security-Policy that runs the page's own inline script and nothing else."""
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() + "'"
        for s in _SCRIPT.findall(html)
    )
    return (
        f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; "
        "base-uri 'none'; form-action 'none'"
    )


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


def _allowed_hosts(bind: Bind) -> frozenset[str] | None:
    """The ``Host`` names the view answers to; None: any (a ``--public`` bind)."""
    if not bind.loopback:
        return None
    own = f"[{bind.host}]" if ":" in bind.host else bind.host
    return frozenset({own, "localhost", "127.0.0.1", "[::1]"})


def _host_name(header: str) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:80`` -> ``[::1]``)."""
    if header.startswith("["):
        return header[: header.find("]") + 1]
    return header.rpartition(":")[0] if ":" in header else header


def shown(value: object) -> object:
    """``value`` with every text in it (keys too) as the CLI shows it (:func:`printable`).

    Lists and objects are copied through; numbers, booleans and null stay as they are.
    """
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(str(k)): shown(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [shown(v) for v in value]
    return value


def with_shown(row: dict[str, object]) -> dict[str, object]:
    """``row`` and, under ``shown``, each of its texts as the CLI's tables show it.

    The page draws names only from ``shown``: a control character, a bidi override or an
    escape sequence in a name is written as the CLI writes it (``\\n``, ``\\u202e``, ...),
    by the one function that escapes names for both. The raw fields stay as they are, for
    filters, requests and scripts.
    """
    return {**row, "shown": {k: printable(v) for k, v in row.items() if isinstance(v, str)}}


def _jsonable(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def create_app(
    store: LeaseStore,
    data: WebData,
    *,
    bind: Bind,
    token: str | None = None,
    allow_release: bool = False,
    beat_entries: Sequence[str] = (),
) -> Starlette:
    """The ASGI app of the view.

    Args:
        store: where the beat claims, the history and a lease's record are read.
        data: the listings and the forced release (the CLI's functions).
        bind: where it listens (the ``Host`` names it answers to).
        token: the bearer token ``POST /api/leases/release`` needs.
        allow_release: whether the forced release is offered at all; needs ``token``.
        beat_entries: the names of the app's beat entries.

    Raises:
        ValueError: ``allow_release`` without a ``token``.
    """
    if allow_release and not token:
        msg = "--allow-release needs --token (or --token-file): a release must be authorised"
        raise ValueError(msg)
    html = page()
    headers = {
        "Content-Security-Policy": _csp(html),
        "X-Frame-Options": "DENY",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-store",
    }
    expected = (token or "").encode()

    hosts = _allowed_hosts(bind)

    def guarded(
        endpoint: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            response: Response
            try:
                if hosts is not None and _host_name(request.headers.get("host", "")) not in hosts:
                    # another name for a loopback address: a page elsewhere rebinding DNS
                    response = _error(400, "invalid Host header")
                else:
                    response = await endpoint(request)
            except LeaseBackendError as exc:
                response = _error(503, str(exc))
            except LeaseError as exc:
                response = _error(400, str(exc))
            response.headers.update(headers)
            return response

        return run

    async def index(request: Request) -> Response:
        return HTMLResponse(html)

    async def healthz(request: Request) -> Response:
        try:
            ok = await run_in_threadpool(store.ping)
        except LeaseError as exc:
            return JSONResponse({"ok": False, "error": str(exc)}, status_code=503)
        return JSONResponse({"ok": bool(ok)}, status_code=200 if ok else 503)

    async def config(request: Request) -> Response:
        return JSONResponse(
            {
                "release": allow_release,
                "key_prefix": store.settings.key_prefix,
                "history": callable(getattr(store, "history", None)),
                "lease_record": callable(getattr(store, "lease_record", None)),
            }
        )

    async def leases(request: Request) -> Response:
        owner = request.query_params.get("owner") or None
        pattern = request.query_params.get("resource") or None

        def read() -> list[dict[str, object]]:
            return [with_shown(row) for row in data.leases(owner=owner, pattern=pattern)]

        return JSONResponse(await run_in_threadpool(read))

    async def owners(request: Request) -> Response:
        listed = await run_in_threadpool(data.owners)
        return JSONResponse([with_shown(row) for row in listed])

    async def limits(request: Request) -> Response:
        rows = await run_in_threadpool(lambda: store.run(list_limits(store.engine)))
        return JSONResponse([with_shown(limit_json(r)) for r in rows])

    async def parked(request: Request) -> Response:
        counts = await run_in_threadpool(data.parked)
        return JSONResponse({"parked": counts, "total": sum(counts.values())})

    async def beat(request: Request) -> Response:
        runs = await run_in_threadpool(store.beat_runs, list(beat_entries))
        return JSONResponse(
            {
                "entries": list(beat_entries),
                "claims": [
                    with_shown(
                        {
                            "entry": r.entry,
                            "kind": r.kind,
                            "run": r.run,
                            "replica": r.replica,
                            "expires_in": round(r.expires_in, 3),
                        }
                    )
                    for r in runs
                ],
            }
        )

    async def history(request: Request) -> Response:
        read: Callable[..., list[dict[str, Any]]] | None = getattr(store, "history", None)
        if read is None:
            return _error(404, "history not available in this version")
        params = request.query_params
        try:
            count = min(max(int(params.get("n", "50")), 1), HISTORY_MAX)
        except ValueError:
            return _error(400, "n must be an integer")
        resource, node = params.get("resource") or None, params.get("node") or None
        records = await run_in_threadpool(lambda: read(resource=resource, node=node, count=count))
        return JSONResponse([with_shown(r) for r in records])

    async def lease(request: Request) -> Response:
        read: Callable[[str], object] | None = getattr(store, "lease_record", None)
        if read is None:
            return _error(404, "a lease's record is not available in this version")
        resource = request.query_params.get("resource", "")
        if not resource:
            return _error(400, "resource is required")
        record = await run_in_threadpool(read, resource)
        if record is None:
            return _error(404, f"no record of {resource!r}")
        body = _jsonable(record)
        if isinstance(body, dict):
            body = {**body, "shown": shown(body)}
        return JSONResponse(body)

    async def authorised(request: Request) -> Response | dict[str, Any]:
        """The JSON body of a release or revocation, or the error response refusing it."""
        if not allow_release:
            return _error(403, "this view is read-only (start it with --allow-release)")
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            return _error(401, "Authorization: Bearer <token> required", **_challenge())
        if not hmac.compare_digest(given.strip().encode(), expected):
            return _error(403, "wrong token")
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        resource = body.get("resource") if isinstance(body, dict) else None
        if not isinstance(body, dict) or not isinstance(resource, str) or not resource.strip():
            return _error(400, 'the body must be {"resource": "<name>", ...}')
        return body

    def via(request: Request) -> str:
        return f"web view, client {request.client.host if request.client else 'unknown'}"

    async def release(request: Request) -> Response:
        body = await authorised(request)
        if isinstance(body, Response):
            return body
        resource, asked = body["resource"], via(request)
        freed = await run_in_threadpool(lambda: data.release(resource, via=asked))
        if not freed:
            return _error(404, f"no lease is held on {resource!r}")
        released = [with_shown(row) for row in freed]
        return JSONResponse({"resource": resource, "released": released})

    async def revoke(request: Request) -> Response:
        body = await authorised(request)
        if isinstance(body, Response):
            return body
        resource, reason, deadline = body["resource"], body.get("reason"), body.get("deadline")
        reason = "" if reason is None else reason
        asked = via(request)
        done = await run_in_threadpool(
            lambda: data.revoke(resource, reason=reason, deadline=deadline, via=asked)
        )
        if not done["holders"]:
            return _error(404, f"no lease is held on {resource!r}")
        return JSONResponse(with_shown(done))

    routes = [
        Route("/", guarded(index)),
        Route("/healthz", guarded(healthz)),
        Route("/api/config", guarded(config)),
        Route("/api/leases", guarded(leases)),
        Route("/api/owners", guarded(owners)),
        Route("/api/limits", guarded(limits)),
        Route("/api/parked", guarded(parked)),
        Route("/api/beat", guarded(beat)),
        Route("/api/history", guarded(history)),
        Route("/api/lease", guarded(lease)),
        Route("/api/leases/release", guarded(release), methods=["POST"]),
        Route("/api/leases/revoke", guarded(revoke), methods=["POST"]),
    ]
    return Starlette(routes=routes)


def _challenge() -> dict[str, str]:
    return {"WWW-Authenticate": 'Bearer realm="celery-leases"'}


def serve(app: Starlette, bind: Bind) -> None:
    """Serve ``app`` on ``bind`` until interrupted (uvicorn, one process)."""
    uvicorn.run(app, host=bind.host, port=bind.port, log_level="warning", access_log=False)
