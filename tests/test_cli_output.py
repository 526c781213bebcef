"""What `slimpack` prints and draws, as a user reads it:
Megatron's option spellings, the plan table (DP-Merge groups apart, imbalance a max/mean ratio),
the demo's log under its progress bar, Gantt charts readable at hundreds of MicroPacks."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import warnings

import numpy as np
import pytest

import megatron_slimpack as ms
from megatron_slimpack import cli
from megatron_slimpack.config import SlimPackConfig

SMALL = ["--workload", "longtail", "--context-length", "16384", "--global-batch-size", "8",
         "--solver-deterministic-limit", "0.2", "--solver-time-limit", "60"]  # deterministic under load


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """`slimpack argv`: exit status (argparse's exits included), stdout, stderr."""
    try:
        code = cli.main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


# ---- 1. Megatron's spellings -----------------------------------------------------------------

MEGATRON_ARGV = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                 "--context-parallel-size", "2", "--seq-length", "8192", "--recompute-granularity", "selective"]
OWN_ARGV = ["--tp", "2", "--pp", "2", "--cp", "2", "--context-length", "8192", "--recompute", "selective"]


def test_plan_takes_megatron_spellings_as_aliases():
    parser = cli.build_parser()
    assert vars(parser.parse_args(["plan", *MEGATRON_ARGV])) == vars(parser.parse_args(["plan", *OWN_ARGV]))
    help_text = parser._subparsers._group_actions[0].choices["plan"].format_help()
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                 "--seq-length", "--recompute-granularity", "--base-merge"):
        assert flag in help_text


def test_a_plan_made_with_megatron_spellings(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--workload", "longtail", "--global-batch-size", "4", "--dp", "1", "--model", "tiny",
            "--hardware", "cpu", *MEGATRON_ARGV, "--solver-deterministic-limit", "0.2", "--out", str(out)]
    code, printed, _ = run_cli(argv, capsys)
    assert code == 0 and "tp2 pp2 cp2 dp1" in printed
    plan = ms.Plan.from_json(out)
    assert (plan.parallel.tp, plan.parallel.pp, plan.parallel.cp, plan.parallel.recompute) == (2, 2, 2, "selective")
    assert plan.context_length == 8192


def test_megatron_spellings_are_checked_and_named_like_ours(capsys):
    code, _, err = run_cli(["plan", "--tensor-model-parallel-size", "0"], capsys)
    assert code == 2 and "--tensor-model-parallel-size: must be a positive integer, got 0" in err
    code, _, err = run_cli(["plan", "--recompute-granularity", "sometimes"], capsys)
    assert code == 2 and "--recompute-granularity: recompute must be one of" in err and "got 'sometimes'" in err


def stand_in_comparison(monkeypatch) -> dict:
    """`compare` with a stand-in for the search that records its arguments (returned, filled on
    each call) and finds no row (so `compare` exits 2)."""
    from megatron_slimpack import comparison

    seen: dict = {}

    def fake(**kwargs):
        seen.update(kwargs)
        return comparison.ComparisonResult({}, failures={"slimpack": "a stand-in comparison: nothing searched"})

    monkeypatch.setattr(comparison, "run_comparison", fake)
    return seen


def test_compare_takes_seq_length(monkeypatch, capsys):
    seen = stand_in_comparison(monkeypatch)
    code, _, err = run_cli(["compare", "--seq-length", "4096", "--json"], capsys)
    assert code == 2 and "no strategy has a feasible layout" in err  # the stand-in has no row
    assert seen["config"] == SlimPackConfig(context_length=4096, long_documents="split")  # the command's default


def test_plan_base_merge_reproduces_a_compare_cp_layout(tmp_path, capsys):
    """`compare` reports SlimPack's layouts as 'cpK dpD'; `plan --cp 1 --dp K*D --base-merge K` (the form
    Megatron runs) plans the same thing (and printed a traceback before: its table indexed the
    planner's per-replica figures, recorded for the D replicas planned, by the K*D ranks)."""
    as_compare, as_megatron = tmp_path / "cp.json", tmp_path / "merge.json"
    common = [*SMALL, "--tp", "1", "--pp", "2"]
    assert run_cli(["plan", *common, "--cp", "2", "--dp", "2", "--out", str(as_compare)], capsys)[0] == 0
    code, printed, _ = run_cli(["plan", *common, "--cp", "1", "--dp", "4", "--base-merge", "2",
                                "--out", str(as_megatron)], capsys)
    assert code == 0 and "DP-Merge groups (2;" in printed
    times = []
    for path, gantt in ((as_compare, tmp_path / "cp.png"), (as_megatron, tmp_path / "merge.png")):
        code, printed, _ = run_cli(["simulate", str(path), "--json", "--gantt", str(gantt)], capsys)
        assert code == 0 and gantt.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        times.append(json.loads(printed)["iteration_s"])
    assert times[0] == pytest.approx(times[1], rel=1e-9)


