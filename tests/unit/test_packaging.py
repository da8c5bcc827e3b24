"""What the package index shows: the README's links, the classifiers, the version's changelog."""

from __future__ import annotations

import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_links_are_absolute_and_resolve_to_files_here() -> None:
    # a package index renders the README without the repository: a relative link is dead there
    source = PROJECT["urls"]["Source"]
    links = _LINK.findall((ROOT / "README.md").read_text())
    assert links
    relative = [link for link in links if not link.startswith("https://")]
    assert relative == [], f"relative links in README.md: {relative}"
    ours = f"{source}/blob/main/"
    missing = [
        link
        for link in links
        if link.startswith(ours) and not (ROOT / link[len(ours) :].split("#")[0]).exists()
    ]
    assert missing == [], f"README.md links to files that do not exist: {missing}"


def test_readme_starts_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split()[0] for line in first_block] == ["scripts/demo", "scripts/test"]


def test_python_classifiers_cover_requires_python() -> None:
    floor = re.fullmatch(r">=3\.(\d+)", PROJECT["requires-python"])
    assert floor, PROJECT["requires-python"]
    minors = {
        int(m.group(1))
        for c in PROJECT["classifiers"]
        if (m := re.fullmatch(r"Programming Language :: Python :: 3\.(\d+)", c))
    }
    assert minors
    assert min(minors) == int(floor.group(1))
    assert minors == set(range(min(minors), max(minors) + 1))


def test_changelog_top_section_is_this_version() -> None:
    text = (ROOT / "docs" / "changelog.md").read_text()
    top = re.search(r"^## (\S+)", text, re.M)
    assert top, "docs/changelog.md has no release section"
    assert top.group(1) == PROJECT["version"]
