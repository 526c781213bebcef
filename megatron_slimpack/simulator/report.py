"""Human- and tool-readable outputs of simulations: tables, a Gantt chart, a Chrome trace.

- `markdown_table` / `csv_table`: one row per named report.
- `comparison_table`: the `slimpack compare` table, rows of (strategy, layout, report,
  planning time, speedup reference).
- `write_gantt`: PNG, one row per (rank, stage) device.
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


def comparison_table(rows: Iterable[ComparisonRow | tuple], fmt: str = "markdown") -> str:
    """Rows as `ComparisonRow`s or tuples (strategy, layout, report, planning_time_s, reference);
    fmt: markdown | csv."""
    values = [(row if isinstance(row, ComparisonRow) else ComparisonRow(*row)).values() for row in rows]
    if fmt == "markdown":
        return _markdown(values)
    if fmt == "csv":
        return _csv(values)
    raise ValueError(f"unknown table format {fmt!r}; use markdown or csv")


_HEADERS = {
    "name": "name", "strategy": "strategy", "layout": "layout", "iteration_s": "iteration (s)",
    "tokens_per_s": "tokens/s", "mfu": "MFU", "bubble_ratio": "bubble", "dp_imbalance": "DP imb.",
    "pp_imbalance": "PP imb.", "peak_memory_gib": "peak mem (GiB)", "fits_memory": "fits",
    "dp_reduce_exposed_s": "DP exposed (s)", "lower_bound_s": "lower bound (s)",
    "planning_s": "planning (s)", "speedup": "speedup",
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
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) >= 0.01 or value == 0 else f"{value:.2e}"
    return str(value)


def _markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    lines = ["| " + " | ".join(_HEADERS.get(k, k) for k in keys) + " |",
             "|" + "|".join("---" if k in ("name", "strategy", "layout") else "---:" for k in keys) + "|"]
    lines += ["| " + " | ".join(_format(k, row[k]) for k in keys) + " |" for row in rows]
    return "\n".join(lines) + "\n"


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
_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "DP": "#8C8C8C"}


def write_gantt(report_or_records, path: str | Path, title: str | None = None) -> Path:
    """A Gantt chart PNG: one row per (rank, stage), forward blue, backward orange (DP-Merge
    group tasks hatched), DP gradient reduction as a grey hatched strip at the bottom of the
    row, idle time left white. Bars wide enough for it carry their unit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    records = report_or_records.tasks if isinstance(report_or_records, SimulationReport) else list(report_or_records)
    devices = sorted({(_get(r, "rank"), _get(r, "stage")) for r in records})
    row_of = {device: i for i, device in enumerate(devices)}
    horizon = max((_get(r, "end") for r in records), default=1.0) or 1.0
    bars: dict[tuple[int, str, bool], list[tuple[float, float]]] = {}
    fig, ax = plt.subplots(figsize=(12, 1.4 + 0.45 * max(1, len(devices))))
    for record in records:
        kind = _get(record, "kind")
        if kind not in _COLOURS:
            continue
        start, end = _get(record, "start"), _get(record, "end")
        row = row_of[(_get(record, "rank"), _get(record, "stage"))]
        merged = str(_get(record, "detail", "")).startswith("merge")
        bars.setdefault((row, kind, merged), []).append((start, end - start))
        if kind in COMPUTE_KINDS and end - start > horizon / 60:
            ax.text((start + end) / 2, row - 0.1, f"{kind}{_get(record, 'unit')}", ha="center", va="center",
                    fontsize=6, color="white", clip_on=True)
    for (row, kind, merged), spans in bars.items():
        if kind == "DP":
            ax.broken_barh(spans, (row + 0.22, 0.18), facecolors="white", edgecolor=_COLOURS[kind], hatch="////",
                           linewidth=0.5)
        else:
            ax.broken_barh(spans, (row - 0.4, 0.6), facecolors=_COLOURS[kind], edgecolor="white", linewidth=0.3,
                           hatch=".." if merged else None)
    ax.set_yticks(range(len(devices)), [f"rank {r} stage {s}" for r, s in devices])
    ax.set_ylim(len(devices) - 0.5, -0.5)  # rank 0 stage 0 on top
    ax.set_xlabel("time (s)")
    ax.set_xlim(0, horizon * 1.01)
    ax.legend(handles=[Patch(color=_COLOURS["F"], label="forward"), Patch(color=_COLOURS["B"], label="backward"),
                       Patch(facecolor="#999999", hatch="..", label="DP-Merge group"),
                       Patch(facecolor="white", edgecolor=_COLOURS["DP"], hatch="////", label="DP reduction")],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=4, fontsize=7, frameon=False)
    if title:
        ax.set_title(title, loc="left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
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
        tid = stage if kind in COMPUTE_KINDS else COMM_TID_OFFSET + stage
        threads.add((rank, tid, f"stage {stage}" if tid == stage else f"stage {stage} comm"))
        args = {k: _get(record, k) for k in ("unit", "replica", "detail") if _get(record, k) not in (None, "")}
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
