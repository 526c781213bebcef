"""Human- and tool-readable outputs of simulations: tables, a Gantt chart, a Chrome trace.

- `markdown_table` / `csv_table`: one row per named report.
- `comparison_table`: the `slimpack compare` table, rows of (strategy, layout, report,
  planning time, speedup reference).
- `figures_source` and `legend`: the lines under a table, saying where its seconds come from and
  what its abbreviated headers mean.
- `write_gantt` (`gantt_figure`): PNG, one row per (data-parallel rank, pipeline stage), an
  optional shared time axis (`horizon_s`); a bar per task, or past `AGGREGATE_ABOVE` tasks in a
  row, busy bands over a second panel of the first pipeline flush drawn a bar per task;
  `gantt_title` names what ran and how long it took.
- `chrome_trace` / `write_chrome_trace`: Perfetto-compatible JSON from any task records
  (simulated `TaskRecord`s or measured ones with the same fields), so simulated and measured
  steps open side by side.
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .dag import SimulationReport

GIB = 1024**3
COMPUTE_KINDS = ("F", "B")
# Chrome-trace thread of a stage's communication (P2P, DP): kept off the compute thread so
# overlapping bars do not break the nesting Perfetto expects within one thread.
COMM_TID_OFFSET = 1000


# ---- tables ------------------------------------------------------------------------------------
def summary(report: SimulationReport) -> dict[str, Any]:
    """The headline figures of one report, raw values, stable keys (CSV and JSON columns)."""
    return {
        "layout": report.layout,
        "iteration_s": report.iteration_time_s,
        "tokens_per_s": report.tokens_per_s,
        "mfu": report.mfu,
        "bubble_ratio": report.bubble_ratio,
        "dp_imbalance": report.dp_imbalance,
        "pp_imbalance": report.pp_imbalance,
        "peak_memory_gib": max(report.peak_memory_bytes) / GIB,
        "fits_memory": report.fits_memory,
        "dp_reduce_exposed_s": max(report.dp_reduce_exposed_s, default=0.0),
        "lower_bound_s": report.lower_bound_s,
    }


def _named(reports: Mapping[str, SimulationReport] | Sequence[tuple[str, SimulationReport]]):
    return list(reports.items()) if isinstance(reports, Mapping) else list(reports)


def markdown_table(reports: Mapping[str, SimulationReport] | Sequence[tuple[str, SimulationReport]]) -> str:
    """One row per (name, report)."""
    rows = [{"name": name, **summary(report)} for name, report in _named(reports)]
    return _markdown(rows)


def csv_table(reports: Mapping[str, SimulationReport] | Sequence[tuple[str, SimulationReport]]) -> str:
    rows = [{"name": name, **summary(report)} for name, report in _named(reports)]
    return _csv(rows)


@dataclass
class ComparisonRow:
    """One strategy in a side-by-side comparison. `reference` is what speedup is measured
    against: another report or a reference iteration time in seconds (None: no speedup)."""

    strategy: str
    layout: str
    report: SimulationReport
    planning_time_s: float | None = None
    reference: SimulationReport | float | None = None

    def values(self) -> dict[str, Any]:
        figures = summary(self.report)
        figures.pop("layout")
        reference = self.reference.iteration_time_s if isinstance(self.reference, SimulationReport) else self.reference
        speedup = reference / self.report.iteration_time_s if reference and self.report.iteration_time_s > 0 else None
        return {"strategy": self.strategy, "layout": self.layout, **figures,
                "planning_s": self.planning_time_s, "speedup": speedup}


# The Markdown table's default columns (`wide=False`); extra columns a row adds (the speedup over
# megatron-stock) are kept. CSV and JSON always carry every figure.
COMPACT_COLUMNS = ("strategy", "layout", "iteration_s", "tokens_per_s", "mfu", "speedup", "bubble_ratio",
                   "peak_memory_gib")


def comparison_table(rows: Iterable[ComparisonRow | tuple], fmt: str = "markdown", wide: bool = True) -> str:
    """Rows as `ComparisonRow`s or tuples (strategy, layout, report, planning_time_s, reference);
    fmt: markdown | csv. `wide=False`: the Markdown table keeps `COMPACT_COLUMNS` only."""
    values = [(row if isinstance(row, ComparisonRow) else ComparisonRow(*row)).values() for row in rows]
    if fmt == "markdown":
        if not wide:
            values = [_compact(row) for row in values]
        return _markdown(values)
    if fmt == "csv":
        return _csv(values)
    raise ValueError(f"unknown table format {fmt!r}; use markdown or csv")


def _compact(row: dict) -> dict:
    """`COMPACT_COLUMNS` of a row, with the columns it adds (the speedup over megatron-stock) right
    after the speedup."""
    extra = {key: value for key, value in row.items() if key not in _HEADERS}
    compact = {}
    for key in COMPACT_COLUMNS:
        compact[key] = row[key]
        if key == "speedup":
            compact.update(extra)
    return compact


_HEADERS = {
    "name": "name", "strategy": "strategy", "layout": "layout", "iteration_s": "iteration (s)",
    "tokens_per_s": "tokens/s", "mfu": "MFU", "bubble_ratio": "bubble", "dp_imbalance": "DP imb.",
    "pp_imbalance": "PP imb.", "peak_memory_gib": "peak mem (GiB)", "fits_memory": "fits",
    "dp_reduce_exposed_s": "DP exposed (s)", "lower_bound_s": "lower bound (s)",
    "planning_s": "planning (s)", "speedup": "speedup vs megatron-fixed",
}


def _format(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if key in ("mfu", "bubble_ratio"):
        return f"{100 * value:.1f}%"
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    if key == "speedup":
        return f"{value:.2f}x"
    if isinstance(value, float):  # fixed-point only: no scientific notation among the figures
        return f"{value:.3f}" if abs(value) >= 0.001 or value == 0 else "<0.001"
    return str(value)


def _markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    lines = ["| " + " | ".join(_HEADERS.get(k, k) for k in keys) + " |",
             "|" + "|".join("---" if k in ("name", "strategy", "layout") else "---:" for k in keys) + "|"]
    lines += ["| " + " | ".join(_format(k, row[k]) for k in keys) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def figures_source(cost_model: Mapping[str, Any]) -> str:
    """The line under a table that says where its seconds come from, from `CostModel.describe()`:
    'simulated on h100-sxm with cost model analytic, model llama-7b' (a profile by its path)."""
    source = str(cost_model.get("source") or "analytic")
    if source.startswith("profile:"):
        source = "profile " + source.removeprefix("profile:")
    return f"simulated on {cost_model.get('hardware')} with cost model {source}, model {cost_model.get('model')}"


# The columns whose headers are abbreviations, in the words of docs/usage.md ("Reading the tables").
_COLUMN_WORDS = (
    (("mfu",), "MFU = model FLOPs utilisation"),
    (("bubble_ratio",), "bubble = idle share of all devices' time"),
    (("dp_imbalance", "pp_imbalance"), "DP/PP imb. = max/mean compute over data-parallel ranks/pipeline stages"),
    (("dp_reduce_exposed_s",), "DP exposed = gradient reduction after the last backward"),
    (("lower_bound_s",), "lower bound = no plan can be faster"),
)


def legend(columns: Iterable[str]) -> str | None:
    """One line spelling out the abbreviated headers among `columns` (summary keys); None if none is."""
    present = set(columns)
    words = [meaning for keys, meaning in _COLUMN_WORDS if present.intersection(keys)]
    return "legend: " + "; ".join(words) if words else None


def comparison_legend(wide: bool = True) -> str | None:
    """`legend` of the comparison table: every column, or `COMPACT_COLUMNS` (`wide=False`)."""
    return legend(_HEADERS if wide else COMPACT_COLUMNS)


def _csv(rows: list[dict]) -> str:
    if not rows:
        return ""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return out.getvalue()


# ---- generic task records ----------------------------------------------------------------------
def _get(record: Any, name: str, default: Any = None) -> Any:
    if isinstance(record, Mapping):
        return record.get(name, default)
    return getattr(record, name, default)


# ---- Gantt chart -------------------------------------------------------------------------------
# Forward cool, backward warm; a DP-Merge group's tasks in their own shade of each (a hatch would be
# invisible on the one-pixel bars of a step with hundreds of MicroPacks); the gradient reduction in
# a colour no compute bar has, with a marker, since it is a sliver at the end of a long step. The
# legend shows these very colours.
_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "DP": "#E0A800"}
_MERGED_COLOURS = {"F": "#2CA6A4", "B": "#B5344A"}
_LEGEND = (("F", False, "forward"), ("B", False, "backward"), ("F", True, "DP-Merge group forward"),
           ("B", True, "DP-Merge group backward"), ("DP", False, "DP gradient reduction"))
GANTT_Y_LABEL = "data-parallel rank / pipeline stage"
GANTT_DPI = 120
_MIN_BAR_PX = 1.0  # a task shorter than a pixel is drawn one pixel wide, so that every task shows
_MIN_MARKED_PX = 3.0  # DP-Merge group tasks and gradient reductions: at least this wide, at any scale
_OUTLINED_PX = 6.0  # bars at least this wide keep a thin white outline
# Above this many forward and backward tasks in one row a bar per task is a barcode (a 256K-context
# step runs about 540 MicroPacks per rank): the row is drawn as busy bands instead.
AGGREGATE_ABOVE = 60
# Idle gaps shorter than this share of the time axis (a pixel or two) are inside a band; longer
# ones stay white gaps.
GAP_SHARE = 0.002
# A band is cut into pieces on a grid of this many cells over the time axis; each piece stacks the
# share of its time spent in each kind of task, so that where a band turns from forward to backward
# shows and the idle time inside it stays blank at its top.
BAND_CELLS = 100
# Neighbouring pieces whose shares differ by at most this much are drawn as one: a steady phase is
# one rectangle per kind rather than a staircase of cell-to-cell noise.
SHARE_TOLERANCE = 0.08
# The per-task panel under an aggregated chart: from 0 to the end of the first backward of the
# stage that starts backward last (the first pipeline flush), at least 5% and at most 25% of the
# time axis.
FLUSH_SHARE = (0.05, 0.25)
# The flush panel draws the rows of the first data-parallel ranks, at most this many (one rank at
# least): the flush looks alike on every rank, and a panel as tall as a 128-row chart doubles it.
FLUSH_ROWS = 16
# Bottom to top within a row's bar: backward under forward (forward drawn over backward is what
# the per-task chart does for one-pixel bars too).
_STACK = (("B", True), ("B", False), ("F", True), ("F", False))
_BAR_Y, _BAR_HEIGHT = -0.4, 0.6  # a compute bar spans row - 0.4 .. row + 0.2
_REDUCE_Y, _REDUCE_HEIGHT = 0.24, 0.16  # the gradient reduction: a strip under it


def _gantt_colour(kind: str, merged: bool) -> str:
    return _MERGED_COLOURS[kind] if merged and kind in _MERGED_COLOURS else _COLOURS[kind]


# (row, start, length, unit) of each bar, by (kind, merged)
_Bars = dict[tuple[str, bool], list[tuple[int, float, float, Any]]]


def busy_bands(intervals: Iterable[tuple[float, float]], gap_s: float) -> list[tuple[float, float]]:
    """(start, end) of the busy bands of one row: its tasks' (start, end) intervals in time order,
    merged where they overlap or the idle gap between them is at most `gap_s` seconds."""
    bands: list[list[float]] = []
    for start, end in sorted(intervals):
        if bands and start - bands[-1][1] <= gap_s:
            bands[-1][1] = max(bands[-1][1], end)
        else:
            bands.append([start, end])
    return [(start, end) for start, end in bands]


def flush_end_s(records: Iterable[Any]) -> float:
    """When the first pipeline flush is over: the end of the first backward of the (rank, stage)
    that starts backward last; 0.0 without backward tasks."""
    first: dict[tuple[Any, Any], tuple[float, float]] = {}
    for record in records:
        if _get(record, "kind") == "B":
            device = (_get(record, "rank"), _get(record, "stage"))
            start, end = float(_get(record, "start")), float(_get(record, "end"))
            if device not in first or start < first[device][0]:
                first[device] = (start, end)
    return max((end for _, end in first.values()), default=0.0)


def _band_pieces(units: list[tuple[float, float, tuple[str, bool]]], band: tuple[float, float], cell_s: float,
                 least_s: float) -> list[tuple[float, float, dict[tuple[str, bool], float]]]:
    """A band cut on the grid of `cell_s`: (start, end, busy seconds by (kind, merged)) per piece.
    A band narrower than `least_s` is one piece that wide, its busy seconds scaled to fill it."""
    low, high = band
    if high - low < least_s:
        busy: dict[tuple[str, bool], float] = {}
        for start, end, key in units:
            busy[key] = busy.get(key, 0.0) + end - start
        total = sum(busy.values()) or 1.0
        return [(low, low + least_s, {key: least_s * seconds / total for key, seconds in busy.items()})]
    first, last = int(low // cell_s), int(high // cell_s)
    edges = [low, *(cell * cell_s for cell in range(first + 1, last + 1) if low < cell * cell_s < high), high]
    pieces: list[dict[tuple[str, bool], float]] = [{} for _ in edges[1:]]
    for start, end, key in units:
        index = max(0, int(start // cell_s) - first - 1)
        while index < len(pieces) and edges[index] < end:
            overlap = min(end, edges[index + 1]) - max(start, edges[index])
            if overlap > 0:
                pieces[index][key] = pieces[index].get(key, 0.0) + overlap
            index += 1
    return [(edges[i], edges[i + 1], busy) for i, busy in enumerate(pieces) if busy]


def _even_runs(pieces: list[tuple[float, float, dict[tuple[str, bool], float]]]
               ) -> list[tuple[float, float, dict[tuple[str, bool], float]]]:
    """Adjacent pieces whose shares of each kind of task stay within SHARE_TOLERANCE of their
    run's joined as one (busy seconds summed, so every busy second is still drawn once)."""
    runs: list[tuple[float, float, dict[tuple[str, bool], float]]] = []
    for start, end, busy in pieces:
        if runs and runs[-1][1] == start:
            low, high, joined = runs[-1]
            keys = set(busy) | set(joined)
            if all(abs(busy.get(key, 0.0) / (end - start) - joined.get(key, 0.0) / (high - low)) <= SHARE_TOLERANCE
                   for key in keys):
                runs[-1] = (low, end, {key: busy.get(key, 0.0) + joined.get(key, 0.0) for key in keys})
                continue
        runs.append((start, end, busy))
    return runs


