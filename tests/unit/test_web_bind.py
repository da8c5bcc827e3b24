"""The web view's --bind rule: loopback unless --public, HOST:PORT well formed."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette", reason="the web extra")

from celery_leases.web import check_bind


@pytest.mark.parametrize(
    ("bind", "public", "ok"),
    [
        ("127.0.0.1:8765", False, True),
        ("localhost:8765", False, True),
        ("[::1]:8765", False, True),
        ("127.3.4.5:1", False, True),
        ("0.0.0.0:8765", False, False),
        ("0.0.0.0:8765", True, True),
        ("10.1.2.3:80", False, False),
        ("example.com:80", False, False),
        ("127.0.0.1", False, False),
        ("127.0.0.1:0", False, False),
        ("127.0.0.1:99999", False, False),
        (":8765", False, False),
    ],
)
def test_check_bind(bind: str, public: bool, ok: bool) -> None:
    if ok:
        assert check_bind(bind, public=public).port > 0
    else:
        with pytest.raises(ValueError, match="--bind"):
            check_bind(bind, public=public)
