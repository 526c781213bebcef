"""Megatron-LM's sequence-packing schedulers as peers: megatron-dp-balanced (`dp_balanced`) and
megatron-dynamic-cp (dev's `default_dynamic_cp`). Each rule is checked on hand-worked batches, the
plans pass `Plan.validate()` and simulate, and on the long-tail batches of NVIDIA's dynamic-CP
benchmark the dynamic-CP step is not slower than its dp_balanced baseline."""
from __future__ import annotations

import numpy as np
import pytest

import megatron_slimpack as ms
from megatron_slimpack.plan import Plan, PlanError
from megatron_slimpack.planner.baselines.dp_balanced import pack_dp_balanced
from megatron_slimpack.planner.baselines.dynamic_cp import (
    WORKLOAD_SLACK,
    cp_size_needed,
    dynamic_cp_micro_batch,
    dynamic_cp_schedule,
)
from megatron_slimpack.planner.outcomes import DoesNotFit
from megatron_slimpack.planner.strategies import get_strategy, strategy_names, strategy_spec
from megatron_slimpack.simulator.dag import simulate
from megatron_slimpack.specs import ModelSpec, ParallelConfig

COST = ms.CostModel.analytic("llama-7b", "h100-sxm")
# The model of examples/dynamic_context_parallel/benchmark_dcp.sh (Megatron-LM dev): GPT, GELU.
DCP_GPT = ModelSpec("dcp-benchmark-gpt", 12, 2048, 8192, 16, vocab_size=131072, swiglu=False)


def run(strategy, lengths, *, cost=COST, context=8192, per_rank=None, **layout):
    parallel = ParallelConfig(**{"tp": 1, **layout})
    config = ms.SlimPackConfig(strategy=strategy, context_length=context, max_micropack_tokens=per_rank)
    return get_strategy(strategy)(list(lengths), parallel, cost, config).validate()


def lognormal_batch(count, seed, *, mean=1024, sigma=1.5, low=128, high=8192):
    """The benchmark's mock lengths: lognormal with the given mean and sigma, clipped to [low, high]."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(np.log(mean) - sigma ** 2 / 2, sigma, count), low, high)]


def own_packs(plan: Plan, rank: int) -> list[list[int]]:
    """Sample ids of each MicroPack of a rank's own replica plan."""
    replica = next(r for r in plan.replicas if r.dp_ranks == [rank])
    return [[s.sample_id for s in m.slices] for m in replica.micropacks]


def test_both_are_registered_simulated_only_baselines_that_keep_documents_whole():
    for name in ("megatron-dp-balanced", "megatron-dynamic-cp"):
        spec = strategy_spec(name)
        assert name in strategy_names() and spec.role == "baseline" and not spec.trainable
        assert not spec.splits_documents and not spec.renumbers_samples and not spec.is_reference
        assert "documents whole" in spec.description
    assert strategy_spec("megatron-dynamic-cp").constraints.cp == (1,)


# ---- dp_balanced ------------------------------------------------------------------------------
def test_dp_balanced_packs_in_order_and_moves_single_samples_to_reach_a_multiple():
    lengths = [3, 4, 2, 5, 1, 6]
    # next-fit at 8 tokens: 3+4 | 2+5+1 | 6
    assert pack_dp_balanced(lengths, 8, 1) == [[0, 1], [2, 3, 4], [5]]
    # to 4 packed sequences: the last sample of the last multi-sample pack gets one of its own
    assert pack_dp_balanced(lengths, 8, 2) == [[0, 1], [2, 3], [5], [4]]
    assert pack_dp_balanced(lengths, 8, 5) == [[0, 1], [2], [5], [4], [3]]
    with pytest.raises(PlanError, match="too few hold two samples"):
        pack_dp_balanced(lengths, 8, 8)


def test_dp_balanced_never_cuts_and_holds_every_sample_once():
    lengths = lognormal_batch(64, seed=3)
    capacity = 2048 * 4
    packed = pack_dp_balanced(lengths, capacity, 1)
    assert [i for pack in packed for i in pack] == list(range(len(lengths)))  # in order
    totals = [sum(lengths[i] for i in pack) for pack in packed]
    assert max(totals) <= capacity
    # next-fit: a packed sequence closes only when the next sample would overflow it
    assert all(total + lengths[nxt[0]] > capacity for total, nxt in zip(totals, packed[1:]))
    moved = pack_dp_balanced(lengths, capacity, 6)
    assert len(moved) % 6 == 0 and sorted(i for pack in moved for i in pack) == list(range(len(lengths)))


