"""`slimpack validate` end to end on one small plan (2 gloo processes, PP=2)."""
import pytest

from megatron_slimpack.specs import ModelSpec

SPEC = ModelSpec("test-small", 2, 64, 128, 4, num_query_groups=2, vocab_size=256)


@pytest.mark.slow
def test_validate_one_small_plan(tmp_path):
    from megatron_slimpack.apps.fidelity import compare, measure_plans, overall, summary_table, text_plans
    from megatron_slimpack.costmodel import CostModel

    cost = CostModel.analytic(SPEC, "cpu", dtype_bytes=4, attention_backend="torch")
    planned = text_plans(cost, strategies=["slimpack"], pp=2, context_length=256, global_batch_size=2, steps=1, seed=3)
    plans = [p for _, _, p in planned]
    steps = measure_plans(plans, SPEC, batches=[b for _, b, _ in planned], repeats=1, warmup=1, timeout_s=240)
    assert len(steps) == 1 and steps[0].iteration_time_s > 0
    kinds = {r["kind"] for r in steps[0].records}
    assert {"F", "B", "RECV", "P2P"} <= kinds
    assert {(m["rank"], m["stage"]) for m in steps[0].memory} == {(0, 0), (0, 1)}
    assert all(m["peak_activation_bytes"] > 0 for m in steps[0].memory)
    comparisons = compare(plans, steps, cost, out_dir=tmp_path)
    figures = overall(comparisons)
    for key in ("iteration_mape", "task_mape", "memory_mape"):
        assert figures[key] == figures[key]  # finite, not NaN
    assert figures["memory_mape"] < 0.5  # the analytic torch-backend itemisation is close already
    assert (tmp_path / "step0_slimpack_gantt.png").stat().st_size > 0
    assert "slimpack" in summary_table(comparisons)


@pytest.mark.slow
def test_speed_reference_gives_drift_corrected_errors():
    """With a profile's speed reference, every step is preceded by the reference timing and the
    comparison reports drift-corrected errors; a simulated time scaled by the drift is what they use."""
    import dataclasses

    from megatron_slimpack.apps.fidelity import (
        StepComparison,
        compare,
        measure_plans,
        overall,
        summary_table,
        text_plans,
    )
    from megatron_slimpack.costmodel import CostModel

    cost = CostModel.analytic(SPEC, "cpu", dtype_bytes=4, attention_backend="torch")
    cost.reference = {"tokens": 1024, "layers": 1, "seconds": 0.05}
    planned = text_plans(cost, strategies=["slimpack"], pp=2, context_length=256, global_batch_size=2, steps=1, seed=3)
    plans = [p for _, _, p in planned]
    steps = measure_plans(plans, SPEC, batches=[b for _, b, _ in planned], repeats=2, warmup=0, timeout_s=240,
                          reference=cost.reference)
    assert all(s.reference_s and s.reference_s > 0 for s in steps)
    (comparison,) = compare(plans, steps, cost)
    assert comparison.drift == [s.reference_s / 0.05 for s in steps]
    figures = overall([comparison])
    assert len(figures["corrected_iteration_errors"]) == 2 and figures["corrected_task_mape"] >= 0
    assert "x |" in summary_table([comparison])
    # the correction is the simulated time times the drift: a drift making them equal gives 0 error
    exact = dataclasses.replace(comparison, drift=[m / comparison.simulated_iteration_s
                                                   for m in comparison.measured_iteration_s])
    assert max(StepComparison.corrected_iteration_errors.fget(exact)) < 1e-12


def test_validate_json_is_one_document_on_stdout(monkeypatch, capsys):
    """`slimpack validate --json` prints only the JSON on stdout; its progress goes to stderr.
    (Measurement is replaced: this checks where the output goes, not what is measured.)"""
    import argparse
    import json

    from megatron_slimpack import fidelity

    monkeypatch.setattr(fidelity, "text_plans", lambda cost, **kw: [("slimpack", None, None)])
    monkeypatch.setattr(fidelity, "measure_plans", lambda plans, model, **kw: [])
    monkeypatch.setattr(fidelity, "compare", lambda plans, steps, cost, out_dir=None: [])
    monkeypatch.setattr(fidelity, "overall", lambda comparisons: {"iteration_mape": 0.0})
    assert fidelity.validate_main(argparse.Namespace(json=True)) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"overall": {"iteration_mape": 0.0}, "plans": []}
    assert "running 1 plans" in captured.err
