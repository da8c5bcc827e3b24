"""``on_lost="interrupt"``: ``LeaseLost`` raised inside the running task body, as Celery raises
``SoftTimeLimitExceeded``: by a signal in the main thread, in the greenlet under gevent or
eventlet, else at the next checkpoint.
"""

from __future__ import annotations

import ctypes
import importlib
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, ClassVar

from ._lease import Held
from .exceptions import LeaseLost

try:
    # signal.signal converts both handlers to and from enums: 10 us a call, measured, and
    # every leased task in a main thread sets and restores one; the C function takes 0.4 us
    # (it knows the default action by its own SIG_DFL object only, not the enum)
    from _signal import SIG_DFL as _DEFAULT_ACTION  # type: ignore[import-not-found]
    from _signal import signal as _set_handler
except ImportError:  # pragma: no cover - an interpreter without CPython's _signal
    _set_handler, _DEFAULT_ACTION = signal.signal, signal.SIG_DFL


class _GreenTarget:
    """The greenlet running a task body under the gevent or eventlet pool.

    An exception is thrown into it from the hub, as both libraries' own ``Timeout`` (and so
    Celery's soft time limit there) do: a throw from the heartbeat's greenlet would switch
    into the body and never come back to the heartbeat.
    """

    __slots__ = ("glet", "schedule")

    def __init__(self, glet: Any, schedule: Callable[[Callable[[], None]], Any]) -> None:
        self.glet = glet
        self.schedule = schedule

    def throw_later(self, pick: Callable[[], BaseException | None]) -> None:
        """In the hub, soon: throw what ``pick()`` returns into the greenlet (if anything)."""
        glet = self.glet

        def throw() -> None:
            exc = pick()
            if exc is not None and not glet.dead:
                glet.throw(exc)

        self.schedule(throw)


def _green_target() -> _GreenTarget | None:
    """The calling greenlet, if this process runs on a monkey-patched gevent or eventlet."""
    # imported by name: neither library is a dependency, and neither ships type hints
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("threading"):
        gevent: Any = importlib.import_module("gevent")
        return _GreenTarget(gevent.getcurrent(), gevent.get_hub().loop.run_callback)
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None and patcher.is_monkey_patched("thread"):
        hubs: Any = importlib.import_module("eventlet.hubs")
        greenlet: Any = importlib.import_module("greenlet")
        hub = hubs.get_hub()
        return _GreenTarget(greenlet.getcurrent(), lambda fn: hub.schedule_call_global(0, fn))
    return None


class Interrupter:
    """Raises LeaseLost inside the thread running a task body, once, only while it runs.

    In the main thread (prefork child, solo) a signal interrupts even a blocking call, as
    Celery's soft time limit does; in another thread (threads pool) an asynchronous exception
    arrives at the next bytecode. Timeline it guards: t0 heartbeat decides the lease is lost;
    t1 the body returns; t2 the finalizer runs — the exception must not land in the finalizer,
    so it is only raised while ``running`` and a pending one is cancelled at t1.
    """

    SIGNAL: ClassVar[int] = signal.SIGUSR2

    def __init__(self) -> None:
        self.thread_id = threading.get_ident()
        # gevent/eventlet pools: the body runs in a greenlet, not in a thread of its own
        self.green = _green_target()
        self.main = self.green is None and threading.current_thread() is threading.main_thread()
        self.running = False
        self.fired: LeaseLost | None = None
        self._lock = threading.Lock()
        self._old_handler: Any = None

    def __enter__(self) -> Interrupter:
        if self.main:
            self._old_handler = _set_handler(self.SIGNAL, self._on_signal)
        with self._lock:
            self.running = True
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.running = False
            if self.fired is not None and not self.main and self.green is None:
                # cancel an asynchronous exception that did not land yet
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), None)
        if self.main and self.fired is None:
            old = self._old_handler
            _set_handler(self.SIGNAL, _DEFAULT_ACTION if old is None else old)
        # After a fired interrupt our handler stays, inert (running is False): restoring the
        # default action could let a signal still in flight terminate the process.

    def _throw_green(self) -> Any:
        """The exception to throw into the body's greenlet now, or None (it has finished).

        Runs in the hub, which the body's greenlet is suspended in: the body cannot move
        between this check and the throw (no lock: the hub must never block).
        """
        fired, running = self.fired, self.running
        return fired if running and fired is not None else None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # No lock here: the handler runs in the main thread, which may hold it in __exit__.
        fired, running = self.fired, self.running
        if running and fired is not None:
            raise fired

    def __call__(self, held: Held) -> None:
        with self._lock:
            if not self.running or self.fired is not None:
                return
            self.fired = held.lost_error(time.monotonic())  # LeaseRevoked once revoked
            if self.green is not None:
                self.green.throw_later(self._throw_green)
            elif self.main:
                signal.pthread_kill(self.thread_id, self.SIGNAL)
            else:
                # an asynchronous exception is instantiated without arguments: give it a
                # class that knows its details
                fired = self.fired
                base = type(fired)
                detailed = type(
                    base.__name__,
                    (base,),
                    {
                        "__init__": lambda exc: base.__init__(exc, *fired.args),
                        "__module__": base.__module__,
                    },
                )
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self.thread_id), ctypes.py_object(detailed)
                )
