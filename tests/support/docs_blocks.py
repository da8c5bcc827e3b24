"""The code blocks of the pages in docs/, for tests that run the docs' examples as written."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: str) -> list[str]:
    """The ```python blocks of one page of docs/, in order."""
    return _BLOCK.findall((ROOT / "docs" / page).read_text())