# ---- 2. the plan table ---------------------------------------------------------------------------

def _plan_with_an_outlier_group() -> ms.Plan:
    """dp 2: a DP-Merge group [0, 1] that holds nearly all the work and two small replicas of their
    own, with the planner's predicted makespans in the metadata (as SlimPack records them)."""
    from test_simulator import random_plan

    plan = random_plan(3, dp=2, pp=2, micropacks_per_replica=3, merge=True).validate()
    makespans = {(0, 1): 2.387, (0,): 0.010, (1,): 0.012}
    plan.metadata["replicas"] = [{"dp_ranks": list(r.dp_ranks), "makespan_s": makespans[tuple(r.dp_ranks)]}
                                 for r in plan.replicas]
    return plan


@pytest.fixture
def planned_outlier_group(monkeypatch):
    """`slimpack plan` with its planner replaced by one that returns `_plan_with_an_outlier_group()`."""
    from megatron_slimpack.planner import strategies

    plan = _plan_with_an_outlier_group()

    class Planner:
        def plan(self, lengths, parallel, cost, config):
            return plan

    monkeypatch.setattr(strategies, "new_planner", lambda name: Planner())
    return plan


def test_plan_table_shows_dp_merge_groups_apart(planned_outlier_group, capsys):
    """DP-Merge groups are listed apart from the DP ranks (with dp 4 a table of every replica plan would
    show six "replicas"), and a group has no "imbalance" of its own (its time over the mean of the
    ranks' own pipelines would read 217.0 here)."""
    code, printed, _ = run_cli(["plan", *SMALL, "--tp", "1", "--pp", "2", "--dp", "2"], capsys)
    assert code == 0
    ranks_part, groups_part = printed.split("DP-Merge groups (1;")
    rank_rows = [line for line in ranks_part.splitlines() if line.startswith("| ") and line[2].isdigit()]
    group_rows = [line for line in groups_part.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rank_rows) == 2 and len(group_rows) == 1  # one row per rank; the group apart
    assert group_rows[0].startswith("| 0 | 0, 1 | ")
    # each rank's time holds its share of the group: 2.397 and 2.399 s, a ratio near 1, never 238.7
    assert [row.split(" | ")[-3:] for row in rank_rows] == [["2.387", "2.397", "1.000 |"],
                                                            ["2.387", "2.399", "1.000 |"]]
    assert "imbalance (max/mean" in printed and "DP imbalance (max/mean of rank s): 1.000" in printed
    assert "/ mean" not in groups_part and "| imbalance |" not in printed  # (before: a group's "imbalance" 217.000)


def test_plan_json_keeps_ratios_off_groups(planned_outlier_group, capsys):
    code, printed, _ = run_cli(["plan", *SMALL, "--tp", "1", "--pp", "2", "--dp", "2", "--json"], capsys)
    assert code == 0
    step = json.loads(printed)[0]
    group = next(row for row in step["replicas"] if row["kind"] == "DP-Merge group")
    assert group["dp_ranks"] == [0, 1] and group["pipeline_s"] == 2.387 and group["rank_s_over_mean"] is None
    ranks = [row for row in step["replicas"] if row["kind"] == "replica"]
    assert [row["rank_s"] for row in ranks] == pytest.approx([2.397, 2.399])
    assert step["dp_imbalance_max_over_mean"] == pytest.approx(2.399 / 2.398)


# ---- 3. the demo's log under its progress bar ------------------------------------------------------

class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def screen(text: str) -> list[str]:
    """What a terminal shows of `text`: a carriage return moves back to the line's start, where
    the next characters overwrite the old ones."""
    lines, line, column = [], [], 0
    for char in text:
        if char == "\r":
            column = 0
        elif char == "\n":
            lines.append("".join(line).rstrip())
            line, column = [], 0
        else:
            line[column:column + 1] = [char]
            column += 1
    return lines + ["".join(line).rstrip()]


def test_demo_log_lines_and_warnings_go_through_the_bar():
    """The demo's log lines and the progress bar do not overwrite each other: on a terminal each line
    (and each warning of the process) lifts the bar, prints, and redraws the bar below."""
    from megatron_slimpack.apps.demo import StepLog

    terminal = Terminal()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown_before = warnings.showwarning
        log = StepLog(3, stream=terminal)
        log.capture_warnings()
        try:
            log.line(" [step 1] loss 5.5")
            log.advance()
            warnings.warn("something to say", RuntimeWarning, stacklevel=1)
            log.line(" [step 2] loss 5.0")
            log.advance()
            assert screen(terminal.getvalue())[-1].startswith("demo steps: ")  # the bar, last
        finally:
            log.close()
        assert warnings.showwarning is shown_before  # restored
    shown = [line for line in screen(terminal.getvalue()) if line]
    assert shown[0] == " [step 1] loss 5.5" and shown[-1] == " [step 2] loss 5.0"
    warning = [line for line in shown if "RuntimeWarning: " in line]
    assert len(warning) == 1 and warning[0].startswith(__file__) and warning[0].endswith(": something to say")
    assert not any("demo steps" in line for line in shown)  # the bar: never mixed in, cleared at the end


