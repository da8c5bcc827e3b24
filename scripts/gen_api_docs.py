"""Write docs/reference.md: docs/api.md's reference as plain Markdown, readable anywhere.

docs/api.md is a page of mkdocstrings directives (``::: celery_leases.Leases``): the docs
site renders them, the repository's page and a package index show them as they are. This
writes the same reference, headings, prose and objects in the same order, from the same
docstrings, as Markdown that reads on any of them. Never edit docs/reference.md by hand.

Usage: python scripts/gen_api_docs.py [--check]
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "docs" / "api.md"
TARGET = ROOT / "docs" / "reference.md"

_SECTION = re.compile(r"^(Args|Arguments|Returns|Raises|Attributes|Yields|Example|Examples|Note):$")
_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


def _markdown(doc: str) -> str:
    """A Google-style docstring as Markdown: ``code`` as `code`, sections as lists."""
    doc = _ROLE.sub(r"`\1`", doc).replace("``", "`")
    doc = re.sub(r"(\S)::$", r"\1:", doc, flags=re.M)  # a literal block follows
    doc = re.sub(r"^\.\. versionadded:: (\S+)$", r"*Added in \1.*", doc, flags=re.M)
    doc = re.sub(r"^\.\. versionchanged:: (\S+)$", r"*Changed in \1:*", doc, flags=re.M)
    out: list[str] = []
    section: str | None = None
    for line in doc.splitlines():
        head = _SECTION.match(line.strip()) if not line.startswith(" ") else None
        if head:
            section = head[1]
            out += ["", f"**{section}**", ""]
            continue
        if section and line.startswith("    ") and not line.startswith("        "):
            entry = line.strip()
            name, sep, rest = entry.partition(": ")
            if sep and section not in ("Example", "Examples", "Note") and " " not in name:
                out.append(f"- `{name}`: {rest}")
            else:
                out.append(f"- {entry}" if section not in ("Example", "Examples") else entry)
            continue
        if section and line.startswith("        "):
            out[-1] += " " + line.strip()
            continue
        if line.strip() and not line.startswith(" "):
            section = None
        out.append(line)
    return "\n".join(out).strip()


def _annotation(value: Any) -> str:
    return value if isinstance(value, str) else inspect.formatannotation(value)


def _signature(obj: Any) -> str:
    """``(a: int, *, b: str = 'x') -> None``: annotations as written, without ``self``."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    parts: list[str] = []
    star = False
    for param in sig.parameters.values():
        if param.name in ("self", "cls") and not parts:
            continue
        text = param.name
        if param.kind is param.VAR_POSITIONAL:
            text, star = "*" + text, True
        elif param.kind is param.VAR_KEYWORD:
            text = "**" + text
        elif param.kind is param.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if param.annotation is not param.empty:
            text += f": {_annotation(param.annotation)}"
        if param.default is not param.empty:
            text += f" = {param.default!r}"
        parts.append(text)
    out = "(" + ", ".join(parts) + ")"
    if sig.return_annotation is not sig.empty:
        out += f" -> {_annotation(sig.return_annotation)}"
    return out


def _members(cls: type) -> list[tuple[str, Any]]:
    """The public methods and properties ``cls`` defines itself, in source order."""
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        target = value.fget if isinstance(value, property) else value
        target = getattr(target, "__func__", target)
        if not callable(target) or not getattr(target, "__doc__", None):
            continue
        if name == "__init__":
            continue
        out.append((name, value))
    return out


def _render(dotted: str, *, members: bool) -> list[str]:
    module_name, _, attr = dotted.rpartition(".")
    try:
        obj: Any = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError):
        obj = importlib.import_module(dotted)
    out: list[str] = []
    if inspect.ismodule(obj):
        out += [f"### `{dotted}`", "", _markdown(inspect.getdoc(obj) or ""), ""]
        return out
    kind = "class" if inspect.isclass(obj) else "def"
    signature = _signature(obj).removesuffix(" -> None") if kind == "class" else _signature(obj)
    out += [f"### `{dotted}`", "", "```python", f"{kind} {attr}{signature}", "```", ""]
    out += [_markdown(inspect.getdoc(obj) or ""), ""]
    if inspect.isclass(obj) and members:
        for name, value in _members(obj):
            if isinstance(value, property):
                out += [f"#### `{attr}.{name}` (property)", ""]
                doc = inspect.getdoc(value.fget) or ""
            else:
                func = getattr(value, "__func__", value)
                out += [f"#### `{attr}.{name}{_signature(func)}`", ""]
                doc = inspect.getdoc(func) or ""
            out += [_markdown(doc), ""]
    return out


def render() -> str:
    """docs/reference.md as it must read."""
    lines = SOURCE.read_text().splitlines()
    out = [
        "<!-- generated from docs/api.md and the docstrings by scripts/gen_api_docs.py -->",
        "",
    ]
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("::: "):
            members = True
            while i + 1 < len(lines) and lines[i + 1].startswith("    "):
                if lines[i + 1].strip() == "members: false":
                    members = False
                i += 1
            out += _render(line[4:].strip(), members=members)
        elif line.startswith("# "):
            out.append("# API reference (plain Markdown)")
        elif "reference.md" in line:  # api.md's pointer to this page
            pass
        else:
            out.append(line)
        i += 1
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"
    return text.replace(
        "The prose pages say how the\npieces fit; this page is the exact signature and meaning "
        "of each.",
        "The prose pages say how the\npieces fit; this page is the exact signature and meaning "
        "of each. It is docs/api.md\nwritten out as Markdown, so that it reads here too.",
    )


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET.relative_to(ROOT)} is out of date: run scripts/gen_api_docs.py")
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