def test_dp_balanced_plan_deals_packed_sequences_round_robin_on_the_full_cp_group():
    lengths = [3, 4, 2, 5, 1, 6]
    plan = run("megatron-dp-balanced", lengths, dp=2, cp=2, per_rank=4, context=8)  # 4 x cp 2 = 8 tokens
    assert own_packs(plan, 0) == [[0, 1], [5]] and own_packs(plan, 1) == [[2, 3], [4]]
    assert all(s.start == 0 and s.end == lengths[s.sample_id]
               for r in plan.replicas for m in r.micropacks for s in m.slices)  # whole documents
    assert plan.max_micropack_tokens == 8 and plan.parallel.cp == 2
    assert plan.metadata["cp_size_per_sample"] == [2] * 6 and plan.metadata["max_seqlen_per_dp_cp_rank"] == 4
    assert "documents whole" in plan.metadata["training_objective"]
    with pytest.raises(DoesNotFit, match="exceeds dp_balanced's packed sequence"):
        run("megatron-dp-balanced", [9, 1], dp=1, cp=2, per_rank=4, context=16)


def test_dp_balanced_with_virtual_stages_gives_each_rank_a_multiple_of_pp():
    lengths = lognormal_batch(40, seed=5)
    plan = run("megatron-dp-balanced", lengths, dp=2, pp=2, vpp=2, cp=2, per_rank=2048)
    assert plan.metadata["packed_sequences"] % 4 == 0
    assert all(len(r.micropacks) % 2 == 0 for r in plan.replicas)


# ---- default_dynamic_cp -----------------------------------------------------------------------
def test_cp_size_per_sample_is_the_smallest_power_of_two_holding_it_at_the_cap():
    assert [cp_size_needed(n, 2048) for n in (1, 2048, 2049, 4096, 4097, 8192, 8193)] == [1, 1, 2, 2, 4, 4, 8]
    assert cp_size_needed(100, 2048, minimum=2) == 2


def test_dynamic_cp_packs_a_groups_samples_and_grows_groups_over_idle_gpus():
    # Pool of 4 GPUs, 2048 tokens per GPU. Micro-batch 1: 4000 opens a CP-2 group on GPUs 0-1;
    # 3000 (CP >= 2) cannot join it (7000 > 2 x 2048) and opens one on GPUs 2-3; 1500 fits neither
    # group and no GPU is free, so it waits; 1000 joins 3000's group (4000 tokens); 500 waits.
    # Micro-batch 2: 1500 on GPU 0, 500 on GPU 1 (a group of its own: the busiest GPU stays lower);
    # GPUs 2-3 are idle, so the first smallest group doubles (GPUs 0-1), pushing 500's to 2, which
    # then doubles too (GPUs 2-3).
    lengths = [4000, 3000, 1500, 1000, 500]
    micro_batches = dynamic_cp_schedule(lengths, 4, 2048)
    assert [[(g.ranks, g.samples) for g in mb] for mb in micro_batches] == [
        [((0, 1), [0]), ((2, 3), [1, 3])],
        [((0, 1), [2]), ((2, 3), [4])],
    ]
    plan = run("megatron-dynamic-cp", lengths, dp=4, per_rank=2048)
    assert plan.metadata["cp_size_per_sample"] == [2, 2, 2, 2, 2] and plan.metadata["micro_batches"] == 2
    merges = {tuple(r.dp_ranks): [[s.sample_id for s in m.slices] for m in r.micropacks]
              for r in plan.replicas if r.is_merge_group}
    assert merges == {(0, 1): [[0], [2]], (2, 3): [[1, 3], [4]]}  # one THD micro-batch per group
    assert all(not r.micropacks for r in plan.replicas if not r.is_merge_group)


def test_dynamic_cp_short_samples_run_on_one_gpu_and_long_ones_widen():
    lengths = [8192, 3000, 2000, 1800, 1500, 1200, 900, 700]
    plan = run("megatron-dynamic-cp", lengths, dp=8, per_rank=2048)
    cp = plan.metadata["cp_size_per_sample"]
    assert cp[0] == 4 and cp[1] >= 2 and all(size >= cp_size_needed(n, 2048) for n, size in zip(lengths, cp))
    assert min(cp) == 1
    group_of = {sid: len(r.dp_ranks) for r in plan.replicas for sid in r.sample_ids}
    assert group_of == dict(enumerate(cp))


