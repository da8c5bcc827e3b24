"""Every log line the docs quote is one the code can emit.

A quoted log line is an inline code span of README.md or docs/ that starts with ``leases: ``
(the library's lines) or ``Task <`` (Celery's own lines about a task). Its placeholders
(``<resource>``, ``...``, numbers) match anything; so do the code's ``%s`` and ``{...}``
fields. A quote matches when some message of the code (a string literal of celery_leases/
that starts with ``leases: ``, or Celery's log formats for tasks) can read as it: the quote
may stop early (a line named by its start), never say what the code does not.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
from celery.app import trace

ROOT = Path(__file__).resolve().parents[2]
HOLE = None  # a quote's placeholder: any field(s) of a message; a message's field: one word
ANY = 0  # a message's field that may read as several words (one ending it, or in parentheses)
TAIL = 1  # the end of a quote: the rest of the line, whatever it is (a quote may stop early)
Pattern = tuple[str | int | None, ...]

_QUOTE = re.compile(r"`((?:leases: |Task <)[^`]+)`")
# placeholders; "[ after waiting <s>s]": a part that is there or not
_DOC_HOLES = re.compile(r"<[^<>`]*>|\.\.\.|…|\[ [^\]]*\]|\d+(?:\.\d+)?")
_PERCENT = re.compile(r"%(?:\([^)]*\))?[-#0 +]*\d*(?:\.\d+)?[sdrfgixX]")


def _pattern(parts: list[str | int | None]) -> Pattern:
    out: list[str | int | None] = []
    for part in parts:
        if isinstance(part, str):
            out.extend(part)
        elif not out or out[-1] is not part:
            out.append(part)
    return tuple(out)


def _fields(pattern: Pattern) -> Pattern:
    """A message's fields that may read as several words made ``ANY``."""
    out = list(pattern)
    holes = [k for k, c in enumerate(out) if c is HOLE]
    for k in holes:
        boxed = 0 < k < len(out) - 1 and out[k - 1] == "(" and out[k + 1] == ")"
        if boxed or k == len(out) - 1:
            out[k] = ANY
    return tuple(out)


def _doc_pattern(quote: str) -> Pattern:
    parts: list[str | int | None] = []
    last = 0
    for match in _DOC_HOLES.finditer(quote.replace("\\|", "|")):
        parts += [quote.replace("\\|", "|")[last : match.start()], HOLE]
        last = match.end()
    parts += [quote.replace("\\|", "|")[last:], TAIL]
    return _pattern(parts)


def _percent_pattern(text: str, hole: int | None = HOLE) -> Pattern:
    parts: list[str | int | None] = []
    last = 0
    for match in _PERCENT.finditer(text):
        parts += [text[last : match.start()].replace("%%", "%"), hole]
        last = match.end()
    parts.append(text[last:].replace("%%", "%"))
    return _fields(_pattern(parts))


def _literal(pattern: Pattern) -> str:
    return "".join(c if isinstance(c, str) else " " for c in pattern)


def _code_pattern(node: ast.expr) -> Pattern | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _percent_pattern(node.value)
    if isinstance(node, ast.JoinedStr):
        parts: list[str | int | None] = []
        for value in node.values:
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                parts.append(value.value)
            else:
                parts.append(HOLE)
        return _fields(_pattern(parts))
    return None