def _draw_bands(ax, bars: _Bars, rows: int, horizon: float, gap_s: float, seconds_per_px: float) -> None:
    """Each row's forward and backward tasks as busy bands (`busy_bands`), each band's pieces
    (`_band_pieces`, joined by `_even_runs`) stacking the share of the piece's time each kind of
    task takes, in that kind's colour; one PolyCollection per kind, its gid 'band F', 'band B
    merged', ..."""
    from matplotlib.collections import PolyCollection

    units_of_row: list[list[tuple[float, float, tuple[str, bool]]]] = [[] for _ in range(rows)]
    for (kind, merged), kind_bars in bars.items():
        if kind in COMPUTE_KINDS:
            for row, start, length, _ in kind_bars:
                units_of_row[row].append((start, start + length, (kind, merged)))
    cell_s = horizon / BAND_CELLS
    rectangles: dict[tuple[str, bool], list[list[float]]] = {}  # [start, end, bottom, top] by kind
    for row, units in enumerate(units_of_row):
        units.sort()
        index = 0
        for band in busy_bands([(start, end) for start, end, _ in units], gap_s):
            inside = []
            while index < len(units) and units[index][0] <= band[1]:
                inside.append(units[index])
                index += 1
            merged = any(key[1] for _, _, key in inside)
            least = (_MIN_MARKED_PX if merged else _MIN_BAR_PX) * seconds_per_px
            for start, end, busy in _even_runs(_band_pieces(inside, band, cell_s, least)):
                width, bottom = end - start, row + _BAR_Y + _BAR_HEIGHT
                for key in _STACK:
                    if busy.get(key, 0.0) > 0:
                        top = max(row + _BAR_Y, bottom - _BAR_HEIGHT * min(1.0, busy[key] / width))
                        rectangles.setdefault(key, []).append([start, end, bottom, top])
                        bottom = top
    for zorder, key in enumerate(_STACK, start=2):
        if key in rectangles:
            verts = [[(x0, y0), (x1, y0), (x1, y1), (x0, y1)] for x0, x1, y0, y1 in rectangles[key]]
            ax.add_collection(PolyCollection(verts, facecolors=_gantt_colour(*key), edgecolors="none", linewidths=0,
                                             antialiaseds=False, zorder=zorder,
                                             gid=f"band {key[0]}{' merged' if key[1] else ''}"))


