"""Lanes: each thread's own connection for the sync driver's single script calls.

A grant and a release are one EVALSHA each. Sent through ``client.execute_command``, each
pays redis-py's per-command machinery (the pool's checkout and check-in, its observability
recorders, the retry wrapper, event dispatch): measured at about 75 µs of a 115 µs call on
loopback, against 38 µs for the same call written and read on a connection directly. So a
thread keeps one connection of its own (a lane) and sends a single script call on it
directly, with the client's semantics kept: the connection's own connect step (the restart
check of ``_restart_check`` runs on every new connection), its socket timeouts, one resend after
a connection error only when the call allows it (``Send.once`` is False), NOSCRIPT loading
the script and sending again (the script did not run), and a connection that failed in the
middle of a call dropped, so no later call can read a stale reply. On a plain socket read
by redis-py's hiredis parser, a lane writes and reads the socket itself (:func:`_direct`),
with redis-py's errors; elsewhere (TLS, the pure-Python parser) through redis-py's methods.

Not on a cluster (the client routes by slot there). A lane is made anew after a fork or a
new client, closed when its thread ends, and all of them by :meth:`Lanes.close`.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import weakref
from contextlib import suppress
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._protocol import Command, Script, words_of
from .._scripts import SOURCE
from .._wire import handoff, pack, where

__all__ = ("Lane", "Lanes", "direct_parser", "skip_replies")

_HiredisParser: Any
try:  # what a direct call (_direct) reads with: redis-py's hiredis parser, as it sets it up
    from hiredis import PushNotification as _Push
    from redis._parsers.hiredis import NOT_ENOUGH_DATA as _MORE
    from redis._parsers.hiredis import _HiredisParser
except ImportError:  # pragma: no cover - hiredis is optional; another redis-py: its own path
    _HiredisParser = None


def _call(conn: Any, packed: list[bytes]) -> Any:
    """Send ``packed`` on ``conn`` (connected) and read its reply, as redis-py would.

    On a plain socket read by redis-py's hiredis parser, directly (:func:`_direct`):
    redis-py's ``send_packed_command`` and ``read_response`` spend more instructions than
    the socket calls and the parsing themselves (measured with callgrind: 45.6k against
    18.5k for two small commands). Anything else (TLS, the pure-Python parser, health
    checks) goes through redis-py's methods.
    """
    if direct_parser(conn) is not None:
        return _direct(conn, conn._sock, conn._parser, packed)
    conn.send_packed_command(packed, check_health=False)
    return conn.read_response()


def direct_parser(conn: Any) -> Any:
    """``conn``'s hiredis parser when the socket may be read directly, past redis-py's
    read path (a connected plain socket read by redis-py's hiredis parser, no health
    checks); else None (TLS, the pure-Python parser, another redis-py: redis-py's path)."""
    parser = conn._parser
    if (
        type(parser) is _HiredisParser
        and type(conn._sock) is socket.socket
        and not conn.health_check_interval
        and getattr(parser, "_reader", None) is not None
    ):
        return parser
    return None


def skip_replies(conn: Any, parser: Any, timeout: float, channel: str | None = None) -> str | None:
    """Wait up to ``timeout`` seconds for anything to read on ``conn`` (whose
    :func:`direct_parser` is ``parser``), and read and drop every whole reply there is, up
    to a handoff on ``channel``: then the handed token (as text) is returned, and the replies
    after it are left to read.

    For a waiter's subscriber connection, where each message but a handoff (see
    :func:`handoff`) only says "try again": this skips redis-py's ``get_message`` (its
    readiness checks, parsing into a dict, handlers), about 37 µs a message on the benchmark
    VM. Raises redis-py's ConnectionError when the server closed the connection.
    """
    reader = parser._reader
    reply = reader.gets()
    if reply is _MORE:  # nothing whole read yet: wait on the socket
        if timeout <= 0:
            return None
        sock, buf = conn._sock, parser._buffer
        try:
            sock.settimeout(timeout)
            read = sock.recv_into(buf)
        except TimeoutError as exc:
            if exc.errno is None:  # the wait's own timeout: nothing came
                return None
            raise RedisConnectionError(f"Error while reading from {where(conn)}: {exc}") from None
        except OSError as exc:
            raise RedisConnectionError(f"Error while reading from {where(conn)}: {exc}") from None
        finally:
            with suppress(OSError):
                sock.settimeout(conn.socket_timeout)
        if not read:
            raise RedisConnectionError("Connection closed by server.")
        reader.feed(buf, 0, read)
        reply = reader.gets()
    while reply is not _MORE:
        if channel is not None and isinstance(reply, list) and len(reply) == 3:
            token = handoff(reply[0], reply[1], reply[2], channel)
            if token is not None:
                return token
        reply = reader.gets()
    return None


def _direct(conn: Any, sock: socket.socket, parser: Any, packed: list[bytes]) -> Any:
    """:func:`_call` on the socket: its errors are redis-py's, and the connection is closed
    after any failure mid-call (a later call must never read this call's reply)."""
    reader = parser._reader
    buf = parser._buffer
    try:
        sock.sendall(packed[0] if len(packed) == 1 else b"".join(packed))
        while True:
            reply = reader.gets()
            if reply is _MORE:
                read = sock.recv_into(buf)
                if not read:
                    raise RedisConnectionError("Connection closed by server.")
                reader.feed(buf, 0, read)
            elif type(reply) is _Push:  # RESP3: a push (maintenance, say), then the reply
                parser.handle_push_response(reply)
            else:
                break
    except TimeoutError:  # the socket's: redis-py's TimeoutError, as its own read says
        conn.disconnect()
        raise RedisTimeoutError(f"Timeout reading from {where(conn)}") from None
    except OSError as exc:
        conn.disconnect()
        raise RedisConnectionError(f"Error while reading from {where(conn)}: {exc.args}") from None
    except BaseException:
        conn.disconnect()
        raise
    if isinstance(reply, (ResponseError, RedisConnectionError)):
        raise reply  # an error reply (NOSCRIPT is a ResponseError), or LOADING and the like
    return reply


class Lane:
    """One thread's connection, for one client in one process.

    ``poller``: a poll object on the connection's socket, made once per socket, so the
    check before each call (:func:`_ready`) is one system call with nothing allocated.
    """

    __slots__ = ("__weakref__", "client", "conn", "fd", "pid", "poller")

    def __init__(self, client: Any, conn: Any, pid: int) -> None:
        self.client = client
        self.conn = conn
        self.pid = pid
        self.fd = -1
        self.poller: Any = None

    def __del__(self) -> None:
        # the thread ended (its locals go) or the lane was replaced: close the socket
        if self.pid == os.getpid():
            with suppress(Exception):
                self.conn.disconnect()


def _quiet(lane: Lane, sock: Any) -> bool:
    """True if ``sock`` (``lane``'s connected socket) has nothing to read: the usual case,
    told by one ``poll`` on a plain socket. A TLS socket (it may hold decrypted bytes
    above the kernel's), any socket that polls readable, and a process without
    ``select.poll`` (eventlet) are left to redis-py's own check, which tells a stray reply
    from a close."""
    # looked up at each call: eventlet's monkey patching takes select.poll away
    poll = getattr(select, "poll", None)
    if type(sock) is not socket.socket or poll is None:
        return False
    fd = sock.fileno()
    if lane.fd != fd or lane.poller is None:
        lane.poller = poll()
        lane.poller.register(fd, select.POLLIN)
        lane.fd = fd
    reader = getattr(lane.conn._parser, "_reader", None)
    return not lane.poller.poll(0) and reader is not None and not reader.has_data()


def _ready(lane: Lane) -> None:
    """Make ``lane``'s connection ready to send, as the pool makes its connections.

    connect() through the connection: a Sentinel connection asks the sentinels for the
    master there (send_packed_command would connect to the connection's default address
    instead), and the restart check runs. A connected one with something to read was closed
    by the server (CLIENT KILL, a timeout, a restart) or holds a stray reply: it is made
    anew before the call goes out, so a call that allows a single attempt does not spend it
    on a dead connection (a lost reply and its read-back).
    """
    conn = lane.conn
    sock = conn._sock
    if sock is not None:
        if _quiet(lane, sock):
            return
        try:
            if not conn.can_read():
                return
        except (RedisConnectionError, RedisTimeoutError, OSError):
            pass
        conn.disconnect()
    conn.connect()


class Lanes:
    """A store's lanes: one connection per thread that sends script calls."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._all: weakref.WeakSet[Lane] = weakref.WeakSet()
        self._lock = threading.Lock()

    def send(self, client: Any, call: Script | Command, once: bool) -> Any:
        """EVALSHA ``call`` (or a plain command without a response callback in redis-py,
        such as ``GET``) on this thread's connection of ``client``; its reply.

        ``once``: a single attempt (no resend after a connection error). Raises redis-py's
        errors, as ``client.execute_command`` would.
        """
        lane = self._lane(client)
        conn = lane.conn
        packed = pack(conn, words_of(call))
        resends = 0 if once else 1
        while True:
            try:
                _ready(lane)
                return _call(conn, packed)
            except NoScriptError:
                # Redis restarted or SCRIPT FLUSH ran: the script did not run
                assert isinstance(call, Script)  # only a script gets NOSCRIPT
                conn.send_command("SCRIPT", "LOAD", SOURCE[call.name], check_health=False)
                conn.read_response()
                conn.send_packed_command(packed, check_health=False)
                return conn.read_response()
            except ResponseError:
                raise  # an error reply: the connection is in step
            except RedisConnectionError:
                conn.disconnect()
                if resends == 0:
                    raise
                resends -= 1
            except BaseException:
                # a timeout, or an interrupt mid-call: the reply may still come on this
                # connection, so it must not be read by the next call
                conn.disconnect()
                raise

    def _lane(self, client: Any) -> Lane:
        lane: Lane | None = getattr(self._local, "lane", None)
        if lane is not None and lane.client is client and lane.pid == os.getpid():
            return lane
        pool = client.connection_pool
        conn = pool.connection_class(**pool.connection_kwargs)
        lane = self._local.lane = Lane(client, conn, os.getpid())
        with self._lock:
            self._all.add(lane)
        return lane

    def close(self) -> None:
        """Close every lane of this process (each thread makes a new one on its next call)."""
        with self._lock:
            lanes = list(self._all)
            self._all = weakref.WeakSet()
        pid = os.getpid()
        for lane in lanes:
            if lane.pid == pid:
                lane.conn.disconnect()
        self._local = threading.local()
