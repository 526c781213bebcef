"""`slimpack compare` rows: one figure per batch, consistent with `plan` + `simulate`: a row's time,
MFU and lower bound come from the same steps, so no row beats its own bound."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

import megatron_slimpack as ms
from megatron_slimpack import cli, comparison
from megatron_slimpack.apps.comparison import run_comparison
from megatron_slimpack.simulator import per_batch_report, simulate

COST = ms.CostModel.analytic("llama-7b", "h100-sxm")
CONTEXT = 32768
CONFIG = ms.SlimPackConfig(context_length=CONTEXT, solver_time_limit_s=60.0, solver_deterministic_limit=0.2)


def batches(count: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[int(x) for x in np.clip(rng.lognormal(8.0, 1.6, 120), 1, CONTEXT)] for _ in range(count)]


def compare(steps: int, strategies: str):
    return run_comparison(workload="given", model="llama-7b", hardware="h100-sxm", cost=COST, gpus=8,
                          global_batch_size=120, strategies=strategies, config=CONFIG, show_progress=False,
                          batches=batches(steps))


@pytest.mark.parametrize("strategy", ["slimpack", "wlb-llm"])
def test_a_row_is_every_step_together_and_never_beats_its_bound(strategy):
    result = compare(3, strategy)
    steps = result.results[strategy].reports  # wlb-llm: three batches and the final flush
    times = [r.iteration_time_s for r in steps]
    for row in result.rows():
        report = row.report
        assert report.iteration_time_s == pytest.approx(sum(times) / 3)
        assert report.lower_bound_s == pytest.approx(sum(r.lower_bound_s for r in steps) / 3)
        assert report.mfu == pytest.approx(sum(r.mfu * t for r, t in zip(steps, times)) / sum(times))
        assert report.iteration_time_s >= report.lower_bound_s * (1 - 1e-12)


def test_a_delaying_strategy_gets_its_steady_state_figures_beside_its_mean():
    """wlb-llm trains what its queues still hold after the last batch in a final flush, which its
    mean counts; its steady-state figures leave the flush out: tokens per second over the planned
    steps, and the seconds a global batch of the same tokens takes at that rate."""
    result = compare(3, "megatron-fixed,wlb-llm")
    states = result.steady_states()
    assert list(states) == ["wlb-llm"]  # megatron-fixed has no flush
    figure, reports = states["wlb-llm"], result.results["wlb-llm"].reports
    planned, flush = reports[:3], reports[3]
    assert len(reports) == 4 and figure["steps"] == 3
    rate = sum(r.num_tokens for r in planned) / sum(r.iteration_time_s for r in planned)
    assert figure["tokens_per_s"] == pytest.approx(rate, rel=1e-12)
    assert figure["flush_tokens"] == flush.num_tokens > 0
    assert figure["flush_s"] == flush.iteration_time_s
    given = sum(sum(lengths) for lengths in batches(3))
    assert sum(r.num_tokens for r in reports) == given  # every token trained once, in a step or the flush
    assert figure["iteration_s"] == pytest.approx(given / 3 / rate, rel=1e-12)
    note = next(line for line in result.notes() if line.startswith("wlb-llm delays documents"))
    fixed = result.results["megatron-fixed"].mean_iteration_time_s
    assert f"{figure['flush_tokens']:,} tokens" in note and f"{figure['iteration_s']:.3f} s" in note
    assert f"{fixed / figure['iteration_s']:.2f}x over megatron-fixed" in note
    assert json.loads(json.dumps(result.to_dict()))["steady_state"] == {"wlb-llm": pytest.approx(figure)}


def test_wlb_llm_is_compared_with_its_fastest_delay_thresholds_at_its_layout():
    """A comparison tunes WLB-LLM's delay thresholds on the layout its search chose (its paper tunes
    them): each candidate is run over the batches at that layout, the fastest mean is its row, and
    the note says how to train with it."""
    from megatron_slimpack.planner.baselines.wlb_llm import DELAY_CANDIDATES
    from megatron_slimpack.planner.layouts import best_layout

    result = compare(3, "wlb-llm")
    found = result.results["wlb-llm"]
    tuning = found.plans[0].metadata["delay_tuning"]
    assert list(tuning) == list(DELAY_CANDIDATES)  # the configured ones (the default) first
    means = {text: seconds for text, seconds in tuning.items() if isinstance(seconds, float)}
    chosen = ",".join(f"{f:g}" for f in found.plans[0].metadata["delay_fractions"])
    assert found.mean_iteration_time_s == pytest.approx(min(means.values()), rel=1e-12) == means[chosen]
    searched = best_layout("wlb-llm", batches(3), COST, 8, CONTEXT, CONFIG)  # three finalists
    assert searched.parallel == found.parallel  # tuned at the layout the search chose
    # a stateful strategy's comparison searches for its best alone (`search_finalists`): the same best
    assert [e.parallel for e in found.finalists] == [found.parallel] and len(searched.finalists) > 1
    assert means["0.5,0.25"] == pytest.approx(searched.mean_iteration_time_s, rel=1e-12)
    for text, seconds in means.items():  # each candidate as a run of its own thresholds would time it
        alone = best_layout("wlb-llm", batches(3), COST, 8, CONTEXT, CONFIG.with_(wlb_delay_fractions=text),
                            layouts=[found.parallel])
        assert seconds == pytest.approx(alone.mean_iteration_time_s, rel=1e-12)
    note = next(line for line in result.notes() if line.startswith("wlb-llm: delay thresholds"))
    assert f"--slimpack-wlb-delay-fractions '{chosen}'" in note


def test_one_batch_compare_equals_plan_and_simulate_of_its_layout():
    result = compare(1, "slimpack")
    row = result.rows()[0]
    layout = result.results["slimpack"]
    plan = ms.plan(batches(1)[0], parallel=layout.parallel, cost=COST, config=CONFIG)
    report = ms.simulate(plan, COST)
    assert row.report.iteration_time_s == pytest.approx(report.iteration_time_s, rel=1e-12)
    assert row.report.mfu == pytest.approx(report.mfu, rel=1e-12)
    assert row.report.lower_bound_s == pytest.approx(report.lower_bound_s, rel=1e-12)


def test_a_comparison_keeps_the_plans_of_each_strategys_best_layout_only():
    """The other finalists keep their reports (their means, in the JSON) but not their plans,
    which nothing reads and a worker would pickle back; the best keeps one plan per batch."""
    found = compare(2, "megatron-fixed").results["megatron-fixed"]
    others = [e for e in found.finalists if e is not found.best]
    assert others and found.best in found.finalists and len(found.best.plans) == 2
    assert all(e.plans == [] and len(e.reports) == 2 and e.mean_iteration_time_s >= found.mean_iteration_time_s
               for e in others)


def test_per_batch_report_is_the_steps_together():
    plans = [ms.plan(lengths, parallel=ms.ParallelConfig(dp=2, pp=2, tp=2), cost=COST, config=CONFIG)
             for lengths in batches(3)]
    reports = [simulate(plan, COST, detail=False) for plan in plans]
    combined = per_batch_report(reports, 3)
    times = [r.iteration_time_s for r in reports]
    assert combined.iteration_time_s == pytest.approx(sum(times) / 3)
    assert combined.lower_bound_s == pytest.approx(sum(r.lower_bound_s for r in reports) / 3)
    assert combined.mfu == pytest.approx(sum(r.mfu * t for r, t in zip(reports, times)) / sum(times))
    assert combined.peak_memory_bytes == [max(r.peak_memory_bytes[s] for r in reports) for s in range(2)]
    assert min(r.mfu for r in reports) <= combined.mfu <= max(r.mfu for r in reports)
    with pytest.raises(ValueError):
        per_batch_report([], 1)


COMPARE_SMALL = ["compare", "--workload", "longtail", "--model", "tiny", "--hardware", "cpu", "--gpus", "2",
                 "--context-length", "4096", "--global-batch-size", "4", "--strategies", "megatron-fixed,bfd"]


def test_markdown_is_a_document_with_notes_as_a_list_and_charts_as_images(monkeypatch, capsys):
    """`compare --markdown` prints a Markdown document: the table, notes as list items (plain lines
    would run together into one paragraph) and each Gantt chart as an image."""
    real = comparison.run_comparison

    def with_note_and_chart(**kwargs):
        result = real(**kwargs)
        result.failures["slimpipe"] = "no layout fits in memory"
        result.gantt_files.append("charts/bfd.png")
        return result

    monkeypatch.setattr(comparison, "run_comparison", with_note_and_chart)
    assert cli.main([*COMPARE_SMALL, "--markdown"]) == 0
    out = capsys.readouterr().out
    table, source, legend, notes, image = out.split("\n\n")
    assert table.splitlines()[0].startswith("| strategy | layout |") and len(table.splitlines()) == 4
    assert source == "simulated on cpu with cost model analytic, model tiny"
    assert legend == "legend: MFU = model FLOPs utilisation; bubble = idle share of all devices' time"
    note_lines = notes.splitlines()
    assert note_lines[0] == "- slimpipe: no feasible layout (no layout fits in memory)"
    # the overlaps each strategy is priced with, and their Megatron flags
    assert note_lines[1].startswith("- overlaps priced: megatron-fixed: TP") and "--overlap-grad-reduce" in notes
    assert image == "![bfd Gantt chart](charts/bfd.png)\n"
    assert cli.main(COMPARE_SMALL) == 0  # the default: the table and plain note lines
    assert "Gantt chart: charts/bfd.png" in capsys.readouterr().out


def test_output_formats_exclude_each_other(capsys):
    assert cli.main([*COMPARE_SMALL, "--markdown", "--csv"]) == 2
    assert "--csv and --markdown each choose the output format; give one of them" in capsys.readouterr().err
    assert cli.main([*COMPARE_SMALL, "--json", "--markdown"]) == 2
    assert cli.main([*COMPARE_SMALL, "--csv"]) == 0
    assert capsys.readouterr().out.startswith("strategy,layout,iteration_s,")


def test_compare_shows_megatron_stock_as_a_labelled_reference(capsys):
    """Stock pretrain_gpt.py (cross-document attention) is a reference row with its own
    speedup column and a note saying what it trains; it is never the fastest other strategy."""
    argv = [*COMPARE_SMALL[:-1], "megatron-fixed,megatron-stock,slimpack"]
    assert cli.main([*argv, "--markdown"]) == 0
    out = capsys.readouterr().out
    table, _, _, notes = out.split("\n\n")[:4]  # the table, its source and legend lines, the notes
    assert "| speedup vs megatron-fixed | speedup vs megatron-stock |" in table.splitlines()[0]
    assert any(line.startswith("| megatron-stock |") and "| 1.00x |" in line for line in table.splitlines())
    notes = notes.splitlines()
    assert notes[0].startswith("- megatron-stock is a reference, left out of the fastest other strategy: "
                               "cross-document attention")
    headline = next(line for line in notes if line.startswith("- slimpack: "))
    assert "over the fastest other strategy (megatron-fixed)" in headline
    assert "over megatron-stock (cross-document attention, a different training semantic)" in headline
    assert cli.main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fastest_other"] == "megatron-fixed" and list(data["references"]) == ["megatron-stock"]
    assert all(row["speedup_vs_stock"] > 0 for row in data["rows"])


def test_gantt_charts_of_a_comparison_share_one_time_axis(tmp_path, monkeypatch):
    """`compare --gantt-dir` draws every strategy on the same time axis (the longest step)."""
    from megatron_slimpack import comparison
    from megatron_slimpack.costmodel import CostModel

    horizons = {}

    def record(report, path, title=None, horizon_s=None):
        horizons[Path(path).stem] = (horizon_s, report.iteration_time_s)

    monkeypatch.setattr(comparison, "write_gantt", record)
    cost = CostModel.analytic("llama-7b", "h100-sxm")
    comparison.run_comparison(workload="text", model="llama-7b", hardware="h100-sxm", cost=cost, gpus=8,
                              context_length=8192, global_batch_size=8, strategies="megatron-fixed,slimpack",
                              seed=0, long_documents="split", gantt_dir=str(tmp_path), show_progress=False)
    assert set(horizons) == {"megatron-fixed", "slimpack"}
    longest = max(own for _, own in horizons.values())
    assert all(horizon == longest for horizon, _ in horizons.values())


def test_compare_table_is_compact_by_default_and_wide_on_request():
    """A compact default table (speedup named as over megatron-fixed), every column under
    --wide, and no scientific notation among the figures."""
    from megatron_slimpack import cli

    argv = ["compare", "--gpus", "8", "--context-length", "8192", "--global-batch-size", "16",
            "--strategies", "megatron-fixed,slimpack"]
    tables = {}
    for extra in ([], ["--wide"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            assert cli.main(argv + extra) == 0
        tables[bool(extra)] = out.getvalue().splitlines()[0]
    compact, wide = tables[False], tables[True]
    assert compact == ("| strategy | layout | iteration (s) | tokens/s | MFU | speedup vs megatron-fixed | bubble "
                       "| peak mem (GiB) |")
    assert "lower bound (s)" in wide and "DP imb." in wide and "planning (s)" in wide
    from megatron_slimpack.simulator.report import _format

    assert _format("planning_s", 0.000839) == "<0.001" and _format("iteration_s", 0.0123) == "0.012"


def test_compare_json_states_each_strategys_overlaps_and_objective(capsys):
    """Which communication each row was priced as hiding, the flags that give it on a cluster, and
    what each strategy trains."""
    import json

    assert cli.main([*COMPARE_SMALL, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    fixed, bfd = result["overlaps"]["megatron-fixed"], result["overlaps"]["bfd"]
    assert fixed["tp_comm"] and "--tp-comm-overlap" in fixed["flags"]
    # bfd runs on the SlimPack runtime: its TP rings, not TE's userbuffers
    assert bfd["tp_comm"] and "--slimpack-tp-overlap" in bfd["flags"] and "--tp-comm-overlap" not in bfd["flags"]
    assert "--overlap-grad-reduce" in bfd["flags"]
    assert result["objectives"] == {"megatron-fixed": "documents cut at sequence boundaries", "bfd": "documents whole"}


def _single_layout_result(name: str, plan) -> "comparison.LayoutResult":
    from megatron_slimpack.planner.layouts import LayoutEvaluation, LayoutResult

    report = simulate(plan, COST, detail=False)
    evaluation = LayoutEvaluation(plan.parallel, [plan], [report], 1)
    return LayoutResult(name, plan.parallel.world_size, evaluation, [evaluation], [(plan.parallel, 0.0)], [], 0.0, 1)


def test_a_competitor_faster_than_slimpack_is_explained_by_its_overlaps_and_attention_pairs():
    """Where megatron-fixed is faster, the notes say what its plans cost with SlimPack's overlaps
    (re-priced here by hand), what share of SlimPack's attention pairs it computes, and how much of
    SlimPack's own step is idle."""
    from megatron_slimpack.costmodel.overlaps import overlaps_of
    from megatron_slimpack.planner.strategies import new_planner

    lengths = batches(1)[0]
    parallel = ms.ParallelConfig(dp=1, pp=1, tp=8)
    fixed = new_planner("megatron-fixed").plan(lengths, parallel, COST, CONFIG.with_(strategy="megatron-fixed"))
    mine = new_planner("slimpack").plan(lengths, parallel, COST, CONFIG.with_(strategy="slimpack"))
    result = comparison.ComparisonResult({"megatron-fixed": _single_layout_result("megatron-fixed", fixed),
                                          "slimpack": _single_layout_result("slimpack", mine)})
    fixed_s = result.results["megatron-fixed"].mean_iteration_time_s
    mine_s = result.results["slimpack"].mean_iteration_time_s
    repriced_s = simulate(fixed, COST, detail=False, overlaps=overlaps_of("slimpack")).iteration_time_s
    assert repriced_s == pytest.approx(fixed_s)  # tp8 cp1: both runtimes hide the TP collectives
    assert fixed_s < mine_s
    lines = comparison.why_slower(result, COST)
    assert len(lines) == 1 and lines[0].startswith("slimpack is slower than megatron-fixed")
    assert f"its plans take {repriced_s:.3f} s, still faster" in lines[0]
    pairs = (sum(m.attention_pairs for r in fixed.replicas for m in r.micropacks)
             / sum(m.attention_pairs for r in mine.replicas for m in r.micropacks))
    assert f"it computes {pairs:.1%} of slimpack's attention pairs" in lines[0]
    own = simulate(mine, COST, detail=False)
    assert lines[0].endswith(f"slimpack's devices idle {own.bubble_ratio:.1%} of its step (pipeline bubbles and "
                             f"waits; its busiest rank computes {own.dp_imbalance - 1:.1%} more than the mean)")
    result.explanations = lines
    assert lines[0] in result.notes() and result.to_dict()["explanations"] == lines


def test_no_explanation_where_slimpack_is_fastest():
    lengths = batches(1)[0]
    parallel = ms.ParallelConfig(dp=1, pp=1, tp=8)
    from megatron_slimpack.planner.strategies import new_planner

    mine = new_planner("slimpack").plan(lengths, parallel, COST, CONFIG.with_(strategy="slimpack"))
    slow = new_planner("bfd").plan(lengths, parallel.with_(recompute="full"), COST, CONFIG.with_(strategy="bfd"))
    result = comparison.ComparisonResult({"bfd": _single_layout_result("bfd", slow),
                                          "slimpack": _single_layout_result("slimpack", mine)})
    assert result.results["bfd"].mean_iteration_time_s > result.results["slimpack"].mean_iteration_time_s
    assert comparison.why_slower(result, COST) == []
