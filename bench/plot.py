"""Plot the benchmark results as self-contained SVGs (no plotting library needed).

    python -m bench.plot                       # bench/results/*.json -> docs/img/*.svg
    python -m bench.plot --results DIR --out-dir DIR

``benchmarks.svg`` comes from ``engine.json`` (parts a to d, whichever were run). Panels:

1. (a) acquire+release cycles/s per contender, ratio to its floor, the floor target (0.95x);
   the contenders of ``"a"`` and of any ``"a-..."`` part (``"a-asyncio"``): an asyncio one
   (``ahold``, ``aredis-py``) is compared with the asyncio floor (``afloor``), and a contender
   this module does not know is drawn too, under its key;
2. (b) median handoff delay with a p99 whisker, on a log scale (redis-py's Lock polls);
3. (c) heartbeat calls/s against the number of leases held, with the +-10% band;
4. (d) when present: commands and server time per release and the handoff delay against the
   number of waiters, log-log, per contender; :func:`waiter_series` lists the shapes it reads.

``bench-tasks.svg`` comes from ``tasks.json`` (failing that, the first table of ``tasks.md``):
plain against leased tasks/s per worker pool, and the Redis commands and server time per task,
plain against leased, with the lease's script calls and their time marked.

``bench-fleet.svg`` comes from ``fleet.json``: plain against leased tasks/s per lease Redis
(single, cluster), and the acquire latency p50 with a p99 whisker (all tasks, those granted at
once, those that retried), on a log scale.

``bench-memory.svg`` comes from ``memory.json``: the bytes Redis keeps per distinct resource
after its release, per contender, at the largest number of resources measured, with what 10
million distinct resources a day would keep.

``bench-cleanup.svg`` comes from ``cleanup.json``: the time of the start-up cleanup,
``cleanup_owner``, ``reconcile`` and the SCAN baseline against the leases held and against the
keyspace size, and their server time against the keyspace size; log-log.

Every benchmark calls :func:`refresh` at the end of a run; a failure there prints a warning
and never fails the benchmark. A plot whose results are missing is left as it is.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any, Final

REPO: Final = Path(__file__).resolve().parents[1]
RESULTS_DIR: Final = REPO / "bench" / "results"
IMG_DIR: Final = REPO / "docs" / "img"
SVG_PATH: Final = IMG_DIR / "benchmarks.svg"
TASKS_SVG: Final = "bench-tasks.svg"
FLEET_SVG: Final = "bench-fleet.svg"
CLEANUP_SVG: Final = "bench-cleanup.svg"
MEMORY_SVG: Final = "bench-memory.svg"

WIDTH: Final = 900
MARGIN: Final = 24
LABEL_W: Final = 250  # left column of bar labels
VALUE_W: Final = 230  # right column of values
FONT: Final = "DejaVu Sans, Verdana, Helvetica, Arial, sans-serif"
INK: Final = "#1f2937"
MUTED: Final = "#6b7280"
GRID: Final = "#e5e7eb"
OURS: Final = "#2563eb"
OTHER: Final = "#9ca3af"
UNCONTENDED: Final = "#93c5fd"
FLOOR: Final = "#4b5563"
TARGET_INK: Final = "#dc2626"
PASS_INK: Final = "#15803d"
#: line colours and dashes of the cleanup contenders (ours solid, the baseline dashed red)
SERIES_STYLE: Final = {
    "cleanup_node": (OURS, ""),
    "cleanup_owner": ("#0891b2", "2 3"),
    "reconcile": ("#7c3aed", "8 3"),
    "scan": (TARGET_INK, "6 4"),
}

CONTENDERS_A: Final = (
    ("hold", "celery_leases hold()"),
    ("hold-history", "hold(), history on"),
    ("floor", "raw floor (SET NX PX + CAD)"),
    ("bare", "two bare round trips"),
    ("hold-calls", "hold()'s calls, sent bare"),
    ("redis-py", "redis-py Lock"),
    ("prl", "python-redis-lock"),
    ("ahold", "celery_leases ahold()"),
    ("afloor", "asyncio raw floor"),
    ("aredis-py", "redis.asyncio Lock"),
)
#: the names an asyncio floor of part (a) may have in engine.json; the first one present is
#: the baseline of every asyncio contender (a key that starts with "a" + a sync key, or has
#: "async" in it) unless the contender names its own with a "baseline" field
ASYNC_FLOORS: Final = ("afloor", "async-floor", "asyncio-floor", "floor-async", "async_floor")
#: our contenders: drawn in our colour, and held to a fraction of their floor (the target)
OURS_A: Final = ("hold", "ahold", "async-hold", "hold-async", "async_hold")
CONTENDERS_B: Final = (
    ("hold", "celery_leases hold(wait=10)"),
    ("prl", "python-redis-lock (BLPOP)"),
    ("redis-py", "redis-py Lock (poll 0.1 s)"),
)


# --- SVG building -------------------------------------------------------------------------------
@dataclass
class Canvas:
    """SVG elements of one panel, drawn from y=0; placed later with a translate."""

    height: float = 0.0
    parts: list[str] = field(default_factory=list)

    def text(
        self,
        x: float,
        y: float,
        s: str,
        size: float = 13,
        anchor: str = "start",
        fill: str = INK,
        weight: str = "normal",
    ) -> None:
        bold = ' font-weight="bold"' if weight != "normal" else ""
        self.parts.append(
            f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{fill}"{bold}>{escape(s)}</text>'
        )

    def rect(self, x: float, y: float, w: float, h: float, fill: str, extra: str = "") -> None:
        self.parts.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{h:.1f}" '
            f'fill="{fill}"{extra}/>'
        )

    def line(
        self,
        x1: float,
        y1: float,
        x2: float,
        y2: float,
        stroke: str = INK,
        width: float = 1,
        dash: str = "",
    ) -> None:
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        self.parts.append(
            f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
            f'stroke="{stroke}" stroke-width="{width}"{dashed}/>'
        )

    def title(self, heading: str, *subs: str) -> float:
        self.text(MARGIN, 22, heading, size=16, weight="bold")
        for k, sub in enumerate(subs):
            self.text(MARGIN, 42 + 17 * k, sub, size=12, fill=MUTED)
        return 42 + 17 * len(subs)


#: the height of a bar of a one-bar-per-row panel, and the gap between rows
BAR_H: Final = 24
BAR_GAP: Final = 14


def bar_axis(
    c: Canvas, y: float, x0: float, x1: float, top: float, rows: int, unit: str = ""
) -> tuple[float, float, float]:
    """The value axis of a one-bar-per-row panel from ``x0`` to ``x1`` under ``y``: its grid
    lines and tick labels (``unit`` after each), for values up to ``top``.

    Returns ``(scale, plot_top, plot_bottom)``: pixels per unit of value, and where the rows
    begin and end (``rows`` bars of :data:`BAR_H` with :data:`BAR_GAP` between them).
    """
    ticks = nice_ticks(top)
    scale = (x1 - x0) / ticks[-1]
    plot_top = y + 8
    plot_bottom = plot_top + rows * (BAR_H + BAR_GAP) - BAR_GAP + 8
    for t in ticks:
        x = x0 + t * scale
        c.line(x, plot_top - 4, x, plot_bottom, GRID)
        c.text(x, plot_bottom + 16, f"{fmt_tick(t)}{unit}", size=11, anchor="middle", fill=MUTED)
    return scale, plot_top, plot_bottom


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least ``top``."""
    raw = top / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [step * i for i in range(math.ceil(top / step) + 1)]


