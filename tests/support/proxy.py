"""A loopback TCP proxy in front of a real Redis that loses replies on command.

Every connection a client opens to the proxy is forwarded to the Redis behind it. A test can
arm it to lose the reply of the next request that matches a byte pattern (a script's SHA, say):
the request is forwarded and runs in Redis, and when its reply comes back both sides are
closed and the reply is dropped, which is what a client sees when the network fails between
the command and its reply. It can also hold such a reply back for a while (past the client's
socket timeout), or lose a fraction of all matching replies (the fault suite's load).
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from dataclasses import dataclass, field

__all__ = ("LossyProxy",)

_CHUNK = 65536


@dataclass
class _Rule:
    pattern: bytes
    count: int  # matching requests left to act on (-1: every one, at ``fraction``)
    delay: float  # 0: drop the reply; else hold it back this long, then forward it
    fraction: float = 1.0
    after: int = 0  # matching requests to let through first
    then_refuse: bool = False  # once the reply is lost, refuse every connection
    hits: int = 0


@dataclass
class _Pair:
    client: socket.socket
    upstream: socket.socket
    # set when a matching request went up: what to do with the reply that follows
    pending: list[_Rule] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class LossyProxy:
    """Forwards 127.0.0.1:<port> to ``upstream``; loses replies of matching requests.

    A request is matched on the bytes of one read from the client (a redis-py command or
    pipeline is sent in one write, so it arrives whole on loopback).
    """

    def __init__(self, upstream_host: str, upstream_port: int, *, seed: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._pairs: list[_Pair] = []
        self._random = random.Random(seed)
        self._stopped = False
        self._refusing = False
        self.lost = 0  # replies dropped or held back so far
        self._thread = threading.Thread(target=self._accept, name="lossy-proxy", daemon=True)
        self._thread.start()

    def url(self, db: int = 0) -> str:
        """A redis:// URL that goes through the proxy."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    # --- arming -----------------------------------------------------------------------------
    def drop_next_reply(
        self, pattern: bytes, count: int = 1, *, after: int = 0, then_refuse: bool = False
    ) -> None:
        """Lose the replies of the next ``count`` requests containing ``pattern``.

        ``after``: let that many matching requests through first. ``then_refuse``: from the
        lost reply on, close every connection as it is made (Redis is unreachable) until
        :meth:`accept_again`.
        """
        with self._lock:
            self._rules.append(_Rule(pattern, count, 0.0, after=after, then_refuse=then_refuse))

    def accept_again(self) -> None:
        """Forward new connections again (after ``then_refuse``)."""
        self._refusing = False

    def delay_next_reply(
        self, pattern: bytes, seconds: float, count: int = 1, *, after: int = 0
    ) -> None:
        """Hold back the replies of the next ``count`` requests containing ``pattern``."""
        with self._lock:
            self._rules.append(_Rule(pattern, count, seconds, after=after))

    def drop_fraction(self, pattern: bytes, fraction: float) -> None:
        """From now on, lose the reply of each request containing ``pattern`` with that chance."""
        with self._lock:
            self._rules.append(_Rule(pattern, -1, 0.0, fraction))

    def delay_fraction(self, pattern: bytes, fraction: float, seconds: float) -> None:
        """From now on, hold back the reply of each request containing ``pattern`` with that
        chance, for ``seconds``."""
        with self._lock:
            self._rules.append(_Rule(pattern, -1, seconds, fraction))

    def disarm(self) -> None:
        """Forget every rule (replies already doomed are still lost)."""
        with self._lock:
            self._rules.clear()

    def armed(self) -> bool:
        """True while a counted rule has requests left to act on."""
        with self._lock:
            return any(r.count > 0 for r in self._rules)

    def _match(self, data: bytes) -> _Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.count == 0 or rule.pattern not in data:
                    continue
                if rule.count < 0 and self._random.random() >= rule.fraction:
                    continue
                if rule.after > 0:
                    rule.after -= 1
                    continue
                if rule.count > 0:
                    rule.count -= 1
                rule.hits += 1
                self.lost += 1
                return rule
        return None

    # --- forwarding -------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._refusing:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(client, upstream)
            with self._lock:
                self._pairs = [p for p in self._pairs if not p.closed]
                self._pairs.append(pair)
            threading.Thread(target=self._up, args=(pair,), daemon=True).start()
            threading.Thread(target=self._down, args=(pair,), daemon=True).start()

    def _up(self, pair: _Pair) -> None:
        try:
            while True:
                data = pair.client.recv(_CHUNK)
                if not data:
                    break
                rule = self._match(data)
                if rule is not None:
                    with pair.lock:
                        pair.pending.append(rule)
                pair.upstream.sendall(data)
        except OSError:
            pass
        pair.close()

    def _down(self, pair: _Pair) -> None:
        try:
            while True:
                data = pair.upstream.recv(_CHUNK)
                if not data:
                    break
                with pair.lock:
                    rule = pair.pending.pop(0) if pair.pending else None
                if rule is not None:
                    if rule.delay <= 0:
                        if rule.then_refuse:
                            self._refusing = True
                        break  # the request ran in Redis; its reply is lost with the connection
                    time.sleep(rule.delay)
                pair.client.sendall(data)
        except OSError:
            pass
        pair.close()

    def cut_all(self) -> None:
        """Close every forwarded connection now."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            pair.close()

    def close(self) -> None:
        """Stop accepting, and close every connection."""
        self._stopped = True
        self._listener.close()
        self.cut_all()

    def __enter__(self) -> LossyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
