"""Who holds a lease: node, incarnation and process, as one owner id."""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
from dataclasses import dataclass
from functools import cached_property

from ._keys import escape, owner_id

__all__ = ("Identity", "current_identity", "default_node", "set_node")


def default_node() -> str:
    """``<program>@<host>``, the node name of a process that is not a Celery worker."""
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    return f"{program or 'python'}@{socket.gethostname()}"


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


_cache: dict[tuple[str | None, str | None, str, int], Identity] = {}


def current_identity(node: str | None = None) -> Identity:
    """The identity of the calling process; ``node`` overrides the process-wide node name."""
    pid = os.getpid()
    key = (node, _node, _incarnation, pid)
    ident = _cache.get(key)
    if ident is None:
        if len(_cache) > 64:
            _cache.clear()
        ident = _cache[key] = Identity(node or _node or default_node(), _incarnation, pid)
    return ident