def fmt(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def fmt_ms(value: float) -> str:
    return f"{value:.0f} ms" if value >= 10 else f"{value:.2f} ms"


def fmt_tick(value: float) -> str:
    return f"{value:,.0f}" if value == int(value) else f"{value:g}"


# --- panels -------------------------------------------------------------------------------------
def cycle_items(a: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """Part (a)'s contenders: the known ones in their order, then any other, by key."""
    known = dict(CONTENDERS_A)
    known.update(dict.fromkeys(ASYNC_FLOORS[1:], known["afloor"]))
    order = [k for k, _ in CONTENDERS_A] + [k for k in sorted(a) if k not in known]
    order[order.index("afloor") : order.index("afloor") + 1] = list(ASYNC_FLOORS)
    return [
        (key, known.get(key, key), a[key])
        for key in order
        if isinstance(a.get(key), dict) and a[key].get("median")
    ]


def cycle_baseline(key: str, a: dict[str, Any]) -> str | None:
    """The key of the floor a part (a) contender is compared with, when it is there."""
    named = a.get(key, {}).get("baseline")
    if isinstance(named, str) and named in a:
        return named
    if key == "floor" or key in ASYNC_FLOORS:
        return None
    sync_keys = {k for k, _ in CONTENDERS_A if not k.startswith("a")}
    is_async = "async" in key or (key.startswith("a") and key[1:] in sync_keys)
    if is_async:
        return next((f for f in ASYNC_FLOORS if f in a), None)
    return "floor" if "floor" in a else None


#: the floor targets of part (a) when engine.json does not record them (older runs)
CYCLE_TARGETS: Final = {"cycle": 0.95, "acycle": 0.95}


def panel_cycles(a: dict[str, Any], targets: dict[str, float] | None = None) -> Canvas | None:
    aims = {**CYCLE_TARGETS, **(targets or {})}
    items = cycle_items(a)
    if not items:
        return None
    c = Canvas()
    sub = "one thread, uncontended; bar = median of rounds, thin line = slowest to fastest round"
    subs = [sub]
    if any(key in ASYNC_FLOORS for key, _, _ in items):
        subs.append(
            "asyncio contenders against the asyncio floor; "
            f"red dashes = {aims['acycle']:g}x the floor"
        )
    y = c.title("(a) Acquire + release cycles per second (higher is better)", *subs)
    x0, x1 = MARGIN + LABEL_W, WIDTH - MARGIN - VALUE_W
    top = max(max(d.get("rates") or [d["median"]]) for _, _, d in items)
    bar_h, gap = BAR_H, BAR_GAP
    scale, plot_top, plot_bottom = bar_axis(c, y, x0, x1, top, len(items))
    for i, (key, label, d) in enumerate(items):
        by = plot_top + 4 + i * (bar_h + gap)
        is_floor = key == "floor" or key in ASYNC_FLOORS
        colour = OURS if key in OURS_A else FLOOR if is_floor else OTHER
        c.text(x0 - 10, by + bar_h / 2 + 5, label, size=13, anchor="end")
        c.rect(x0, by, d["median"] * scale, bar_h, colour)
        rates = d.get("rates") or []
        if len(rates) > 1:
            mid = by + bar_h / 2
            lo, hi = x0 + min(rates) * scale, x0 + max(rates) * scale
            c.line(lo, mid, hi, mid, INK, 1.5)
            c.line(lo, mid - 5, lo, mid + 5, INK, 1.5)
            c.line(hi, mid - 5, hi, mid + 5, INK, 1.5)
        base_key = cycle_baseline(key, a)
        base = a[base_key]["median"] if base_key else None
        ratio = ""
        if base:
            name = "floor" if base_key == "floor" else "afloor"
            ratio = f" \u00b7 {d['median'] / base:.2f}x {name}"
        if base and base_key != "floor" and key in OURS_A:  # the asyncio floor's target, here
            tx = x0 + aims["acycle"] * base * scale
            c.line(tx, by - 3, tx, by + bar_h + 3, TARGET_INK, 2, "4 3")
        rt = d.get("round_trips_per_cycle")
        rts = f" \u00b7 {rt:.0f} RT" if rt else ""
        c.text(x1 + 16, by + bar_h / 2 + 5, f"{d['median']:,.0f}/s{ratio}{rts}", size=12)
    floor = a.get("floor", {}).get("median")
    if floor:
        tx = x0 + aims["cycle"] * floor * scale
        c.line(tx, plot_top - 6, tx, plot_bottom, TARGET_INK, 2, "6 4")
        verdict = ""
        if "hold" in a and "pass" in a["hold"]:
            verdict = ": PASS" if a["hold"]["pass"] else ": MISS"
        aim = f"target {aims['cycle']:g}x floor{verdict}"
        c.text(tx, plot_bottom + 32, aim, 12, "middle", TARGET_INK)
    c.text((x0 + x1) / 2, plot_bottom + 50, "cycles/s", size=12, anchor="middle", fill=MUTED)
    c.height = plot_bottom + 62
    return c


def panel_handoff(b: dict[str, Any]) -> Canvas | None:
    items = [(key, label, b[key]) for key, label in CONTENDERS_B if key in b]
    if not items:
        return None
    c = Canvas()
    sub = "holder in another process releases, waiter here takes over; log scale; whisker = p99"
    y = c.title("(b) Handoff delay, median ms (lower is better)", sub)
    x0, x1 = MARGIN + LABEL_W, WIDTH - MARGIN - VALUE_W
    values = [v for _, _, d in items for v in (d["median_ms"], d["p99_ms"]) if v > 0]
    lo = 10 ** math.floor(math.log10(min(values)))
    hi = 10 ** math.ceil(math.log10(max(values)))
    xs = log_scale(lo, hi, x0, x1)

    bar_h, gap = 24, 14
    plot_top = y + 8
    plot_bottom = plot_top + len(items) * (bar_h + gap) - gap + 8
    for decade in decades(lo, hi):
        x = xs(decade)
        c.line(x, plot_top - 4, x, plot_bottom, GRID)
        c.text(x, plot_bottom + 16, fmt_tick(decade) + " ms", size=11, anchor="middle", fill=MUTED)
        for k in range(2, 10):
            if decade * k < hi:
                xm = xs(decade * k)
                c.line(xm, plot_bottom - 4, xm, plot_bottom, GRID)
    base = b.get("prl", {}).get("median_ms")
    for i, (key, label, d) in enumerate(items):
        by = plot_top + 4 + i * (bar_h + gap)
        mid = by + bar_h / 2
        colour = OURS if key == "hold" else OTHER
        c.text(x0 - 10, mid + 5, label, size=13, anchor="end")
        c.rect(x0, by, xs(d["median_ms"]) - x0, bar_h, colour)
        xm, xp = xs(d["median_ms"]), xs(d["p99_ms"])
        c.line(xm, mid, xp, mid, INK, 1.5)
        c.line(xp, mid - 6, xp, mid + 6, INK, 1.5)
        ratio = f" \u00b7 {d['median_ms'] / base:.2f}x prl" if base else ""
        note = f"{fmt_ms(d['median_ms'])} \u00b7 p99 {fmt_ms(d['p99_ms'])}{ratio}"
        c.text(x1 + 16, mid + 5, note, size=12)
    c.height = plot_bottom + 30
    return c


def panel_heartbeat(cdata: dict[str, Any], private: bool) -> Canvas | None:
    if not cdata:
        return None
    counts = sorted(cdata, key=int)
    key = "calls_per_s" if private else "writes_per_s"
    rates = [cdata[n].get(key, cdata[n].get("calls_per_s", 0.0)) for n in counts]
    expected = cdata[counts[0]].get("expected_per_s") or rates[0]
    base = rates[0]
    c = Canvas()
    what = "EVALSHA calls the server saw" if private else "heartbeat socket writes"
    sub = f"{what}, per second; grey label = server time of one renewal call"
    sub2 = (
        f"dashed = 1 call per renew interval ({expected:.2f}/s); "
        "shaded = \u00b110% of the 1-lease rate (the target band)"
    )
    y = c.title("(c) Heartbeat calls per second vs leases held (flat is the goal)", sub, sub2)
    x0, x1 = MARGIN + 70, WIDTH - MARGIN - 60
    plot_top, plot_bottom = y + 14, y + 214
    top = max(max(rates), expected) * 1.5
    ticks = nice_ticks(top, 4)
    yscale = (plot_bottom - plot_top) / ticks[-1]

    def ys(v: float) -> float:
        return plot_bottom - v * yscale

    for t in ticks:
        c.line(x0, ys(t), x1, ys(t), GRID)
        c.text(x0 - 8, ys(t) + 4, fmt_tick(t), size=11, anchor="end", fill=MUTED)
    c.rect(x0, ys(base * 1.1), x1 - x0, ys(base * 0.9) - ys(base * 1.1), "#dcfce7")
    c.line(x0, ys(expected), x1, ys(expected), PASS_INK, 1.5, "6 4")
    step = (x1 - x0) / max(len(counts), 1)
    pts = [(x0 + step * (i + 0.5), ys(r)) for i, r in enumerate(rates)]
    path = " ".join(f"{'M' if i == 0 else 'L'}{px:.1f},{py:.1f}" for i, (px, py) in enumerate(pts))
    c.parts.append(f'<path d="{path}" fill="none" stroke="{OURS}" stroke-width="2.5"/>')
    for n, (px, py), r in zip(counts, pts, rates, strict=True):
        c.parts.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="5" fill="{OURS}"/>')
        c.text(px, py - 12, f"{r:.2f}/s", size=12, anchor="middle")
        us = cdata[n].get("server_us_per_call")
        if us is not None:
            c.text(px, py + 24, f"server {us:,.0f} us/call", size=11, anchor="middle", fill=MUTED)
        label = f"{int(n):,} lease" + ("" if int(n) == 1 else "s")
        c.text(px, plot_bottom + 18, label, size=12, anchor="middle")
    c.line(x0, plot_bottom, x1, plot_bottom, MUTED)
    c.text(x0 - 50, plot_top - 6, "calls/s", size=11, fill=MUTED)
    c.height = plot_bottom + 36
    return c


def panel_tasks(
    pools: Sequence[dict[str, Any]],
    target: float | None,
    heading: str = "Task throughput: plain vs leased tasks per second (higher is better)",
    sub: str | None = None,
) -> Canvas | None:
    if not pools:
        return None
    c = Canvas()
    if sub is None:
        sub = f"one worker per pool; median of rounds; dashed = target {target}x plain"
    y = c.title(heading, *sub.split("\n"))  # one subtitle line per "\n"
    x0, x1 = MARGIN + LABEL_W, WIDTH - MARGIN - VALUE_W
    top = max(max(p["plain"] or 0, p["leased"] or 0, p.get("uncontended") or 0) for p in pools)
    top = top or 1.0
    ticks = nice_ticks(top)
    scale = (x1 - x0) / ticks[-1]
    bar_h, inner, gap = 22, 4, 22
    bars = 3 if any(p.get("uncontended") for p in pools) else 2
    group_h = bars * bar_h + (bars - 1) * inner
    plot_top = y + 8
    plot_bottom = plot_top + len(pools) * (group_h + gap) - gap + 8
    for t in ticks:
        x = x0 + t * scale
        c.line(x, plot_top - 4, x, plot_bottom, GRID)
        c.text(x, plot_bottom + 16, fmt_tick(t), size=11, anchor="middle", fill=MUTED)
    for i, p in enumerate(pools):
        gy = plot_top + 4 + i * (group_h + gap)
        c.text(x0 - 10, gy + group_h / 2 - 2, p["label"], size=13, anchor="end", weight="bold")
        if not p["plain"] or not p["leased"]:
            note = p.get("note") or "not run"
            c.text(x0 + 8, gy + group_h / 2 + 5, note, size=12, fill=MUTED)
            continue
        ratio = p["leased"] / p["plain"]
        raw = p.get("json") or {}
        cost = raw.get("target_kind") == "cost" and raw.get("hold_cycle_ms_median")
        if cost:  # the lease's own time a task against one hold() cycle of the same run
            verdict = ": PASS" if raw.get("pass") else ": MISS"
            times = raw["lease_ms"] / raw["hold_cycle_ms_median"]
            what = f"lease +{raw['lease_ms']:.2f} ms = {times:.2f}x hold(){verdict}"
        else:
            verdict = "" if target is None else ": PASS" if ratio >= target else ": MISS"
            what = f"leased/plain {ratio:.2f}{verdict}"
        c.text(x0 - 10, gy + group_h / 2 + 14, what, 11, "end")
        c.rect(x0, gy, p["plain"] * scale, bar_h, OTHER)
        c.text(x1 + 16, gy + bar_h / 2 + 5, f"plain {p['plain']:,.0f}/s", 12)
        ly = gy + bar_h + inner
        c.rect(x0, ly, p["leased"] * scale, bar_h, OURS)
        c.text(x1 + 16, ly + bar_h / 2 + 5, f"leased {p['leased']:,.0f}/s", 12)
        if target is not None and not cost:
            tx = x0 + target * p["plain"] * scale
            c.line(tx, ly - 2, tx, ly + bar_h + 2, TARGET_INK, 2, "4 3")
        if p.get("uncontended"):
            uy = ly + bar_h + inner
            c.rect(x0, uy, p["uncontended"] * scale, bar_h, UNCONTENDED)
            note = f"leased, uncontended {p['uncontended']:,.0f}/s"
            c.text(x1 + 16, uy + bar_h / 2 + 5, note, 12)
    c.text((x0 + x1) / 2, plot_bottom + 34, "tasks/s", size=12, anchor="middle", fill=MUTED)
    c.height = plot_bottom + 46
    return c


def panel_pairs(
    pools: Sequence[dict[str, Any]],
    heading: str,
    subs: Sequence[str],
    unit: str,
    part_label: str | None = None,
) -> Canvas | None:
    """Plain against leased bars per pool, of a cost per task (lower is better).

    ``pools``: label, plain, leased (None: not measured) and optionally ``part``, the piece
    of the leased value drawn darker at the start of its bar (``part_label`` names it).
    """
    rows = [p for p in pools if p.get("plain") is not None and p.get("leased") is not None]
    if not rows:
        return None
    c = Canvas()
    y = c.title(heading, *subs)
    x0, x1 = MARGIN + LABEL_W, WIDTH - MARGIN - VALUE_W
    top = max(max(p["plain"], p["leased"]) for p in rows) or 1.0
    ticks = nice_ticks(top)
    scale = (x1 - x0) / ticks[-1]
    bar_h, inner, gap = 22, 4, 22
    group_h = 2 * bar_h + inner
    plot_top = y + 8
    plot_bottom = plot_top + len(rows) * (group_h + gap) - gap + 8
    for t in ticks:
        x = x0 + t * scale
        c.line(x, plot_top - 4, x, plot_bottom, GRID)
        c.text(x, plot_bottom + 16, fmt_tick(t), size=11, anchor="middle", fill=MUTED)
    for i, p in enumerate(rows):
        gy = plot_top + 4 + i * (group_h + gap)
        c.text(x0 - 10, gy + group_h / 2 - 2, p["label"], size=13, anchor="end", weight="bold")
        extra = p["leased"] - p["plain"]
        c.text(x0 - 10, gy + group_h / 2 + 14, f"lease adds {fmt(extra)} {unit}", 11, "end")
        c.rect(x0, gy, p["plain"] * scale, bar_h, OTHER)
        c.text(x1 + 16, gy + bar_h / 2 + 5, f"plain {fmt(p['plain'])} {unit}", 12)
        ly = gy + bar_h + inner
        c.rect(x0, ly, p["leased"] * scale, bar_h, OURS)
        note = f"leased {fmt(p['leased'])} {unit}"
        part = p.get("part")
        if part:
            c.rect(x0, ly, min(part, p["leased"]) * scale, bar_h, "#1e3a8a")
            note += f" ({fmt(part)} {part_label or 'part'})"
        c.text(x1 + 16, ly + bar_h / 2 + 5, note, 12)
    c.text((x0 + x1) / 2, plot_bottom + 34, f"{unit} per task", size=12, anchor="middle",
           fill=MUTED)  # fmt: skip
    c.height = plot_bottom + 46
    return c


def log_bounds(values: Sequence[float]) -> tuple[float, float]:
    """Decades around ``values`` (all > 0) for a log axis."""
    lo = 10 ** math.floor(math.log10(min(values)))
    hi = 10 ** math.ceil(math.log10(max(values)))
    return lo, hi if hi > lo else lo * 10


def log_scale(lo: float, hi: float, start: float, end: float) -> Callable[[float], float]:
    """The coordinate of a value on a log axis from ``lo`` (at ``start``) to ``hi`` (at
    ``end``); values below ``lo`` sit at ``start``."""
    span = math.log10(hi) - math.log10(lo)

    def at(v: float) -> float:
        return start + (math.log10(max(v, lo)) - math.log10(lo)) / span * (end - start)

    return at


def decades(lo: float, hi: float) -> Iterator[float]:
    """``lo``, ``10 lo``, ... up to ``hi``: the grid lines of a log axis."""
    decade = lo
    while decade <= hi * 1.0001:
        yield decade
        decade *= 10


def fmt_count(value: float) -> str:
    """1, 10, 100, 1k, 10k, 100k, 1M."""
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= div:
            return f"{value / div:g}{suffix}"
    return f"{value:g}"


def panel_latency(runs: Sequence[dict[str, Any]]) -> Canvas | None:
    """Acquire latency per lease Redis: p50 bar, p99 whisker, for all / at once / retried."""
    rows: list[tuple[str, str, dict[str, Any] | None]] = []
    for run in runs:
        lat = run.get("latency_ms")
        if not lat:
            rows.append((run["label"], "", None))
            continue
        rows.append((run["label"], "all leased tasks", lat))
        for part, label in (("immediate", "granted at once"), ("retried", "found busy first")):
            sub = lat.get(part) or {}
            if sub.get("n"):
                rows.append(("", f"{label} ({sub['n']:,})", sub))
    values = [
        v for _, _, d in rows if d for v in (d.get("p50"), d.get("p99")) if v is not None and v > 0
    ]
    if not values:
        return None
    c = Canvas()
    sub = "first acquire attempt to grant; bar = p50, whisker = p99; log scale"
    sub2 = "a task that found its lease busy first waits its countdown and its retry's queueing"
    y = c.title("Acquire latency, ms (lower is better)", sub, sub2)
    x0, x1 = MARGIN + LABEL_W, WIDTH - MARGIN - VALUE_W
    lo, hi = log_bounds(values)
    lo /= 10  # a decade below the smallest p50, so its bar has a length to compare
    xs = log_scale(lo, hi, x0, x1)

    bar_h, gap = 20, 10
    plot_top = y + 8
    plot_bottom = plot_top + len(rows) * (bar_h + gap) - gap + 8
    for decade in decades(lo, hi):
        x = xs(decade)
        c.line(x, plot_top - 4, x, plot_bottom, GRID)
        c.text(x, plot_bottom + 16, fmt_tick(decade) + " ms", size=11, anchor="middle", fill=MUTED)
    for i, (label, what, d) in enumerate(rows):
        by = plot_top + 4 + i * (bar_h + gap)
        mid = by + bar_h / 2
        if label:
            c.text(x0 - 10, mid - 1 if what else mid + 5, label, 13, "end", weight="bold")
        if what:
            c.text(x0 - 10, mid + (13 if label else 5), what, 11, "end", fill=MUTED)
        if d is None:
            c.text(x0 + 8, mid + 5, "not run yet", size=12, fill=MUTED)
            continue
        p50, p99 = d.get("p50"), d.get("p99")
        if p50 is None or p99 is None:
            continue
        c.rect(x0, by, xs(p50) - x0, bar_h, OURS if label else OTHER)
        c.line(xs(p50), mid, xs(p99), mid, INK, 1.5)
        c.line(xs(p99), mid - 6, xs(p99), mid + 6, INK, 1.5)
        c.text(x1 + 16, mid + 5, f"p50 {fmt_ms(p50)} \u00b7 p99 {fmt_ms(p99)}", size=12)
    c.height = plot_bottom + 30
    return c


def panel_lines(
    heading: str,
    subs: Sequence[str],
    series: Sequence[tuple[str, str, str, Sequence[tuple[float, float]]]],
    xlabel: str,
    yunit: str,
) -> Canvas | None:
    """A log-log line chart. ``series``: (label, colour, dash, [(x, y), ...]) with x, y > 0."""
    pts = [(x, yv) for _, _, _, ps in series for x, yv in ps if x > 0 and yv > 0]
    if not pts:
        return None
    c = Canvas()
    y = c.title(heading, *subs)
    # legend, one row
    lx = MARGIN + 70.0
    for label, colour, dash, _ in series:
        c.line(lx, y + 14, lx + 28, y + 14, colour, 2.5, dash)
        c.text(lx + 34, y + 18, label, size=12)
        lx += 34 + 7.2 * len(label) + 26
    x0, x1 = MARGIN + 70, WIDTH - MARGIN - 150
    plot_top, plot_bottom = y + 40, y + 300
    xlo, xhi = log_bounds([p[0] for p in pts])
    ylo, yhi = log_bounds([p[1] for p in pts])

    px = log_scale(xlo, xhi, x0, x1)
    py = log_scale(ylo, yhi, plot_bottom, plot_top)
    for decade in decades(xlo, xhi):
        c.line(px(decade), plot_top, px(decade), plot_bottom, GRID)
        c.text(px(decade), plot_bottom + 16, fmt_count(decade), 11, "middle", MUTED)
    for decade in decades(ylo, yhi):
        c.line(x0, py(decade), x1, py(decade), GRID)
        c.text(x0 - 8, py(decade) + 4, f"{fmt_tick(decade)} {yunit}", 11, "end", MUTED)
    c.line(x0, plot_bottom, x1, plot_bottom, MUTED)
    c.line(x0, plot_top, x0, plot_bottom, MUTED)
    ends: list[tuple[float, float, str, str]] = []  # (y, x, text, colour) of end labels
    for _label, colour, dash, ps in series:
        good = sorted((x, v) for x, v in ps if x > 0 and v > 0)
        if not good:
            continue
        path = " ".join(
            f"{'M' if i == 0 else 'L'}{px(x):.1f},{py(v):.1f}" for i, (x, v) in enumerate(good)
        )
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        c.parts.append(
            f'<path d="{path}" fill="none" stroke="{colour}" stroke-width="2.5"{dashed}/>'
        )
        for x, v in good:
            c.parts.append(f'<circle cx="{px(x):.1f}" cy="{py(v):.1f}" r="3.5" fill="{colour}"/>')
        x, v = good[-1]
        ends.append((py(v) + 4, px(x) + 10, f"{fmt(v)} {yunit}", colour))
    last = -math.inf
    for ty, tx, text, colour in sorted(ends):  # end labels never overlap
        ty = max(ty, last + 13)
        c.text(tx, ty, text, size=11, fill=colour)
        last = ty
    c.text((x0 + x1) / 2, plot_bottom + 34, xlabel, size=12, anchor="middle", fill=MUTED)
    c.height = plot_bottom + 46
    return c


#: part (d) of engine.json (waiters on one lease), whose shape this module guesses: the keys
#: tried, in order, for the number of waiters, a contender's name, commands per release and
#: the handoff's median and p99 (in a point, or one level down, e.g. point["handoff"])
WAITER_N: Final = ("waiters", "n_waiters", "n", "count")
WAITER_WHO: Final = ("contender", "kind", "name")
WAITER_COMMANDS: Final = (
    "commands_per_release",
    "calls_per_release",
    "release_commands",
    "cmds_per_release",
    "commands",
)
WAITER_MEDIAN: Final = ("handoff_median_ms", "handoff_ms", "median_ms", "p50_ms", "handoff_p50_ms")
WAITER_P99: Final = ("handoff_p99_ms", "p99_ms")
WAITER_USEC: Final = ("usec_per_release", "server_us_per_release", "server_us")
WAITER_STYLE: Final = ((OURS, ""), (OTHER, "6 4"), ("#7c3aed", "2 3"), (TARGET_INK, "8 3"))


def _number(point: dict[str, Any], keys: Sequence[str]) -> float | None:
    """The first of ``keys`` in ``point`` or in a dict one level down, as a float."""
    for where in (point, *(v for v in point.values() if isinstance(v, dict))):
        for key in keys:
            value = where.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
    return None


def _is_count(key: object) -> bool:
    return str(key).isdigit()


def waiter_series(d: object) -> dict[str, list[tuple[float, dict[str, Any]]]]:
    """Part (d) as contender -> [(waiters, point), ...], from any of the shapes below; {} if
    there is none or it has another shape.

    - ``{"1": point, "10": point, ...}`` (one contender, ours), as part (c);
    - ``{"hold": {"1": point, ...}, "prl": {...}}``;
    - a list of points, or ``{"points" | "results" | "rows": [...]}``, each point naming its
      waiters (``WAITER_N``) and, optionally, its contender (``WAITER_WHO``).
    """
    out: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    if isinstance(d, dict):
        lists = (d[k] for k in ("points", "results", "rows") if isinstance(d.get(k), list))
        listed = next(lists, None)
        if listed is not None:
            return waiter_series(listed)
        points = {k: v for k, v in d.items() if isinstance(v, dict)}
        if points and all(_is_count(k) for k in points):
            out["hold"] = [(float(k), v) for k, v in points.items()]
        else:
            for who, sub in points.items():
                counted = {k: v for k, v in sub.items() if _is_count(k) and isinstance(v, dict)}
                if counted:
                    out[str(who)] = [(float(k), v) for k, v in counted.items()]
    elif isinstance(d, list):
        for point in d:
            if not isinstance(point, dict):
                continue
            n = _number(point, WAITER_N)
            who = next((str(point[k]) for k in WAITER_WHO if isinstance(point.get(k), str)), "hold")
            if n is not None:
                out.setdefault(who, []).append((n, point))
    return {who: sorted(pts, key=lambda p: p[0]) for who, pts in out.items() if pts}


def panels_waiters(d: object) -> list[Canvas | None]:
    """Part (d): commands per release and the handoff delay against the number of waiters."""
    series = waiter_series(d)
    if not series:
        return []
    labels = {**dict(CONTENDERS_B), "hold": "celery_leases hold(wait=...)"}
    ordered = sorted(series, key=lambda who: (who != "hold", who))
    styles = dict(zip(ordered, itertools.cycle(WAITER_STYLE), strict=False))

    def lines(keys: Sequence[str]) -> list[tuple[str, str, str, list[tuple[float, float]]]]:
        out = []
        for who in ordered:
            pts = [(n, v) for n, point in series[who] if (v := _number(point, keys)) is not None]
            if pts:
                colour, dash = styles[who]
                out.append((labels.get(who, who), colour, dash, pts))
        return out

    return [
        panel_lines(
            "(d) Commands per release vs waiters on the lease (log-log; flat is the goal)",
            ["the Redis commands one release costs, those run inside its script included"],
            lines(WAITER_COMMANDS),
            "waiters blocked on the lease",
            "cmds",
        ),
        panel_lines(
            "(d) Server time per release vs waiters on the lease (log-log)",
            ["part (d)'s usec_per_release: INFO commandstats usec per release and its handoff"],
            lines(WAITER_USEC),
            "waiters blocked on the lease",
            "us",
        ),
        panel_lines(
            "(d) Handoff delay vs waiters on the lease, median ms (log-log)",
            ["release in another process to the first waiter holding the lease"],
            lines(WAITER_MEDIAN),
            "waiters blocked on the lease",
            "ms",
        ),
    ]


def cleanup_series(
    axis: dict[str, Any], labels: dict[str, str], key: str, scale: float
) -> list[tuple[str, str, str, list[tuple[float, float]]]]:
    out = []
    for name, (colour, dash) in SERIES_STYLE.items():
        points = [
            (float(x), float(point[name][key]) * scale)
            for x, point in axis.items()
            if name in point and point[name].get(key) is not None
        ]
        if points:
            out.append((labels.get(name, name), colour, dash, points))
    return out


# --- data ---------------------------------------------------------------------------------------
def _read(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _heading(title: str, machine: dict[str, Any], dates: str) -> Canvas:
    head = Canvas()
    head.text(MARGIN, 30, title, size=20, weight="bold")
    if machine:
        info = (
            f"{machine.get('cpus')} cores, {machine.get('cpu_model')}; Python "
            f"{machine.get('python')}, redis-py {machine.get('redis_py')}, Redis "
            f"{str(machine.get('server', '?')).split()[0]}"
        )
        head.text(MARGIN, 52, info, size=12, fill=MUTED)
    if dates:
        head.text(MARGIN, 70, dates, size=12, fill=MUTED)
    head.height = 84
    return head


def _assemble(title: str, canvases: Sequence[Canvas]) -> str:
    body: list[str] = []
    y = 0.0
    for k, canvas in enumerate(canvases):
        if k > 1:
            body.append(f'<line x1="{MARGIN}" y1="{y - 8:.1f}" x2="{WIDTH - MARGIN}" '
                        f'y2="{y - 8:.1f}" stroke="{GRID}"/>')  # fmt: skip
        body.append(f'<g transform="translate(0,{y:.1f})">')
        body += canvas.parts
        body.append("</g>")
        y += canvas.height + 16
    height = math.ceil(y)
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" font-family="{FONT}" role="img">',
            f"<title>{escape(title)}</title>",
            f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>',
            *body,
            "</svg>",
            "",
        ]
    )


def render_fleet(results: Path = RESULTS_DIR) -> str | None:
    """The SVG of ``fleet.json`` in ``results``, or None when there is none."""
    runs = _read(results / "fleet.json").get("runs") or {}
    if not runs:
        return None
    ordered = sorted(runs.values(), key=lambda r: (r["label"] == "cluster", r["label"]))
    pools: list[dict[str, Any]] = [
        {
            "label": r["label"],
            "plain": r["plain"]["rate_median"],
            "leased": r["leased"]["rate_median"],
            "uncontended": (r.get("uncontended") or {}).get("rate_median"),
        }
        for r in ordered
    ]
    lat_runs: list[dict[str, Any]] = [
        {"label": r["label"], "latency_ms": r["leased"].get("latency_ms")} for r in ordered
    ]
    if "cluster" not in runs:
        pools.append({"label": "cluster", "plain": None, "leased": None,
                      "note": "not run yet: scripts/bench --cluster"})  # fmt: skip
        lat_runs.append({"label": "cluster", "latency_ms": None})
    first = ordered[0]
    cfg = first["config"]
    workers = f"{cfg['processes']} solo workers" if cfg["pool"] == "solo" else (
        f"one prefork worker -c {cfg['processes']}")  # fmt: skip
    sub = (
        f"{cfg['tasks']:,} tasks per kind, {cfg['resources']} resources, {workers}, "
        f"{cfg['body'] * 1000:.0f} ms body; median of {cfg['rounds']} interleaved rounds"
    )
    retries = "; ".join(f"{r['label']}: {r['leased']['retries']:,} busy retries" for r in ordered)
    panels = [
        panel_tasks(pools, None, "Fleet: plain vs leased tasks per second (higher is better)",
                    f"{sub}\n{retries}"),
        panel_latency(lat_runs),
    ]  # fmt: skip
    dates = "; ".join(f"{r['label']} run {r['machine']['date']}" for r in ordered)
    head = _heading("celery_leases fleet benchmark", first.get("machine", {}), dates)
    return _assemble("celery_leases fleet benchmark", [head, *(p for p in panels if p)])


def render_cleanup(results: Path = RESULTS_DIR) -> str | None:
    """The SVG of ``cleanup.json`` in ``results``, or None when there is none."""
    data = _read(results / "cleanup.json")
    if not data or not (data.get("leases") or data.get("keys")):
        return None
    labels = data.get("labels", {})
    cfg = data.get("config", {})
    leases, keys = data.get("leases") or {}, data.get("keys") or {}
    panels = [
        panel_lines(
            "Cleanup time vs leases held (log-log)",
            [
                f"a dead owner's N exclusive leases beside {cfg.get('base_keys', 0):,} unrelated "
                "keys; median of repeats",
                "ours read the owner registry: O(leases held); the baseline SCANs the keyspace",
            ],
            cleanup_series(leases, labels, "ms", 1.0),
            "leases held by the dead predecessor",
            "ms",
        ),
        panel_lines(
            "Cleanup time vs keyspace size (log-log)",
            [
                f"{cfg.get('base_leases', 0)} leases held beside K unrelated keys; median of "
                "repeats",
                "ours stay flat (same commands at every size); the SCAN baseline grows with K",
            ],
            cleanup_series(keys, labels, "ms", 1.0),
            "unrelated keys in the database",
            "ms",
        ),
        panel_lines(
            "Server time vs keyspace size (log-log)",
            ["INFO commandstats usec of the commands each pass made Redis run"],
            cleanup_series(keys, labels, "server_us", 1.0),
            "unrelated keys in the database",
            "us",
        ),
    ]
    head = _heading(
        "celery_leases cleanup and reconcile cost",
        data.get("machine", {}),
        f"run {data.get('machine', {}).get('date', '')}",
    )
    return _assemble("celery_leases cleanup and reconcile cost", [head, *(p for p in panels if p)])


def load_tasks(results: Path) -> tuple[list[dict[str, Any]], float, str]:
    """Per pool: label, plain and leased tasks/s (medians); the target; the date line.

    From ``tasks.json`` (each pool also keeps its raw entry under ``"json"``), else from the
    first table of ``tasks.md``.
    """
    path = results / "tasks.json"
    if path.exists():
        data = json.loads(path.read_text())
        pools = [
            {
                "label": f"{p['pool']} (-c {p['concurrency']})",
                "plain": p["plain_median"],
                "leased": p["leased_median"],
                "json": p,
            }
            for p in data.get("pools", [])
        ]
        return pools, float(data.get("target", 0.9)), data.get("machine", {}).get("date", "")
    md = results / "tasks.md"
    if not md.exists():
        return [], 0.9, ""
    pools = []
    row = re.compile(r"^\| ([^|]+?) \| ([\d,.]+) \| ([\d,.]+) \|")
    for line in md.read_text().splitlines():
        m = row.match(line)
        if m:
            plain, leased = (float(g.replace(",", "")) for g in m.group(2, 3))
            pools.append({"label": m.group(1), "plain": plain, "leased": leased})
        elif pools and not line.startswith("|"):
            break  # the first table only: the second one is the Redis work per task
    date = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d UTC)", md.read_text())
    return pools, 0.9, date.group(1) if date else ""


