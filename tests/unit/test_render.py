"""The CLI's tables survive any resource name: escaped, shortened, aligned by display width."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.cells import cell_len

from celery_leases._census import LIMITS, ROW_HEADERS, text_table
from celery_leases._render import ELLIPSIS, printable, shorten

NASTY = [
    "line\nbreak",
    "carriage\rreturn",
    "\x1b[31mred\x1b[0m",
    "\x1b]0;title\x07",  # an OSC sequence: sets the terminal's title
    "tab\there",
    "nul\x00byte",
    "del\x7f",
    "c1\x9bcsi",
    "bidi\u202eevil",
    "sep\u2028line",
    "zero\u200bwidth",
    "[bold]markup[/bold]",
    ":smile: emoji code",
    "日本語のリソース",
    "emoji 😀🎉",
    "x" * 300,
    "寿" * 200,
]


def row(resource: str, marker: str) -> list[object]:
    """An ``ls`` row whose MODE column holds ``marker`` (to find where that column starts)."""
    return [resource, marker, 1, "1.0s", "celery@h", "celery%40h/abc/1", "alive", "t-1", "p.t"]


def column_start(line: str, text: str) -> int:
    """The display column at which ``text`` starts in ``line``."""
    return cell_len(line[: line.index(text)])


def test_every_row_is_one_line_with_no_control_character_left() -> None:
    out = text_table(ROW_HEADERS, [row(name, f"m{i}") for i, name in enumerate(NASTY)])
    lines = out.split("\n")
    assert len(lines) == 1 + len(NASTY)
    for line in lines:
        assert line.isprintable(), repr(line)
        assert "\x1b" not in line
        assert "\r" not in line
        assert "\t" not in line
    assert "line\\nbreak" in out
    assert "\\x1b[31mred\\x1b[0m" in out
    assert "tab\\there" in out
    assert "nul\\x00byte" in out
    assert "bidi\\u202eevil" in out
    assert "sep\\u2028line" in out


def test_markup_and_emoji_codes_are_shown_as_they_are() -> None:
    out = text_table(ROW_HEADERS, [row("[bold]markup[/bold]", "m"), row(":smile:", "n")])
    assert "[bold]markup[/bold]" in out
    assert ":smile:" in out
    assert "😄" not in out


def test_columns_line_up_by_display_width() -> None:
    names = ["a", "日本語のリソース", "emoji 😀🎉", "寿" * 200, "x" * 300, "line\nbreak"]
    out = text_table(ROW_HEADERS, [row(name, f"m{i}") for i, name in enumerate(names)])
    header, *lines = out.split("\n")
    start = column_start(header, "MODE")
    assert [column_start(line, f"m{i}") for i, line in enumerate(lines)] == [start] * len(names)
    # the next column lines up too, and the first is as wide as its widest (shortened) name
    token = column_start(header, "TOKEN")
    assert all(column_start(line, " 1 ") + 1 == token for line in lines)
    assert start == LIMITS["RESOURCE"] + 2


def test_long_names_are_shortened_in_the_middle_with_an_ellipsis() -> None:
    name = "repo:" + "x" * 200 + ":42"
    (line,) = text_table(ROW_HEADERS, [row(name, "m")]).split("\n")[1:]
    cell = line.split("  ")[0]
    assert cell_len(cell) == LIMITS["RESOURCE"]
    assert cell.startswith("repo:xx")
    assert cell.endswith("xx:42")
    assert ELLIPSIS in cell


@pytest.mark.parametrize("width", [1, 2, 3, 10, 11, 60])
def test_shorten_never_splits_a_wide_character_nor_exceeds_the_width(width: int) -> None:
    for text in ("寿" * 50, "a寿" * 50, "😀" * 40, "abc" * 40):
        short = shorten(text, width)
        assert cell_len(short) <= width
        assert ELLIPSIS in short
        assert set(short) <= set(text) | {ELLIPSIS}
    assert shorten("short", 60) == "short"


@given(st.text())
def test_printable_is_one_printable_line(text: str) -> None:
    shown = printable(text)
    assert shown.isprintable()
    assert "\n" not in shown
    assert "\x1b" not in shown
    if text.isascii() and text.isprintable():
        assert shown == text
