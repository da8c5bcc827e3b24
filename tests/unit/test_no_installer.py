"""The package (what the wheel ships) installs nothing and carries no dev servers.

The pytest plugin may start an installed redis-server for users' tests, but the wheel never
runs apt-get or pip, and the dev-only helpers (the installer, the ``serve``/``stop``/``pick``
commands, local Cluster and Sentinel sets) live in tests/support/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_leases"
SOURCES = sorted(PACKAGE.rglob("*.py"))

#: argv words of a package manager: a string constant equal to one is a command being built
_INSTALLER_WORDS = {"apt", "apt-get", "dpkg", "pip", "pip3", "ensurepip", "uv", "conda"}
#: the only module that may start a process: it runs an installed server binary, nothing else
_MAY_SPAWN = {PACKAGE / "_redis_server.py"}


def _constants(tree: ast.AST) -> list[str]:
    return [
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def _imported(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_package_has_sources() -> None:
    assert PACKAGE / "pytest_plugin.py" in SOURCES
    assert len(SOURCES) > 10


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_package_module_runs_an_installer(path: Path) -> None:
    text = path.read_text()
    tree = ast.parse(text)
    assert "apt-get" not in text
    assert "ensure_server_binary" not in text
    words = [c for c in _constants(tree) if c.strip() in _INSTALLER_WORDS]
    assert words == [], f"{path.name} builds a command with {words}"
    if path not in _MAY_SPAWN:
        spawning = _imported(tree) & {"subprocess", "multiprocessing", "pty"}
        assert not spawning, f"{path.name} imports {spawning}"
        assert "os.system" not in text
        assert "os.exec" not in text
        assert "os.spawn" not in text


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_package_module_carries_dev_servers_or_commands(path: Path) -> None:
    text = path.read_text()
    tree = ast.parse(text)
    for name in ("LocalCluster", "LocalSentinel", "_redis_topology"):
        assert name not in text, f"{path.name} mentions {name}"
    assert not {m for m in _imported(tree) if m == "tests" or m.startswith("tests.")}
    if path.name != "cli.py":  # `celery leases` is the one command line the package has
        assert "argparse" not in _imported(tree), f"{path.name} has a command line"
        assert "__main__" not in _constants(tree), f"{path.name} runs as a script"


def test_the_dev_helpers_are_in_tests_support() -> None:
    assert not (PACKAGE / "_redis_topology.py").exists()
    assert (ROOT / "tests" / "support" / "servers.py").exists()
    assert (ROOT / "tests" / "support" / "topology.py").exists()
