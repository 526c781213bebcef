"""Token packers: best-fit-decreasing (TRL / NeMo) and LongAlign's sorted batching."""
from __future__ import annotations

import bisect
import random

import numpy as np

from ...config import SlimPackConfig
from ...costmodel import SLIMPACK_RUNTIME, CostModel
from ...plan import (
    MicroPack,
    Plan,
    samples_of,
)
from ...specs import ParallelConfig
from ..compiled import next_fit_starts
from ..registry import register
from .common import (
    INTERLEAVED,
    assemble_plan,
    deal_round_robin,
    input_sources,
    meet_interleaved_count,
    whole_micropacks,
)


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of document indices: documents in decreasing length (ties: lower index first), each
    into the open bin with the least room that still holds it, else a new bin. Bins in order of
    opening."""
    bins: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # sorted (room left, bin index)
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        position = bisect.bisect_left(rooms, (length, -1))
        if position == len(rooms):
            bins.append([index])
            bisect.insort(rooms, (capacity - length, len(bins) - 1))
            continue
        room, chosen = rooms.pop(position)
        bins[chosen].append(index)
        bisect.insort(rooms, (room - length, chosen))
    return bins


@register("bfd", overlaps=SLIMPACK_RUNTIME, role="baseline", trainable=True,
          description="best-fit-decreasing token packing (TRL, NeMo)",
          minimum_in_flight="document", constraints=INTERLEAVED, plans_by_shape=True)
def plan_bfd(lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig, *,
             sources=None) -> Plan:
    """Best-fit-decreasing token packing (TRL `pack_dataset(strategy="bfd")`, NeMo packed SFT).

    Reproduces: whole documents (never split) packed into bins of `context_length` tokens by
    best-fit decreasing (`best_fit_decreasing`); one bin per micro-batch, per-document attention
    masking. Bins are sorted by token count, largest first (stable), and dealt round-robin to
    data-parallel ranks (bin i to rank i % dp); each rank runs classic 1F1B (with virtual stages
    Megatron's interleaved 1F1B, a rank's bins split or merged to a multiple of pp: `meet_interleaved_count`).
    """
    samples = samples_of(lengths)
    bins = best_fit_decreasing(lengths, config.context_length)
    bins.sort(key=lambda members: -sum(lengths[i] for i in members))
    micropacks = whole_micropacks(lengths, bins)
    per_rank = meet_interleaved_count(deal_round_robin(micropacks, parallel.dp), parallel,
                                      config.context_length, "bfd")
    return assemble_plan(per_rank, samples, parallel, cost, config, config.context_length, {"num_bins": len(bins)},
                         input_sources(lengths, sources))


# ==== sorted ====================================================================================


def pack_in_order(order: list[int], lengths: list[int], capacity: int) -> list[list[int]]:
    """Next-fit: documents in `order` fill a sequence until the next one does not fit (the loop
    compiled: `compiled.next_fit_starts`; a search packs one ~10^5-document batch per layout)."""
    if not order:
        return []
    ordered = np.asarray(lengths, dtype=np.int64)[np.asarray(order, dtype=np.int64)]
    bounds = np.append(next_fit_starts(ordered, capacity), len(order)).tolist()
    return [order[start:end] for start, end in zip(bounds, bounds[1:])]


@register("sorted", overlaps=SLIMPACK_RUNTIME, role="baseline", trainable=True, description="LongAlign sorted batching",
          minimum_in_flight="document", constraints=INTERLEAVED, plans_by_shape=True)
def plan_sorted(lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig, *,
                sources=None) -> Plan:
    """LongAlign's sorted batching.

    Reproduces: documents sorted by length (ascending, stable), packed greedily in that order
    into sequences of at most `context_length` tokens (next-fit, `pack_in_order`); consecutive
    sequences form groups of dp (one micro-batch step of all data-parallel ranks, so ranks see
    similar lengths at the same time); the order of the groups is shuffled with
    `random.Random(config.seed)` (LongAlign shuffles its sorted batches) and within a group
    sequence j goes to rank j (a last, partial group leaves the last ranks one micro-batch
    short). Each rank runs classic 1F1B (with virtual stages Megatron's interleaved 1F1B, a rank's
    sequences split or merged to a multiple of pp: `meet_interleaved_count`).
    """
    samples = samples_of(lengths)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    sequences = pack_in_order(order, lengths, config.context_length)
    groups = [sequences[start:start + parallel.dp] for start in range(0, len(sequences), parallel.dp)]
    random.Random(config.seed).shuffle(groups)
    per_rank: list[list[MicroPack]] = [[] for _ in range(parallel.dp)]
    micropacks = iter(whole_micropacks(lengths, (members for group in groups for members in group)))
    for group in groups:
        for rank in range(len(group)):
            per_rank[rank].append(next(micropacks))
    per_rank = meet_interleaved_count(per_rank, parallel, config.context_length, "sorted")
    return assemble_plan(per_rank, samples, parallel, cost, config, config.context_length,
                         {"num_sequences": len(sequences), "group_order_seed": config.seed},
                         input_sources(lengths, sources))
