"""Per-strategy layout search: enumeration, cheap memory checks, feasible choice, reasons."""
from __future__ import annotations

import numpy as np
import pytest

import megatron_slimpack as ms
from megatron_slimpack import specs
from megatron_slimpack.plan import PlanError
from megatron_slimpack.planner.layouts import (
    NoFeasibleLayout,
    attention_pairs_bound,
    best_layout,
    cheap_rejection,
    enumerate_layouts,
    iteration_lower_bound,
    minimum_memory_bytes,
)
from megatron_slimpack.planner.strategies import get_strategy, new_planner, strategy_spec, strategy_specs
from megatron_slimpack.simulator.dag import simulate
from megatron_slimpack.specs import ParallelConfig

COST_7B = ms.CostModel.analytic("llama-7b", "h100-sxm")
COST_70B = ms.CostModel.analytic("llama-70b", "h100-sxm")
FAST = ms.SlimPackConfig(solver_time_limit_s=0.1)


def batch(seed: int, count: int, context: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(7.5, 1.5, count), 1, context)]


def test_enumeration_respects_hardware_model_and_strategy():
    layouts = enumerate_layouts(COST_70B, 256, "megatron-fixed")
    assert layouts and len(set(layouts)) == len(layouts)
    for p in layouts:
        assert p.world_size == 256 and p.tp <= 8 and 64 % p.tp == 0 and 8 % p.tp == 0
        assert 80 % p.pp == 0 and p.cp & (p.cp - 1) == 0
    # every block-N below a chunk's layers, for a strategy whose plans do not depend on memory
    modes_by_shape: dict[tuple[int, ...], set[str]] = {}
    for p in layouts:
        modes_by_shape.setdefault((p.tp, p.pp, p.vpp, p.cp), set()).add(p.recompute)
    for (_, pp, vpp, _), modes in modes_by_shape.items():
        chunk = 80 // (pp * vpp)
        assert modes == {"none", "selective", "selective-mlp", "full", *(f"block-{n}" for n in range(1, chunk))}
    assert {p.recompute for p in enumerate_layouts(COST_70B, 256, "slimpack")} == {
        "none", "selective", "selective-mlp", "full"}
    assert all(p.pp == 1 and p.cp == 1 for p in enumerate_layouts(COST_70B, 256, "megatron-hybrid-cp"))
    # base merge
    assert {p.cp for p in enumerate_layouts(COST_70B, 256, "slimpack")} == {1, 2, 4, 8, 16, 32, 64, 128, 256}
    assert all(p.cp == 1 for p in enumerate_layouts(COST_70B, 256, "slimpack-nomerge"))
    assert strategy_spec("megatron-hybrid-cp").constraints.reason


def test_layout_facts_come_from_the_strategy_specs():
    """Every registered strategy declares its layout facts in its spec (no tables keyed by name in
    layouts.py); an unknown name is refused with the known ones."""
    specs = strategy_specs()
    assert {name for name, spec in specs.items() if spec.sizes_to_memory} == {"slimpack", "slimpack-sym",
                                                                              "slimpack-nomerge"}
    assert {name for name, spec in specs.items() if spec.splits_documents} == {"megatron-fixed", "megatron-stock",
                                                                                "slimpipe"}
    assert {name: spec.minimum_in_flight for name, spec in specs.items()} == {
        "megatron-fixed": "sequence", "megatron-stock": "sequence", "bfd": "document", "sorted": "document",
        "wlb-llm": "document",
        "slimpipe": "half-document", "slimpack": "merged-document", "slimpack-sym": "merged-document",
        "slimpack-nomerge": "document", "megatron-hybrid-cp": "none", "megatron-dp-balanced": "document",
        "megatron-dynamic-cp": "none"}
    assert {name for name, spec in specs.items() if spec.constraints.pp or spec.constraints.cp} == {
        "megatron-hybrid-cp", "megatron-dynamic-cp", "slimpack-nomerge"}
    assert all(spec.constraints.reason for spec in specs.values() if spec.constraints.pp or spec.constraints.cp)
    with pytest.raises(PlanError, match="unknown strategy 'nope'; known: bfd"):
        enumerate_layouts(COST_7B, 8, "nope")


def test_minimum_memory_matches_the_simulated_peak_of_fixed_packing():
    context = 65536
    lengths = batch(0, 300, context)
    parallel = ParallelConfig(dp=2, pp=4, tp=8, recompute="selective")
    plan = get_strategy("megatron-fixed")(lengths, parallel, COST_7B,
                                          ms.SlimPackConfig(strategy="megatron-fixed", context_length=context))
    peak = max(simulate(plan, COST_7B, detail=False).peak_memory_bytes)
    bound = minimum_memory_bytes("megatron-fixed", lengths, COST_7B, parallel, context)
    assert bound <= peak * (1 + 1e-9)


