"""bench/plot.py draws every figure from the results it finds, and skips what it cannot read.

No benchmark runs here: the results are written by hand, in the shapes the benchmarks write
(tasks.json) or may write (part (d) of engine.json, an asyncio contender in part (a)).
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from bench import plot

NS = "{http://www.w3.org/2000/svg}"


def texts(svg: str) -> list[str]:
    root = ET.fromstring(svg)  # well-formed, or this raises
    assert root.tag == f"{NS}svg"
    return [t.text or "" for t in root.iter(f"{NS}text")]


def titles(svg: str) -> list[str]:
    root = ET.fromstring(svg)
    return [t.text or "" for t in root.iter(f"{NS}text") if t.get("font-weight") == "bold"]


def pool(name: str, concurrency: int, plain: float, leased: float) -> dict[str, Any]:
    return {
        "pool": name,
        "concurrency": concurrency,
        "plain_median": plain,
        "leased_median": leased,
        "plain_calls_per_task_median": 14.5,
        "leased_calls_per_task_median": 30.5,
        "leased_evalsha_per_task_median": 2.0,
        "plain_server_us_per_task_median": 300.0,
        "leased_server_us_per_task_median": 520.0,
        "leased_script_us_per_task_median": 150.0,
    }


def write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data))


def test_tasks_svg_has_throughput_commands_and_server_time(tmp_path: Path) -> None:
    write(
        tmp_path / "tasks.json",
        {
            "machine": {"date": "2026-12-01 15:00 UTC", "cpus": 2},
            "config": {"rounds": 2, "tasks": 300, "quick": True},
            "target": 0.9,
            "pools": [pool("solo", 1, 900.0, 640.0), pool("prefork", 2, 1000.0, 880.0)],
        },
    )
    assert plot.write_plots(tmp_path, tmp_path) == [tmp_path / plot.TASKS_SVG]
    svg = (tmp_path / plot.TASKS_SVG).read_text()
    heads = titles(svg)
    assert any("plain vs leased tasks per second" in t for t in heads)
    assert any("Redis commands per task" in t for t in heads)
    assert any("server time per task" in t for t in heads)
    words = texts(svg)
    assert "lease adds 16.0 cmds" in words  # leased minus plain, per pool
    assert "lease adds 220 us" in words
    assert "leased 520 us (150 scripts)" in words
    assert "leased/plain 0.71: MISS" in words
    assert "leased/plain 0.88: MISS" in words


def test_a_cost_target_is_drawn_as_the_lease_against_one_hold_cycle(tmp_path: Path) -> None:
    # solo's target: the lease's own time a task (1000/640 - 1000/900 = 0.45 ms) against one
    # hold() cycle of the same run (0.30 ms); prefork keeps its leased/plain ratio
    solo = {
        **pool("solo", 1, 900.0, 640.0),
        "target_kind": "cost",
        "lease_ms": 1000 / 640 - 1000 / 900,
        "hold_cycle_ms_median": 0.30,
        "pass": False,
    }
    prefork = {**pool("prefork", 2, 1000.0, 950.0), "target_kind": "ratio", "pass": True}
    write(tmp_path / "tasks.json", {"target": 0.9, "pools": [solo, prefork]})
    words = texts(plot.render_tasks(tmp_path) or "")
    assert "lease +0.45 ms = 1.50x hold(): MISS" in words
    assert "leased/plain 0.95: PASS" in words
    assert not any(w.startswith("leased/plain 0.71") for w in words)


def test_tasks_svg_without_counts_draws_throughput_only(tmp_path: Path) -> None:
    # a run against --redis-url: no counts (null), and an old tasks.md: its first table only
    entry = pool("solo", 1, 900.0, 850.0)
    for key in list(entry):
        if key.endswith("_per_task_median"):
            entry[key] = None
    write(tmp_path / "tasks.json", {"target": 0.9, "pools": [entry]})
    heads = titles(plot.render_tasks(tmp_path) or "")
    assert any("tasks per second" in t for t in heads)
    assert not any("Redis" in t for t in heads)

    (tmp_path / "tasks.json").unlink()
    (tmp_path / "tasks.md").write_text(
        "# Task throughput results\n\n- run: 2026-11-29 14:54 UTC\n\n"
        "| pool | plain tasks/s | leased tasks/s | leased/plain |\n|---|---|---|---|\n"
        "| solo (-c 1) | 915 | 644 | 0.70 |\n\n"
        "| pool | Redis cmds/task plain | leased |\n|---|---|---|\n| solo (-c 1) | 14.1 | 30.2 |\n"
    )
    pools, target, date = plot.load_tasks(tmp_path)
    assert [(p["label"], p["plain"], p["leased"]) for p in pools] == [("solo (-c 1)", 915, 644)]
    assert (target, date) == (0.9, "2026-11-29 14:54 UTC")


def cycles(median: float) -> dict[str, Any]:
    return {"median": median, "rates": [median * 0.9, median], "round_trips_per_cycle": 2.0}


def engine(a: dict[str, Any], d: object = None) -> dict[str, Any]:
    results: dict[str, Any] = {"a": a}
    if d is not None:
        results["d"] = d
    return {"machine": {"date": "2026-12-01 15:00 UTC"}, "results": results}


def test_an_asyncio_contender_is_compared_with_the_asyncio_floor(tmp_path: Path) -> None:
    a = {"hold": cycles(3000), "floor": cycles(4000), "ahold": cycles(1500),
         "afloor": cycles(2000), "amystery": cycles(100)}  # fmt: skip
    write(tmp_path / "engine.json", engine(a))
    words = texts(plot.render(tmp_path))
    assert "celery_leases ahold()" in words
    assert "asyncio raw floor" in words
    assert "amystery" in words  # an unknown contender is drawn under its key
    assert "3,000/s \u00b7 0.75x floor \u00b7 2 RT" in words
    assert "1,500/s \u00b7 0.75x afloor \u00b7 2 RT" in words
    assert plot.cycle_baseline("ahold", a) == "afloor"
    assert plot.cycle_baseline("hold", a) == "floor"
    assert plot.cycle_baseline("afloor", a) is None
    assert plot.cycle_baseline("ahold", {**a, "ahold": {**a["ahold"], "baseline": "floor"}}) == (
        "floor"
    )


def test_the_asyncio_part_of_a_is_drawn_beside_the_sync_one(tmp_path: Path) -> None:
    # the shape of engine.json with the asyncio rows: a part "a-asyncio" of its own
    asyncio_part = {"ahold": cycles(1800), "afloor": cycles(2000), "aredis-py": cycles(1900)}
    data = engine({"hold": cycles(3000), "floor": cycles(4000)})
    data["results"]["a-asyncio"] = asyncio_part
    write(tmp_path / "engine.json", data)
    words = texts(plot.render(tmp_path))
    assert "1,800/s \u00b7 0.90x afloor \u00b7 2 RT" in words
    assert "1,900/s \u00b7 0.95x afloor \u00b7 2 RT" in words
    assert "redis.asyncio Lock" in words
    assert "3,000/s \u00b7 0.75x floor \u00b7 2 RT" in words


POINT_1 = {"commands_per_release": 5, "median_ms": 1.2, "p99_ms": 2.0}
POINT_10 = {"commands_per_release": 5, "median_ms": 1.6, "p99_ms": 3.0}


@pytest.mark.parametrize(
    "d",
    [
        {"1": POINT_1, "10": POINT_10},
        {"hold": {"1": POINT_1, "10": POINT_10}},
        [{"waiters": 10, **POINT_10}, {"waiters": 1, **POINT_1}],
        {"points": [{"n": 1, "contender": "hold", **POINT_1}, {"n": 10, **POINT_10}]},
        {
            "1": {"handoff": {"median_ms": 1.2}, "calls_per_release": 5},
            "10": {"handoff": {"median_ms": 1.6}, "calls_per_release": 5},
        },
        {  # the shape bench_waiters writes (its JSON keys are strings)
            "1": {
                "calls_per_release": 5.0,
                "usec_per_release": 40.0,
                "first_handoff_ms": 1.0,
                "median_ms": 1.2,
                "p99_ms": 2.0,
                "overtaken": 0,
                "handoffs": 3,
            },
            "10": {
                "calls_per_release": 5.0,
                "usec_per_release": 44.0,
                "first_handoff_ms": 1.1,
                "median_ms": 1.6,
                "p99_ms": 3.0,
                "overtaken": 0,
                "handoffs": 30,
                "pass": True,
            },
        },
    ],
)
def test_part_d_is_read_in_each_shape_it_may_come_in(tmp_path: Path, d: object) -> None:
    series = plot.waiter_series(d)
    assert list(series) == ["hold"]
    assert [n for n, _ in series["hold"]] == [1.0, 10.0]
    write(tmp_path / "engine.json", engine({"floor": cycles(4000)}, d))
    svg = plot.render(tmp_path)
    assert any("Commands per release vs waiters" in t for t in titles(svg))
    assert any("Handoff delay vs waiters" in t for t in titles(svg))
    assert "5.00 cmds" in texts(svg)
    assert "1.60 ms" in texts(svg)


@pytest.mark.parametrize("d", ["no", 3, [], {}, {"1": 5}, {"hold": {"x": {}}}, [{"nope": 1}]])
def test_part_d_of_another_shape_is_left_out(tmp_path: Path, d: object) -> None:
    assert plot.waiter_series(d) == {}
    write(tmp_path / "engine.json", engine({"floor": cycles(4000)}, d))
    assert not any("waiters" in t for t in titles(plot.render(tmp_path)))


def test_part_d_server_time_is_drawn_when_it_was_measured(tmp_path: Path) -> None:
    d = {"1": {**POINT_1, "usec_per_release": 40.0}, "10": {**POINT_10, "usec_per_release": 44.0}}
    write(tmp_path / "engine.json", engine({"floor": cycles(4000)}, d))
    svg = plot.render(tmp_path)
    assert any("Server time per release vs waiters" in t for t in titles(svg))
    assert "44.0 us" in texts(svg)
    write(tmp_path / "engine.json", engine({"floor": cycles(4000)}, {"1": POINT_1}))
    assert not any("Server time per release" in t for t in titles(plot.render(tmp_path)))