def task_work(
    pools: Sequence[dict[str, Any]], metric: str, part: str | None = None
) -> list[dict[str, Any]]:
    """Per pool, plain and leased medians of a per-task metric of ``tasks.json``."""
    out = []
    for p in pools:
        raw = p.get("json") or {}
        out.append(
            {
                "label": p["label"],
                "plain": raw.get(f"plain_{metric}_median"),
                "leased": raw.get(f"leased_{metric}_median"),
                "part": raw.get(f"leased_{part}_median") if part else None,
            }
        )
    return out


def render_tasks(results: Path = RESULTS_DIR) -> str | None:
    """The SVG of the task benchmark (``tasks.json``, else ``tasks.md``), or None."""
    pools, target, date = load_tasks(results)
    if not pools:
        return None
    data = _read(results / "tasks.json")
    cfg = data.get("config", {})
    runs = ""
    if cfg:
        runs = f"; {cfg.get('rounds')} interleaved rounds x {cfg.get('tasks'):,} tasks per kind"
    sub = (
        f"one worker per pool{runs}; median of rounds; dashed = target {target}x plain "
        "(a pool held to the lease's cost: its time a task against one hold() cycle)\n"
        "plain(x) and leased_tiny(rid): the same trivial body, the second under a lease"
    )
    where = "per task of a round, from the consume order to the last result (not the publishing)"
    panels = [
        panel_tasks(pools, target, sub=sub),
        panel_pairs(
            task_work(pools, "calls_per_task", "evalsha_per_task"),
            "Redis commands per task (lower is better)",
            [
                "INFO commandstats calls, those run inside Lua scripts and MULTI/EXEC included; "
                "dark = the lease's EVALSHA calls",
                where,
            ],
            "cmds",
            "EVALSHA",
        ),
        panel_pairs(
            task_work(pools, "server_us_per_task", "script_us_per_task"),
            "Redis server time per task, us (lower is better)",
            [
                "the CPU time of the server's main thread (INFO cpu, user + sys)",
                "dark = the lease scripts' run time (INFO commandstats usec of EVALSHA, their "
                "inner commands included)",
                where,
            ],
            "us",
            "scripts",
        ),
    ]
    machine = data.get("machine", {})
    dates = f"tasks run {date}" if date else ""
    if cfg.get("quick"):
        dates += " (--quick)"
    if machine.get("load") is not None:
        dates += f", load {machine['load']} at start"  # a shared machine shows here
    head = _heading("celery_leases task benchmark", machine, dates)
    return _assemble("celery_leases task benchmark", [head, *(p for p in panels if p)])


