"""Gantt charts readable at scale: past AGGREGATE_ABOVE tasks a row, busy bands (every busy second
covered, long idle gaps kept) over a per-task panel of the first pipeline flush; gradient
reductions and DP-Merge tasks drawn at least _MIN_MARKED_PX wide; titles that name model,
context, layout and time. The figures are checked through their matplotlib objects."""
from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from megatron_slimpack.simulator import report as gantt
from megatron_slimpack.simulator import simulate
from test_simulator import LLAMA, equal_units_plan, random_plan

F_S, B_S, WAIT_S = 0.3, 0.6, 0.01  # forward, backward, the idle wait after each task
IDLE_S = 20.0  # one long idle gap per row, far over GAP_SHARE of the axis
MERGED_PAIRS = 10  # the first pairs of a row belong to a DP-Merge group
REDUCE_S = 1e-4  # the gradient reduction: far under a pixel


def long_rows(pairs: int = 600, ranks: int = 2, stages: int = 2, idle_after: int = 300) -> list[dict]:
    """Each (rank, stage): `pairs` forward/backward pairs with a short wait after each task, a long
    idle gap after `idle_after` pairs, then a gradient reduction."""
    records = []
    for rank in range(ranks):
        for stage in range(stages):
            now = 0.1 * stage
            for unit in range(pairs):
                if unit == idle_after:
                    now += IDLE_S
                for kind, seconds in (("F", F_S), ("B", B_S)):
                    detail = "merge group [0, 1]" if unit < MERGED_PAIRS else ""
                    records.append({"rank": rank, "stage": stage, "replica": 0, "kind": kind, "unit": unit,
                                    "start": now, "end": now + seconds, "detail": detail})
                    now += seconds + WAIT_S
            records.append({"rank": rank, "stage": stage, "replica": -1, "kind": "DP", "unit": -1, "start": now,
                            "end": now + REDUCE_S, "detail": "gradient reduction"})
    return records


def rectangles(ax, prefix: str) -> list[tuple[str, int, float, float, float, float]]:
    """(gid, row, x0, x1, y0, y1) of every rectangle of the collections whose gid starts with `prefix`."""
    out = []
    for collection in ax.collections:
        gid = collection.get_gid() or ""
        if gid.startswith(prefix):
            for path in collection.get_paths():
                xs, ys = path.vertices[:, 0], path.vertices[:, 1]
                y0, y1 = float(ys.min()), float(ys.max())
                out.append((gid, round((y0 + y1) / 2 + 0.1), float(xs.min()), float(xs.max()), y0, y1))
    return out


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1] + 1e-9:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def px(ax, seconds: float) -> float:
    return float(ax.transData.transform((seconds, 0))[0] - ax.transData.transform((0, 0))[0])


def rows_of(records) -> dict[int, list[tuple[float, float]]]:
    devices = sorted({(r["rank"], r["stage"]) for r in records})
    out: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(devices))}
    for r in records:
        if r["kind"] in ("F", "B"):
            out[devices.index((r["rank"], r["stage"]))].append((r["start"], r["end"]))
    return out


@pytest.fixture
def large():
    records = long_rows()
    fig = gantt.gantt_figure(records, title="large")
    yield records, fig
    plt.close(fig)


def test_a_large_chart_draws_far_fewer_rectangles_than_tasks(large):
    records, fig = large
    ax, flush = fig.axes
    assert (ax.get_gid(), flush.get_gid()) == ("gantt", "gantt flush")
    bands = rectangles(ax, "band")
    units = [r for r in records if r["kind"] in ("F", "B")]
    assert rectangles(ax, "unit") == []  # no bar per task on the main axes
    assert 0 < len(bands) < len(units) / 5
    rows = {row for _, row, *_ in bands}
    assert rows == {0, 1, 2, 3}
    for row in rows:  # bounded by the grid, not by the task count
        assert sum(1 for band in bands if band[1] == row) <= 4 * (gantt.BAND_CELLS + 2)
    assert {gid for gid, *_ in bands} == {"band F", "band B", "band F merged", "band B merged"}


