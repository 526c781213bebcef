"""megatron-stock: stock Megatron-LM `pretrain_gpt.py` without `--reset-attention-mask`.
megatron-fixed's sequences, each one causal sequence across its document boundaries: the
same cuts, L(L+1)/2 attention pairs per sequence, never faster than megatron-fixed on a layout, a
reference that `compare` and the paper grid label and keep out of "the fastest other strategy",
and not trainable by the SlimPack runtime."""
from __future__ import annotations

import dataclasses
import json
from collections import Counter

import numpy as np
import pytest

import megatron_slimpack as ms
from megatron_slimpack.apps.comparison import STOCK_COLUMN, STOCK_HEADER, competitors, is_reference, run_comparison
from megatron_slimpack.plan import Plan, pack_figures
from megatron_slimpack.planner.layouts import best_layout, enumerate_layouts
from megatron_slimpack.planner.strategies import get_strategy, strategy_spec, trainable_strategy_names
from megatron_slimpack.simulator.dag import simulate
from megatron_slimpack.specs import ParallelConfig
from megatron_slimpack.workload import GlobalBatchSampler

COST = ms.CostModel.analytic("llama-7b", "h100-sxm")
CONTEXT = 32768


def plan_of(strategy: str, lengths, parallel: ParallelConfig, context: int = CONTEXT, sources=None) -> Plan:
    config = ms.SlimPackConfig(strategy=strategy, context_length=context)
    return get_strategy(strategy)(list(lengths), parallel, COST, config, sources=sources).validate()


def batch(seed: int = 0, count: int = 200, context: int = CONTEXT) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(8.0, 1.5, count), 1, context)]


# ---- the plan ---------------------------------------------------------------------------------
def test_hand_checked_sequences_are_whole_samples_with_the_cuts_of_megatron_fixed():
    # Stream of 25 tokens cut every 8: [d0 5 | d1 3] [d1 7 | d2 1] [d2 2 | d3 6] [d3 1]
    parallel = ParallelConfig(dp=2, pp=1, tp=8)
    stock = plan_of("megatron-stock", [5, 10, 3, 7], parallel, context=8)
    assert [tuple(s) for s in stock.samples] == [(0, 8), (1, 8), (2, 8), (3, 1)]
    assert stock.metadata["sequence_pieces"] == [[[0, 0, 5], [1, 0, 3]], [[1, 3, 7], [2, 0, 1]],
                                                 [[2, 1, 2], [3, 0, 6]], [[3, 6, 1]]]
    # where each sequence begins: its first piece
    assert [tuple(s) for s in stock.sample_sources] == [(0, 0), (1, 3), (2, 1), (3, 6)]
    assert [[(s.sample_id, s.start, s.end) for s in m.slices] for r in stock.replicas for m in r.micropacks] == [
        [(0, 0, 8)], [(1, 0, 8)], [(2, 0, 8)], [(3, 0, 1)]]
    assert stock.metadata["micro_batches_per_rank"] == [2, 2]


@pytest.mark.parametrize("parallel", [ParallelConfig(dp=4, pp=1, tp=8), ParallelConfig(dp=3, pp=4, tp=2),
                                      ParallelConfig(dp=2, pp=2, tp=4, cp=2)])
def test_same_cuts_dealing_and_schedule_as_megatron_fixed(parallel):
    lengths = batch(1)
    fixed = plan_of("megatron-fixed", lengths, parallel)
    stock = plan_of("megatron-stock", lengths, parallel)
    pieces = iter(fixed.metadata["pieces"])
    sizes = fixed.sample_lengths()
    assert stock.metadata["num_sequences"] == fixed.metadata["num_sequences"]
    assert stock.metadata["micro_batches_per_rank"] == fixed.metadata["micro_batches_per_rank"]
    sequence = 0
    for mine, theirs in zip(stock.replicas, fixed.replicas):
        assert mine.dp_ranks == theirs.dp_ranks
        assert (mine.forward_units, mine.backward_units, mine.stage_orders) == (
            theirs.forward_units, theirs.backward_units, theirs.stage_orders)
        for whole, cut in zip(mine.micropacks, theirs.micropacks):
            # one sequence: the pieces of megatron-fixed's micro-batch, in order, as one sample
            expected = [[*next(pieces), sizes[s.sample_id]] for s in cut.slices]
            assert stock.metadata["sequence_pieces"][sequence] == expected
            assert [(s.sample_id, s.start, s.end) for s in whole.slices] == [(sequence, 0, cut.num_tokens)]
            sequence += 1
    assert sequence == stock.metadata["num_sequences"]


