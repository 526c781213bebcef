"""WLB-LLM packs micro-batches up to S_max, the longest sequence memory permits (its paper's rule),
not up to the context: a micro-batch may exceed the context where memory allows, and outliers
released from the delay queues find room (at 7B-64K on Wikipedia the queues hold 3 documents after
40 steps, 149 when packed up to the context: docs/peers.md)."""
from __future__ import annotations

import megatron_slimpack as ms
from megatron_slimpack.planner.baselines.wlb_llm import longest_micro_batch
from megatron_slimpack.planner.slimpack.memory import activation_budget, fullest_stage_bytes
from megatron_slimpack.planner.strategies import new_planner
from megatron_slimpack.simulator.dag import simulate
from megatron_slimpack.specs import ParallelConfig

COST = ms.CostModel.analytic("llama-7b", "h100-sxm")


def fits(cost, parallel, tokens: int) -> bool:
    return fullest_stage_bytes(cost, parallel, tokens, tokens ** 2 / 2, tokens) <= activation_budget(cost, parallel)


def test_s_max_is_the_longest_micro_batch_memory_permits_up_to_twice_the_context():
    roomy = ParallelConfig(dp=2, tp=8)
    assert longest_micro_batch(COST, roomy, 4096) == 8192  # memory allows more than twice: capped
    tight, context = ParallelConfig(dp=1, tp=8, pp=4), 65536
    cost13 = ms.CostModel.analytic("llama-13b", "h100-sxm")
    longest = longest_micro_batch(cost13, tight, context)
    assert context <= longest < 2 * context
    assert fits(cost13, tight, longest) and not fits(cost13, tight, longest + context // 8)


def test_a_micro_batch_may_exceed_the_context_where_memory_permits():
    parallel, context = ParallelConfig(dp=2, tp=8), 100
    planner = new_planner("wlb-llm")
    config = ms.SlimPackConfig(strategy="wlb-llm", context_length=context)
    plan = planner.plan([19, 18, 20, 21, 19, 21, 4, 24, 23, 25, 2], parallel, COST, config).validate()
    largest = max(mp.num_tokens for replica in plan.replicas for mp in replica.micropacks)
    assert context < largest <= longest_micro_batch(COST, parallel, context) == plan.max_micropack_tokens
    assert planner.pending == [] and simulate(plan, COST).fits_memory