@cache
def messages() -> tuple[Pattern, ...]:
    """The messages the code can log: literals that start with ``leases: ``, Celery's."""
    found: set[Pattern] = set()
    for path in sorted((ROOT / "celery_leases").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.expr) and not isinstance(node, ast.FormattedValue):
                pattern = _code_pattern(node)
                if pattern and _literal(pattern).startswith("leases: "):
                    found.add(pattern)
    # a message of no words of its own ("leases: %s[%s] %s") would read as any quote: left
    # out, and what its callers pass it spelled out instead
    found = {p for p in found if re.search(r"[a-z]{2,}", _literal(p).removeprefix("leases:"))}
    # messages whose fields take words of the library's own, spelled out as they read
    found.update(
        _percent_pattern(text)
        for text in (
            "leases: %s[%s] retrying in %.1fs: %s",  # task.py, _busy_retry (DEBUG)
            "leases: beat: %s not sent: unique key %r is held by %s task %s",  # _unique.py
            # worker.py, _log_report: whose is "owner" or "dead owner", then _task_text
            "leases: %s freed %d lease(s) of dead owner %s, task %s (%s): %s",
            "leases: %s freed %d lease(s) of owner %s, task %s (%s): %s",
            "leases: %s freed %d lease(s) of dead owner %s, held outside a task: %s",
            "leases: orphan reconcile released %d lease(s): %s",  # worker.py, reconcile
        )
    )
    celery = [trace.LOG_RETRY, trace.LOG_FAILURE, trace.LOG_SUCCESS, trace.LOG_REJECTED]
    celery += [trace.LOG_IGNORED, trace.LOG_INTERNAL_ERROR, trace.LOG_RECEIVED]
    # Celery's line for an exception listed in a task's `throws`
    celery += ["Task %(name)s[%(id)s] raised expected: %(exc)s"]
    found.update(_percent_pattern(text, ANY) for text in celery)
    return tuple(found)


def can_read_as(doc: Pattern, code: Pattern) -> bool:
    """Whether the quote ``doc`` can be a line the message ``code`` logs.

    A placeholder of the quote stands for fields of the message, never for its words; the
    quote's end for the rest of the message. A field of the message reads as one word of the
    quote (no space), or as several where it is ``ANY``.
    """
    n, m = len(doc), len(code)
    row = [False] * (m + 1)  # row[j]: doc[:i] can read as code[:j]
    row[0] = True
    for j in range(1, m + 1):
        row[j] = row[j - 1] and code[j - 1] in (HOLE, ANY)
    for i in range(1, n + 1):
        d = doc[i - 1]
        new = [False] * (m + 1)
        new[0] = row[0] and d in (HOLE, TAIL)
        for j in range(1, m + 1):
            c = code[j - 1]
            field = c is HOLE or c == ANY
            ok = False
            if d == TAIL:
                ok = row[j] or new[j - 1]
            elif d is HOLE:
                ok = row[j] or (new[j - 1] and field)
            elif not field:
                ok = row[j - 1] and d == c
            if field and not ok:
                ok = new[j - 1] or (row[j] and (c == ANY or d != " "))
            new[j] = ok
        row = new
    return row[m]


def quotes() -> list[tuple[str, str]]:
    """``(where, quote)`` for every log line quoted in README.md and docs/."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in _QUOTE.finditer(line):
                quote = match.group(1)
                if quote.strip() in ("leases:", "leases: "):
                    continue
                out.append((f"{path.relative_to(ROOT)}:{number}", quote))
    return out


def test_the_docs_quote_log_lines() -> None:
    assert len(quotes()) > 50


@pytest.mark.parametrize(("where", "quote"), quotes(), ids=[w for w, _ in quotes()])
def test_a_quoted_log_line_is_one_the_code_emits(where: str, quote: str) -> None:
    doc = _doc_pattern(quote)
    assert any(can_read_as(doc, code) for code in messages()), (
        f"{where}: `{quote}` is no message of celery_leases/ (nor Celery's task lines)"
    )


def test_the_matcher() -> None:
    code = _percent_pattern("leases: lost %s after %.1fs (%s); the work may overlap")
    assert can_read_as(_doc_pattern("leases: lost <resource> after <s>s (...)"), code)
    assert can_read_as(_doc_pattern("leases: lost res:1 after 2.5s"), code)
    assert not can_read_as(_doc_pattern("leases: <resource> is busy (retry after <s>s)"), code)
    assert not can_read_as(_doc_pattern("leases: lost <resource> before <s>s"), code)