def _draw_units(ax, bars: _Bars, seconds_per_px: float, label_s: float) -> None:
    """A bar per forward and backward task (gid 'unit F', 'unit B merged', ...); a bar wider than
    `label_s` seconds carries its unit."""
    order = sorted((key for key in bars if key[0] in COMPUTE_KINDS), key=lambda key: (key[0] == "F", key[1]))
    for zorder, (kind, merged) in enumerate(order, start=2):  # forward on top
        least = (_MIN_MARKED_PX if merged else _MIN_BAR_PX) * seconds_per_px
        # (row, outlined): a bar _OUTLINED_PX or wider keeps a thin white outline that tells
        # neighbours of one colour apart; narrower ones have none (it would cover them).
        by_row: dict[tuple[int, bool], list[tuple[float, float]]] = {}
        for row, start, length, unit in bars[(kind, merged)]:
            outlined = length >= _OUTLINED_PX * seconds_per_px
            by_row.setdefault((row, outlined), []).append((start, max(length, least)))
            if length > label_s:
                ax.text(start + length / 2, row - 0.1, f"{kind}{unit}", ha="center", va="center", fontsize=6,
                        color="white", clip_on=True, zorder=len(order) + 3)
        for (row, outlined), spans in by_row.items():
            ax.broken_barh(spans, (row + _BAR_Y, _BAR_HEIGHT), facecolors=_gantt_colour(kind, merged),
                           edgecolor="white" if outlined else "none", linewidth=0.5 if outlined else 0,
                           antialiased=outlined, zorder=zorder, gid=f"unit {kind}{' merged' if merged else ''}")