def cycle_results(raw: dict[str, Any]) -> dict[str, Any]:
    """Part (a)'s contenders: ``raw["a"]`` and those of any ``"a-..."`` part (``"a-asyncio"``)."""
    merged: dict[str, Any] = dict(raw.get("a") or {})
    for part in sorted(raw):
        if part.startswith(("a-", "a_")) and isinstance(raw[part], dict):
            merged.update(raw[part])
    return merged


def render(results: Path = RESULTS_DIR) -> str:
    """The SVG text of ``benchmarks.svg`` for the engine results in ``results``."""
    engine = _read(results / "engine.json")
    raw = engine.get("results", {})
    private = bool(engine.get("config", {}).get("private_server", True))
    panels = [
        panel_cycles(cycle_results(raw), engine.get("targets")),
        panel_handoff(raw.get("b", {})),
        panel_heartbeat(raw.get("c", {}), private),
        *panels_waiters(raw.get("d")),
    ]
    drawn = [p for p in panels if p is not None]
    if not drawn:
        raise FileNotFoundError(f"no engine benchmark results in {results}")
    m = engine.get("machine", {})
    dates = f"engine run {m.get('date')}" if m else ""
    head = _heading("celery_leases benchmarks", m, dates)
    return _assemble("celery_leases benchmarks", [head, *drawn])