def rows_with_bands(records, fig):
    """(row, its tasks sorted, its band rectangles, the time axis's end) of every row of the chart."""
    bands = rectangles(fig.axes[0], "band")
    horizon = max(r["end"] for r in records)
    for row, tasks in rows_of(records).items():
        yield row, sorted(tasks), [band for band in bands if band[1] == row], horizon


def test_every_busy_second_is_inside_a_band(large):
    for row, tasks, mine, horizon in rows_with_bands(*large):
        covered = union([(x0, x1) for _, _, x0, x1, _, _ in mine])
        busy = sum(end - start for start, end in tasks)
        waits = (len(tasks) - 2) * WAIT_S  # the waits inside the bands; the long gap is not one
        assert sum(end - start for start, end in covered) == pytest.approx(busy + waits, rel=1e-9)
        assert waits < 0.03 * busy
        for start, end in tasks:
            assert any(low - 1e-9 <= start and end <= high + 1e-9 for low, high in covered)
        # A band's layers are as tall as the share of its time each kind takes: areas add up to the busy time.
        area = sum((x1 - x0) * (y1 - y0) / 0.6 for _, _, x0, x1, y0, y1 in mine)
        assert area == pytest.approx(busy, rel=1e-9)
        for _, _, _, _, y0, y1 in mine:
            assert row - 0.4 - 1e-9 <= y0 < y1 <= row + 0.2 + 1e-9
        assert gantt.GAP_SHARE * horizon > WAIT_S


def test_idle_gaps_over_the_threshold_stay_gaps(large):
    for _, tasks, mine, horizon in rows_with_bands(*large):
        gaps = [(a_end, b_start) for (_, a_end), (b_start, _) in zip(tasks, tasks[1:])
                if b_start - a_end > gantt.GAP_SHARE * horizon]
        assert len(gaps) == 1 and gaps[0][1] - gaps[0][0] == pytest.approx(IDLE_S + WAIT_S)
        for low, high in gaps:
            assert not [band for band in mine if band[2] < high - 1e-9 and band[3] > low + 1e-9]


def test_busy_bands_merge_short_gaps_only():
    assert gantt.busy_bands([(2.0, 3.0), (0.0, 1.0), (1.05, 1.5), (1.4, 1.8)], gap_s=0.1) == [(0.0, 1.8),
                                                                                               (2.0, 3.0)]
    assert gantt.busy_bands([], gap_s=1.0) == []


def test_reductions_are_drawn_at_least_the_minimum_width_with_a_marker(large):
    records, fig = large
    ax = fig.axes[0]
    strips = rectangles(ax, "reduction strip")
    reductions = [r for r in records if r["kind"] == "DP"]
    assert len(strips) == len(reductions) == 4
    for _, _, x0, x1, _, _ in strips:
        assert px(ax, x1 - x0) >= gantt._MIN_MARKED_PX - 1e-6
        assert px(ax, REDUCE_S) < 0.1  # what it would be drawn at its own length
    markers = [c for c in ax.collections if c.get_gid() == "reduction marker"]
    assert len(markers) == 1 and len(markers[0].get_offsets()) == len(reductions)
    swatches = {text.get_text(): tuple(handle.get_facecolor())
                for handle, text in zip(ax.get_legend().legend_handles, ax.get_legend().get_texts())}
    colour = tuple(next(c for c in ax.collections if c.get_gid() == "reduction strip").get_facecolors()[0])
    assert swatches["DP gradient reduction"] == colour == tuple(markers[0].get_facecolors()[0])
    compute = {tuple(c.get_facecolors()[0]) for c in ax.collections if (c.get_gid() or "").startswith("band")}
    assert colour not in compute  # a colour of its own