def test_dynamic_cp_falls_back_to_the_whole_pool_when_no_group_can_grow():
    # Pool of 7: 8192 on GPUs 0-3 (CP 4), 4000 on 4-5 (CP 2); GPU 6 idle and the CP-2 group cannot
    # double inside the pool, so the micro-batch becomes one group of all 7 holding both.
    assert [[(g.ranks, g.samples) for g in mb] for mb in dynamic_cp_schedule([8192, 4000], 7, 2048)] == [
        [((0, 1, 2, 3, 4, 5, 6), [0, 1])]]


def test_dynamic_cp_balances_work_over_the_dp_cp_pool():
    lengths = lognormal_batch(128, seed=0)
    pool, cap = 32, 2048
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    placed: list[int] = []
    while order:
        tallest = lengths[order[0]]
        groups, order = dynamic_cp_micro_batch(order, lengths, pool, cap)
        assert [r for g in groups for r in g.ranks] == list(range(pool))  # every GPU in one group
        assert all(g.tokens <= g.size * cap for g in groups)  # the per-rank token cap
        # the busiest GPU has at most the slack over the micro-batch's tallest sample's own work
        assert max(g.work for g in groups) <= tallest * cap * (1 + WORKLOAD_SLACK)
        placed += [i for g in groups for i in g.samples]
    assert sorted(placed) == list(range(len(lengths)))


def reference_dynamic_cp(lengths, pool, cap):
    """Rules 1-4 with every GPU's work kept apart (no shortcuts): [[(ranks, samples)] per micro-batch]."""
    def needed(n):
        k = 1
        while k * cap < n:
            k *= 2
        return k

    order, schedule = sorted(range(len(lengths)), key=lambda i: -lengths[i]), []
    while order:
        load, groups, left = [0.0] * pool, [], []  # group: [ranks, samples, tokens]
        bound = lengths[order[0]] * cap * (1 + WORKLOAD_SLACK)
        for position, sample in enumerate(order):
            n, best, k = lengths[sample], None, needed(lengths[sample])
            free = list(range(sum(len(g[0]) for g in groups), pool))
            while k <= (pool if position else needed(n)):  # the tallest opens a group at its minimum
                options = [g[0] for g in groups if len(g[0]) == k and g[2] + n <= k * cap]
                options += [free[:k]] if len(free) >= k else []
                for ranks in options:
                    projected = max(load[r] + (n * n / k if r in ranks else 0.0) for r in range(pool))
                    if (position == 0 or projected <= bound) and (best is None or projected < best[0]):
                        best = (projected, ranks)
                k *= 2
            if best is None:
                left.append(sample)
                continue
            group = next((g for g in groups if g[0] is best[1]), None)
            if group is None:
                group = [best[1], [], 0]
                groups.append(group)
            group[1].append(sample)
            group[2] += n
            for r in group[0]:
                load[r] += n * n / len(group[0])
        while sum(len(g[0]) for g in groups) < pool:
            smallest = min(len(g[0]) for g in groups)
            gain = min(2 * smallest, pool) - smallest
            used = sum(len(g[0]) for g in groups)
            at = next((i for i, g in enumerate(groups) if len(g[0]) == smallest and g[0][-1] + gain < pool
                       and used + gain <= pool), None)
            if at is None:
                kept = []
                for sample in order:
                    if sum(lengths[i] for i in kept) + lengths[sample] <= pool * cap:
                        kept.append(sample)
                groups, left = [[list(range(pool)), kept, 0]], [i for i in order if i not in kept]
                break
            groups[at][0] = list(range(groups[at][0][0], groups[at][0][-1] + gain + 1))
            for g in groups[at + 1:]:
                g[0] = [r + gain for r in g[0]]
        schedule.append([(tuple(g[0]), g[1]) for g in groups])
        order = left
    return schedule


@pytest.mark.parametrize("pool", [4, 7, 8, 16])
def test_dynamic_cp_schedule_matches_a_per_gpu_reference(pool):
    for seed in range(4):
        lengths = lognormal_batch(6 * pool, seed)
        got = [[(g.ranks, g.samples) for g in mb] for mb in dynamic_cp_schedule(lengths, pool, 2048)]
        assert got == reference_dynamic_cp(lengths, pool, 2048), (pool, seed)


