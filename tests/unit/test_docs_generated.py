"""The references are generated (configuration from the settings model, the API's plain
Markdown from docs/api.md and the docstrings), never hand-copied."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_setting_is_documented() -> None:
    from celery_leases.config import LeaseSettings

    text = (ROOT / "docs" / "configuration.md").read_text()
    for name, field in LeaseSettings.model_fields.items():
        assert field.description, f"setting {name} has no description"
        assert f"`{name}`" in text


def test_api_reference_markdown_is_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_api_docs.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_architecture_sizes_are_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_architecture_sizes.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
