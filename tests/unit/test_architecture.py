"""docs/architecture.md cannot rot: every name it gives exists, and the layers it states hold."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_leases"
PAGE = ROOT / "docs" / "architecture.md"

#: ``file.py::Name`` or ``file.py::Class.method`` in backticks
REFERENCE = re.compile(r"`([\w/]+\.py)::([\w.]+)`")
#: ``lua/name.lua`` in backticks
SCRIPT = re.compile(r"`(lua/\w+\.lua)`")

#: the layers of the page's table: a module may import its own layer and those above it
LAYERS: dict[str, int] = {
    **dict.fromkeys(("exceptions", "signals", "_text", "_connect"), 0),
    **dict.fromkeys(("config", "_keys", "_lease", "_identity", "_render", "_registry"), 1),
    **dict.fromkeys(("_scripts", "_protocol"), 2),
    **dict.fromkeys(
        ("_engine", "_lostreply", "_grants", "_cleanup", "_inspect", "_claims", "_renewround"), 3
    ),
    **dict.fromkeys(("_restart_check", "_one_attempt", "_wire", "_sync", "_aio"), 4),
    **dict.fromkeys(
        (
            "app",
            "task",
            "worker",
            "beat",
            "once",
            "cli",
            "web",
            "_unique",
            "_guard",
            "fence",
            "metrics",
            "otel",
            "pytest_plugin",
            "__init__",
        ),
        6,
    ),
    # the pytest plugin's private server: it imports nothing of the package
    "_redis_server": 0,
}
#: the sans-IO core: the protocol written once, for both drivers
CORE: tuple[str, ...] = tuple(sorted(m for m, layer in LAYERS.items() if layer in (2, 3)))


def _defined(tree: ast.Module, dotted: str) -> bool:
    """Whether ``dotted`` (``Name`` or ``Class.member``) is defined in ``tree``."""
    body: list[ast.stmt] = tree.body
    for part in dotted.split("."):
        found: ast.stmt | None = None
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name == part:
                    found = node
            elif isinstance(node, ast.Assign):
                if any(isinstance(t, ast.Name) and t.id == part for t in node.targets):
                    found = node
            elif (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == part
            ):
                found = node
        if found is None:
            return False
        body = found.body if isinstance(found, ast.ClassDef) else []
    return True


def test_the_page_names_something():
    text = PAGE.read_text(encoding="utf-8")
    assert len(REFERENCE.findall(text)) > 40
    assert len(SCRIPT.findall(text)) > 8


@pytest.mark.parametrize(
    ("path", "name"), sorted(set(REFERENCE.findall(PAGE.read_text(encoding="utf-8"))))
)
def test_every_named_function_exists(path: str, name: str):
    source = PACKAGE / path
    assert source.is_file(), f"docs/architecture.md names {path}, which is not in the package"
    tree = ast.parse(source.read_text(encoding="utf-8"))
    assert _defined(tree, name), f"docs/architecture.md names {path}::{name}, which is gone"


@pytest.mark.parametrize("script", sorted(set(SCRIPT.findall(PAGE.read_text(encoding="utf-8")))))
def test_every_named_script_exists(script: str):
    assert (PACKAGE / script).is_file(), f"docs/architecture.md names {script}, which is gone"


def _runtime_imports(tree: ast.Module) -> set[str]:
    """The package modules ``tree`` imports when it runs (``TYPE_CHECKING`` blocks skipped)."""
    out: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    if node.module:
                        out.add(node.module.split(".")[0])
                    else:
                        out.update(a.name for a in node.names)
                elif node.level == 0 and (node.module or "").startswith("celery_leases."):
                    out.add((node.module or "").split(".")[1])
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    visit([child])

    visit(tree.body)
    return out


def test_every_module_has_a_layer():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert sorted(modules - LAYERS.keys()) == [], "add the new module to docs/architecture.md"


def test_imports_go_up_the_layers_only():
    wrong = []
    for path in sorted(PACKAGE.glob("*.py")):
        mine = LAYERS.get(path.stem, 6)
        for imported in sorted(_runtime_imports(ast.parse(path.read_text(encoding="utf-8")))):
            if LAYERS.get(imported, 6) > mine:
                wrong.append(f"{path.stem} (layer {mine}) imports {imported}")
    assert wrong == []


def _third_party_imports(tree: ast.Module) -> set[str]:
    """Top-level names of everything ``tree`` imports when it runs, outside the package."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []  # annotations only
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("module", [m for m in CORE if (PACKAGE / f"{m}.py").is_file()])
def test_the_core_does_no_io(module: str):
    """The core imports neither redis nor asyncio (nor anything that does I/O for it)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text(encoding="utf-8"))
    io = _third_party_imports(tree) & {"redis", "asyncio", "socket", "threading", "celery"}
    if module == "_lostreply":  # the book of this process's grants has a lock
        io -= {"threading"}
    assert io == set(), f"{module} is in the sans-IO core but imports {sorted(io)}"
