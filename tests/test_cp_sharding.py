"""Context parallelism's load per rank, as the run shards a micro-batch: per document (Megatron's THD
path, the SlimPack runtime: every strategy the comparison prices) leaves the ranks balanced, as
`pairs / cp` prices them; per sequence (WLB-LLM's "Plain-4D" baseline: the whole pack cut into
2 x cp chunks) leaves them unequal under document masking, and every layer waits for the busiest."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from megatron_slimpack import SlimPackConfig
from megatron_slimpack import plan as plan_batch
from megatron_slimpack.costmodel import FIXED_SHAPE, CostModel
from megatron_slimpack.plan import MicroPack, Slice, micropack_figures, sequence_sharded_pairs
from megatron_slimpack.planner.strategies import strategy_names, strategy_spec
from megatron_slimpack.runtime.attention.context_parallel import split_slice
from megatron_slimpack.simulator.dag import simulate
from megatron_slimpack.specs import ParallelConfig


def rank_pairs_by_hand(slices: list[tuple[int, int]], cp: int) -> list[int]:
    """(prefix, length) slices packed in order; chunks of the whole pack, zigzag; a token attends its
    slice's prefix and its document's earlier tokens."""
    weights = [start + i + 1 for start, length in slices for i in range(length)]
    bounds = [len(weights) * j // (2 * cp) for j in range(2 * cp + 1)]
    chunks = [sum(weights[bounds[j]:bounds[j + 1]]) for j in range(2 * cp)]
    return [chunks[r] + chunks[2 * cp - 1 - r] for r in range(cp)]


def test_a_sequence_sharded_pack_is_priced_at_its_busiest_rank():
    # cp 2: a 6-token document then a 2-token one, chunks of 2 tokens: rank 0 holds 1+2 and 1+2,
    # rank 1 holds 3+4 and 5+6; 24 pairs in all, the busiest rank 18
    pack = MicroPack([Slice(0, 0, 6), Slice(1, 0, 2)])
    assert micropack_figures([pack])[1].tolist() == [24.0]
    assert sequence_sharded_pairs([pack], 2).tolist() == [36.0]
    assert rank_pairs_by_hand([(0, 6), (0, 2)], 2) == [6, 18]


def test_one_causal_sequence_and_a_prefixed_slice_stay_balanced():
    # the zigzag balances one causal sequence exactly, KV prefix or not
    packs = [MicroPack([Slice(0, 0, 8)]), MicroPack([Slice(3, 4, 12)])]
    assert sequence_sharded_pairs(packs, 2).tolist() == micropack_figures(packs)[1].tolist()


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_random_packs_match_the_hand_count(cp):
    rng = np.random.default_rng(cp)
    packs, expected = [], []
    for sample in range(30):
        slices = [(int(rng.integers(0, 50)), int(rng.integers(1, 60))) for _ in range(int(rng.integers(1, 6)))]
        tokens = sum(length for _, length in slices)
        if tokens < 2 * cp:
            continue
        packs.append(MicroPack([Slice(10 * sample + i, start, start + length)
                                for i, (start, length) in enumerate(slices)]))
        expected.append(cp * max(rank_pairs_by_hand(slices, cp)))
    assert sequence_sharded_pairs(packs, cp).tolist() == pytest.approx(expected)
    assert all(e >= p for e, p in zip(expected, micropack_figures(packs)[1]))


@pytest.mark.parametrize("length", [37, 64, 1000, 4097])
def test_the_runtime_shards_per_document_within_a_token_per_chunk(length):
    """Why every strategy the comparison prices keeps `pairs / cp`: the SlimPack runtime's split
    of one slice (and Megatron's THD split of one document) gives each rank its zigzag share."""
    cp, start = 4, 100
    shares = [sum(start + offset + 1 for offset in offsets) for offsets in split_slice(length, cp)]
    total = sum(shares)
    assert max(shares) - total / cp <= 2 * (start + length)  # at most a token per chunk (two chunks) above even


def test_every_strategy_shards_per_document():
    for name in strategy_names():
        assert not strategy_spec(name).overlaps.cp_per_sequence, name


def test_the_simulator_prices_per_sequence_sharding_only_where_declared():
    cost = CostModel.analytic("llama-7b", "h100-sxm")
    parallel = ParallelConfig(tp=1, pp=1, cp=2, dp=1)
    # one 16K sequence: a 12K document and short ones, so its tail chunk is light and its middle heavy
    lengths = [12288, 1024, 1024, 1024, 1024]
    plan = plan_batch(lengths, parallel=parallel, cost=cost,
                      config=SlimPackConfig(strategy="megatron-fixed", context_length=16384))
    balanced = simulate(plan, cost)
    per_sequence = simulate(plan, cost, overlaps=replace(FIXED_SHAPE, cp_per_sequence=True))
    assert per_sequence.iteration_time_s > balanced.iteration_time_s
    # the difference is the attention of the busiest rank's extra pairs, forward and backward
    pack = plan.replicas[0].micropacks
    extra = sequence_sharded_pairs(pack, 2) - micropack_figures(pack)[1]
    assert extra[0] > 0
    view = cost.with_overlaps(FIXED_SHAPE)
    tokens, pairs = float(micropack_figures(pack)[0][0]), float(micropack_figures(pack)[1][0])
    expected = cost.model.num_layers * sum(
        cost.attention_time(tokens, pairs + extra[0], parallel, backward) - cost.attention_time(tokens, pairs, parallel,
                                                                                                backward)
        for backward in (False, True))
    assert view.overlaps.cp_exchange  # the ring hides the exchange behind the (longer) attention
    assert per_sequence.iteration_time_s - balanced.iteration_time_s == pytest.approx(expected, rel=0.05)
