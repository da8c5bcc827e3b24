"""Examples in the docs that need no Redis, run as written."""

from __future__ import annotations

from tests.docs_blocks import python_blocks


def test_redlock_page_fenced_sql_write_refuses_an_older_token() -> None:
    # the block's own asserts are the check: the newer token's write lands, the older is refused
    block = next(b for b in python_blocks("redlock.md") if "import sqlite3" in b)
    namespace: dict[str, object] = {}
    exec(compile(block, "docs/redlock.md", "exec"), namespace)
    save_result = namespace["save_result"]
    db = namespace["db"]
    assert callable(save_result)
    assert save_result(db, "42:align", "same grant again", 1_700_000_000_000_002)
    row = db.execute("SELECT data, fence FROM results").fetchall()  # type: ignore[attr-defined]
    assert row == [("same grant again", 1_700_000_000_000_002)]
