"""Names made safe to show on one line, in a table or a log line (no dependencies)."""

from __future__ import annotations

from typing import Final

__all__ = ("printable",)

_NAMED: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every character that a terminal would not just show escaped.

    What Python does not count printable becomes ``\\n``, ``\\x1b``, ``\\u202e`` ... as in
    a Python literal: control characters (``\\n``, ``\\t``, ``\\x00``, the ESC that starts
    an ANSI sequence), bidi and other format characters (zero-width ones too), line
    separators, spaces other than the ASCII one, private-use and unassigned code points.
    Everything else, unicode letters and emoji included, is kept.

    Args:
        text: the name to show.

    Returns:
        the text, one line, that prints as what it is.
    """
    if text.isprintable():  # the common case, at no cost
        return text
    return "".join(c if c.isprintable() else _escaped(c) for c in text)
