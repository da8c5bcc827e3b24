"""The task, fleet and cleanup benchmarks run at a tiny size, so they cannot rot.

No timing is asserted: only that each run ends well and writes results of the right shape,
its plot and its docs section. The claims the cleanup benchmark checks on exact command
counts (no SCAN, flat in the keyspace, linear in the leases) must hold at any size.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_leases._redis_server import find_server_binary

REPO = Path(__file__).resolve().parents[2]
CONTENDERS = ("cleanup_node", "cleanup_owner", "reconcile", "scan")


@pytest.fixture(autouse=True)
def _server_binary() -> None:
    if find_server_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("no redis-server binary: the benchmarks start private servers")
        pytest.skip("no redis-server binary: the benchmarks start private servers")


def run_bench(name: str, *args: str, timeout: float = 240.0) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_LEASES_")}
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    return proc.stdout


def svg_titles(path: Path) -> list[str]:
    """The bold panel headings of one of our SVG plots (it must be well-formed XML)."""
    root = ET.parse(path).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == f"{ns}svg"
    return [t.text or "" for t in root.iter(f"{ns}text") if t.get("font-weight") == "bold"]


def test_cleanup_bench_tiny(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    out = run_bench(
        "cleanup",
        "--leases", "1,10,100",
        "--keys", "100,1000",
        "--base-keys", "100",
        "--base-leases", "5",
        "--repeats", "1",
        "--out-dir", str(tmp_path),
        "--docs", str(docs),
    )  # fmt: skip

    data: dict[str, Any] = json.loads((tmp_path / "cleanup.json").read_text())
    assert sorted(data["leases"], key=int) == ["1", "10", "100"]
    assert sorted(data["keys"], key=int) == ["100", "1000"]
    for axis in ("leases", "keys"):
        for point in data[axis].values():
            for c in CONTENDERS:
                assert point[c]["ms"] > 0
                assert point[c]["commands"] > 0
            for c in CONTENDERS[:3]:
                assert point[c]["scan_calls"] == 0, (axis, c, point[c]["by_command"])
            assert point["scan"]["scan_calls"] >= 1
    # ours cost the same commands at both keyspace sizes; the set-up left no key behind
    small, large = data["keys"]["100"], data["keys"]["1000"]
    for c in CONTENDERS[:3]:
        assert small[c]["by_command"] == large[c]["by_command"]
    assert small["dbsize"] < large["dbsize"]
    assert len(data["targets"]) == 3
    assert all(t.endswith("PASS") for t in data["targets"]), data["targets"]
    assert "target: no SCAN or KEYS" in out
    section = docs.read_text()
    assert "## Cleanup and reconcile cost" in section
    assert "img/bench-cleanup.svg" in section
    titles = svg_titles(tmp_path / "bench-cleanup.svg")
    assert any("vs leases held" in t for t in titles)
    assert any("vs keyspace size" in t for t in titles)


@pytest.mark.worker
def test_fleet_bench_tiny(tmp_path: Path, leases_redis_url: str) -> None:
    docs = tmp_path / "benchmarks.md"
    out = run_bench(
        "fleet",
        "--tasks", "60",
        "--rounds", "2",
        "--warmup", "4",
        "--processes", "2",
        "--resources", "3",
        "--redis-url", leases_redis_url,
        "--out-dir", str(tmp_path),
        "--docs", str(docs),
    )  # fmt: skip

    runs = json.loads((tmp_path / "fleet.json").read_text())["runs"]
    assert list(runs) == ["single (given)"]
    run = runs["single (given)"]
    for kind in ("plain", "leased", "uncontended"):
        assert run[kind]["tasks"] == 60
        assert len(run[kind]["rates"]) == 2
        assert run[kind]["rate_median"] > 0
    assert run["plain"]["retries"] == 0
    assert run["uncontended"]["retries"] == 0  # nobody else wants its resources
    leased = run["leased"]
    assert 0 <= leased["retried_tasks"] <= leased["retries"]
    latency = leased["latency_ms"]
    assert latency["immediate"]["n"] + latency["retried"]["n"] == 60
    assert 0 <= latency["p50"] <= latency["p99"] <= latency["max"]
    assert len(run["round_ratios"]) == 2
    assert "leased/plain" in out
    # the run deleted every key it made on a Redis that is not its own
    client = redis.Redis.from_url(leases_redis_url)
    try:
        assert list(client.scan_iter(match=f"{{{run['key_prefix']}:*", count=1000)) == []
    finally:
        client.close()
    section = docs.read_text()
    assert "## Fleet run" in section
    assert "| cluster: run by scripts/bench --cluster |" in section
    titles = svg_titles(tmp_path / "bench-fleet.svg")
    assert any("plain vs leased" in t for t in titles)
    assert any("Acquire latency" in t for t in titles)


@pytest.mark.worker
def test_tasks_bench_tiny(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    out = run_bench(
        "tasks",
        "--pools", "solo",
        "--rounds", "1",
        "--tasks", "20",
        "--out-dir", str(tmp_path),
        "--docs", str(docs),
    )  # fmt: skip

    data: dict[str, Any] = json.loads((tmp_path / "tasks.json").read_text())
    assert data["config"]["private_server"] is True
    (solo,) = data["pools"]
    assert solo["pool"] == "solo"
    assert solo["plain_median"] > 0
    assert solo["leased_median"] > 0
    # a private server counts our commands only: the lease's two scripts and what they run
    assert solo["leased_evalsha_per_task_median"] >= 2
    assert solo["plain_evalsha_per_task_median"] < 1
    assert solo["lease_calls_per_task"] > 2
    assert solo["leased_by_command"]["evalsha"] >= 2
    for kind in ("plain", "leased"):
        assert solo[f"{kind}_calls_per_task_median"] > 0
        assert solo[f"{kind}_server_us_per_task_median"] > 0
    assert solo["leased_script_us_per_task_median"] > 0
    assert "lease's cmds" in out
    section = docs.read_text()
    assert "## Task throughput" in section
    assert "img/bench-tasks.svg" in section
    assert "scripts' us/task" in section
    heads = svg_titles(tmp_path / "bench-tasks.svg")
    assert any("plain vs leased" in t for t in heads)
    assert any("Redis commands per task" in t for t in heads)
    assert any("server time per task" in t for t in heads)


def test_memory_bench_tiny(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    out = run_bench(
        "memory", "--counts", "20", "200", "--out-dir", str(tmp_path), "--docs", str(docs)
    )
    data: dict[str, Any] = json.loads((tmp_path / "memory.json").read_text())
    res = data["results"]
    assert sorted(res) == sorted(["hold", "hold0", "redis-py", "prl"])
    # exact counts, whatever the timing: the counter key per resource with the default, none
    # without it (nor with redis-py's Lock), once every lease is released
    assert res["hold"]["200"]["keys_per_resource"] == 1.0
    assert res["hold0"]["200"]["keys_per_resource"] == 0.0
    assert res["redis-py"]["200"]["keys_per_resource"] == 0.0
    assert "bytes/resource at 200" in out
    assert "## Memory left behind" in docs.read_text()
    titles = svg_titles(tmp_path / "bench-memory.svg")
    assert any("memory left per distinct resource" in t for t in titles)


def test_server_cost_bench_tiny(tmp_path: Path) -> None:
    if shutil.which("valgrind") is None:
        pytest.skip("no valgrind: the server cost benchmark runs redis-server under callgrind")
    docs = tmp_path / "benchmarks.md"
    out = run_bench(
        "server_cost", "--cycles", "40", "--out-dir", str(tmp_path), "--docs", str(docs)
    )
    data: dict[str, Any] = json.loads((tmp_path / "server_cost.json").read_text())
    per_cycle = data["instructions_per_cycle"]
    assert sorted(per_cycle) == sorted(
        ["floor", "shipped", "calls", "no_grace", "no_counter", "no_registry", "no_home",
         "no_queue", "no_publish"]
    )  # fmt: skip
    # at this size only the large differences are sure (the Lua GC steps every 50 scripts):
    # the calls alone cost more than the floor's whole cycle, the scripts' work more again
    assert per_cycle["floor"] < per_cycle["calls"] < per_cycle["shipped"]
    assert "hold(): acquire.lua + release.lua" in out
    assert "## Server work of a hold() cycle" in docs.read_text()


def test_limits_bench_quick(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    out = run_bench(
        "limits", "--quick", "--callers", "4", "--out-dir", str(tmp_path), "--docs", str(docs)
    )
    assert "most admitted in any window" in out
    assert "<= N: PASS" in out  # the window guarantee is exact: never a MISS
    section = docs.read_text()
    assert section.startswith("# Benchmarks\n") or "## Rate limits" in section
    assert "share of N used per period" in (tmp_path / "limits.md").read_text()
