"""The ACL user documented in docs/security.md, and a MONITOR log of what a server runs.

The ``ACL SETUSER`` lines are read from the docs page, so the page and the tests cannot drift.
"""

from __future__ import annotations

import shlex
import threading
import uuid
from pathlib import Path
from typing import Any, Final

import redis
from redis.exceptions import ResponseError

DOCS: Final = Path(__file__).resolve().parents[2] / "docs" / "security.md"
USER: Final = "celery_leases"
#: commands with sub-commands: a permission names the pair (``client|setname``)
_CONTAINERS: Final = frozenset(
    {"acl", "client", "cluster", "command", "config", "function", "memory", "object", "script"}
)


def documented_acl_lines(*, cluster: bool = False) -> list[str]:
    """The ``ACL SETUSER celery_leases ...`` lines of the docs, the main one first; the
    Redis Cluster line only when ``cluster``."""
    lines = [ln.strip() for ln in DOCS.read_text().splitlines()]
    found = [ln for ln in lines if ln.startswith(f"ACL SETUSER {USER} ")]
    found = [ln for ln in found if cluster or "+cluster|" not in ln]
    assert found, f"no ACL SETUSER {USER} line in {DOCS}"
    return found


def documented_password() -> str:
    """The placeholder password of the documented line (``>change-me``)."""
    argv = shlex.split(documented_acl_lines()[0])
    return next(a[1:] for a in argv if a.startswith(">"))


def create_documented_user(
    admin: redis.Redis,
    *,
    prefix: str = "leases",
    password: str | None = None,
    key_pattern: str | None = None,
    cluster: bool = False,
    user: str = USER,
) -> str:
    """Run the documented lines on ``admin``'s server, as the docs tell users to adapt them.

    Args:
        admin: a client with the right to run ``ACL SETUSER`` (a private server's default user).
        prefix: the ``key_prefix`` in use; replaces ``leases`` in the key and channel patterns.
        password: replaces the placeholder password.
        key_pattern: replaces the whole ``{<prefix>:*`` pattern of keys and channels.
        cluster: add the Redis Cluster line.
        user: the user name to create instead of ``celery_leases``.

    Returns:
        the user's password.
    """
    main, *extra = documented_acl_lines(cluster=cluster)
    argv = shlex.split(main)
    assert argv[:4] == ["ACL", "SETUSER", USER, "on"], main
    argv[2] = user
    pattern = key_pattern or f"{{{prefix}:*"
    out = []
    for arg in argv:
        if arg.startswith(">") and password is not None:
            arg = ">" + password
        elif arg.startswith(("~{leases:", "&{leases:")):
            arg = arg[0] + pattern
        out.append(arg)
    admin.execute_command(*out)
    for line in extra:
        try:
            admin.execute_command(*[user if a == USER else a for a in shlex.split(line)])
        except ResponseError as exc:  # CLIENT SETINFO is unknown before Redis 7.2
            if "unknown" not in str(exc).lower():
                raise
    return next(a[1:] for a in out if a.startswith(">"))


def allowed_commands(admin: redis.Redis) -> set[str]:
    """The commands the server grants the documented user, as ``name`` or ``name|sub``."""
    info: dict[str, Any] | None = admin.acl_getuser(USER)
    assert info is not None, f"no user {USER}"
    assert [_text(c) for c in info["categories"]] == ["-@all"], info
    rules = [_text(c) for c in info["commands"]]
    assert all(r.startswith("+") for r in rules), rules
    return {r[1:].lower() for r in rules}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class CommandLog:
    """Every command a server runs while it is open (``MONITOR``), scripts' own included.

    Refused commands never reach ``MONITOR``: what it records is what ran.
    """

    def __init__(self, url: str) -> None:
        self._url = url
        self._marker = f"celery-leases-monitor-end-{uuid.uuid4().hex}"
        self._ready = threading.Event()
        self._lines: list[str] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="monitor", daemon=True)

    def __enter__(self) -> CommandLog:
        self._thread.start()
        if not self._ready.wait(10):
            raise AssertionError("MONITOR did not start within 10s")
        return self

    def __exit__(self, *exc: object) -> None:
        client = redis.Redis.from_url(self._url)
        try:
            client.get(self._marker)
        finally:
            client.close()
        self._thread.join(20)
        if self._thread.is_alive():
            raise AssertionError("MONITOR did not see its end marker within 20s")
        if self._error is not None:
            raise AssertionError(f"MONITOR failed: {self._error!r}")

    def _run(self) -> None:
        try:
            # no socket timeout (redis-py 8 sets 5 s): a loaded machine can leave the server
            # quiet for longer than that, and a read that times out would end the log
            client = redis.Redis.from_url(self._url, protocol=2, socket_timeout=None)
            with client.monitor() as monitor:
                self._ready.set()
                for event in monitor.listen():
                    line = str(event["command"])
                    if self._marker in line:
                        return
                    self._lines.append(line)
        except BaseException as exc:  # reported by __exit__
            self._error = exc
            self._ready.set()

    @property
    def lines(self) -> list[str]:
        return list(self._lines)

    def commands(self) -> set[str]:
        """The names of the commands run, lower-case, ``name|sub`` for container commands."""
        names = set()
        for line in self._lines:
            words = line.split()
            if not words:
                continue
            name = words[0].lower()
            if name in _CONTAINERS and len(words) > 1:
                name = f"{name}|{words[1].lower()}"
            names.add(name)
        return names