def test_each_sequence_attends_over_its_whole_length():
    lengths = batch(2)
    stock = plan_of("megatron-stock", lengths, ParallelConfig(dp=2, pp=2, tp=8))
    fixed = plan_of("megatron-fixed", lengths, ParallelConfig(dp=2, pp=2, tp=8))
    for mine, theirs in zip(stock.replicas, fixed.replicas):
        figures = pack_figures(mine.micropacks)
        tokens = np.array([m.num_tokens for m in mine.micropacks], dtype=float)
        assert (figures.tokens == tokens).all()
        assert (figures.pairs == tokens * (tokens + 1) / 2).all()  # what the simulator prices
        assert not figures.prefix.any() and not figures.continued.any()  # no KV cache: nothing is sliced
        assert all(m.attention_pairs == m.num_tokens * (m.num_tokens + 1) // 2 for m in mine.micropacks)
        # more attention than per-document masking wherever a sequence holds several pieces
        for whole, cut in zip(mine.micropacks, theirs.micropacks):
            assert whole.attention_pairs >= cut.attention_pairs
            assert (whole.attention_pairs > cut.attention_pairs) == (len(cut.slices) > 1)


@pytest.mark.parametrize("parallel", [ParallelConfig(dp=4, pp=1, tp=8), ParallelConfig(dp=2, pp=4, tp=4),
                                      ParallelConfig(dp=2, pp=2, tp=4, cp=2, recompute="selective"),
                                      ParallelConfig(dp=1, pp=2, tp=8, cp=4, recompute="full")])
def test_never_faster_than_megatron_fixed_on_the_same_layout(parallel):
    lengths = batch(3)
    fixed = simulate(plan_of("megatron-fixed", lengths, parallel), COST, detail=False)
    stock = simulate(plan_of("megatron-stock", lengths, parallel), COST, detail=False)
    assert stock.iteration_time_s >= fixed.iteration_time_s
    if parallel.cp == 1:  # these batches pack several documents a sequence: strictly more attention
        assert stock.iteration_time_s > fixed.iteration_time_s
    # (with cp > 1 the extra attention may hide under the K/V exchange it overlaps, which the cost
    # model exposes only where it outlasts the attention: then both take the same time)
    assert stock.lower_bound_s >= fixed.lower_bound_s


def test_sources_say_where_each_sequence_begins_and_its_pieces_cover_the_batch_once():
    corpus = np.random.default_rng(5).integers(50, 3 * 4096, size=200)
    sampler = GlobalBatchSampler(corpus, 4096, 16, seed=5, long_documents="split")
    for _ in range(3):
        drawn = sampler.next_batch()
        plan = plan_of("megatron-stock", drawn.lengths, ParallelConfig(dp=2, pp=2, tp=8), context=4096,
                       sources=drawn.sources)
        tokens: Counter = Counter()
        for sample, source, pieces in zip(plan.samples, plan.sample_sources, plan.metadata["sequence_pieces"]):
            assert sum(length for _, _, length in pieces) == sample.length
            index, offset, _ = pieces[0]
            document, start = drawn.sources[index]
            assert tuple(source) == (document, start + offset)
            for index, offset, length in pieces:
                document, start = drawn.sources[index]
                tokens.update((document, start + offset + t) for t in range(length))
        given: Counter = Counter()
        for (document, start), length in zip(drawn.sources, drawn.lengths):
            given.update((document, start + t) for t in range(length))
        assert tokens == given
        again = Plan.from_json(plan.to_json())
        assert again.validate().fingerprint() == plan.fingerprint()
        assert again.metadata["sequence_pieces"] == json.loads(json.dumps(plan.metadata["sequence_pieces"]))


# ---- the registry and the runtime -------------------------------------------------------------
def test_registered_as_a_reference_that_the_runtime_refuses():
    spec = strategy_spec("megatron-stock")
    assert not spec.trainable and "megatron-stock" not in trainable_strategy_names()
    assert spec.is_reference and is_reference("megatron-stock")
    assert "cross-document" in spec.different_semantics and "--reset-attention-mask" in spec.different_semantics
    assert "different training semantic" in spec.description
    assert not any(strategy_spec(name).is_reference for name in trainable_strategy_names())
    fixed = strategy_spec("megatron-fixed")
    for fact in ("minimum_in_flight", "splits_documents", "renumbers_samples", "constraints", "sizes_to_memory"):
        assert getattr(spec, fact) == getattr(fixed, fact), fact
    from megatron_slimpack.megatron.args import SlimPackArgumentError, validate_slimpack_args

    args = type("Args", (), dict(slimpack=True, calculate_per_token_loss=True, slimpack_strategy="megatron-stock"))()
    with pytest.raises(SlimPackArgumentError, match="--slimpack-strategy 'megatron-stock' is simulated for "
                                                    "comparison only: the SlimPack runtime does not run it"):
        validate_slimpack_args(args)


def test_the_layout_search_finds_its_own_best_layout():
    assert enumerate_layouts(COST, 16, "megatron-stock") == enumerate_layouts(COST, 16, "megatron-fixed")
    batches = [batch(seed, 120) for seed in (6, 7)]
    result = best_layout("megatron-stock", batches, COST, 16, CONTEXT,
                         ms.SlimPackConfig(solver_time_limit_s=60.0, solver_deterministic_limit=0.2))
    assert result.plans[0].strategy == "megatron-stock" and len(result.plans) == 2
    assert result.mean_iteration_time_s == min(e.mean_iteration_time_s for e in result.finalists)
    fixed = plan_of("megatron-fixed", batches[0], result.parallel)
    assert result.reports[0].iteration_time_s >= simulate(fixed, COST, detail=False).iteration_time_s


# ---- compare ----------------------------------------------------------------------------------
TINY = ms.CostModel.analytic("tiny", "cpu")


def compare(strategies: str):
    """A small comparison (the tiny model on 2 CPU "GPUs", 4K context) of one batch."""
    return run_comparison(workload="given", model="tiny", hardware="cpu", cost=TINY, gpus=2,
                          global_batch_size=6, strategies=strategies, show_progress=False,
                          config=ms.SlimPackConfig(context_length=4096, solver_time_limit_s=60.0,
                                                   solver_deterministic_limit=0.2),
                          batches=[batch(8, 40, context=4096)])


def test_compare_labels_it_and_reports_the_speedup_over_it():
    result = compare("megatron-fixed,megatron-stock,bfd,slimpack")
    seconds = {name: r.mean_iteration_time_s for name, r in result.results.items()}
    assert seconds["megatron-stock"] > seconds["megatron-fixed"]
    rows = {row["strategy"]: row for row in result.to_dict()["rows"]}
    for name, row in rows.items():
        assert row["speedup"] == pytest.approx(seconds["megatron-fixed"] / seconds[name])
        assert row[STOCK_COLUMN] == pytest.approx(seconds["megatron-stock"] / seconds[name])
    table = result.table("markdown").splitlines()
    assert f"| speedup vs megatron-fixed | {STOCK_HEADER} |" in table[0]
    slimpack_row = next(line for line in table if line.startswith("| slimpack |"))
    assert slimpack_row.endswith(f"| {seconds['megatron-stock'] / seconds['slimpack']:.2f}x |")
    assert result.table("csv").splitlines()[0].endswith(f",speedup,{STOCK_COLUMN}")
    notes = result.notes()
    assert any(line.startswith("megatron-stock is a reference, left out of the fastest other strategy: "
                               "cross-document attention") for line in notes)
    headline = next(line for line in notes if line.startswith("slimpack: "))
    assert f"{seconds['megatron-stock'] / seconds['slimpack']:.2f}x over megatron-stock (cross-document" in headline
    assert f"{seconds['megatron-fixed'] / seconds['slimpack']:.2f}x over megatron-fixed" in headline
    assert result.to_dict()["references"] == {"megatron-stock": strategy_spec("megatron-stock").different_semantics}


def test_compare_never_takes_it_for_the_fastest_other_strategy():
    result = compare("megatron-stock,slimpack")
    assert result.fastest_other() is None  # the only other strategy is a reference
    assert "fastest other" not in result.headline()
    assert "over megatron-stock" in result.headline()
    # even when it is the fastest of them (a stand-in: its time made the lowest)
    names = ["megatron-fixed", "megatron-stock", "bfd", "slimpack", "slimpack-sym"]
    assert competitors(names, "slimpack") == ["megatron-fixed", "bfd"]
    full = compare("megatron-fixed,megatron-stock,slimpack")
    stock = full.results["megatron-stock"].best
    stock.reports = [dataclasses.replace(report, iteration_time_s=1e-6) for report in stock.reports]
    assert full.results["megatron-stock"].mean_iteration_time_s < full.results["megatron-fixed"].mean_iteration_time_s
    assert full.fastest_other() == "megatron-fixed"
    assert "(megatron-fixed)" in full.headline()


def test_without_it_compare_has_no_stock_column():
    result = compare("megatron-fixed,bfd")
    assert STOCK_HEADER not in result.table("markdown") and STOCK_COLUMN not in result.table("csv")
    assert not any("megatron-stock" in line for line in result.notes())