def test_lower_bound_never_exceeds_the_simulated_time():
    """Also with context parallelism, whose exchange the bound counts where a strategy's run waits
    for all of it (bfd, slimpipe, slimpack: a blocking K/V gather) and leaves out where a ring
    hides it behind attention (megatron-fixed)."""
    context = 32768
    lengths = batch(1, 120, context)
    for strategy in ("megatron-fixed", "bfd", "slimpipe", "slimpack"):
        for parallel in (ParallelConfig(dp=4, pp=2, tp=4), ParallelConfig(dp=2, pp=1, tp=8, recompute="full"),
                         ParallelConfig(dp=2, pp=2, tp=4, cp=2 if strategy != "slimpack" else 1),
                         ParallelConfig(dp=2, pp=2, tp=2, cp=4)):
            config = FAST.with_(strategy=strategy, context_length=context)
            plan = get_strategy(strategy)(lengths, parallel, COST_7B, config)
            time_s = simulate(plan, COST_7B, detail=False).iteration_time_s
            assert iteration_lower_bound(strategy, lengths, COST_7B, parallel, config=config) <= time_s, (
                strategy, parallel)


def test_the_bound_counts_a_blocking_context_parallel_exchange():
    from megatron_slimpack.costmodel.overlaps import SERIAL, VARIABLE_SHAPE_RING_CP

    parallel = ParallelConfig(dp=2, pp=2, tp=2, cp=4)
    blocking, ring = COST_7B.with_overlaps(SERIAL), COST_7B.with_overlaps(VARIABLE_SHAPE_RING_CP)
    tokens, pairs, pack = 262144.0, 262144.0 * 4096, 32768.0
    exchange = sum(COST_7B.cp_comm_time(pack, parallel, backward) for backward in (False, True))
    exchange *= tokens / pack * COST_7B.layers_per_stage(parallel)
    assert blocking.pass_time_bound(tokens, pairs, parallel, pack) == pytest.approx(
        ring.pass_time_bound(tokens, pairs, parallel, pack) + exchange)
    assert exchange > 0


def test_a_memory_starved_layout_gets_a_higher_bound_that_still_holds():
    """With memory for packs of only ~12K tokens, efficiency caps what any plan reaches: the bound
    rises above the one for unlimited memory (by the GEMMs' lower efficiency on smaller packs and
    the per-pack overhead: attention is priced per document, whatever the pack) and still stays
    under the simulated time."""
    from dataclasses import replace

    from megatron_slimpack.planner.layouts import largest_pack_tokens

    context, parallel = 8192, ParallelConfig(dp=2, pp=2, tp=4, recompute="selective")
    lengths = batch(1, 120, context)
    per_token = COST_7B.activation_bytes(1.0, 1.0, parallel, last_stage=True)
    room = COST_7B.static_memory_bytes(parallel) + 12000 * per_token
    hardware = replace(COST_7B.hardware, memory_bytes=int(room / COST_7B.hardware.usable_memory_fraction))
    starved = ms.CostModel.analytic("llama-7b", hardware)
    assert largest_pack_tokens("slimpipe", starved, parallel) == pytest.approx(12000, rel=1e-6)
    for strategy in ("slimpack", "slimpipe"):
        config = FAST.with_(strategy=strategy, context_length=context)
        bound = iteration_lower_bound(strategy, lengths, starved, parallel, config=config)
        # measured: 1.025x (slimpack), 1.013x (slimpipe), TP collectives hidden as their runtime hides them
        assert bound > 1.01 * iteration_lower_bound(strategy, lengths, COST_7B, parallel)
        report = simulate(get_strategy(strategy)(lengths, parallel, starved, config), starved, detail=False)
        assert max(report.peak_memory_bytes) <= starved.memory_budget_bytes()
        assert bound <= report.iteration_time_s, strategy


def test_slimpacks_bound_prices_the_merges_memory_forces():
    """At 128K on 16 GPUs the longest documents do not fit one replica of tp1/tp2 layouts: DP-Merge
    groups must run them with context parallelism across replicas. The bound that prices those
    documents on the merged view rises above the plain one (which priced every document on one
    replica) and stays under the simulated time of SlimPack's plan; with enough memory for every
    document (tp4) it is the plain one."""
    from megatron_slimpack.planner.layouts import SortedBatch, merged_work_bound, work_lower_bound

    context = 131072
    lengths = batch(1, 100, context)
    config = FAST.with_(strategy="slimpack", context_length=context)
    for parallel in (ParallelConfig(dp=16), ParallelConfig(cp=2, dp=8), ParallelConfig(pp=2, dp=8),
                     ParallelConfig(tp=2, dp=8), ParallelConfig(tp=4, dp=4)):
        plain_bound = work_lower_bound("slimpack", float(sum(lengths)), attention_pairs_bound("slimpack", lengths),
                                       COST_7B, parallel, config)
        bound = iteration_lower_bound("slimpack", lengths, COST_7B, parallel, config=config)
        assert bound == max(plain_bound, merged_work_bound("slimpack", SortedBatch.of(lengths), COST_7B,
                                                           parallel, config))
        if parallel.tp == 4:
            assert bound == plain_bound
            continue
        assert bound > 1.01 * plain_bound, parallel
        plan = get_strategy("slimpack")(lengths, parallel, COST_7B, config)
        report = simulate(plan, COST_7B, detail=False)
        assert max(report.peak_memory_bytes) <= COST_7B.memory_budget_bytes()
        assert bound <= report.iteration_time_s, parallel
    # the documents merged: sums of a length range
    ordered = SortedBatch.of(lengths)
    assert ordered.totals(0, len(lengths)) == (sum(lengths), sum(n * (n + 1) / 2 for n in lengths))
    assert ordered.totals(3, 7) == (sum(sorted(lengths)[3:7]), sum(n * (n + 1) / 2 for n in sorted(lengths)[3:7]))


