"""The configuration reference is generated from the settings model, never hand-copied."""

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
