"""The web view's --bind rule: loopback unless --public, HOST:PORT well formed."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette", reason="the web extra")

from celery_leases.web import _allowed_hosts, _host_name, check_bind


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


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("127.0.0.1:8765", "127.0.0.1"),
        ("localhost", "localhost"),
        ("[::1]:8765", "[::1]"),
        ("[::1]", "[::1]"),
        ("attacker.example:8765", "attacker.example"),
        ("", ""),
    ],
)
def test_host_names_lose_their_port(header: str, name: str) -> None:
    assert _host_name(header) == name


def test_a_loopback_view_answers_its_own_names_only() -> None:
    assert _allowed_hosts(check_bind("[::1]:1", public=False)) == {
        "[::1]",
        "127.0.0.1",
        "localhost",
    }
    assert _allowed_hosts(check_bind("127.0.0.2:1", public=False)) == {
        "127.0.0.2",
        "127.0.0.1",
        "localhost",
        "[::1]",
    }
    assert _allowed_hosts(check_bind("0.0.0.0:1", public=True)) is None
