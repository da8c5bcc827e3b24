"""The lanes pack their script calls themselves: the bytes must be redis-py's, word for word."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio.connection import Connection
from redis.connection import Connection as SyncConnection

from celery_leases._wire import _packed, pack

WORDS: list[tuple[Any, ...]] = [
    ("EVALSHA", "4c929e7085c491f98e5a000ac9aea021c49be65a", 2, "{p:0}:x:r", "{p:0}:reg:n/1/2"),
    ("EVALSHA", "f160", 0),
    ("EVALSHA", "f160", 1, "k", 30000, 0, -1, 2**70, 1.5, 0.1, -0.0, "", "é ✓ 日本", b"\x00\xff"),
]


@pytest.mark.parametrize("words", WORDS)
def test_the_lane_packs_as_redis_py(words: tuple[Any, ...]) -> None:
    conn = Connection(decode_responses=True)
    packed = _packed(words)
    assert packed is not None
    assert b"".join(packed) == b"".join(conn.pack_command(*words))


@pytest.mark.parametrize("words", WORDS)
@pytest.mark.parametrize(("encoding", "errors"), [("utf-8", "strict"), ("latin-1", "replace")])
@pytest.mark.parametrize("connection", [Connection, SyncConnection])
def test_the_lane_packs_for_its_connection_as_redis_py(
    words: tuple[Any, ...], encoding: str, errors: str, connection: Any
) -> None:
    # hiredis's packer where it is installed and the encoding is utf-8, else ours; the same
    # for the sync and the asyncio lane
    conn = connection(decode_responses=True, encoding=encoding, encoding_errors=errors)
    assert b"".join(pack(conn, words)) == b"".join(conn.pack_command(*words))


@pytest.mark.parametrize("odd", [True, None, bytearray(b"x"), memoryview(b"x"), object()])
def test_other_words_are_left_to_redis_py(odd: object) -> None:
    # redis-py refuses a bool or None, and takes bytearray or memoryview: its own rules
    assert _packed(("EVALSHA", "f160", 1, "k", odd)) is None
