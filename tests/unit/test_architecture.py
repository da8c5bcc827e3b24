"""docs/architecture.md cannot rot: every name it gives exists, and the layers it states hold."""

from __future__ import annotations

import ast
import importlib.util
import re
from functools import cache
from pathlib import Path
from typing import Any, Final

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_leases"
PAGE = ROOT / "docs" / "architecture.md"

#: ``file.py::Name`` or ``file.py::Class.method`` in backticks
REFERENCE = re.compile(r"`([\w/]+\.py)::([\w.]+)`")
#: ``lua/name.lua`` in backticks
SCRIPT = re.compile(r"`(lua/\w+\.lua)`")

#: the layers of the page's table: a module may import its own layer and those above it.
#: Modules of the driver packages are named with their package (``_sync.driver``).
LAYERS: dict[str, int] = {
    **dict.fromkeys(("exceptions", "signals", "_text", "_connect"), 0),
    **dict.fromkeys(
        (
            "config",
            "_config_source",
            "_config_diagnostics",
            "_setting_texts",
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
            "_beat_claims",
            "_wait",
            "_renewround",
            "_limits",
            "_revocation",
        ),
        3,
    ),
    # what the drivers are made of, and what both of them share
    **dict.fromkeys(("_one_attempt", "_restart_check", "_wire", "_sync", "_aio"), 4),
    **dict.fromkeys(
        (
            f"{side}.{part}"
            for side in ("_sync", "_aio")
            for part in ("client", "lanes", "subscriber", "renewals", "replicated", "operations")
        ),
        4,
    ),
    "_aio.shields": 4,
    # the drivers and their heartbeats
    **dict.fromkeys(
        (f"{side}.{part}" for side in ("_sync", "_aio") for part in ("driver", "heartbeat")), 5
    ),
    **dict.fromkeys(
        (
            "app",
            "_outcomes",
            "task",
            "_interrupt",
            "_templates",
            "_taskflow",
            "worker",
            "beat",
            "_beat_runs",
            "once",
            "cli",
            "_cli_base",
            "_cli_inspect",
            "_cli_watch",
            "_cli_repair",
            "_cli_limits",
            "_limiter",
            "_cli_parked",
            "_census",
            "web",
            "_unique",
            "_modes",
            "_guard",
            "_parking",
            "_parked",
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
#: the value layer and the core: they never name a driver (not even in annotations)
BELOW_THE_DRIVERS: tuple[str, ...] = tuple(
    sorted(m for m, layer in LAYERS.items() if layer in (1, 2, 3))
)
#: the two mirrored driver packages
SIDES: Final = ("_sync", "_aio")
#: modules of one side with no twin on the other (asyncio's cancellation shields)
UNMIRRORED: Final = {"_sync": set[str](), "_aio": {"shields"}}
#: module -> (sync name, asyncio name): the twins a reader finds by name
TWINS: Final = {
    "driver": ("LeaseStore", "AsyncLeaseStore"),
    "operations": ("Operations", "Operations"),
    "client": ("round_trip", "round_trip"),
    "lanes": ("Lane", "Lane"),
    "subscriber": ("Subscriber", "Subscriber"),
    "renewals": ("RenewalLines", "RenewalLines"),
    "replicated": ("send_replicated", "send_replicated"),
    "heartbeat": ("Heartbeat", "Heartbeat"),
}
#: what no module below the drivers may name
DRIVER_NAMES: Final = re.compile(r"\b(_sync|_aio|LeaseStore|AsyncLeaseStore)\b")
#: the size limits of the driver packages (lines)
MAX_MODULE: Final = 700
MAX_CLASS: Final = 400


@cache
def _modules() -> dict[str, Path]:
    """Every module of the package by its name (``_sync.driver``; a package by its own)."""
    out: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if len(parts) > 1 and parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _layer(module: str) -> int:
    return LAYERS.get(module, LAYERS.get(module.split(".")[0], 6))


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


def _runtime_imports(tree: ast.Module, module: str) -> set[str]:
    """The package modules ``module`` (its ``tree``) imports when it runs (``TYPE_CHECKING``
    blocks skipped), by name (``_sync.lanes``)."""
    out: set[str] = set()
    package = module.split(".")[:-1] if "." in module else []
    if (PACKAGE / module.replace(".", "/") / "__init__.py").is_file():
        package = module.split(".")  # a package's own __init__: its imports are from inside

    def resolve(node: ast.ImportFrom) -> list[str]:
        if node.level == 0:
            name = node.module or ""
            if not name.startswith("celery_leases."):
                return []
            return [name.removeprefix("celery_leases.")]
        base = package[: len(package) - (node.level - 1)]
        if node.module:
            return [".".join([*base, node.module])]
        return [".".join([*base, alias.name]) for alias in node.names]

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.ImportFrom):
                known = _modules()
                for name in resolve(node):
                    while name and name not in known and "." in name:
                        name = name.rsplit(".", 1)[0]  # from .x import Name: the module x
                    if name in known:
                        out.add(name)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    visit([child])

    visit(tree.body)
    return out - {module}


def test_every_module_has_a_layer():
    modules = set(_modules())
    assert sorted(modules - LAYERS.keys()) == [], "add the new module to docs/architecture.md"


def test_imports_go_up_the_layers_only():
    wrong = []
    for module, path in _modules().items():
        mine = _layer(module)
        imported = _runtime_imports(ast.parse(path.read_text(encoding="utf-8")), module)
        for other in sorted(imported):
            if _layer(other) > mine:
                wrong.append(f"{module} (layer {mine}) imports {other}")
    assert wrong == []


def test_the_import_resolution_sees_the_driver_packages():
    """The check above is only as good as its reading of relative imports."""
    driver = _modules()["_sync.driver"]
    imported = _runtime_imports(ast.parse(driver.read_text(encoding="utf-8")), "_sync.driver")
    assert {"_sync.lanes", "_wait", "_protocol", "config"} <= imported
    app = _modules()["app"]
    assert {"_sync.driver", "_aio.driver"} <= _runtime_imports(
        ast.parse(app.read_text(encoding="utf-8")), "app"
    )


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


# --- two mirrored drivers -------------------------------------------------------------------
def _side(side: str) -> set[str]:
    return {p.stem for p in (PACKAGE / side).glob("*.py") if p.stem != "__init__"}


def test_the_drivers_have_the_same_module_names():
    sync, aio = (_side(side) - UNMIRRORED[side] for side in SIDES)
    assert sorted(sync ^ aio) == [], "a driver module needs its twin (or a place in UNMIRRORED)"
    assert sync, "no driver modules found"


@pytest.mark.parametrize("module", sorted(TWINS))
def test_each_twin_is_found_by_its_name_on_both_sides(module: str):
    for side, name in zip(SIDES, TWINS[module], strict=True):
        tree = ast.parse((PACKAGE / side / f"{module}.py").read_text(encoding="utf-8"))
        assert _defined(tree, name), f"{side}/{module}.py has no {name}, the twin of the other's"


def test_every_mirrored_module_names_a_twin():
    assert sorted(_side("_sync") - TWINS.keys()) == []


def test_the_drivers_do_not_import_each_other():
    wrong = []
    for module, path in _modules().items():
        side = module.split(".")[0]
        if side not in SIDES:
            continue
        other = SIDES[1 - SIDES.index(side)]
        imported = _runtime_imports(ast.parse(path.read_text(encoding="utf-8")), module)
        wrong += [f"{module} imports {m}" for m in sorted(imported) if m.split(".")[0] == other]
    assert wrong == []


# --- no back-pointers -----------------------------------------------------------------------
def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring nodes of ``tree`` (prose, not names)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _driver_names(tree: ast.Module) -> list[str]:
    """Every place ``tree`` names a driver: names, attributes, imports (``TYPE_CHECKING``
    blocks included) and strings (annotations written as strings too), docstrings aside."""
    prose = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        texts: list[str] = []
        if isinstance(node, ast.Name):
            texts = [node.id]
        elif isinstance(node, ast.Attribute):
            texts = [node.attr]
        elif isinstance(node, ast.ImportFrom):
            texts = [node.module or "", *(a.name for a in node.names)]
        elif isinstance(node, ast.Import):
            texts = [a.name for a in node.names]
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
        ):
            texts = [node.value]
        found += [f"line {node.lineno}: {text!r}" for text in texts if DRIVER_NAMES.search(text)]
    return found


@pytest.mark.parametrize("module", BELOW_THE_DRIVERS)
def test_the_core_and_the_values_never_name_a_driver(module: str):
    tree = ast.parse(_modules()[module].read_text(encoding="utf-8"))
    assert _driver_names(tree) == [], f"{module} names a driver"


def test_the_back_pointer_check_sees_annotations_and_type_checking_imports():
    source = """
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from ._sync.driver import LeaseStore
def f(store: "AsyncLeaseStore") -> None:
    \"\"\"Docstrings may say LeaseStore.\"\"\"
"""
    found = _driver_names(ast.parse(source))
    assert len(found) == 3, found  # the import's module, its name, the string annotation


# --- room sizes -----------------------------------------------------------------------------
@pytest.mark.parametrize("module", sorted(m for m in _modules() if m.split(".")[0] in SIDES))
def test_the_driver_rooms_stay_small(module: str):
    text = _modules()[module].read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_MODULE, f"{module} is over {MAX_MODULE} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            assert size <= MAX_CLASS, f"{module}::{node.name} is {size} lines (> {MAX_CLASS})"


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
MODULE_EXEMPTIONS: dict[str, str] = {}
CLASS_EXEMPTIONS: dict[str, str] = {}


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