def _write(svg: str, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".svg.tmp")
    tmp.write_text(svg, encoding="utf-8")
    tmp.replace(out)
    return out


def write_plot(results: Path = RESULTS_DIR, out: Path = SVG_PATH) -> Path:
    """Write ``benchmarks.svg`` for ``results`` to ``out`` (atomically) and return ``out``."""
    return _write(render(results), out)


def panel_memory(data: dict[str, Any]) -> Canvas | None:
    """Bytes left per distinct resource after its release, one bar per contender."""
    results: dict[str, dict[str, dict[str, Any]]] = data.get("results") or {}
    labels: dict[str, str] = data.get("labels") or {}
    counts = [str(n) for n in data.get("counts") or []]
    if not results or not counts:
        return None
    top = counts[-1]
    first = [k for k in data.get("order") or labels if k in results]  # the benchmark's order
    order = [*first, *(k for k in results if k not in first)]
    rows = [(k, labels.get(k, k), results[k][top]) for k in order if top in results.get(k, {})]
    c = Canvas()
    y = c.title(
        "Redis memory left per distinct resource after its release",
        f"used_memory after {int(top):,} distinct resources were taken and released, per "
        "resource; lower is better",
    )
    x0, x1 = MARGIN + LABEL_W + 60, WIDTH - MARGIN - VALUE_W
    most = max(r[2]["bytes_per_resource"] for r in rows) or 1.0
    bar_h, gap = BAR_H, BAR_GAP
    scale, plot_top, plot_bottom = bar_axis(c, y, x0, x1, most, len(rows), " B")
    for i, (key, label, point) in enumerate(rows):
        gy = plot_top + 4 + i * (bar_h + gap)
        ours = key.startswith("hold")
        c.text(
            x0 - 10,
            gy + bar_h / 2 + 5,
            label,
            size=12,
            anchor="end",
            weight="bold" if ours else "normal",
        )
        per = float(point["bytes_per_resource"])
        c.rect(x0, gy, max(per * scale, 1.5), bar_h, OURS if ours else OTHER)
        day = per * 10_000_000
        shown = f"{day / 1e9:.2f} GB" if day >= 1e8 else f"{day / 1e6:.1f} MB"
        note = f"{per:,.0f} B; 10 M a day: {shown}" if key != "prl" else f"{per:,.0f} B (kept 1 s)"
        c.text(x1 + 16, gy + bar_h / 2 + 5, note, 12)
    c.height = plot_bottom + 30
    return c


