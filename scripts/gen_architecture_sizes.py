"""Write docs/architecture.md's "How big the rooms are" table: measured, never typed.

The table lists every module of the package (subpackages included) with its lines, and its
largest class with that class's lines (from its ``class`` line to its last). The size limits
of ``tests/unit/test_architecture.py`` use the same measures. Only the part between the
page's ``sizes:`` markers is written; never edit it by hand.

Usage: python scripts/gen_architecture_sizes.py [--check]
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "celery_leases"
PAGE = ROOT / "docs" / "architecture.md"

BEGIN = "<!-- sizes: begin (written by scripts/gen_architecture_sizes.py) -->"
END = "<!-- sizes: end -->"


def module_sizes(package: Path = PACKAGE) -> dict[str, int]:
    """Lines of each module of ``package``, by its path in the package (``_aio/driver.py``)."""
    return {
        path.relative_to(package).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for path in sorted(package.rglob("*.py"))
    }


def class_sizes(package: Path = PACKAGE) -> dict[str, int]:
    """Lines of each class of ``package`` (nested ones too), as ``file.py::Name``."""
    sizes: dict[str, int] = {}
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                sizes[f"{where}::{node.name}"] = node.end_lineno - node.lineno + 1
    return sizes


def render(package: Path = PACKAGE) -> str:
    """The table, largest module first."""
    classes = class_sizes(package)
    largest: dict[str, tuple[str, int]] = {}
    for name, lines in classes.items():
        module, _, cls = name.partition("::")
        if lines > largest.get(module, ("", 0))[1]:
            largest[module] = (cls, lines)
    modules = module_sizes(package)
    rows = ["| Module | Lines | Its largest class | Lines |", "|---|---:|---|---:|"]
    for module, lines in sorted(modules.items(), key=lambda item: (-item[1], item[0])):
        cls, cls_lines = largest.get(module, ("", 0))
        shown = (f"`{cls}`", str(cls_lines)) if cls else ("-", "-")
        rows.append(f"| `{module}` | {lines} | {shown[0]} | {shown[1]} |")
    total = sum(modules.values())
    rows.append(f"| all {len(modules)} modules | {total} | | |")
    return "\n".join(rows)


def rewritten(page: str, table: str) -> str:
    """``page`` with ``table`` between its markers."""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(page):
        msg = f"{PAGE.relative_to(ROOT)} has no {BEGIN!r} ... {END!r} markers"
        raise SystemExit(msg)
    return pattern.sub(lambda _: f"{BEGIN}\n{table}\n{END}", page)


def main() -> int:
    page = PAGE.read_text(encoding="utf-8")
    text = rewritten(page, render())
    if "--check" in sys.argv[1:]:
        if text != page:
            where = PAGE.relative_to(ROOT)
            print(f"{where}'s sizes are stale: run scripts/gen_architecture_sizes.py")
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote the sizes of {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
