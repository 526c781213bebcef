"""A layout's cp K runs in Megatron as --slimpack-base-merge K (cp 1, K times the replicas) for
every strategy the plugin trains: SlimPack reads the base merge itself, the others plan the cp-K
layout `slimpack compare` priced and share each MicroPack by a DP-Merge group of K ranks."""
from __future__ import annotations

import pytest

import megatron_slimpack as ms
from megatron_slimpack.megatron.data import fast_forward, plan_function
from megatron_slimpack.planner.strategies import new_planner, planning_view
from megatron_slimpack.simulator import simulate
from megatron_slimpack.workload import GlobalBatch, GlobalBatchSampler, load_lengths

COST = ms.CostModel.analytic("llama-7b", "h100-sxm")
CONTEXT = 16384
RUN = ms.ParallelConfig(dp=4, pp=2, tp=4)  # what Megatron runs: cp 1, dp x K replicas


def batches(count: int) -> list[GlobalBatch]:
    sampler = GlobalBatchSampler(load_lengths("longtail", seed=3), CONTEXT, 16, seed=3, long_documents="split")
    return [sampler.next_batch() for _ in range(count)]


@pytest.mark.parametrize("strategy", ["wlb-llm", "slimpipe", "bfd"])
def test_a_base_merge_runs_the_cp_layout_as_dp_merge_groups(strategy):
    config = ms.SlimPackConfig(strategy=strategy, context_length=CONTEXT, base_merge=2)
    view, base_merge = planning_view(RUN, config)
    assert (view, base_merge) == (RUN.with_(dp=2, cp=2), 2)
    reference = new_planner(strategy)  # the layout as `slimpack compare` priced it
    plan_batch = plan_function(new_planner(strategy), RUN, COST, config)
    for batch in batches(2):
        plan = plan_batch(batch)
        priced = reference.plan(batch.lengths, view, COST, config, sources=batch.sources)
        assert plan.parallel == RUN and plan.metadata["base_merge"] == 2
        groups = [r for r in plan.replicas if r.micropacks]
        assert groups and all(len(r.dp_ranks) == 2 for r in groups)  # every MicroPack shared by 2 ranks
        assert simulate(plan, COST, detail=False).iteration_time_s == pytest.approx(
            simulate(priced, COST, detail=False).iteration_time_s, rel=1e-12)


def test_slimpack_reads_the_base_merge_itself():
    config = ms.SlimPackConfig(strategy="slimpack", context_length=CONTEXT, base_merge=2)
    assert planning_view(RUN, config) == (RUN, 1)
    plan = plan_function(new_planner("slimpack"), RUN, COST, config)(batches(1)[0])
    assert plan.parallel == RUN and plan.metadata["base_merge"] == 2


def test_a_resumed_stateful_planner_advances_on_the_view():
    """wlb-llm's delay queues after N batches are those planning them on the view leaves."""
    config = ms.SlimPackConfig(strategy="wlb-llm", context_length=CONTEXT, base_merge=2)
    planned, resumed = new_planner("wlb-llm"), new_planner("wlb-llm")
    plan_batch = plan_function(planned, RUN, COST, config)
    for batch in batches(2):
        plan_batch(batch)
    sampler = GlobalBatchSampler(load_lengths("longtail", seed=3), CONTEXT, 16, seed=3, long_documents="split")
    fast_forward(sampler, resumed, RUN, COST, config, 2)
    assert resumed.state_dict() == planned.state_dict()