def render_memory(results: Path = RESULTS_DIR) -> str | None:
    """The SVG of ``memory.json`` in ``results``, or None when there is none."""
    data = _read(results / "memory.json")
    panel = panel_memory(data)
    if panel is None:
        return None
    machine = data.get("machine") or {}
    head = _heading("celery_leases: memory left behind", machine, str(machine.get("date", "")))
    return _assemble("celery_leases memory benchmark", [head, panel])


def write_plots(results: Path = RESULTS_DIR, out_dir: Path = IMG_DIR) -> list[Path]:
    """Write every plot whose results exist in ``results`` into ``out_dir``; returns them."""
    written = []
    if (results / "engine.json").exists():
        written.append(write_plot(results, out_dir / SVG_PATH.name))
    drawings = (
        (TASKS_SVG, render_tasks),
        (FLEET_SVG, render_fleet),
        (CLEANUP_SVG, render_cleanup),
        (MEMORY_SVG, render_memory),
    )
    for name, draw in drawings:
        svg = draw(results)
        if svg is not None:
            written.append(_write(svg, out_dir / name))
    return written


def refresh(results: Path) -> None:
    """Best effort, for the end of a benchmark run: a failure prints a warning, never raises.

    Results in the default directory update the plots in ``docs/img/``; results written
    elsewhere (``--out-dir``) get their plots next to them, so the docs keep the canonical run.
    """
    try:
        default = results.resolve() == RESULTS_DIR.resolve()
        for out in write_plots(results, IMG_DIR if default else results):
            print(f"[bench.plot] wrote {out}", file=sys.stderr, flush=True)
    except Exception as exc:
        print(f"[bench.plot] warning: no plot written: {exc!r}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plot", description=__doc__)
    parser.add_argument("--results", default=str(RESULTS_DIR), help="the results directory")
    parser.add_argument("--out-dir", default=str(IMG_DIR), help="where the SVGs go")
    args = parser.parse_args(argv)
    for out in write_plots(Path(args.results), Path(args.out_dir)):
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