def _draw_reductions(ax, bars: _Bars, seconds_per_px: float) -> None:
    """The gradient reductions: a strip under the row at least _MIN_MARKED_PX wide (gid 'reduction strip')
    and a marker on it (gid 'reduction marker') that shows however short it is."""
    spans = bars.get(("DP", False), [])
    if not spans:
        return
    least = _MIN_MARKED_PX * seconds_per_px
    by_row: dict[int, list[tuple[float, float]]] = {}
    for row, start, length, _ in spans:
        by_row.setdefault(row, []).append((start, max(length, least)))
    for row, row_spans in by_row.items():
        ax.broken_barh(row_spans, (row + _REDUCE_Y, _REDUCE_HEIGHT), facecolors=_COLOURS["DP"], edgecolor="none",
                       linewidth=0, zorder=7, gid="reduction strip")
    ax.scatter([start + max(length, least) / 2 for _, start, length, _ in spans],
               [row + _REDUCE_Y + _REDUCE_HEIGHT / 2 for row, _, _, _ in spans], marker="v", s=22,
               c=_COLOURS["DP"], edgecolors="#333333", linewidths=0.5, zorder=8, clip_on=False,
               gid="reduction marker")


def _rows_axis(ax, devices: list, xlim: float) -> None:
    rows = max(1, len(devices))
    labelled = [i for i, (rank, stage) in enumerate(devices)
                if rows <= 48 or stage == min(s for r, s in devices if r == rank)]
    ax.set_yticks(labelled, [f"{devices[i][0]} / {devices[i][1]}" for i in labelled],
                  fontsize=8 if rows <= 32 else 6)
    ax.set_ylabel(GANTT_Y_LABEL if rows >= 6 else GANTT_Y_LABEL.replace(" / ", " /\n"))  # fits a short chart
    ax.set_ylim(rows - 0.5, -0.5)  # rank 0 stage 0 on top
    ax.set_xlabel("time (s)")
    ax.set_xlim(0, xlim)
    ax.set_axisbelow(True)
    ax.grid(axis="x", color="#DDDDDD", linewidth=0.6)
    for i in range(1, len(devices)):
        if devices[i][0] != devices[i - 1][0]:  # between data-parallel ranks
            ax.axhline(i - 0.5, color="#BBBBBB", linewidth=0.6, zorder=1)