def test_dynamic_cp_refuses_what_its_plans_cannot_express():
    with pytest.raises(PlanError, match="give the whole pool as data parallelism"):
        run("megatron-dynamic-cp", [1000, 2000], dp=2, cp=2, per_rank=2048)
    with pytest.raises(PlanError, match="use vpp=1"):
        run("megatron-dynamic-cp", [1000, 2000] * 4, dp=2, pp=2, vpp=2, per_rank=2048)
    with pytest.raises(DoesNotFit, match="needs CP 4"):
        run("megatron-dynamic-cp", [8192, 100], dp=2, per_rank=2048)


# ---- plans and steps ----------------------------------------------------------------------------
@pytest.mark.parametrize("strategy, per_rank, layout", [
    ("megatron-dp-balanced", 2048, dict(dp=2, cp=4)),
    ("megatron-dp-balanced", 4096, dict(dp=2, pp=2, cp=2)),
    ("megatron-dp-balanced", 4096, dict(dp=2, pp=2, vpp=2, cp=2)),
    ("megatron-dynamic-cp", 2048, dict(dp=8)),
    ("megatron-dynamic-cp", 2048, dict(dp=4, pp=2)),
])
def test_plans_validate_round_trip_and_simulate(strategy, per_rank, layout):
    lengths = lognormal_batch(64, seed=2)  # up to 8192 tokens: a packed sequence holds per_rank x cp
    plan = run(strategy, lengths, per_rank=per_rank, **layout)
    assert Plan.from_json(plan.to_json()).to_dict() == plan.to_dict()
    assert plan.num_tokens == sum(lengths)
    report = simulate(plan, COST, detail=False)
    assert report.iteration_time_s > 0 and report.num_tokens == sum(lengths)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dynamic_cp_step_is_not_slower_than_dp_balanced_on_the_benchmark_batches(seed):
    """NVIDIA's benchmark on 8 GPUs: dp_balanced at TP1 CP4 DP2, dynamic CP over the same 8 GPUs,
    8 micro-batches x DP2 = 16 samples, 2048 tokens per rank. Packing to 8192 tokens on CP4 makes
    every short document pay CP4's exchange and shares the packed sequence's quadratic work; dynamic
    CP runs short documents on one GPU and balances L^2 / k, so its step should be no slower."""
    cost = ms.CostModel.analytic(DCP_GPT, "h100-sxm")
    lengths = lognormal_batch(16, seed)
    baseline = run("megatron-dp-balanced", lengths, cost=cost, dp=2, cp=4, per_rank=2048)
    dynamic = run("megatron-dynamic-cp", lengths, cost=cost, dp=8, per_rank=2048)
    baseline_s = simulate(baseline, cost, detail=False).iteration_time_s
    dynamic_s = simulate(dynamic, cost, detail=False).iteration_time_s
    assert dynamic_s <= baseline_s, (dynamic_s, baseline_s)


@pytest.mark.parametrize("strategy", ["megatron-dynamic-cp", "megatron-hybrid-cp"])
def test_layouts_sharing_a_pool_and_per_rank_tokens_schedule_a_batch_once(monkeypatch, strategy):
    """Both schedulers depend on the batch, the DP x CP pool and the tokens per rank only: a layout
    search asks again for each recompute mode of a pool, and gets the plan scheduling it again gives."""
    from megatron_slimpack.planner.baselines import dynamic_cp, hybrid_cp

    calls = []
    if strategy == "megatron-dynamic-cp":
        owner, name, cache = dynamic_cp, "dynamic_cp_schedule", dynamic_cp._schedule_of
    else:
        owner, name = hybrid_cp._balanced_cp_scheduler(), "get_groups_and_subsamples"
        cache = hybrid_cp._scheduled_groups
    original = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args: calls.append(args) or original(*args))
    cache.cache_clear()
    lengths = lognormal_batch(64, seed=11)
    plans = [run(strategy, lengths, per_rank=2048, dp=8, recompute=mode) for mode in ("none", "selective", "full")]
    assert len(calls) == 1
    cache.cache_clear()
    again = run(strategy, lengths, per_rank=2048, dp=8, recompute="full")
    assert len(calls) == 2 and again.to_dict() == plans[-1].to_dict()
    assert len({str([replica.to_dict()["micropacks"] for replica in plan.replicas]) for plan in plans}) == 1