def test_slimpack_bound_knows_its_micropack_cap():
    """SlimPack never packs more than its cap: a 2K cap raises the bound (lower GEMM efficiency
    and more per-pack overhead; attention is priced per document, whatever the pack), and the plan
    it makes under that cap still takes at least as long as the bound."""
    context, parallel = 32768, ParallelConfig(dp=2, pp=2, tp=4, recompute="selective")
    lengths = batch(1, 120, context)
    config = FAST.with_(strategy="slimpack", context_length=context)
    capped = config.with_(max_micropack_tokens=2048)
    bound = iteration_lower_bound("slimpack", lengths, COST_7B, parallel, config=capped)
    assert bound > 1.05 * iteration_lower_bound("slimpack", lengths, COST_7B, parallel, config=config)
    plan = get_strategy("slimpack")(lengths, parallel, COST_7B, capped)
    assert bound <= simulate(plan, COST_7B, detail=False).iteration_time_s


@pytest.mark.parametrize("strategy", ["megatron-fixed", "wlb-llm", "slimpack"])
def test_best_layout_is_feasible_and_fastest_of_its_finalists(strategy):
    context = 32768
    batches = [batch(seed, 150, context) for seed in (2, 3)]
    result = best_layout(strategy, batches, COST_7B, 8, context, FAST)
    assert result.parallel.world_size == 8
    assert result.best.peak_memory_bytes <= COST_7B.memory_budget_bytes()
    assert len(result.plans) >= len(batches) and len(result.reports) == len(result.plans)
    assert result.mean_iteration_time_s == min(e.mean_iteration_time_s for e in result.finalists)
    for plan in result.plans:
        plan.validate()
        assert plan.parallel == result.parallel
    assert all(r.reason for r in result.rejected)
    assert result.to_dict()["layout"] == result.parallel.describe()
    if strategy == "wlb-llm":  # delayed documents are flushed at the end: every document is trained
        trained = sum(p.num_tokens for p in result.plans)
        assert trained == sum(map(sum, batches))


