"""SlimPack's memory rules: what a stage holds, the largest MicroPack that fits, and how many
replicas must share a long document (its DP-Merge group) for it to fit. Each failure is a
`DoesNotFit`."""
from __future__ import annotations

import numpy as np

from ...config import SlimPackConfig
from ...costmodel import CostModel, format_bytes
from ...specs import ParallelConfig
from ..outcomes import DoesNotFit, kept
from .ladder import SizeLadder


def activation_budget(cost: CostModel, parallel: ParallelConfig) -> float:
    """Bytes a stage may hold in flight (activations and KV caches): memory minus weights,
    gradients and optimizer state."""
    return cost.memory_budget_bytes() - cost.static_memory_bytes(parallel)


def fullest_stage_bytes(cost: CostModel, parallel: ParallelConfig, tokens: float, pairs: float,
                        other_pack_tokens: float = 0.0) -> float:
    """Activations on the fullest pipeline stage while `tokens` (with `pairs`) are in flight next to
    the pp - 1 MicroPacks of `other_pack_tokens` that 1F1B keeps on stage 0. Stage s holds pp - s
    packs; only the last stage (one pack) adds its logits, so the peak is on stage 0 or the last.
    With virtual stages (vpp > 1) figures are per chunk: the pack is in flight on all vpp chunks of
    a rank, next to the other chunk forwards of rank 0's interleaved warm-up."""
    chunks = parallel.vpp
    middle = cost.activation_bytes(tokens, pairs, parallel)
    last = cost.activation_bytes(tokens, pairs, parallel, last_stage=True) + (chunks - 1) * middle
    if parallel.pp == 1:
        return last
    other_chunks = parallel.pp - 1 if chunks == 1 else (chunks - 1) * parallel.pp + 2 * (parallel.pp - 1) + 1 - chunks
    others = other_chunks * cost.activation_bytes(other_pack_tokens, other_pack_tokens ** 2 / 2, parallel)
    return max(chunks * middle + others, last)


