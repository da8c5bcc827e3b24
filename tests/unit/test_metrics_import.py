"""celery_leases.metrics without prometheus_client: importing works, install() says what to do."""

from __future__ import annotations

import importlib
import sys

import pytest

import celery_leases


def test_metrics_imports_without_prometheus_client_and_install_names_the_extra(monkeypatch):
    # None in sys.modules makes `import prometheus_client` raise ImportError, as if absent
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    # a fresh import; both the module and the package attribute are put back afterwards
    monkeypatch.delitem(sys.modules, "celery_leases.metrics", raising=False)
    monkeypatch.delattr(celery_leases, "metrics", raising=False)
    metrics = importlib.import_module("celery_leases.metrics")
    with pytest.raises(ImportError, match=r"pip install celery-leases\[metrics\]") as info:
        metrics.install()
    assert info.value.name == "prometheus_client"
    assert isinstance(info.value.__cause__, ImportError)


def test_importing_metrics_connects_nothing(monkeypatch):
    from celery_leases import _renewround, signals, worker

    # a fresh import; both the module and the package attribute are put back afterwards
    monkeypatch.delitem(sys.modules, "celery_leases.metrics", raising=False)
    monkeypatch.delattr(celery_leases, "metrics", raising=False)
    before = [len(getattr(signals, name).receivers) for name in signals.__all__]
    importlib.import_module("celery_leases.metrics")
    assert [len(getattr(signals, name).receivers) for name in signals.__all__] == before
    assert _renewround.renew_observers == []
    assert worker.cleanup_observers == []
