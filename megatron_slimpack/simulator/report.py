"""Human- and tool-readable outputs of simulations: tables, a Gantt chart, a Chrome trace.

- `markdown_table` / `csv_table`: one row per named report.
- `comparison_table`: the `slimpack compare` table, rows of (strategy, layout, report,
  planning time, speedup reference).
- `figures_source` and `legend`: the lines under a table, saying where its seconds come from and
  what its abbreviated headers mean.
- `write_gantt` (`gantt_figure`): PNG, one row per (data-parallel rank, pipeline stage), an
  optional shared time axis (`horizon_s`); `gantt_title` names what ran and how long it took.
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
# invisible on the one-pixel bars of a step with hundreds of MicroPacks); the legend shows these
# very colours.
_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "DP": "#6E6E6E"}
_MERGED_COLOURS = {"F": "#2CA6A4", "B": "#B5344A"}
_LEGEND = (("F", False, "forward"), ("B", False, "backward"), ("F", True, "DP-Merge group forward"),
           ("B", True, "DP-Merge group backward"), ("DP", False, "DP gradient reduction"))
GANTT_Y_LABEL = "data-parallel rank / pipeline stage"
GANTT_DPI = 120
_MIN_BAR_PX = 1.0  # a task shorter than a pixel is drawn one pixel wide, so that every task shows
_OUTLINED_PX = 6.0  # bars at least this wide keep a thin white outline


def _gantt_colour(kind: str, merged: bool) -> str:
    return _MERGED_COLOURS[kind] if merged and kind in _MERGED_COLOURS else _COLOURS[kind]


def gantt_figure(report_or_records, title: str | None = None, horizon_s: float | None = None):
    """The matplotlib figure `write_gantt` saves (the caller closes it): one row per (data-parallel
    rank, pipeline stage), forward and backward bars with no white edges where they are narrow (the
    edges washed out bars a pixel wide), a task shorter than a pixel drawn a pixel wide with forward
    over backward, DP-Merge group tasks in their own colours (the legend's), the DP gradient
    reduction as a grey strip under the row, idle time white. `horizon_s`: the end of the time
    axis (default: the last task's end), so that charts of several strategies share one time
    axis; it must not cut a task off (ValueError)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    records = report_or_records.tasks if isinstance(report_or_records, SimulationReport) else list(report_or_records)
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
    bars: dict[tuple[str, bool], list[tuple[int, float, float]]] = {}
    for record in records:
        kind, start, end = _get(record, "kind"), float(_get(record, "start")), float(_get(record, "end"))
        merged = kind in COMPUTE_KINDS and str(_get(record, "detail", "") or "").startswith("merge")
        row = row_of[(_get(record, "rank"), _get(record, "stage"))]
        bars.setdefault((kind, merged), []).append((row, start, end - start))

    rows = max(1, len(devices))
    tasks_of_row = [0] * rows
    for (kind, _), kind_bars in bars.items():
        for row, _, _ in kind_bars:
            tasks_of_row[row] += kind in COMPUTE_KINDS
    per_row = max(tasks_of_row)
    width = min(20.0, max(12.0, 2.2 * per_row / GANTT_DPI))  # about 2 px per task of the busiest row
    row_height = max(0.12, min(0.45, 12.0 / rows))
    fig, ax = plt.subplots(figsize=(width, max(2.8, 1.5 + row_height * rows)), dpi=GANTT_DPI)
    labelled = [i for i, (rank, stage) in enumerate(devices)
                if rows <= 48 or stage == min(s for r, s in devices if r == rank)]
    ax.set_yticks(labelled, [f"{devices[i][0]} / {devices[i][1]}" for i in labelled],
                  fontsize=8 if rows <= 32 else 6)
    ax.set_ylabel(GANTT_Y_LABEL if rows >= 6 else GANTT_Y_LABEL.replace(" / ", " /\n"))  # fits a short chart
    ax.set_ylim(rows - 0.5, -0.5)  # rank 0 stage 0 on top
    ax.set_xlabel("time (s)")
    ax.set_xlim(0, horizon * 1.01)
    ax.set_axisbelow(True)
    ax.grid(axis="x", color="#DDDDDD", linewidth=0.6)
    for i in range(1, len(devices)):
        if devices[i][0] != devices[i - 1][0]:  # between data-parallel ranks
            ax.axhline(i - 0.5, color="#BBBBBB", linewidth=0.6, zorder=1)
    present = set(bars)
    handles = [Patch(facecolor=_gantt_colour(kind, merged), edgecolor="none", label=label)
               for kind, merged, label in _LEGEND if (kind, merged) in present]
    if handles:  # under the time axis, where no title can run into it
        ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0), bbox_transform=fig.transFigure,
                  ncol=len(handles), fontsize=8, frameon=False)
    if title:
        ax.set_title(title, loc="left")
    fig.tight_layout(rect=(0, 0.3 / fig.get_figheight() if handles else 0, 1, 1))
    # Pixels are known once the layout is: a task shorter than one is drawn one wide.
    seconds_per_px = (horizon * 1.01) / max(1.0, ax.get_window_extent().width)
    least = _MIN_BAR_PX * seconds_per_px
    order = sorted(present, key=lambda key: ({"DP": 0, "B": 1, "F": 2}[key[0]], key[1]))  # forward on top
    for zorder, (kind, merged) in enumerate(order, start=2):
        # (row, outlined): a bar _OUTLINED_PX or wider keeps a thin white outline that tells
        # neighbours of one colour apart; narrower ones have none (it would cover them).
        by_row: dict[tuple[int, bool], list[tuple[float, float]]] = {}
        for row, start, length in bars[(kind, merged)]:
            outlined = kind in COMPUTE_KINDS and length >= _OUTLINED_PX * seconds_per_px
            by_row.setdefault((row, outlined), []).append((start, max(length, least)))
        for (row, outlined), spans in by_row.items():
            y, height = (row + 0.24, 0.16) if kind == "DP" else (row - 0.4, 0.6)
            ax.broken_barh(spans, (y, height), facecolors=_gantt_colour(kind, merged),
                           edgecolor="white" if outlined else "none", linewidth=0.5 if outlined else 0,
                           antialiased=outlined, zorder=zorder)
    for record in records:  # a bar wide enough for it carries its unit
        kind, start, end = _get(record, "kind"), float(_get(record, "start")), float(_get(record, "end"))
        if kind in COMPUTE_KINDS and end - start > horizon / 60:
            row = row_of[(_get(record, "rank"), _get(record, "stage"))]
            ax.text((start + end) / 2, row - 0.1, f"{kind}{_get(record, 'unit')}", ha="center", va="center",
                    fontsize=6, color="white", clip_on=True, zorder=len(order) + 3)
    return fig


