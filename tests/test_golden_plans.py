"""Golden plans: `Plan.fingerprint()` and the simulated makespan of fixed batches and layouts.

A restructuring of the planner, the simulator or the plan format must keep these: it changes
the code, not the plans. The batches are those of
`benchmarks/planner.py` (Wikipedia lengths, llama-7b, 64K-256K on 128 and 256 H100s, first batch),
two of the paper grid's 70B/150B layouts, and every training strategy on one batch. CP-SAT stops
on its deterministic limit, so the plans are the same on any machine.

    python tests/test_golden_plans.py --regenerate   # only for an intended change of plans; say why in the commit
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import megatron_slimpack as ms
from megatron_slimpack.workload import GlobalBatchSampler, load_lengths

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden" / "plans.json"
WIKIPEDIA = f"file:{ROOT.parent / 'shared' / 'data' / 'wikipedia_lengths.txt'}"
K = 1024


def case_list() -> dict[str, dict]:
    cases = {}
    for gpus, parallel in ((128, dict(dp=4, pp=4, tp=8)), (256, dict(dp=8, pp=4, tp=8))):
        for context in (64 * K, 128 * K, 256 * K):
            cases[f"llama-7b-{context // K}K-{gpus}gpus-wikipedia"] = dict(
                model="llama-7b", workload=WIKIPEDIA, context=context, sequences=512, parallel=parallel)
    cases["llama-70b-128K-github-tp4pp8cp4dp2"] = dict(
        model="llama-70b", workload="github", context=128 * K, sequences=64,
        parallel=dict(dp=2, pp=8, tp=4, cp=4, recompute="selective"))
    cases["llama-150b-64K-wikipedia-tp8pp8cp2dp2"] = dict(
        model="llama-150b-gqa", workload=WIKIPEDIA, context=64 * K, sequences=64,
        parallel=dict(dp=2, pp=8, tp=8, cp=2, recompute="selective"))
    for strategy in ("slimpack-sym", "slimpack-nomerge", "megatron-fixed", "bfd", "sorted", "wlb-llm", "slimpipe"):
        cases[f"{strategy}-llama-7b-64K-wikipedia"] = dict(
            model="llama-7b", workload=WIKIPEDIA, context=64 * K, sequences=64, parallel=dict(dp=4, pp=4, tp=8),
            strategy=strategy)
    return cases


def compute(case: dict) -> dict:
    lengths = load_lengths(case["workload"])
    batch = GlobalBatchSampler(lengths, case["context"], case["sequences"], seed=0, long_documents="split").next_batch()
    cost = ms.CostModel.analytic(case["model"], "h100-sxm")
    config = ms.SlimPackConfig(strategy=case.get("strategy", "slimpack"), context_length=case["context"],
                               solver_time_limit_s=120.0, solver_deterministic_limit=0.5)
    plan = ms.plan(batch.lengths, parallel=ms.ParallelConfig(**case["parallel"]), cost=cost, config=config,
                   sources=batch.sources)
    return {"fingerprint": plan.fingerprint(), "makespan_s": ms.simulate(plan, cost).iteration_time_s}


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", list(case_list()))
def test_plan_is_unchanged(golden, name):
    got = compute(case_list()[name])
    want = golden[name]
    assert got["fingerprint"] == want["fingerprint"], f"{name}: the plan changed"
    assert got["makespan_s"] == pytest.approx(want["makespan_s"], rel=1e-9), f"{name}: the simulated makespan changed"


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(__doc__)
    GOLDEN.write_text(json.dumps({name: compute(case) for name, case in case_list().items()}, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