def test_dp_merge_tasks_are_drawn_at_least_the_minimum_width():
    task = {"rank": 0, "stage": 0, "detail": ""}
    records = [{**task, "kind": "F", "unit": 0, "start": 0.0, "end": 1e-4, "detail": "merge group [0, 1]"},
               {**task, "kind": "F", "unit": 1, "start": 5.0, "end": 5.0 + 1e-4},
               {**task, "kind": "B", "unit": 1, "start": 6.0, "end": 10.0}]
    fig = gantt.gantt_figure(records)
    try:
        ax = fig.axes[0]
        widths = {gid: px(ax, x1 - x0) for gid, _, x0, x1, _, _ in rectangles(ax, "unit")}
        assert widths["unit F merged"] >= gantt._MIN_MARKED_PX - 1e-6
        assert gantt._MIN_BAR_PX - 1e-6 <= widths["unit F"] < gantt._MIN_MARKED_PX
    finally:
        plt.close(fig)


def test_the_flush_panel_draws_a_bar_per_task(large):
    records, fig = large
    ax, flush = fig.axes
    horizon = max(r["end"] for r in records)
    end = gantt.flush_end_s(records)
    assert end == pytest.approx(0.1 + F_S + B_S + WAIT_S)  # stage 1 starts backward last
    low, high = gantt.FLUSH_SHARE
    assert flush.get_xlim() == pytest.approx((0.0, min(max(1.05 * end, low * horizon), high * horizon)))
    shown = [r for r in records if r["kind"] in ("F", "B") and r["start"] < flush.get_xlim()[1]]
    bars = rectangles(flush, "unit")
    assert len(bars) == len(shown) > 0
    assert {gid for gid, *_ in bars} == {"unit F merged", "unit B merged", "unit F", "unit B"}
    assert rectangles(flush, "band") == []
    assert flush.get_title(loc="left").startswith("first pipeline flush, one bar per task: 0 to ")
    assert [line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == ":"] == [flush.get_xlim()[1]]


def test_the_flush_panel_keeps_to_the_first_ranks():
    fig = gantt.gantt_figure(long_rows(pairs=40, ranks=12, idle_after=20), aggregate_above=10)
    try:
        ax, flush = fig.axes
        assert len(ax.get_yticks()) == 24 and len(flush.get_yticks()) == gantt.FLUSH_ROWS
        assert {row for _, row, *_ in rectangles(flush, "unit")} == set(range(gantt.FLUSH_ROWS))
        assert "data-parallel ranks 0 to 7" in flush.get_title(loc="left")
    finally:
        plt.close(fig)


def test_a_small_chart_keeps_a_bar_per_task():
    records = long_rows(pairs=30, idle_after=15)  # 60 tasks a row: not over AGGREGATE_ABOVE
    fig = gantt.gantt_figure(records)
    try:
        assert len(fig.axes) == 1
        ax = fig.axes[0]
        assert rectangles(ax, "band") == []
        bars = rectangles(ax, "unit")
        units = [r for r in records if r["kind"] in ("F", "B")]
        assert len(bars) == len(units)
        drawn = sorted((row, round(x0, 9)) for _, row, x0, *_ in bars)
        devices = sorted({(r["rank"], r["stage"]) for r in records})
        assert drawn == sorted((devices.index((r["rank"], r["stage"])), round(r["start"], 9)) for r in units)
        for (_, row, x0, x1, y0, y1), unit in zip(sorted(bars, key=lambda b: (b[1], b[2])),
                                                  sorted(units, key=lambda r: (devices.index((r["rank"], r["stage"])),
                                                                                r["start"]))):
            assert x1 - x0 == pytest.approx(unit["end"] - unit["start"])
            assert (y0, y1) == pytest.approx((row - 0.4, row + 0.2))
    finally:
        plt.close(fig)
    fig = gantt.gantt_figure(long_rows(pairs=200), aggregate_above=10_000)  # the threshold is a parameter
    try:
        assert len(fig.axes) == 1 and len(rectangles(fig.axes[0], "unit")) == 4 * 400
    finally:
        plt.close(fig)


