"""docs/cli.md lists every ``celery leases`` command, with a usage line and a section."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from celery_leases.cli import leases

PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
#: commands whose section is a page of their own
ELSEWHERE = {"web": "web.md"}


@pytest.mark.parametrize("name", sorted(leases.commands))
def test_every_command_has_a_usage_line_and_a_section(name: str):
    text = PAGE.read_text(encoding="utf-8")
    assert re.search(rf"^celery -A proj\.app leases {name}\b", text, re.MULTILINE), name
    if name in ELSEWHERE:
        assert f"({ELSEWHERE[name]})" in text
    else:
        assert re.search(rf"^## `{name}\b", text, re.MULTILINE), f"no section for {name}"