def _first_ranks(devices: list, most_rows: int) -> set:
    """The first data-parallel ranks whose rows number at most `most_rows` (the first rank at least)."""
    ranks: list = []
    for rank in dict.fromkeys(rank for rank, _ in devices):
        if ranks and sum(r in ranks or r == rank for r, _ in devices) > most_rows:
            break
        ranks.append(rank)
    return set(ranks)


def _seconds_per_px(ax) -> float:
    low, high = ax.get_xlim()
    return (high - low) / max(1.0, ax.get_window_extent().width)


def gantt_figure(report_or_records, title: str | None = None, horizon_s: float | None = None, *,
                 aggregate_above: int = AGGREGATE_ABOVE, gap_share: float = GAP_SHARE):
    """The matplotlib figure `write_gantt` saves (the caller closes it): one row per (data-parallel
    rank, pipeline stage), idle time white, the legend's colours (forward, backward, a DP-Merge
    group's forward and backward, the DP gradient reduction as a strip under the row with a marker
    on it, at least _MIN_MARKED_PX wide as DP-Merge tasks are).

    A row of at most `aggregate_above` forward and backward tasks: a bar per task, with no white
    edges where they are narrow (the edges washed out bars a pixel wide), a task shorter than a
    pixel drawn a pixel wide with forward over backward. More: busy bands instead
    (`busy_bands`, idle gaps up to `gap_share` of the time axis inside a band, longer ones white),
    each band stacking the share of its time each kind of task takes on a grid of BAND_CELLS cells;
    a second axes under it draws the first pipeline flush (`flush_end_s`, within FLUSH_SHARE of the
    axis) a bar per task, its end dotted on the first.

    `horizon_s`: the end of the time axis (default: the last task's end), so that charts of
    several strategies share one time axis; it must not cut a task off (ValueError). `title`:
    default for a `SimulationReport`, its strategy, layout and iteration time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if isinstance(report_or_records, SimulationReport):
        records = report_or_records.tasks
        if title is None:
            title = gantt_title(report_or_records.strategy, report_or_records.layout,
                                iteration_s=report_or_records.iteration_time_s)
    else:
        records = list(report_or_records)
    records = [r for r in records if _get(r, "kind") in _COLOURS]
    devices = sorted({(_get(r, "rank"), _get(r, "stage")) for r in records})
    row_of = {device: i for i, device in enumerate(devices)}
    last_end = max((float(_get(r, "end")) for r in records), default=0.0)
    if horizon_s is None:
        horizon = last_end or 1.0
    else:
        horizon = float(horizon_s)
        if not 0 < horizon < float("inf"):
            raise ValueError(f"horizon_s must be a positive number of seconds, got {horizon_s!r}")
        if last_end > horizon * (1 + 1e-9):
            raise ValueError(f"horizon_s {horizon:g} s ends before the last task ({last_end:g} s)")
    bars: _Bars = {}
    for record in records:
        kind, start, end = _get(record, "kind"), float(_get(record, "start")), float(_get(record, "end"))
        merged = kind in COMPUTE_KINDS and str(_get(record, "detail", "") or "").startswith("merge")
        row = row_of[(_get(record, "rank"), _get(record, "stage"))]
        bars.setdefault((kind, merged), []).append((row, start, end - start, _get(record, "unit")))

    rows = max(1, len(devices))
    tasks_of_row = [0] * rows
    for (kind, _), kind_bars in bars.items():
        for row, _, _, _ in kind_bars:
            tasks_of_row[row] += kind in COMPUTE_KINDS
    per_row = max(tasks_of_row)
    aggregated = per_row > aggregate_above
    width = min(20.0, max(12.0, 2.2 * per_row / GANTT_DPI))  # about 2 px per task of the busiest row
    row_height = max(0.12, min(0.45, 12.0 / rows))
    flush_rows = [device for device in devices if device[0] in _first_ranks(devices, FLUSH_ROWS)]
    flush_row_height = max(0.12, min(0.45, 12.0 / max(1, len(flush_rows))))
    heights = [max(1.3, row_height * rows), *([max(1.3, flush_row_height * len(flush_rows))] if aggregated else [])]
    fig, axes = plt.subplots(len(heights), 1, figsize=(width, max(2.8, 1.5 + 0.8 * (len(heights) - 1) + sum(heights))),
                             dpi=GANTT_DPI, squeeze=False, gridspec_kw={"height_ratios": heights})
    ax = axes[0][0]
    ax.set_gid("gantt")
    _rows_axis(ax, devices, horizon * 1.01)
    flush_s = 0.0
    if aggregated:
        low, high = FLUSH_SHARE
        flush_s = min(max(1.05 * flush_end_s(records), low * horizon), high * horizon)
        zoom = axes[1][0]
        zoom.set_gid("gantt flush")
        _rows_axis(zoom, flush_rows, flush_s)
        ranks = sorted({rank for rank, _ in flush_rows})
        which = ("" if len(flush_rows) == rows else f", data-parallel rank {ranks[0]}" if len(ranks) == 1
                 else f", data-parallel ranks {ranks[0]} to {ranks[-1]}")
        zoom.set_title(f"first pipeline flush, one bar per task{which}: 0 to {flush_s:.3g} s "
                       "(left of the dotted line above)", loc="left", fontsize=9)
        ax.axvline(flush_s, color="#555555", linestyle=":", linewidth=1.0, zorder=9)
        ax.set_xlabel("time (s); a band stacks the share of its time each kind of task takes, idle time blank")
    present = set(bars)
    handles = [Patch(facecolor=_gantt_colour(kind, merged), edgecolor="none", label=label)
               for kind, merged, label in _LEGEND if (kind, merged) in present]
    if handles:  # under the time axis, where no title can run into it
        legend = ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0),
                           bbox_transform=fig.transFigure, ncol=len(handles), fontsize=8, frameon=False)
        legend.set_in_layout(False)  # the layout keeps room for it below; as part of the axes it would squeeze them
    if title:
        ax.set_title(title, loc="left")
    fig.tight_layout(rect=(0, 0.3 / fig.get_figheight() if handles else 0, 1, 1))
    # Pixels are known once the layout is: minimum widths are in pixels.
    seconds_per_px = _seconds_per_px(ax)
    if aggregated:
        _draw_bands(ax, bars, rows, horizon, gap_share * horizon, seconds_per_px)
        flushed = {key: [bar for bar in spans if bar[0] < len(flush_rows) and bar[1] < flush_s]
                   for key, spans in bars.items()}
        _draw_units(zoom, flushed, _seconds_per_px(zoom), flush_s / 60)
        _draw_reductions(zoom, flushed, _seconds_per_px(zoom))
    else:
        _draw_units(ax, bars, seconds_per_px, horizon / 60)
    _draw_reductions(ax, bars, seconds_per_px)
    return fig


def context_label(tokens: int) -> str:
    """64K for 65536 tokens; a length that is no whole number of K as it is (1,000)."""
    return f"{tokens // 1024}K" if tokens and tokens % 1024 == 0 else f"{tokens:,}"


def gantt_title(strategy: str, layout: str, *, model: str | None = None, context_length: int | None = None,
                iteration_s: float | None = None, hardware: str | None = None, step: int | None = None,
                measured: bool = False) -> str:
    """A chart's title: what ran and how long it took, e.g. 'slimpack, llama-7b, 64K context, tp8
    pp4 cp1 dp4, step 0: 2.345 s per iteration, simulated on h100-sxm' ('measured on' for a
    measured step; '(simulated)' or '(measured)' after the time without `hardware`); what is not
    given is left out."""
    parts = [strategy, *([model] if model else []),
             *([f"{context_label(context_length)} context"] if context_length else []), layout,
             *([f"step {step}"] if step is not None else [])]
    title = ", ".join(parts)
    if iteration_s is not None:
        source = "measured" if measured else "simulated"
        title += f": {iteration_s:.3f} s per iteration" + (f", {source} on {hardware}" if hardware else f" ({source})")
    return title


def write_gantt(report_or_records, path: str | Path, title: str | None = None,
                horizon_s: float | None = None, *, aggregate_above: int = AGGREGATE_ABOVE,
                gap_share: float = GAP_SHARE) -> Path:
    """A Gantt chart PNG of a `SimulationReport` or of task records (rank, stage, kind, unit,
    start, end, detail: simulated or measured), as `gantt_figure` draws it. `horizon_s`: the end
    of the time axis in seconds (default: the last task's end); give charts that are to be
    compared side by side the same one (e.g. the longest of their iteration times).
    `aggregate_above`, `gap_share`: when rows turn into busy bands (`gantt_figure`)."""
    import matplotlib.pyplot as plt

    fig = gantt_figure(report_or_records, title=title, horizon_s=horizon_s, aggregate_above=aggregate_above,
                       gap_share=gap_share)
    path = Path(path)
    try:
        fig.savefig(path, dpi=GANTT_DPI)
    finally:
        plt.close(fig)
    return path


# ---- Chrome trace ------------------------------------------------------------------------------
def chrome_trace(records: Iterable[Any], metadata: Mapping[str, Any] | None = None, time_scale: float = 1e6) -> dict:
    """Chrome/Perfetto "traceEvents" JSON object from task records.

    A record is a mapping or object with rank, stage, kind, start, end (seconds; `time_scale`
    converts to the trace's microseconds) and optionally unit, replica, detail, name (measured
    traces can set name directly). pid = rank, tid = stage for compute; a stage's P2P and DP
    bars go to tid COMM_TID_OFFSET + stage.
    """
    events: list[dict] = []
    threads: set[tuple[int, int, str]] = set()
    for record in records:
        rank, stage, kind = int(_get(record, "rank")), int(_get(record, "stage")), str(_get(record, "kind"))
        start, end = float(_get(record, "start")), float(_get(record, "end"))
        unit = _get(record, "unit")
        name = _get(record, "name") or (f"{kind}{unit}" if unit is not None and unit >= 0 else kind)
        if _get(record, "chunk"):  # virtual pipeline stages: which model chunk ran it
            name += f" c{_get(record, 'chunk')}"
        tid = stage if kind in COMPUTE_KINDS else COMM_TID_OFFSET + stage
        threads.add((rank, tid, f"stage {stage}" if tid == stage else f"stage {stage} comm"))
        args = {k: _get(record, k) for k in ("unit", "replica", "detail", "chunk") if _get(record, k) not in (None, "")}
        events.append({"name": name, "cat": kind, "ph": "X", "ts": start * time_scale,
                       "dur": max(0.0, end - start) * time_scale, "pid": rank, "tid": tid, "args": args})
    names = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}
             for rank in sorted({rank for rank, _, _ in threads})]
    names += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": label}}
              for rank, tid, label in sorted(threads)]
    names += [{"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid, "args": {"sort_index": tid}}
              for rank, tid, _ in sorted(threads)]
    return {"traceEvents": names + events, "displayTimeUnit": "ms", "otherData": dict(metadata or {})}


def write_chrome_trace(report_or_records, path: str | Path, metadata: Mapping[str, Any] | None = None) -> Path:
    """Write a trace for a `SimulationReport` (its tasks; headline figures as metadata) or records."""
    if isinstance(report_or_records, SimulationReport):
        report = report_or_records
        meta = {"strategy": report.strategy, **summary(report), **dict(metadata or {})}
        trace = chrome_trace(report.tasks, meta)
    else:
        trace = chrome_trace(report_or_records, metadata)
    path = Path(path)
    path.write_text(json.dumps(trace))
    return path