def test_demo_log_to_a_file_is_plain_lines():
    """Captured (a file, a pipe): no bar and no carriage returns in the log."""
    from megatron_slimpack.apps.demo import StepLog

    stream = io.StringIO()
    log = StepLog(2, stream=stream)
    log.line("one")
    log.advance()
    log.line("two")
    log.close()
    assert stream.getvalue() == "one\ntwo\n"


@pytest.mark.slow
def test_demo_stderr_captured_reads_as_plain_lines(tmp_path):
    """A short real demo with stderr piped: every line whole, none with a bar's carriage returns."""
    code = "import sys; from megatron_slimpack.apps.cli import main; sys.exit(main())"
    argv = [sys.executable, "-c", code, "demo", "--steps", "1", "--context-length", "512", "--out-dir", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "\r" not in done.stderr and "demo steps" not in done.stderr
    steps = [line for line in done.stderr.splitlines() if "iteration" in line]
    assert len(steps) == 2 and all(line.startswith(" [") for line in steps)


# ---- 4. Gantt charts ----------------------------------------------------------------------------

def dense_records(pairs: int, merged: int = 0) -> list[dict]:
    """Two pipeline stages of rank 0, `pairs` forward (0.4 s) and backward (0.6 s) tasks back to
    back; the first `merged` pairs of a DP-Merge group."""
    records = []
    for stage in range(2):
        now = 0.0
        for unit in range(pairs):
            for kind, seconds in (("F", 0.4), ("B", 0.6)):
                detail = "merge group [0, 1]" if unit < merged else ""
                records.append({"rank": 0, "stage": stage, "replica": 0, "kind": kind, "unit": unit, "start": now,
                                "end": now + seconds, "detail": detail})
                now += seconds
    return records


def _pixels_near(image: np.ndarray, colour: str) -> int:
    rgb = np.array([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(image[..., :3] - rgb).max(axis=-1) < 0.06).sum())


def test_gantt_of_600_micropacks_keeps_its_colours(tmp_path):
    """At 500+ MicroPacks the bars keep their colours: forward stays visible (white bar edges would wash
    them out: 184 forward-blue pixels against 14,284 backward-orange and 106,056 pale ones)."""
    import matplotlib.image

    from megatron_slimpack.simulator.report import write_gantt

    image = matplotlib.image.imread(write_gantt(dense_records(600), tmp_path / "dense.png"))
    forward, backward = _pixels_near(image, "#4C72B0"), _pixels_near(image, "#DD8452")
    pale = int(((image[..., :3].min(axis=-1) > 0.8) & (image[..., :3].max(axis=-1) < 0.98)).sum())
    assert forward + backward > 100_000
    assert 0.3 < forward / (forward + backward) < 0.5  # 0.4 s of every second is forward
    assert pale < 0.1 * (forward + backward)


def test_gantt_axis_and_legend(tmp_path):
    import matplotlib.pyplot as plt

    from megatron_slimpack.simulator.report import GANTT_Y_LABEL, gantt_figure

    fig = gantt_figure(dense_records(40, merged=10), title="t")
    try:
        ax = fig.axes[0]
        assert " ".join(ax.get_ylabel().split()) == GANTT_Y_LABEL == "data-parallel rank / pipeline stage"
        swatches = {text.get_text(): tuple(handle.get_facecolor())
                    for handle, text in zip(ax.get_legend().legend_handles, ax.get_legend().get_texts())}
        bars = {tuple(colour) for collection in ax.collections for colour in collection.get_facecolors()}
        assert {"forward", "backward", "DP-Merge group forward", "DP-Merge group backward"} == set(swatches)
        assert set(swatches.values()) == bars  # every swatch is a bar colour, every bar colour has one
        assert len(set(swatches.values())) == 4
    finally:
        plt.close(fig)


def test_gantt_shared_time_axis():
    """`horizon_s`: charts of several strategies drawn on one time axis (comparison.py can pass
    the longest iteration); it may not cut a task off."""
    import matplotlib.pyplot as plt

    from megatron_slimpack.simulator.report import gantt_figure

    fig = gantt_figure(dense_records(5), horizon_s=30.0)
    try:
        assert fig.axes[0].get_xlim()[1] == pytest.approx(30.0 * 1.01)
    finally:
        plt.close(fig)
    with pytest.raises(ValueError, match="horizon_s 3 s ends before the last task"):
        gantt_figure(dense_records(5), horizon_s=3.0)
