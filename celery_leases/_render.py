"""Text tables of user data for the terminal: names shown safely, columns aligned by width.

Resource names, task ids and node names are user data: they may hold newlines, tabs, NULs
or ANSI escapes that would break a table or take over the operator's terminal, and wide
(CJK, emoji) characters that take two columns. :func:`printable` (from ``_text``) makes a
name safe to show, :func:`shorten` fits it into a column by display width, and :func:`table`
lays the rows out with ``rich`` (its markup, emoji codes and highlighting off: nothing in a
name is interpreted). ``--json`` output never goes through here: it keeps every name whole.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ._text import printable

__all__ = ("ELLIPSIS", "printable", "shorten", "table")

ELLIPSIS: Final = "…"


def shorten(text: str, max_cells: int) -> str:
    """``text`` cut in the middle with an ellipsis so it takes at most ``max_cells`` columns.

    Both ends are kept (resource names often differ only at the end), measured by display
    width: a wide character counts as two columns and is never split.

    Args:
        text: a printable one-line text (see :func:`printable`).
        max_cells: the widest it may be, in terminal columns (at least 1).

    Returns:
        the text itself if it fits, else its head, ``…`` and its tail.
    """
    if cell_len(text) <= max_cells:
        return text
    budget = max(max_cells - cell_len(ELLIPSIS), 0)
    head_cells = (budget + 1) // 2
    head: list[str] = []
    used = 0
    for char in text:
        width = cell_len(char)
        if used + width > head_cells:
            break
        head.append(char)
        used += width
    tail: list[str] = []
    tail_cells = budget - used
    used = 0
    for char in reversed(text):
        width = cell_len(char)
        if used + width > tail_cells:
            break
        tail.append(char)
        used += width
    return "".join(head) + ELLIPSIS + "".join(reversed(tail))


def table(
    headers: Sequence[str],
    rows: Iterable[Sequence[object]],
    *,
    limits: Mapping[str, int] | None = None,
) -> str:
    """An aligned plain-text table: a header line, one line per row, two spaces between columns.

    Every cell is made :func:`printable`; a cell of a column named in ``limits`` is
    :func:`shorten`-ed to that many columns. Lines carry no trailing blanks and no colours.

    Args:
        headers: the column titles.
        rows: the cells of each row (``str()`` of each is shown).
        limits: the widest each named column may be, in terminal columns.

    Returns:
        the table, without a final newline.
    """
    limits = limits or {}
    out = Table(
        box=None,
        show_header=True,
        header_style=None,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1),
        expand=False,
    )
    for header in headers:
        out.add_column(Text(header), no_wrap=True, overflow="ignore")
    for row in rows:
        cells = []
        for header, value in zip(headers, row, strict=True):
            text = printable(str(value))
            limit = limits.get(header)
            if limit is not None:
                text = shorten(text, limit)
            cells.append(Text(text))
        out.add_row(*cells)
    # as wide as the table needs: never wrapped or cut to the terminal (lines stay greppable)
    buffer = io.StringIO()
    console = Console(
        file=buffer,
        width=1_000_000,
        color_system=None,
        markup=False,
        emoji=False,
        highlight=False,
        force_terminal=False,
        force_jupyter=False,
        legacy_windows=False,
        soft_wrap=False,
    )
    console.print(out)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())
