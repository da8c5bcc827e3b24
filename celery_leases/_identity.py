"""Who holds a lease: node, incarnation and process, as one owner id."""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Final

from ._keys import escape, owner_id

__all__ = ("Identity", "current_identity", "default_node", "set_node", "set_process_kind")


#: options of the ``celery`` command that take a value as the next argument
_CELERY_VALUE_OPTIONS: Final = frozenset(
    ("-A", "--app", "-b", "--broker", "--result-backend", "--loader", "--config", "--workdir")
)


def _program(argv: Sequence[str]) -> str:
    """The program's name: ``celery``, ``uvicorn``, ``myscript.py``, ``python`` (``-c``)."""
    path = argv[0] if argv and argv[0] and not argv[0].startswith("-") else ""
    name = os.path.basename(path)
    if name == "__main__.py":  # python -m package: the package names the program
        name = os.path.basename(os.path.dirname(path))
    return name.removesuffix(".exe") or "python"


def _celery_command(argv: Sequence[str]) -> str | None:
    """The subcommand of a ``celery`` command line (``beat``, ``shell``...), if there is one."""
    args = iter(argv[1:])
    for arg in args:
        if arg in _CELERY_VALUE_OPTIONS:
            next(args, None)
        elif not arg.startswith("-"):
            return arg
    return None


def default_node(kind: str | None = None) -> str:
    """The node name of a process that is not a Celery worker: ``<program>:<kind>:<pid>@<host>``.

    ``kind`` is what the process is: given by the code that knows (``beat``, ``cli``), else the
    subcommand of a ``celery`` command line (``celery -A proj shell`` -> ``shell``), else
    ``proc``. A worker's node name is its hostname (``celery@<host>`` by default), and Celery
    names a worker so only when told to with ``-n``; the kind and the pid in this name keep
    every other process on the host (``celery beat`` included, whose program is also
    ``celery``) out of the node whose earlier incarnations a worker frees at start-up, and two
    live processes of one host out of each other's node.
    """
    argv = sys.argv
    program = _program(argv)
    if kind is None:
        kind = _kind or (_celery_command(argv) if program == "celery" else None) or "proc"
    return f"{program}:{kind}:{os.getpid()}@{socket.gethostname()}"


@dataclass(frozen=True)
class Identity:
    """One lease-holding process: ``node`` + ``incarnation`` + ``pid``."""

    node: str
    incarnation: str
    pid: int

    @cached_property
    def owner(self) -> str:
        """The owner id recorded with every lease this process holds."""
        return owner_id(self.node, self.incarnation, self.pid)

    @cached_property
    def node_key_part(self) -> str:
        """The node name as it appears in key names."""
        return escape(self.node)


_lock = threading.Lock()
_node: str | None = None
#: what this process is, for the default node name (``beat``, ``cli``); see default_node
_kind: str | None = None
# made once per main process; a forked child keeps it, so a worker's children share the
# incarnation of the worker that forked them
_incarnation: str = secrets.token_hex(6)


def set_node(node: str, *, new_incarnation: bool = False) -> None:
    """Name this process's node (a Celery worker calls it with its hostname)."""
    global _node, _incarnation
    with _lock:
        _node = node
        if new_incarnation:
            _incarnation = secrets.token_hex(6)


def set_process_kind(kind: str) -> None:
    """Say what this process is (``beat``...), for its default node name; see default_node."""
    global _kind
    with _lock:
        _kind = kind


_cache: dict[tuple[str | None, str | None, str | None, str, int], Identity] = {}


def current_identity(node: str | None = None) -> Identity:
    """The identity of the calling process; ``node`` overrides the process-wide node name."""
    pid = os.getpid()
    key = (node, _node, _kind, _incarnation, pid)
    ident = _cache.get(key)
    if ident is None:
        if len(_cache) > 64:
            _cache.clear()
        ident = _cache[key] = Identity(node or _node or default_node(), _incarnation, pid)
    return ident
