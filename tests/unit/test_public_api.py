"""The package root: a sorted ``__all__`` that is exactly its public names; imports are inert."""

from __future__ import annotations
import __future__

import subprocess
import sys
import textwrap
import types

import celery_leases


def public_names() -> set[str]:
    """Names a user can import from the package root, less submodules and __future__ flags."""
    return {
        name
        for name, value in vars(celery_leases).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and not isinstance(value, __future__._Feature)
    }


def test_all_is_a_tuple_sorted_case_insensitively():
    assert isinstance(celery_leases.__all__, tuple)
    assert list(celery_leases.__all__) == sorted(celery_leases.__all__, key=str.lower)
    assert len(set(celery_leases.__all__)) == len(celery_leases.__all__)


def test_all_equals_the_public_names():
    assert set(celery_leases.__all__) == public_names()


def test_every_name_in_all_resolves():
    for name in celery_leases.__all__:
        assert getattr(celery_leases, name) is not None


def test_documented_names_are_exported():
    # the names DESIGN.md's public interface imports from the package root
    for name in ("Leases", "Shared", "LeaseError", "LeaseBusy", "LeaseLost", "Lease"):
        assert name in celery_leases.__all__


def test_version_is_a_string():
    assert isinstance(celery_leases.__version__, str)
    assert celery_leases.__version__


def test_importing_every_module_starts_no_thread_and_touches_no_socket():
    code = textwrap.dedent(
        """
        import importlib, pkgutil, socket, sys, threading

        def refuse(*args, **kwargs):
            raise AssertionError("a socket was opened at import time")

        socket.socket.connect = refuse
        socket.create_connection = refuse
        before = {t.ident for t in threading.enumerate()}
        import celery_leases
        names = [m.name for m in pkgutil.walk_packages(celery_leases.__path__, "celery_leases.")]
        for name in names:
            importlib.import_module(name)
        after = [t.name for t in threading.enumerate() if t.ident not in before]
        assert not after, f"threads started at import: {after}"
        print(len(names))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) >= 5  # the walk really imported the modules
