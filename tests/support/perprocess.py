"""A Redis client per process, made again after a fork (for code that runs in pool children)."""

from __future__ import annotations

import os

import redis


class PerProcessClient:
    """Call it to get this process's client to ``url`` (``decode_responses=True``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._client: redis.Redis | None = None
        self._pid = -1

    def __call__(self) -> redis.Redis:
        if self._client is None or self._pid != os.getpid():
            self._client = redis.Redis.from_url(self.url, decode_responses=True)
            self._pid = os.getpid()
        return self._client
