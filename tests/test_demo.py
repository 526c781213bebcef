"""`slimpack demo` end to end with a reduced step count: two gloo processes (PP=2), megatron-fixed
packing and SlimPack on the same batches, identical losses, a decreasing loss, a Gantt PNG; and its
pieces: the measured tasks from the schedule's timeline, the honestly labelled prediction."""
from __future__ import annotations

import json
import re
import types

import pytest


def test_the_baseline_keeps_megatron_packing_and_trains_documents_whole():
    """The baseline plan: megatron-fixed's sequences, pieces of a cut document continuing with
    their prefix (`prefix_keeping_fixed_plan`)."""
    from megatron_slimpack import CostModel, ParallelConfig, SlimPackConfig
    from megatron_slimpack.planner.strategies import new_planner

    lengths = [700, 300, 1000, 100, 900]
    cost = CostModel.analytic("tiny", "cpu")
    parallel = ParallelConfig(pp=2)
    config = SlimPackConfig(strategy="megatron-fixed", context_length=1024)
    fixed = new_planner("megatron-fixed").plan(lengths, parallel, cost, config)
    exact = _fixed_plan()
    assert [m.num_tokens for m in exact.replicas[0].micropacks] == [m.num_tokens for m in fixed.replicas[0].micropacks]
    assert [s.length for s in exact.samples] == lengths
    # a document crossing a cut continues in the next sequence with its prefix
    assert any(piece.start > 0 for m in exact.replicas[0].micropacks for piece in m.slices)


def _fixed_plan():
    from megatron_slimpack import CostModel, ParallelConfig, SlimPackConfig
    from megatron_slimpack.planner.baselines.fixed import prefix_keeping_fixed_plan

    lengths = [700, 300, 1000, 100, 900]
    config = SlimPackConfig(strategy="megatron-fixed", context_length=1024)
    return prefix_keeping_fixed_plan(lengths, ParallelConfig(pp=2), CostModel.analytic("tiny", "cpu"),
                                     config).validate()


def test_gantt_tasks_and_stage_busy_from_timeline_records():
    """The schedule's timeline records -> the demo's Gantt records (compute only, unit tokens) and
    per-stage busy seconds of replica 0."""
    from megatron_slimpack.apps.demo import gantt_tasks, stage_busy_s
    from megatron_slimpack.runtime.pipeline.timing import TimedTask

    plan = _fixed_plan()
    replica = plan.replicas[0]
    records = [TimedTask(0, 0, 0, "F", 0, 0.0, 0.1, ""), TimedTask(0, 0, 0, "RECV", 0, 0.1, 0.3, "B 1->0"),
               TimedTask(0, 1, 0, "F", 0, 0.1, 0.3, ""), TimedTask(0, 1, 0, "B", 0, 0.3, 0.6, ""),
               TimedTask(0, 0, 0, "P2P", 0, 0.1, 0.2, "F 0->1"), TimedTask(0, 0, 0, "B", 0, 0.6, 0.8, ""),
               TimedTask(0, 0, -1, "DP", -1, 0.8, 0.9, "gradient reduction")]
    tasks = gantt_tasks(records, plan)
    assert [(t["stage"], t["kind"]) for t in tasks] == [(0, "F"), (1, "F"), (1, "B"), (0, "B")]
    forward_tokens = sum(replica.micropacks[mp].num_tokens for mp in replica.forward_units[0])
    assert tasks[0]["detail"] == f"{forward_tokens} tokens"
    assert set(tasks[0]) == {"rank", "stage", "kind", "unit", "start", "end", "detail"}
    assert stage_busy_s(tasks, 2) == pytest.approx([0.3, 0.5])
    merged = gantt_tasks([TimedTask(0, 0, 0, "F", 0, 0.0, 0.1, "merge group [0, 1]")], plan)
    assert merged[0]["detail"].startswith("merge group [0, 1]: ")  # hatched in the Gantt chart


def _fake_result(strategies, predicted_s=0.2, step_s=0.1):
    def step(i):
        return {"iteration": i + 1, "loss": 5.0 - i, "step_s": step_s, "tokens": 1024, "tokens_per_s": 1024 / step_s,
                "predicted_s": predicted_s, "pp_imbalance": 1.0, "dp_imbalance": 1.0, "micropacks": 2,
                "stage_busy_s": [0.04, 0.05]}

    return {"runs": {name: {"steps": [step(i) for i in range(3)], "gantt": [],
                            "planning": {"planning_s": 0.003, "hidden_fraction": 0.5}} for name in strategies}}


