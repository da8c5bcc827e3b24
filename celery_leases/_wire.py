"""What both drivers' connections share: a command packed as redis-py packs it, a
handoff read off a pub/sub message, a connection's address for an error."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

__all__ = ("handoff", "pack", "where")

_hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - hiredis is optional
    _hiredis_pack = None
_UTF8: Final = frozenset({"utf-8", "utf8", "UTF-8"})


def pack(conn: Any, words: Sequence[Any]) -> list[bytes]:
    """``words`` packed for ``conn`` (a sync or an asyncio connection, the lanes of both
    drivers), as redis-py packs them: by hiredis if there, else by :func:`_packed`, when the
    connection's encoding is strict utf-8 (our words are str and int, which both pack as
    redis-py does); any other encoding by redis-py itself (whose hiredis packer took no
    encoding before redis-py 8.2 and takes it since: only redis-py knows)."""
    encoder = conn.encoder
    if encoder.encoding not in _UTF8 or encoder.encoding_errors != "strict":
        return conn.pack_command(*words)  # type: ignore[no-any-return]
    if _hiredis_pack is not None:
        return [_hiredis_pack(tuple(words))]
    return _packed(words) or conn.pack_command(*words)


def _packed(words: Sequence[Any]) -> list[bytes] | None:
    """``words`` as redis-py packs them (RESP) for a strict utf-8 connection, for str, int and
    float words; else None.

    The same bytes as ``Connection.pack_command`` (whose encoder also writes an int or a
    float as its ``repr``) at a third of its cost on a script call of twenty words.
    """
    out = [b"*%d\r\n" % len(words)]
    for word in words:
        kind = type(word)
        if kind is str:
            data = word.encode()
        elif kind is int or kind is float:  # not bool: redis-py refuses it
            data = repr(word).encode()
        elif kind is bytes:
            data = word
        else:
            return None
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return [b"".join(out)]


def handoff(kind: object, channel: object, payload: object, mine: str) -> str | None:
    """The token of a lease handed over (lua/release.lua) if a pub/sub message of ``kind``
    on ``channel`` with ``payload`` is one for the waiter listening on ``mine``; else None.

    Every other message a waiter hears only says "try again" (a token, or "0").
    """
    if kind not in (b"message", "message"):
        return None
    if isinstance(channel, bytes):
        channel = channel.decode("utf-8", "replace")
    if channel != mine:
        return None
    if isinstance(payload, bytes):
        payload = payload.decode("ascii", "replace")
    if isinstance(payload, str) and payload[:1] == "h" and payload[1:].isdigit():
        return payload[1:]
    return None


def where(conn: Any) -> str:
    """``host:port`` of ``conn`` (sync or asyncio), for the errors the lanes raise."""
    return f"{getattr(conn, 'host', '?')}:{getattr(conn, 'port', '?')}"