def test_a_simulated_1f1b_step_of_many_micropacks_is_a_few_bands():
    report = simulate(equal_units_plan(300, pp=4, dp=2), LLAMA)
    fig = gantt.gantt_figure(report)
    try:
        ax = fig.axes[0]
        assert len(fig.axes) == 2
        assert ax.get_title(loc="left") == (f"test, {report.layout}: {report.iteration_time_s:.3f} s per iteration "
                                            "(simulated)")
        units = [task for task in report.tasks if task.kind in ("F", "B")]
        assert len(units) == 4800 and len(rectangles(ax, "band")) < 100  # warm-up, steady phase, cool-down
    finally:
        plt.close(fig)


def test_a_simulated_plan_with_ragged_idle_time():
    """Random schedules leave many idle gaps: each over the threshold stays one, every task is inside a band."""
    report = simulate(random_plan(3, dp=2, pp=2, micropacks_per_replica=120, merge=True).validate(), LLAMA)
    records = [task.to_dict() for task in report.tasks]
    fig = gantt.gantt_figure(report)
    try:
        ax = fig.axes[0]
        bands = rectangles(ax, "band")
        horizon = report.iteration_time_s
        least = gantt._MIN_MARKED_PX * horizon * 1.01 / ax.get_window_extent().width  # a widened band's reach
        gaps = 0
        for row, tasks in rows_of(records).items():
            mine = [band for band in bands if band[1] == row]
            covered = union([(x0, x1) for _, _, x0, x1, _, _ in mine])
            for start, end in tasks:
                assert any(low - 1e-9 <= start and end <= high + 1e-9 for low, high in covered)
            area = sum((x1 - x0) * (y1 - y0) / 0.6 for _, _, x0, x1, y0, y1 in mine)
            busy = sum(end - start for start, end in tasks)
            assert area == pytest.approx(busy, rel=0.01)  # bands under a pixel are widened to one
            tasks.sort()
            for (_, a_end), (b_start, _) in zip(tasks, tasks[1:]):
                if b_start - a_end > gantt.GAP_SHARE * horizon:
                    gaps += 1
                    assert not [b for b in mine if b[2] < b_start - 1e-9 and b[3] > a_end + least]
        assert gaps > 50
        assert len(rectangles(ax, "reduction strip")) == sum(r["kind"] == "DP" for r in records) > 0
    finally:
        plt.close(fig)


def test_titles_name_model_context_layout_and_time():
    title = gantt.gantt_title("slimpack", "tp1 pp2 vpp4 cp1 dp64", model="llama-7b", context_length=262144,
                              iteration_s=124.4, hardware="h100-sxm")
    assert title == ("slimpack, llama-7b, 256K context, tp1 pp2 vpp4 cp1 dp64: 124.400 s per iteration, "
                     "simulated on h100-sxm")
    assert (gantt.gantt_title("slimpack", "tp1 pp2 dp1", iteration_s=1.5)
            == "slimpack, tp1 pp2 dp1: 1.500 s per iteration (simulated)")
    assert gantt.gantt_title("slimpack", "pp2", model="tiny", context_length=512, iteration_s=0.25, hardware="cpu",
                             step=3, measured=True) == ("slimpack, tiny, 512 context, pp2, step 3: 0.250 s per "
                                                        "iteration, measured on cpu")
    fig = gantt.gantt_figure(long_rows(), title=title)
    try:
        assert fig.axes[0].get_title(loc="left") == title
    finally:
        plt.close(fig)


def test_write_gantt_passes_the_thresholds_on(tmp_path):
    path = gantt.write_gantt(long_rows(pairs=40), tmp_path / "chart.png", title="t", aggregate_above=10,
                             gap_share=0.01)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(path).shape[0] > 400  # two panels