def test_summary_labels_the_prediction_uncalibrated():
    from megatron_slimpack.apps.demo import DemoOptions, format_summary, summarize

    summary = summarize(_fake_result(["megatron-fixed", "slimpack"]), DemoOptions(steps=3, cost_model="analytic"))
    assert summary["predicted_by"] == "uncalibrated analytic CPU model"
    assert summary["rows"]["slimpack"]["measured_over_predicted"] == pytest.approx(0.5)
    text = format_summary(summary)
    header = text.splitlines()[0]
    assert "| predicted ms/iter (uncalibrated analytic CPU model) |" in header
    assert header.count("|") == text.splitlines()[1].count("|")  # still 13 columns
    assert "UNCALIBRATED" in text and "slimpack 0.50" in text and "--cost-model profile.json" in text
    assert "loss check: OK" in text

    profiled = summarize(_fake_result(["slimpack"]), DemoOptions(steps=3, cost_model="profile.json"))
    text = format_summary(profiled)
    assert "predicted ms/iter (cost model profiled in profile.json)" in text and "UNCALIBRATED" not in text


def _paired_result(fixed_s: list[float], slim_s: list[float]) -> dict:
    result = _fake_result(["megatron-fixed", "slimpack"])
    for name, times in (("megatron-fixed", fixed_s), ("slimpack", slim_s)):
        steps = result["runs"][name]["steps"]
        result["runs"][name]["steps"] = [dict(steps[0], iteration=i + 1, step_s=t) for i, t in enumerate(times)]
    return result


def test_headline_states_the_predicted_gain_then_the_measured_one_with_its_interval():
    from megatron_slimpack.apps.demo import DemoOptions, format_summary, summarize

    options = DemoOptions(steps=9, cost_model="profile.json")
    clear = summarize(_paired_result([0.6] + [0.50 + 0.01 * (i % 3) for i in range(8)],
                                     [0.6] + [0.40 + 0.01 * (i % 2) for i in range(8)]), options)
    assert clear["paired"]["verdict"] == "faster" and clear["paired"]["low"] > 1.0
    text = format_summary(clear)
    predicted_at, measured_at = text.index("predicted speedup"), text.index("measured: slimpack faster")
    assert predicted_at < measured_at and "95% interval [" in text
    assert "measured/predicted median step time: megatron-fixed" in text
    # noise around 1.0: the interval crosses it, and the headline says the machine could not decide
    noisy = summarize(_paired_result([0.5, 0.5, 0.4, 0.6, 0.5, 0.45, 0.55, 0.5, 0.52],
                                     [0.5, 0.45, 0.5, 0.5, 0.6, 0.5, 0.5, 0.48, 0.5]), options)
    assert noisy["paired"]["verdict"] == "undecided" and noisy["paired"]["low"] < 1.0 < noisy["paired"]["high"]
    text = format_summary(noisy)
    assert "too noisy to decide" in text and "slimpack faster" not in text and "SLOWER" not in text
    slower = summarize(_paired_result([0.4] * 9, [0.5, 0.5, 0.51, 0.5, 0.52, 0.5, 0.5, 0.51, 0.5]), options)
    assert slower["paired"]["verdict"] == "slower" and "slimpack SLOWER" in format_summary(slower)


def test_the_calibration_is_made_once_per_machine_and_reused(tmp_path, monkeypatch):
    """The demo's default cost model: a real quick profile of the demo model, cached under the
    user's cache directory (keyed by machine and library versions), read back on the next run."""
    from megatron_slimpack.apps import demo, profiler
    from megatron_slimpack.costmodel import CostModel

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    options = demo.DemoOptions()
    said: list[str] = []
    path = demo.calibrated_profile(options, said.append)
    assert path.startswith(str(tmp_path / "megatron-slimpack")) and "profiling this machine" in said[0]
    assert CostModel.from_profile(path).source == f"profile:{path}"

    def no_profiling(*args, **kwargs):
        raise AssertionError("the cached profile must be reused")

    monkeypatch.setattr(profiler, "profile", no_profiling)
    assert demo.calibrated_profile(options, said.append) == path and "cached at" in said[-1]
    other = demo.DemoOptions(pp=4)  # another stage count is another calibration
    assert demo.profile_cache_key(other) != demo.profile_cache_key(options)
    # another machine (core count) or another library version is another calibration too
    import os

    import torch

    key = demo.profile_cache_key(options)
    monkeypatch.setattr(os, "cpu_count", lambda: 97)
    assert demo.profile_cache_key(options) != key
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.1-other")
    assert demo.profile_cache_key(options) != key


