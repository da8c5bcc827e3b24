"""docs/architecture.md cannot rot: every name it gives exists, and the layers it states hold."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from typing import Any

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
    **dict.fromkeys(
        (
            "config",
            "_config_source",
            "_config_diagnostics",
            "_timing",
            "_keys",
            "_lease",
            "_identity",
            "_render",
            "_registry",
        ),
        1,
    ),
    **dict.fromkeys(("_scripts", "_protocol"), 2),
    **dict.fromkeys(
        (
            "_engine",
            "_lostreply",
            "_grants",
            "_releases",
            "_readback",
            "_renew",
            "_receipts",
            "_cleanup",
            "_inspect",
            "_claims",
            "_wait",
        ),
        3,
    ),
    **dict.fromkeys(
        ("_store", "_astore", "_lanes", "_lifetime", "_once", "_renewlines", "_subscribers"), 4
    ),
    **dict.fromkeys(("_heartbeat", "_aheartbeat"), 5),
    **dict.fromkeys(
        (
            "app",
            "_outcomes",
            "task",
            "_interrupt",
            "worker",
            "beat",
            "once",
            "cli",
            "_cli_base",
            "_cli_inspect",
            "_cli_watch",
            "_cli_repair",
            "_census",
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


# --- the size of the rooms (issue 28): one concept a module, none too big to read ------------
def _sizes_script() -> Any:
    """scripts/gen_architecture_sizes.py, whose measures the page's table shows."""
    path = ROOT / "scripts" / "gen_architecture_sizes.py"
    spec = importlib.util.spec_from_file_location("gen_architecture_sizes", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SIZES = _sizes_script()
module_sizes, class_sizes = SIZES.module_sizes, SIZES.class_sizes

#: the most lines a module of the package may have, and a class
MAX_MODULE_LINES = 700
MAX_CLASS_LINES = 400
#: what is still over, and why; an entry that is no longer needed fails (the list only shrinks)
MODULE_EXEMPTIONS: dict[str, str] = {
    "_astore.py": "the asyncio driver, split into _aio/ by the driver move (issue 28, step 1)",
}
CLASS_EXEMPTIONS: dict[str, str] = {
    "_store.py::LeaseStore": "the sync driver's one-line delegates, thinned by the driver move",
}


def test_no_module_is_over_the_limit():
    over = {
        name: lines
        for name, lines in module_sizes().items()
        if lines > MAX_MODULE_LINES and name not in MODULE_EXEMPTIONS
    }
    assert over == {}, f"split these by concept (at most {MAX_MODULE_LINES} lines a module)"


def test_no_class_is_over_the_limit():
    over = {
        name: lines
        for name, lines in class_sizes().items()
        if lines > MAX_CLASS_LINES and name not in CLASS_EXEMPTIONS
    }
    assert over == {}, f"split these by concept (at most {MAX_CLASS_LINES} lines a class)"


def test_every_size_exemption_is_still_needed():
    modules, classes = module_sizes(), class_sizes()
    done = [m for m in MODULE_EXEMPTIONS if modules.get(m, 0) <= MAX_MODULE_LINES]
    done += [c for c in CLASS_EXEMPTIONS if classes.get(c, 0) <= MAX_CLASS_LINES]
    assert done == [], "these are within the limits now: take them off the exemption lists"


# --- the glossary: every invented term, and the file that defines it -------------------------
def glossary() -> list[tuple[str, str]]:
    """``(term, file)`` of each row of the page's glossary."""
    text = PAGE.read_text(encoding="utf-8")
    section = text.split("\n## Glossary\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("Term", "---"):
            rows.append((cells[0], cells[2].strip("`")))
    return rows


def _squashed(text: str) -> str:
    """``text`` lower-cased, without anything but letters and digits (``restart_grace``,
    ``RenewalLines`` and "renewal lines" read alike)."""
    return re.sub(r"[^a-z0-9]", "", text.lower())


def test_the_glossary_has_the_terms_of_the_house():
    terms = {term for term, _ in glossary()}
    assert len(terms) >= 40
    for term in ("slot group", "home call", "horizon", "grant book", "lane", "ticket", "census"):
        assert term in terms


@pytest.mark.parametrize(("term", "where"), glossary())
def test_every_glossary_term_is_where_it_says(term: str, where: str):
    source = PACKAGE / where
    assert source.is_file(), f"the glossary says {term!r} is defined in {where}, which is gone"
    text = _squashed(source.read_text(encoding="utf-8"))
    # the words of the term: "keeper `~`" is the keeper, "Want/Held" both
    for word in re.sub(r"`[^`]*`", "", term).split("/"):
        assert _squashed(word) in text, f"{where} does not mention {word.strip()!r}"
