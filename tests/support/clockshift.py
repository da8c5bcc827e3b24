"""A private Redis server whose clock the test sets (tests/support/clockshift.c).

The shim is compiled with the system C compiler at first use (skips the test without one) and
preloaded into the server; :meth:`RedisClock.set` then freezes the server's wall clock (Redis
``TIME``, key expiry) at a chosen instant, until the next ``set``. Linux/glibc only.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Final

import pytest

from celery_leases._redis_server import RedisServer

SOURCE: Final = Path(__file__).with_name("clockshift.c")
#: digits written to the clock file (microseconds since the epoch, zero-padded)
_WIDTH: Final = 20

_built: dict[str, str] = {}


def shim() -> str:
    """The path of the compiled shim (built once per process)."""
    if "so" not in _built:
        cc = shutil.which("gcc") or shutil.which("cc")
        if cc is None:
            pytest.skip("no C compiler to build the clock shim")
        out = Path(tempfile.mkdtemp(prefix="clockshift-")) / "clockshift.so"
        subprocess.run(
            [cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(SOURCE)],
            check=True,
            capture_output=True,
        )
        _built["so"] = str(out)
    return _built["so"]


class RedisClock:
    """The wall clock of one server started with :func:`clocked_server`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text(" " * _WIDTH)  # no number yet: the real time

    def set(self, epoch: float) -> None:
        """Freeze the server's clock at ``epoch`` (seconds), until the next ``set``."""
        us = round(epoch * 1_000_000)
        with self.path.open("r+") as fh:  # in place: the shim keeps the file open
            fh.write(f"{us:0{_WIDTH}d}")


def clocked_server(
    make_redis_server: Callable[..., RedisServer], start: float
) -> tuple[RedisServer, RedisClock]:
    """A private server whose clock reads ``start`` (epoch seconds) until the test moves it."""
    clock = RedisClock(Path(tempfile.mkdtemp(prefix="clockshift-")) / "now")
    clock.set(start)
    env = {"LD_PRELOAD": shim(), "CLOCKSHIFT_FILE": str(clock.path)}
    return make_redis_server(env=env), clock


__all__ = ("RedisClock", "clocked_server", "shim")