def test_the_search_pauses_the_cyclic_collector_and_turns_it_back_on(monkeypatch):
    """Every batch is planned with the collector paused (it rescans every kept plan for nothing),
    and the collector is back on after the search, also where every layout fails to plan."""
    import gc

    from megatron_slimpack.planner import layouts

    seen = []
    planning = layouts._plan_and_simulate

    def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        return planning(*args, **kwargs)

    monkeypatch.setattr(layouts, "_plan_and_simulate", recording)
    context = 262144
    lengths = [context, context // 2, 50000] + [4000] * 20
    with pytest.raises(NoFeasibleLayout):  # every layout fails: the collector still comes back on
        best_layout("megatron-fixed", [lengths], COST_70B, 32, context,
                    layouts=[p for p in enumerate_layouts(COST_70B, 32, "megatron-fixed") if p.recompute == "none"])
    assert gc.isenabled()
    best_layout("megatron-fixed", [batch(2, 150, 32768)], COST_7B, 8, 32768, FAST)
    assert seen and not any(seen) and gc.isenabled()


def test_llama70b_at_256k_without_recompute_on_few_gpus_is_rejected_with_reasons():
    context = 262144
    lengths = [context, context // 2, 50000] + [4000] * 20
    no_recompute = [p for p in enumerate_layouts(COST_70B, 32, "megatron-fixed") if p.recompute == "none"]
    with pytest.raises(NoFeasibleLayout, match="memory") as caught:
        best_layout("megatron-fixed", [lengths], COST_70B, 32, context, layouts=no_recompute)
    assert len(caught.value.rejected) == len(no_recompute)
    assert {r.kind for r in caught.value.rejected} <= {"static-memory", "minimum-memory", "simulated-memory"}
    assert all("GiB" in r.reason for r in caught.value.rejected)
    # With recompute allowed the same GPUs fit it, and the search says why the others failed.
    result = best_layout("megatron-fixed", [lengths], COST_70B, 32, context)
    assert result.parallel.recompute != "none"
    assert any(r.parallel.recompute == "none" and r.infeasible for r in result.rejected)


def test_explicit_layouts_are_checked():
    context = 16384
    lengths = batch(4, 60, context)
    wrong = [ParallelConfig(dp=1, pp=2, tp=8), ParallelConfig(dp=1, pp=3, tp=8), ParallelConfig(dp=8, pp=2, tp=1),
             ParallelConfig(dp=4, tp=8)]
    with pytest.raises(NoFeasibleLayout) as caught:
        best_layout("megatron-hybrid-cp", [lengths], COST_7B, 16, context, layouts=wrong)
    reasons = [r.reason for r in caught.value.rejected]
    assert "not a megatron-hybrid-cp layout" in reasons[0]
    assert "32 layers" in reasons[1] and "not divisible by pp=3" in reasons[1]
    assert "not a megatron-hybrid-cp layout" in reasons[2]
    assert reasons[3] == "uses 32 GPUs, not 16"


def test_cheap_checks_reject_static_memory_first():
    parallel = ParallelConfig(dp=8, pp=1, tp=1)
    rejection = cheap_rejection("bfd", [1000], COST_70B, parallel, 4096)
    assert rejection.kind == "static-memory" and "optimizer" in rejection.reason


def test_bad_input_is_refused():
    with pytest.raises(PlanError, match="no batches"):
        best_layout("bfd", [], COST_7B, 8, 4096)
    with pytest.raises(PlanError, match="unknown strategy"):
        best_layout("no-such-strategy", [[100]], COST_7B, 8, 4096)


def test_slimpack_minimum_need_agrees_with_its_planner():
    context = 262144
    lengths = [context, 30000, 2000]
    config = ms.SlimPackConfig(strategy="slimpack", context_length=context)
    for parallel in (ParallelConfig(dp=1, pp=4, tp=8), ParallelConfig(dp=2, pp=4, tp=8, recompute="full"),
                     ParallelConfig(dp=1, pp=8, tp=8, recompute="selective")):
        rejection = cheap_rejection("slimpack", lengths, COST_70B, parallel, context)
        if rejection is not None:
            assert rejection.kind == "minimum-memory"
            with pytest.raises(PlanError, match="memory"):
                get_strategy("slimpack")(lengths, parallel, COST_70B, config)
    assert cheap_rejection("slimpack", lengths, COST_70B, ParallelConfig(dp=1, pp=4, tp=8), context) is not None


def test_interleaved_layouts_are_screened_after_their_plain_twin():
    """A chunk's smaller activations give an interleaved layout a lower bound than its plain twin,
    yet the interleave cascade needs the twin screened first: every interleaved layout was turned
    away as "not evaluated" (megatron-fixed and wlb-llm, whose packs the bound does not cap)."""
    context = 16384
    lengths = batch(4, 400, context)
    while sum(lengths) > 16 * context:  # 16 full sequences: a count Megatron's interleaving takes
        lengths.pop()
    lengths.append(16 * context - sum(lengths))
    plain = ParallelConfig(tp=2, pp=4, dp=1, recompute="selective")
    layouts = [plain.with_(vpp=vpp) for vpp in (1, 2, 4)]
    bounds = [iteration_lower_bound("megatron-fixed", lengths, COST_7B, p) for p in layouts]
    assert max(bounds[1:]) < bounds[0]  # the premise
    result = best_layout("megatron-fixed", [lengths], COST_7B, 8, context, FAST, layouts=layouts, finalists=1)
    assert sorted(p.vpp for p, _ in result.screened) == [1, 2, 4], [str(r) for r in result.rejected]


def test_a_lighter_recompute_mode_is_screened_before_a_heavier_one_with_a_lower_bound():
    """No recompute leaves room for smaller packs, so its bound can be above full recompute's on the
    same shape; screened in bound order alone, full recompute fit first and the recompute cascade
    turned the faster layout without recompute away as "a lighter recompute mode fits". The device
    is a stand-in whose GEMMs want large packs (one saturating curve, half efficiency at 16K tokens)
    with 60 GB: no recompute has room for packs of ~44K tokens, full recompute for ~370K. (On the
    published H100 rates small packs cost too little for a bound to favour recompute, and selective
    recompute frees almost nothing, so its bound is never below no recompute's.)"""
    from dataclasses import replace

    context = 32768
    lengths = batch(5, 120, context)
    hardware = replace(COST_7B.hardware, kernels="generic", half_efficiency_tokens=16384, memory_bytes=60 * 10**9)
    cost = ms.CostModel.analytic("llama-7b", hardware)
    plain = ParallelConfig(tp=2, cp=4, dp=1)
    modes = [plain.with_(recompute=mode) for mode in ("none", "full")]
    bounds = [iteration_lower_bound("megatron-fixed", lengths, cost, p) for p in modes]
    assert bounds[0] > bounds[1]  # the premise
    result = best_layout("megatron-fixed", [lengths], cost, 8, context, FAST, layouts=modes, finalists=1)
    assert result.parallel == modes[0]
    assert [r.kind for r in result.rejected] == ["recompute-cascade"]


def test_block_recompute_is_searched_by_bisection_for_the_smallest_n_that_fits(monkeypatch):
    """On a shape where no recompute, selective and block-N up to some N do not fit (bfd, tp4 pp2:
    16 layers a stage), the search visits its block-1 .. block-15 by bisection (fitting is monotone
    in N, time rises with N) and picks the smallest block-N that fits, as trying every mode of the
    shape does, in at most ceil(log2(16)) = 4 plannings of the 15; the block modes below it are
    ruled out by a block above them that did not fit ("recompute-memory") or the cheap memory
    check, those above by the one that fits; full, which re-runs all any block re-runs, is not
    planned."""
    from dataclasses import replace

    from megatron_slimpack.planner import layouts

    context = 32768
    lengths = batch(5, 120, context)
    cost = ms.CostModel.analytic("llama-7b", replace(COST_7B.hardware, memory_bytes=36 * 10**9))
    shape = [p for p in enumerate_layouts(cost, 8, "bfd") if (p.tp, p.pp, p.vpp, p.cp) == (4, 2, 1, 1)]
    planned = []
    plan_and_simulate = layouts._plan_and_simulate
    monkeypatch.setattr(layouts, "_plan_and_simulate",
                        lambda run, *args, **kwargs: planned.append(run.parallel.recompute)
                        or plan_and_simulate(run, *args, **kwargs))
    result = best_layout("bfd", [lengths], cost, 8, context, FAST, layouts=shape, finalists=1)
    blocks = [mode for mode in planned if specs.block_recompute_layers(mode)]
    assert len(blocks) <= 4 and "full" not in planned
    every = best_layout("bfd", [lengths], cost, 8, context, FAST, layouts=shape, finalists=1, recompute_cascade=False)
    assert result.parallel == every.parallel and result.mean_iteration_time_s == every.mean_iteration_time_s
    chosen = specs.block_recompute_layers(result.parallel.recompute)
    assert 1 < chosen < 15  # the premise: neither end of the bisection
    fits = {p.recompute for p, _ in every.screened}
    assert {"none", "selective", f"block-{chosen - 1}"}.isdisjoint(fits) and f"block-{chosen}" in fits
    kinds = {r.parallel.recompute: r.kind for r in result.rejected}
    below = {kinds[f"block-{n}"] for n in range(1, chosen) if f"block-{n}" not in blocks}
    assert "recompute-memory" in below and below <= {"recompute-memory", "minimum-memory"}
    assert {kinds[f"block-{n}"] for n in range(chosen + 1, 16) if f"block-{n}" not in blocks} == {
        "recompute-cascade"}


def test_slimpack_screens_one_block_mode_a_shape_where_its_bound_says_the_memory_may_pay():
    """SlimPack sizes its MicroPacks to memory, so its search has no recompute cascade: it adds at
    most one block-N a shape, the N of the lowest bound, where that is below every other mode's of
    the shape (llama-7b 32K, 8 GPUs of 50 GB: memory caps the packs and the pipelined and tp2
    shapes gain from recompute). Checked against every block-N's bound; a shape gets none where no
    block-N's bound is below its modes'; the search screens what was added, and counts it among
    its candidates."""
    from dataclasses import replace

    from megatron_slimpack.planner import layouts

    context = 32768
    lengths = batch(1, 120, context)
    cost = ms.CostModel.analytic("llama-7b", replace(COST_7B.hardware, memory_bytes=50 * 10**9))
    config = FAST.with_(strategy="slimpack", context_length=context)
    as_array = np.asarray(lengths, dtype=np.int64)
    runs = [layouts._Run(p, config) for p in enumerate_layouts(cost, 8, "slimpack")
            if not cheap_rejection("slimpack", as_array, cost, p, context)]
    added = {run.parallel.with_(recompute="none"): run.parallel
             for run in layouts._block_modes_that_may_pay(strategy_spec("slimpack"), runs, as_array, cost, context)}
    assert len(added) >= 3
    shapes: dict[ParallelConfig, list[float]] = {}
    for run in runs:
        shapes.setdefault(run.parallel.with_(recompute="none"), []).append(
            iteration_lower_bound("slimpack", lengths, cost, run.parallel, config=config))
    for shape, bounds in shapes.items():
        blocks = {}
        for mode in specs.block_recompute_modes(cost.model.num_layers // (shape.pp * shape.vpp)):
            parallel = shape.with_(recompute=mode)
            if not cheap_rejection("slimpack", as_array, cost, parallel, context):
                blocks[parallel] = iteration_lower_bound("slimpack", lengths, cost, parallel, config=config)
        better = {parallel: bound for parallel, bound in blocks.items() if bound < min(bounds)}
        if not better:
            assert shape not in added
            continue
        lowest = min(better.values())
        assert added[shape] == min((p for p in better if better[p] == lowest),
                                   key=lambda p: specs.block_recompute_layers(p.recompute))
    events = []
    result = best_layout("slimpack", [lengths], cost, 8, context, FAST, finalists=1, progress=events.append)
    decided = {parallel for parallel, _ in result.screened} | {r.parallel for r in result.rejected}
    assert set(added.values()) <= decided
    # The added modes are candidates too: the progress never screens more layouts than it counts.
    enumerated = len(enumerate_layouts(cost, 8, "slimpack"))
    assert result.candidates == enumerated + len(added)
    assert all(e.total <= e.candidates == result.candidates for e in events if e.phase == "screening")


def test_plans_of_layouts_out_of_the_running_are_shelved_and_change_nothing(monkeypatch):
    """The screened layouts' plans, but the `finalists` fastest so far, are kept pickled; the search
    picks the same, and a shelved layout that becomes a finalist (the fastest failed a later batch)
    gets its first batch's plan back instead of planning that batch again. The layouts are the tp4
    ones: there the fastest (cp2, no recompute) is ahead of the other shapes by more than selective
    recompute costs, so when it fails the winner is its own twin with the least recompute, block-1
    (one layer of 32 re-run: less than selective's core attention in every layer at 32K), which
    the recompute cascade had left unevaluated."""
    from megatron_slimpack.planner import layouts

    context = 32768
    batches = [batch(seed, 120, context) for seed in (5, 6)]
    candidates = [p for p in enumerate_layouts(COST_7B, 8, "megatron-fixed") if p.tp == 4]
    shelved, planned = [], []
    shelve, plan_and_simulate = layouts._Run.shelve, layouts._plan_and_simulate
    monkeypatch.setattr(layouts._Run, "shelve", lambda run: shelved.append(run.parallel) or shelve(run))
    monkeypatch.setattr(layouts, "_plan_and_simulate",
                        lambda run, lengths, cost, step, **kwargs: planned.append((run.parallel, step))
                        or plan_and_simulate(run, lengths, cost, step, **kwargs))
    result = best_layout("megatron-fixed", batches, COST_7B, 8, context, FAST, finalists=2, layouts=candidates)
    assert len(result.screened) > 2 and len(shelved) == len(result.screened) - 2
    assert len(planned) == len(set(planned))  # no batch of a layout planned twice
    monkeypatch.setattr(layouts._Run, "shelve", lambda run: None)
    kept = best_layout("megatron-fixed", batches, COST_7B, 8, context, FAST, finalists=2, layouts=candidates)
    assert [e.parallel for e in kept.finalists] == [e.parallel for e in result.finalists]
    assert [p.fingerprint() for p in kept.plans] == [p.fingerprint() for p in result.plans]

    # The fastest screened layout fails its second batch: the runner-up, shelved, is finished, and
    # the layouts left unevaluated below the failed one's first-batch time are screened again.
    monkeypatch.setattr(layouts._Run, "shelve", lambda run: shelved.append(run.parallel) or shelve(run))
    shelved.clear()
    planned.clear()
    fastest = result.screened[0][0]  # screened fastest first
    finish = layouts._finish_run

    finished = []

    def failing(run, *args):
        if run.parallel == fastest:
            return layouts.Rejection(run.parallel, "simulated-memory", "batch 1: made to fail")
        finished.append(run.parallel)
        return finish(run, *args)

    monkeypatch.setattr(layouts, "_finish_run", failing)
    fallback = best_layout("megatron-fixed", batches, COST_7B, 8, context, FAST, finalists=1, layouts=candidates)
    assert fallback.parallel != fastest and any(parallel in shelved for parallel in finished)
    assert len(fallback.plans) == len(batches) and len(planned) == len(set(planned))
    # Here the winner is one the failed layout had left unevaluated (its heavier recompute mode).
    left_out = {r.parallel: r.kind for r in result.rejected if not r.infeasible}
    assert left_out.get(fallback.parallel) == "recompute-cascade"
    assert fallback.parallel == fastest.with_(recompute="block-1")
    assert fallback.parallel not in {r.parallel for r in fallback.rejected}
    assert fallback.mean_iteration_time_s == min(e.mean_iteration_time_s for e in fallback.finalists)


def test_screened_plans_are_validated_once_among_the_fastest(monkeypatch):
    """Screening plans the first batch without `Plan.validate`; a layout's plans are validated when
    it is finished, so every plan a result reports is. A fastest layout whose plan breaks a rule is
    rejected there as invalid, and the search then picks what it picks without that layout."""
    from megatron_slimpack.plan import Plan

    context = 32768
    batches = [batch(seed, 120, context) for seed in (5, 6)]
    candidates = [p for p in enumerate_layouts(COST_7B, 8, "megatron-fixed") if p.tp == 4]
    validate, validated = Plan.validate, []
    monkeypatch.setattr(Plan, "validate", lambda plan: validated.append(plan.parallel) or validate(plan))
    result = best_layout("megatron-fixed", batches, COST_7B, 8, context, FAST, finalists=1, layouts=candidates)
    assert len(result.screened) > 1 and validated == [result.parallel] * len(batches)

    def breaking(plan):
        if plan.parallel == result.parallel:
            raise PlanError("coverage: made to break")
        return validate(plan)

    monkeypatch.setattr(Plan, "validate", breaking)
    broken = best_layout("megatron-fixed", batches, COST_7B, 8, context, FAST, finalists=1, layouts=candidates)
    assert [(r.kind, r.reason) for r in broken.rejected if r.parallel == result.parallel] == [
        ("invalid", "batch 0: coverage: made to break")]
    monkeypatch.setattr(Plan, "validate", validate)
    without = best_layout("megatron-fixed", batches, COST_7B, 8, context, FAST, finalists=1,
                          layouts=[p for p in candidates if p != result.parallel])
    assert broken.parallel == without.parallel != result.parallel
    assert broken.mean_iteration_time_s == without.mean_iteration_time_s


def test_a_stateful_search_validates_the_plans_of_its_finalists_only(monkeypatch):
    """A stateful strategy runs each layout over every batch without `Plan.validate`; the plans of
    its finalists (all a result reports) are validated at the end. Where one of them breaks a rule,
    every layout is run again validating each plan, so the search ends as one that validated all:
    that layout rejected as invalid at its first batch, and the rest picked without it."""
    from megatron_slimpack.plan import Plan

    context = 32768
    batches = [batch(seed, 150, context) for seed in (2, 3)]
    validate, validated = Plan.validate, []
    monkeypatch.setattr(Plan, "validate", lambda plan: validated.append(plan.parallel) or validate(plan))
    result = best_layout("wlb-llm", batches, COST_7B, 8, context, FAST, finalists=2)
    assert sorted(map(str, validated)) == sorted(str(e.parallel) for e in result.finalists for _ in e.plans)
    assert len(result.screened) > len(result.finalists)

    def breaking(plan):
        if plan.parallel == result.parallel:
            raise PlanError("coverage: made to break")
        return validate(plan)

    monkeypatch.setattr(Plan, "validate", breaking)
    broken = best_layout("wlb-llm", batches, COST_7B, 8, context, FAST, finalists=2)
    assert [(r.kind, r.reason) for r in broken.rejected if r.parallel == result.parallel] == [
        ("invalid", "batch 0: coverage: made to break")]
    monkeypatch.setattr(Plan, "validate", validate)
    without = best_layout("wlb-llm", batches, COST_7B, 8, context, FAST, finalists=2,
                          layouts=[p for p in enumerate_layouts(COST_7B, 8, "wlb-llm") if p != result.parallel])
    assert [e.parallel for e in broken.finalists] == [e.parallel for e in without.finalists]
    assert [e.mean_iteration_time_s for e in broken.finalists] == [e.mean_iteration_time_s for e in without.finalists]


def _mean_over_every_batch(strategy: str, batches: list[list[int]], parallel: ParallelConfig, cost, context: int,
                           config) -> float | None:
    """A stateful strategy's mean on a layout, run on its own over every batch and the flush
    (None: a batch does not fit)."""
    planner = new_planner(strategy)
    config = config.with_(strategy=strategy, context_length=context)
    total = 0.0
    try:
        plans = [planner.plan(lengths, parallel, cost, config) for lengths in batches]
        plans.append(planner.flush(parallel, cost, config))
    except PlanError:
        return None
    for plan in filter(None, plans):
        report = simulate(plan, cost, detail=False)
        if max(report.peak_memory_bytes) > cost.memory_budget_bytes():
            return None
        total += report.iteration_time_s
    return total / len(batches)


@pytest.mark.parametrize("finalists", [1, 2])
def test_a_stateful_strategy_runs_each_layout_that_could_still_win_on_every_batch(monkeypatch, finalists):
    """WLB-LLM's first batch is a poor guide to its mean (its queue fills over the steps): each
    layout runs every batch and the flush, in the order of a lower bound on its mean, until that
    bound (before it runs: "bound") or its plans so far and the bound on the rest ("finish-bound")
    rule it out of the `finalists` fastest; the fastest mean wins, and only the finalists keep
    their plans. Each layout ruled out, run on its own over every batch, is indeed slower than
    every finalist, and the finalists are the fastest of every layout the cascades leave (with one
    finalist, what a comparison asks for: the best layout, pruned against the best mean)."""
    from megatron_slimpack.planner import layouts

    context = 32768
    batches = [batch(seed, 150, context) for seed in (2, 3, 4)]
    means = {}  # layout -> mean over every batch (None: it failed one or stopped)
    finish = layouts._finish_run

    def finished(run, *args):
        rejection = finish(run, *args)
        means[run.parallel] = None if rejection else sum(r.iteration_time_s for r in run.reports) / len(batches)
        return rejection

    monkeypatch.setattr(layouts, "_finish_run", finished)
    result = best_layout("wlb-llm", batches, COST_7B, 8, context, FAST, finalists=finalists)
    assert {parallel for parallel, _ in result.screened} <= set(means) and len(means) > 4
    ruled_out = [r for r in result.rejected if r.kind in ("bound", "finish-bound")]
    assert {r.kind for r in ruled_out} == {"bound", "finish-bound"}
    slowest_finalist = max(e.mean_iteration_time_s for e in result.finalists)
    for rejection in ruled_out:
        alone = _mean_over_every_batch("wlb-llm", batches, rejection.parallel, COST_7B, context, FAST)
        assert alone is None or alone > slowest_finalist, rejection
        assert means.get(rejection.parallel) is None
    cascaded = {r.parallel for r in result.rejected if r.kind in ("recompute-cascade", "interleave-cascade")}
    alone = {parallel: _mean_over_every_batch("wlb-llm", batches, parallel, COST_7B, context, FAST)
             for parallel in enumerate_layouts(COST_7B, 8, "wlb-llm") if parallel not in cascaded}
    fastest = sorted((p for p in alone if alone[p] is not None), key=alone.get)[:finalists]
    assert [e.parallel for e in result.finalists] == fastest
    assert [e.mean_iteration_time_s for e in result.finalists] == pytest.approx([alone[p] for p in fastest], rel=1e-12)
    assert all(len(e.plans) >= len(batches) for e in result.finalists)


def test_a_strategy_that_plans_by_shape_plans_each_batch_once_per_shape():
    """bfd's plan depends on the layout only through dp, pp and vpp (`StrategySpec.plans_by_shape`):
    the search plans each batch once per shape, every other layout of the shape gets the same plan
    with its own layout, and it finds what a search planning every layout finds."""
    import dataclasses

    from megatron_slimpack.planner import registry

    context = 32768
    batches = [batch(seed, 120, context) for seed in (5, 6)]
    planned = []
    plan_bfd = registry.REGISTRY["bfd"].factory().function

    def counting(lengths, parallel, *args, **kwargs):
        planned.append((tuple(lengths), parallel.dp, parallel.pp, parallel.vpp))
        if parallel.pp == 2:  # a refusal, also by shape: kept and raised again for the shape's other layouts
            raise PlanError(f"refused: dp {parallel.dp}, pp 2, vpp {parallel.vpp}")
        return plan_bfd(lengths, parallel, *args, **kwargs)

    spec = dataclasses.replace(strategy_spec("bfd"), factory=lambda: registry.StepPlanner(counting))
    shared = best_layout(spec, batches, COST_7B, 8, context, FAST)
    assert len(planned) == len(set(planned))
    first_batch = [key for key in planned if key[0] == tuple(batches[0])]
    given_first_batch = len(shared.screened) + sum(r.kind == "invalid" for r in shared.rejected)
    assert given_first_batch > len(first_batch) > 0  # some layouts got another layout's plan or refusal
    for plan, evaluation in ((plan, e) for e in shared.finalists for plan in e.plans):
        assert plan.parallel == evaluation.parallel
    planned.clear()
    alone = best_layout(dataclasses.replace(spec, plans_by_shape=False), batches, COST_7B, 8, context, FAST)
    assert len(planned) > len(set(planned))  # without it, shapes are planned again
    assert [(e.parallel, e.mean_iteration_time_s) for e in alone.finalists] == \
        [(e.parallel, e.mean_iteration_time_s) for e in shared.finalists]
    assert [p.fingerprint() for p in alone.plans] == [p.fingerprint() for p in shared.plans]
    assert alone.screened == shared.screened
    # A shape the planner refuses is refused again for its other layouts, with the same reason.
    refused = [(r.parallel, r.reason) for r in shared.rejected if r.kind == "invalid"]
    assert len({parallel.with_(tp=1, cp=1, recompute="none") for parallel, _ in refused}) < len(refused)
    assert all(reason.endswith(f"refused: dp {parallel.dp}, pp 2, vpp {parallel.vpp}") for parallel, reason in refused)
    assert [(r.parallel, r.kind, r.reason) for r in alone.rejected] == \
        [(r.parallel, r.kind, r.reason) for r in shared.rejected]


def test_layouts_of_one_shape_get_plans_of_their_own():
    """Two layouts of one shape (dp, pp, vpp) screen on copies of the same plan; as finalists each
    gets plans that share no part with the other's, so changing one never changes the other."""
    context = 32768
    batches = [batch(seed, 120, context) for seed in (5, 6)]
    same_shape = [ParallelConfig(tp=tp, cp=2 // tp, dp=4, recompute="full") for tp in (1, 2)]
    result = best_layout("bfd", batches, COST_7B, 8, context, FAST, layouts=same_shape, finalists=2)
    assert sorted(e.parallel.tp for e in result.finalists) == [1, 2]
    first, second = (e.plans for e in result.finalists)
    assert [p.fingerprint() for p in first] != [p.fingerprint() for p in second]  # their own layouts
    assert [p.to_dict(False)["replicas"] for p in first] == [p.to_dict(False)["replicas"] for p in second]
    for one, other in zip(first, second):
        assert not {id(r) for r in one.replicas} & {id(r) for r in other.replicas}
        assert one.samples is not other.samples and one.metadata is not other.metadata


def test_the_work_bound_is_superadditive():
    """The bounds of any split of the documents sum to at least the bound of all of them, which
    lets a stateful strategy's remaining steps be bounded by what they still have to train."""
    rng = np.random.default_rng(5)
    lengths = batch(7, 300, 32768)
    for strategy, parallel in (("wlb-llm", ParallelConfig(dp=2, pp=2, tp=2)),
                               ("wlb-llm", ParallelConfig(dp=1, pp=4, tp=2, recompute="full")),
                               ("slimpack", ParallelConfig(dp=4, pp=1, tp=2, cp=1))):
        whole = iteration_lower_bound(strategy, lengths, COST_7B, parallel)
        for parts in (2, 7, 40):
            cuts = np.sort(rng.choice(np.arange(1, len(lengths)), parts - 1, replace=False))
            pieces = np.split(np.array(lengths), cuts)
            split = sum(iteration_lower_bound(strategy, [int(n) for n in piece], COST_7B, parallel) for piece in pieces)
            assert split >= whole * (1 - 1e-12), (strategy, parallel, parts)
        assert iteration_lower_bound(strategy, [], COST_7B, parallel) == 0.0