@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    from megatron_slimpack.apps.demo import run_demo

    args = types.SimpleNamespace(steps=3, data_dir=None, model="tiny", out_dir=str(tmp_path), json=True,
                                 context_length=512, global_batch_size=2, progress=False, cost_model="analytic")
    assert run_demo(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = summary["rows"]
    assert set(rows) == {"megatron-fixed", "slimpack"}
    assert summary["losses_match"] and summary["max_loss_rel_diff"] < 1e-4
    assert summary["loss_decreased"]
    assert summary["predicted_by"] == "uncalibrated analytic CPU model"
    for row in rows.values():
        assert row["steps"] == 3 and row["ms_per_iter"] > 0 and row["predicted_ms"] > 0
        # measured task intervals (the schedule's timeline): forward and backward on both stages
        tasks = row["last_step_tasks"]
        assert {(t["stage"], t["kind"]) for t in tasks} == {(0, "F"), (0, "B"), (1, "F"), (1, "B")}
        assert all(0 <= t["start"] < t["end"] for t in tasks)
        assert len(row["stage_busy_ms"]) == 2 and all(ms > 0 for ms in row["stage_busy_ms"])
    assert summary["speedup"] > 0
    assert len(summary["gantt_files"]) == 2
    for path in summary["gantt_files"]:
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_demo_other_strategies(tmp_path):
    """Any trainable strategies side by side (no loss check without megatron-fixed and slimpack)."""
    from megatron_slimpack.apps.demo import run_demo

    args = types.SimpleNamespace(steps=2, data_dir=None, model="tiny", out_dir=str(tmp_path), json=True,
                                 context_length=512, global_batch_size=2, progress=False, cost_model="analytic",
                                 strategies="slimpipe,wlb-llm,megatron-fixed")
    assert run_demo(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["strategies"] == ["slimpipe", "wlb-llm", "megatron-fixed"]
    assert "losses_match" not in summary and "speedup" not in summary
    for row in summary["rows"].values():
        assert row["steps"] == 2 and row["ms_per_iter"] > 0 and row["last_step_tasks"]
    assert len(summary["gantt_files"]) == 3


@pytest.fixture
def no_launch(monkeypatch):
    """`slimpack demo` with its worker processes replaced by a failure: a test passes only when the
    option is refused before any process would start."""
    from megatron_slimpack import demo

    def refuse(options):
        raise AssertionError("the demo started its processes")

    monkeypatch.setattr(demo, "launch", refuse)


@pytest.mark.parametrize("argv, message", [
    (["--strategies", "bogus"], "--strategies: 'bogus' cannot be trained by the demo; known: slimpack, "),
    (["--strategies", ","], "--strategies names no strategy; give some of: slimpack"),
    (["--data-dir", "/nonexistent/slimpack-demo"], "--data-dir /nonexistent/slimpack-demo is not a directory; "),
    (["--pp", "3"], "--model tiny --pp 3: tiny has 4 layers, not divisible by pp=3; choose pp among [1, 2, 4]"),
])
def test_demo_refuses_bad_options_before_starting_processes(argv, message, no_launch, tmp_path, capsys):
    """Bad demo options (--strategies bogus, --data-dir /nonexistent, --pp 0) are refused with one
    message before any process starts: no child tracebacks, no wait for a timeout."""
    from megatron_slimpack import cli

    assert cli.main(["demo", *argv, "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"slimpack demo: error: {message}" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_demo_refuses_a_data_dir_without_text_and_a_bad_profile(no_launch, tmp_path, capsys):
    from megatron_slimpack import cli

    assert cli.main(["demo", "--data-dir", str(tmp_path), "--out-dir", str(tmp_path)]) == 2
    assert f"--data-dir {tmp_path}: text: no non-empty *.py files under {tmp_path}" in capsys.readouterr().err
    profile = tmp_path / "profile.json"
    profile.write_text("{not json")
    assert cli.main(["demo", "--cost-model", str(profile), "--out-dir", str(tmp_path)]) == 2
    assert f"cost-model profile {profile} is not JSON" in capsys.readouterr().err


def test_run_demo_checks_options_given_in_python(no_launch, tmp_path):
    from megatron_slimpack.apps.demo import DemoOptionError, run_demo

    for name, value, message in [("pp", 0, "--pp must be an integer >= 1, got 0"),
                                 ("plan_ahead", -1, "--plan-ahead must be an integer >= 0, got -1"),
                                 ("lr", float("nan"), "--lr must be a positive number, got nan"),
                                 ("model", "llama-150b", "--model: unknown model preset 'llama-150b'")]:
        args = types.SimpleNamespace(out_dir=str(tmp_path), **{name: value})
        with pytest.raises(DemoOptionError, match=re.escape(message)):
            run_demo(args)
