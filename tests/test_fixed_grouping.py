"""SlimPack never plans a step its model prices slower than Megatron's fixed-length grouping of the
same batch (with prefixes kept: the same objective, the same runtime)."""
from __future__ import annotations

import numpy as np

import megatron_slimpack as ms
from megatron_slimpack.planner.baselines.fixed import prefix_keeping_fixed_plan
from megatron_slimpack.planner.strategies import plan_slimpack
from megatron_slimpack.simulator import simulate
from megatron_slimpack.workload import GlobalBatchSampler, TextCorpus


def predicted(plan, cost) -> float:
    return simulate(plan, cost, detail=False).iteration_time_s


def grouping(lengths, parallel, cost, context):
    config = ms.SlimPackConfig(strategy="slimpack", context_length=context)
    return prefix_keeping_fixed_plan(lengths, parallel, cost, config).validate()


def test_on_the_demo_batches_slimpack_is_priced_no_slower_than_the_grouping():
    from megatron_slimpack.apps.demo import DEFAULT_CONTEXT, DEFAULT_GLOBAL_BATCH, demo_cost_model, demo_model_spec

    corpus = TextCorpus(None)
    cost = demo_cost_model(demo_model_spec("tiny", corpus.VOCAB_SIZE), "analytic")
    parallel = ms.ParallelConfig(pp=2)
    sampler = GlobalBatchSampler(corpus.lengths, DEFAULT_CONTEXT, DEFAULT_GLOBAL_BATCH, seed=0)
    config = ms.SlimPackConfig(context_length=DEFAULT_CONTEXT, solver_time_limit_s=0.2)
    for _ in range(4):
        batch = sampler.next_batch()
        plan = plan_slimpack(batch.lengths, parallel, cost, config)
        fixed = grouping(batch.lengths, parallel, cost, DEFAULT_CONTEXT)
        assert predicted(plan, cost) <= predicted(fixed, cost) + 1e-12


def test_on_a_long_tail_batch_slimpack_is_priced_no_slower_than_the_grouping():
    cost = ms.CostModel.analytic("llama-7b", "h100-sxm")
    parallel = ms.ParallelConfig(dp=2, pp=4, tp=4)
    lengths = np.minimum(np.random.default_rng(1).lognormal(7.5, 1.4, size=300).astype(int) + 64, 32768).tolist()
    config = ms.SlimPackConfig(context_length=32768, solver_time_limit_s=5.0, solver_deterministic_limit=0.2)
    plan = plan_slimpack(lengths, parallel, cost, config)
    assert predicted(plan, cost) <= predicted(grouping(lengths, parallel, cost, 32768), cost) + 1e-12


def test_a_search_result_slower_than_the_grouping_is_replaced_by_it(monkeypatch):
    """The guarantee is a real check: a search that returned a plan slower than the grouping (here:
    the grouping's own MicroPacks, one replica idle) gets the grouping instead."""
    from megatron_slimpack.planner import strategies

    cost = ms.CostModel.analytic("llama-7b", "h100-sxm")
    parallel = ms.ParallelConfig(dp=2, pp=2, tp=8)
    lengths = [4096] * 16
    good = grouping(lengths, parallel, cost, 8192)
    replicas = good.replicas
    everything = replicas[0].micropacks + replicas[1].micropacks
    from megatron_slimpack.planner.baselines.common import schedule_1f1b

    lopsided = ms.Plan([schedule_1f1b(everything, parallel, [0]), schedule_1f1b([], parallel, [1])],
                       good.samples, parallel, 8192, "slimpack", 8192, {}).validate()
    assert predicted(lopsided, cost) > predicted(good, cost)

    class Search:
        def __init__(self, *args, **kwargs):
            pass

        def plan(self):
            return lopsided

    monkeypatch.setattr(strategies, "SlimPackSearch", Search)
    chosen = plan_slimpack(lengths, parallel, cost, ms.SlimPackConfig(context_length=8192))
    assert chosen.metadata.get("fixed_length_grouping") is True
    assert predicted(chosen, cost) == predicted(good, cost)
