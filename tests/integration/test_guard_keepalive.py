"""The redelivery guard's keep-alive against a real kombu Redis channel and server."""

from __future__ import annotations

import time

import redis
from kombu import Connection

from celery_leases._guard import KeepAlive


def test_one_zadd_refreshes_every_delivery_held_and_never_brings_one_back(
    leases_redis_url: str, leases_prefix: str, leases_redis: redis.Redis
) -> None:
    prefix = f"{{{leases_prefix}:kombu}}:"
    index = f"{prefix}unacked_index"
    old = time.time() - 1000
    leases_redis.zadd(index, {"held-1": old, "held-2": old, "other": old})
    options = {"global_keyprefix": prefix, "visibility_timeout": 3}
    keep = KeepAlive()
    try:
        with Connection(leases_redis_url, transport_options=options) as conn:
            channel = conn.default_channel
            assert keep.attach(channel)
            assert keep.interval == 1.0  # visibility_timeout / 3
            for tag in ("held-1", "held-2", "acked"):  # "acked": gone from the index already
                keep.add(tag)
            before = time.time()
            keep.touch()
            scores = dict(leases_redis.zrange(index, 0, -1, withscores=True))
    finally:
        keep.stop()
        leases_redis.delete(index)
    assert keep.calls == 1
    assert scores["held-1"] >= before
    assert scores["held-2"] >= before
    assert abs(scores["other"] - old) < 0.001  # another worker's delivery: not ours to refresh
    assert "acked" not in scores  # XX: an acked delivery is not brought back