def auto_token_cap(cost: CostModel, parallel: ParallelConfig, config: SlimPackConfig) -> int:
    """The largest MicroPack that lets stage 0 hold pp of them (and the last stage one with its
    logits), at most the context: the largest power of two that fits, then grown in eighths of it
    while they fit (activation memory is linear in tokens, so the memory between two powers of two
    buys up to 7/8 more tokens)."""
    if config.max_micropack_tokens:
        return config.max_micropack_tokens
    # Long documents' KV caches are the DP-Merge sizing's concern (merge_group_sizes), not the cap's.
    budget = activation_budget(cost, parallel)
    smallest = config.tunables.min_micropack_tokens

    def need(cap: int) -> float:
        return fullest_stage_bytes(cost, parallel, cap, cap * cap / 2, cap)

    cap = 1 << (config.context_length.bit_length() - 1)
    while cap > smallest and need(cap) > budget:
        cap //= 2
    if need(cap) > budget:
        total = cost.static_memory_bytes(parallel) + need(cap)
        raise DoesNotFit(
            f"memory: weights, optimizer state and {parallel.pp} MicroPacks of {cap} tokens need at least "
            f"{format_bytes(total)} per device with {parallel.describe()} but "
            f"{format_bytes(cost.memory_budget_bytes())} is usable on {cost.hardware.name}; "
            f"use activation recompute, more tensor or pipeline parallelism, "
            f"or a shorter context",
            bytes_needed=total, bytes_available=cost.memory_budget_bytes())
    step = max(cap // 8, 1)
    grown = cap
    while grown + step < 2 * cap and grown + step <= config.context_length and need(grown + step) <= budget:
        grown += step
    return min(grown, config.context_length)


def document_memory_bytes(length: int, cost: CostModel, parallel: ParallelConfig,
                          token_cap: int | None = None) -> float:
    """Per-device memory of one document whose slices are all in flight, as its backward needs.

    Without `token_cap` this is a lower bound (the document alone, in one MicroPack). With it, the
    document's MicroPacks count as filled to the cap (short documents top them up), a document
    longer than the cap also holds the KV cache of its sliced prefix, and stage 0 also holds the
    pp - 1 other MicroPacks that 1F1B keeps in flight. A document within the cap is one MicroPack
    like any other: it has no KV cache and needs no more than the cap itself."""
    pairs = length * (length + 1) / 2
    in_flight, kv, other_pack_tokens = length, 0.0, 0
    if token_cap:
        in_flight = -(-length // token_cap) * token_cap
        kv = parallel.vpp * cost.kv_cache_bytes(length, parallel) if length > token_cap else 0.0
        other_pack_tokens = token_cap
    return (cost.static_memory_bytes(parallel)
            + fullest_stage_bytes(cost, parallel, in_flight, pairs, other_pack_tokens) + kv)


def merge_group_sizes(lengths: list[int], cost: CostModel, parallel: ParallelConfig, micropack_tokens: list[int],
                      dp_merge: bool) -> np.ndarray:
    """For each document, how many replicas must share it (context parallelism across a DP-Merge
    group) for it to fit memory with one of the MicroPack sizes the replica planner tries
    (`micropack_tokens`; smaller MicroPacks leave more room for a long document's slices next to
    the ones 1F1B keeps in flight): 1 for nearly all. Raises DoesNotFit when no group size suffices."""
    budget = cost.memory_budget_bytes()
    group_ranks = np.ones(len(lengths), dtype=int)
    largest_group = parallel.dp if dp_merge else 1

    def need(length: int, ranks: int) -> float:
        # A merge group's MicroPacks hold `ranks` x the MicroPack size: each member keeps its share.
        # k-fold context parallelism over dp/k replicas: each member keeps its own optimizer shard
        merged = parallel.with_(cp=parallel.cp * ranks, dp=max(1, parallel.dp // ranks))
        return min(document_memory_bytes(length, cost, merged, tokens * ranks) for tokens in micropack_tokens)

    for index in np.argsort(lengths)[::-1]:
        length = int(lengths[index])
        if need(length, 1) <= budget:
            break  # shorter documents fit too
        ranks = 2
        while ranks <= largest_group and need(length, ranks) > budget:
            ranks *= 2
        if ranks > largest_group or parallel.dp % ranks:
            raise DoesNotFit(
                f"memory: a {length}-token document needs at least {format_bytes(need(length, 1))} per device with "
                f"{parallel.describe()} but {format_bytes(budget)} is usable on {cost.hardware.name}"
                f"{'' if dp_merge else ' (DP-Merge is off)'}; use activation recompute (recompute='full'), "
                f"more tensor or pipeline parallelism, "
                f"{'DP-Merge, ' if not dp_merge else 'more data-parallel replicas, '}"
                f"or a shorter context",
                sample_ids=[int(index)], bytes_needed=need(length, 1), bytes_available=budget)
        group_ranks[index] = ranks
    return group_ranks


def largest_merged_micropack(lengths: list[int], cost: CostModel, parallel: ParallelConfig, ladder: SizeLadder,
                             use_merge: bool) -> tuple[int, np.ndarray]:
    """The largest MicroPack size, at most the ladder's largest (the cap), next to which every
    document fits memory (in a merge group where it needs one), with those group sizes. Bisected
    down to `min_micropack_tokens` (the need grows with the size): the cap is a memory bound for
    short documents only, and the ladder's rungs miss the size a long document allows by up to a
    third."""
    token_cap, smallest = ladder.largest, ladder.tunables.min_micropack_tokens
    try:
        return token_cap, merge_group_sizes(lengths, cost, parallel, [token_cap], use_merge)
    except DoesNotFit as error:
        first_error = kept(error)
    groups: dict[int, np.ndarray] = {}

    def fits(micropack_tokens: int) -> bool:
        try:
            groups[micropack_tokens] = merge_group_sizes(lengths, cost, parallel, [micropack_tokens], use_merge)
            return True
        except DoesNotFit:
            return False

    if not fits(smallest):
        raise first_error
    largest = ladder.largest_fitting(fits, smallest, token_cap)
    return largest, groups[largest]


__all__ = ["activation_budget", "fullest_stage_bytes", "auto_token_cap", "document_memory_bytes", "merge_group_sizes",
           "largest_merged_micropack"]
