"""The docs runner's reading of a page: fragments, file blocks, line numbers."""

from __future__ import annotations

from pathlib import Path

from tests.support.docs_blocks import ROOT, adapt, blocks, pages

PAGE = """# A page

<!-- fragment: uses your results -->
```python
results.set("x", 1)
```

```python
# proj/app.py
app = 1
```

```python
# proj/app.py, below the app
from proj.app import app
```
"""


def test_a_page_is_read_with_its_markers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    first, second, third = blocks(page)
    assert (first.fragment, first.line) == ("uses your results", 5)
    assert (second.fragment, second.file, second.line) == (None, "proj/app.py", 9)
    assert third.file == "proj/app.py"


def test_the_code_is_pointed_at_the_test_redis_and_prefix() -> None:
    code = (
        'Celery("p", broker="redis://localhost:6379/0")\nF("redis://localhost:6379/1", prefix="r")'
    )
    got = adapt(code, "redis://127.0.0.1:6379/10", "run1")
    assert got == 'Celery("p", broker="memory://")\nF("redis://127.0.0.1:6379/10", prefix="run1-r")'


def test_the_readme_and_the_quickstart_are_run() -> None:
    found = {str(p.relative_to(ROOT)) for p in pages()}
    assert {"README.md", "docs/quickstart.md", "docs/tasks.md"} <= found
    assert all(b.fragment is None for b in blocks(ROOT / "docs" / "quickstart.md"))
