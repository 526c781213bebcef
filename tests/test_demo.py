"""`slimpack demo` end to end with a reduced step count: two gloo processes (PP=2), megatron-fixed
packing and SlimPack on the same batches, identical losses, a decreasing loss, a Gantt PNG."""
from __future__ import annotations

import json
import types

import pytest


def test_exact_fixed_plan_keeps_megatron_packing():
    """The baseline plan: megatron-fixed's sequences, pieces mapped back to whole documents."""
    from megatron_slimpack import CostModel, ParallelConfig, SlimPackConfig
    from megatron_slimpack.demo import exact_fixed_plan
    from megatron_slimpack.solver.strategies import new_planner

    lengths = [700, 300, 1000, 100, 900]
    cost = CostModel.analytic("tiny", "cpu")
    parallel = ParallelConfig(pp=2)
    fixed = new_planner("megatron-fixed").plan(lengths, parallel, cost, SlimPackConfig(context_length=1024))
    exact = exact_fixed_plan(fixed, lengths, parallel)  # validates
    assert [m.num_tokens for m in exact.replicas[0].micropacks] == [m.num_tokens for m in fixed.replicas[0].micropacks]
    assert [s.length for s in exact.samples] == lengths
    # a document crossing a cut continues in the next sequence with its prefix
    assert any(piece.start > 0 for m in exact.replicas[0].micropacks for piece in m.slices)


@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    from megatron_slimpack.demo import run_demo

    args = types.SimpleNamespace(steps=3, data_dir=None, model="tiny", out_dir=str(tmp_path), json=True,
                                 context_length=512, global_batch_size=2, progress=False)
    assert run_demo(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = summary["rows"]
    assert set(rows) == {"megatron-fixed", "slimpack"}
    assert summary["losses_match"] and summary["max_loss_rel_diff"] < 1e-4
    assert summary["loss_decreased"]
    for row in rows.values():
        assert row["steps"] == 3 and row["ms_per_iter"] > 0 and row["predicted_ms"] > 0
    assert summary["speedup"] > 0
    for path in summary["gantt_files"]:
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