def context_label(tokens: int) -> str:
    """64K for 65536 tokens; a length that is no whole number of K as it is (1,000)."""
    return f"{tokens // 1024}K" if tokens and tokens % 1024 == 0 else f"{tokens:,}"


def gantt_title(strategy: str, layout: str, *, model: str | None = None, context_length: int | None = None,
                iteration_s: float | None = None, hardware: str | None = None, step: int | None = None) -> str:
    """A chart's title: what ran and how long it took, e.g. 'slimpack, llama-7b, 64K context, tp8
    pp4 cp1 dp4, step 0: 2.345 s per iteration, simulated on h100-sxm'; what is not given is left out."""
    parts = [strategy, *([model] if model else []),
             *([f"{context_label(context_length)} context"] if context_length else []), layout,
             *([f"step {step}"] if step is not None else [])]
    title = ", ".join(parts)
    if iteration_s is not None:
        title += f": {iteration_s:.3f} s per iteration" + (f", simulated on {hardware}" if hardware else "")
    return title


def write_gantt(report_or_records, path: str | Path, title: str | None = None,
                horizon_s: float | None = None) -> Path:
    """A Gantt chart PNG of a `SimulationReport` or of task records (rank, stage, kind, unit,
    start, end, detail: simulated or measured), as `gantt_figure` draws it. `horizon_s`: the end
    of the time axis in seconds (default: the last task's end); give charts that are to be
    compared side by side the same one (e.g. the longest of their iteration times)."""
    import matplotlib.pyplot as plt

    fig = gantt_figure(report_or_records, title=title, horizon_s=horizon_s)
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
