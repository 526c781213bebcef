"""SlimPack never plans a step its model prices slower than Megatron's fixed-length grouping of the
same batch (with prefixes kept: the same objective, the same runtime)."""
from __future__ import annotations

import numpy as np
import pytest

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
    sampler = GlobalBatchSampler(corpus.lengths, DEFAULT_CONTEXT, DEFAULT_GLOBAL_BATCH, seed=0, long_documents="split")
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


@pytest.mark.parametrize("parallel, base_merge", [
    (ms.ParallelConfig(dp=2, pp=2, tp=8), 1),
    (ms.ParallelConfig(dp=2, pp=2, tp=4, cp=2), 1),  # SlimPack's cp: every MicroPack shared by 2 ranks
    (ms.ParallelConfig(dp=4, pp=2, tp=4), 2),  # a base merge the search fell back to
])
def test_a_search_result_slower_than_the_grouping_is_replaced_by_it(monkeypatch, parallel, base_merge):
    """The guarantee is a real check: a search that returned a plan slower than the grouping (here:
    the grouping's own MicroPacks, one replica idle) gets the grouping instead, on every layout:
    with context parallelism or a base merge the grouping is made for the view SlimPack planned
    and shared by the same DP-Merge groups."""
    from megatron_slimpack.planner import strategies
    from megatron_slimpack.planner.baselines.common import schedule_1f1b
    from megatron_slimpack.planner.strategies import shared_by_groups

    cost = ms.CostModel.analytic("llama-7b", "h100-sxm")
    view = parallel.with_(dp=parallel.dp // base_merge, cp=parallel.cp * base_merge)
    lengths = [4096] * 16
    good = grouping(lengths, view, cost, 8192)
    everything = good.replicas[0].micropacks + good.replicas[1].micropacks
    lopsided = ms.Plan([schedule_1f1b(everything, view, [0]), schedule_1f1b([], view, [1])],
                       good.samples, view, 8192, "slimpack", 8192, {}).validate()
    if base_merge > 1:
        good, lopsided = (shared_by_groups(p, parallel, base_merge).validate() for p in (good, lopsided))
    assert predicted(lopsided, cost) > predicted(good, cost)

    class Search:
        def __init__(self, *args, **kwargs):
            pass

        def plan(self):
            return lopsided

    monkeypatch.setattr(strategies, "SlimPackSearch", Search)
    chosen = plan_slimpack(lengths, parallel, cost, ms.SlimPackConfig(context_length=8192))
    assert chosen.metadata.get("fixed_length_grouping") is True
    assert chosen.metadata.get("base_merge", 1) == base_merge and chosen.parallel == parallel
    assert predicted(chosen, cost) == pytest.approx(predicted(good, cost), rel=1e-12)


def test_the_grouping_meets_interleaved_1f1b_micro_batch_counts():
    """A replica's own cut can leave it a sequence count interleaved 1F1B refuses (not a multiple of
    pp): one sequence is split in two, so the grouping is still a candidate on interleaved layouts."""
    cost = ms.CostModel.analytic("llama-7b", "h100-sxm")
    parallel = ms.ParallelConfig(dp=2, pp=2, vpp=2, tp=8)
    lengths = [6000, 6000, 4000, 1000] * 2  # 17,000 tokens per replica: 3 sequences of 8,192
    plain = grouping(lengths, parallel.with_(vpp=1), cost, 8192)
    counts = [len(replica.micropacks) for replica in plain.replicas]
    assert any(count % parallel.pp for count in counts)
    interleaved = grouping(lengths, parallel, cost, 8192)
    assert all(len(replica.micropacks) % parallel.pp == 0 for replica in interleaved.replicas)
    assert sorted(s.sample_id for r in interleaved.replicas for m in r.micropacks for s in m.slices
                  if s.start == 0) == list(range(len(lengths)))
