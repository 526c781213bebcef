"""Megatron-Core's hybrid context parallelism (BalancedCPScheduler), called as a library."""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ...config import SlimPackConfig
from ...costmodel import VARIABLE_SHAPE_RING_CP, CostModel, format_bytes
from ...plan import (
    MicroPack,
    Plan,
    PlanError,
    ReplicaPlan,
    samples_of,
)
from ...specs import ParallelConfig
from ..outcomes import DoesNotFit
from ..registry import LayoutConstraints, register, with_input_sources
from .common import schedule_1f1b, whole_micropacks


class _PoolSize:
    """Stand-in for the DP x CP process group: `BalancedCPScheduler.__init__` only calls
    `dp_cp_group.size()`; nothing else of a process group is used by the scheduling code."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def _balanced_cp_scheduler():
    try:
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    except ImportError as error:
        raise PlanError(
            "megatron-hybrid-cp: the installed megatron-core has no "
            "megatron.core.pipeline_parallel.hybrid_cp_schedule.BalancedCPScheduler "
            f"({error}); it needs megatron-core >= 0.16"
        ) from error
    return BalancedCPScheduler


def max_tokens_per_rank(cost: CostModel, parallel: ParallelConfig, config: SlimPackConfig) -> int:
    """Megatron's `--max-seqlen-per-cp-rank`: `config.max_micropack_tokens` if set, else the
    largest power of two (at most the context) whose activations fit one device next to the
    weights and optimizer state (one sub-sample in flight: forward then backward at once)."""
    if config.max_micropack_tokens:
        return config.max_micropack_tokens
    budget = cost.memory_budget_bytes() - cost.static_memory_bytes(parallel)
    tokens = 1 << max(config.context_length.bit_length() - 1, 0)

    def need(n: int) -> float:
        pairs = n * (n + 1) / 2
        activations = cost.activation_bytes(n, pairs, parallel, last_stage=True)
        return activations + cost.recompute_peak_bytes(n, pairs, parallel)

    while tokens > 256 and need(tokens) > budget:
        tokens //= 2
    if need(tokens) > budget:
        raise DoesNotFit(
            f"memory: with {parallel.describe()} a {cost.model.name} replica has "
            f"{format_bytes(max(budget, 0))} left after weights and optimizer state on {cost.hardware.name}, "
            f"not enough for {tokens} tokens per rank; use more tensor parallelism or recompute",
            bytes_needed=cost.static_memory_bytes(parallel) + need(tokens), bytes_available=cost.memory_budget_bytes(),
        )
    return min(tokens, config.context_length)


def _cp_groups(sample_id_groups: list[list[list[int]]]) -> list[dict[tuple[int, ...], list[int]]]:
    """Per scheduler group: rank set -> the sample ids it runs together, in order."""
    groups = []
    for per_gpu in sample_id_groups:
        ranks_of: dict[int, list[int]] = {}
        order: list[int] = []
        for rank, sample_ids in enumerate(per_gpu):
            for sample_id in sample_ids:
                if sample_id not in ranks_of:
                    ranks_of[sample_id] = []
                    order.append(sample_id)
                if rank not in ranks_of[sample_id]:
                    ranks_of[sample_id].append(rank)
        by_ranks: dict[tuple[int, ...], list[int]] = {}
        for sample_id in order:
            by_ranks.setdefault(tuple(sorted(ranks_of[sample_id])), []).append(sample_id)
        groups.append(by_ranks)
    return groups


# Simulated for comparison only: the SlimPack runtime does not run Megatron's hybrid CP schedule.
@register("megatron-hybrid-cp", overlaps=VARIABLE_SHAPE_RING_CP, role="baseline", trainable=False,
          description="Megatron-Core main's BalancedCPScheduler (hybrid context parallel)",
          minimum_in_flight="none", constraints=LayoutConstraints(
              pp=(1,), cp=(1,),
              reason="BalancedCPScheduler supports no pipeline parallelism and picks CP sizes per sample from the "
                     "DP x CP pool (given as dp)"))
def plan_megatron_hybrid_cp(lengths: list[int], parallel: ParallelConfig, cost: CostModel,
                            config: SlimPackConfig, *, sources=None) -> Plan:
    """Megatron-Core's hybrid context parallelism (`hybrid_cp_schedule.BalancedCPScheduler`).

    Reproduces: the installed megatron-core's scheduler is called as a library
    (`get_groups_and_subsamples`) on the documents of the batch, with the data-parallel ranks as
    its DP x CP pool (`parallel.dp` GPUs; `parallel.cp` must be 1, since CP sizes are chosen per
    sample) and `max_tokens_per_rank` as `--max-seqlen-per-cp-rank`. It gives each document a
    power-of-two CP size (tokens / max per rank, rounded up; cost L^2/cp) and forms groups in
    which every GPU gets a balanced list of sub-samples. Conversion: a document on k > 1 GPUs
    becomes a DP-Merge replica plan over those k ranks (the simulator runs it with CP of k,
    which is the scheduler's semantics: CP ranks taken from the DP x CP pool); documents on one
    GPU form that rank's own replica plan. Every sub-sample is its own micro-batch, forward then
    backward at once (the scheduler's loop; 1F1B with one stage).
    Approximation: our plans order a rank's work as its merge groups (in scheduler-group order)
    and then its own documents, and the simulator synchronises ranks only inside merge groups;
    the scheduler's barrier between groups is not modelled, which slightly favours this baseline.
    Supported regime only: pipeline parallelism is refused ("PP not yet supported" upstream).
    """
    if parallel.pp > 1:
        raise PlanError(
            f"megatron-hybrid-cp: Megatron-Core's BalancedCPScheduler does not support pipeline parallelism "
            f"(hybrid_cp_schedule.py: 'PP not yet supported'); got pp={parallel.pp}, use pp=1"
        )
    if parallel.cp > 1:
        raise PlanError(
            f"megatron-hybrid-cp: CP sizes are chosen per sample from the DP x CP pool; give the whole pool "
            f"as data parallelism (dp={parallel.dp * parallel.cp}, cp=1) instead of cp={parallel.cp}"
        )
    scheduler_class = _balanced_cp_scheduler()
    per_rank_tokens = max_tokens_per_rank(cost, parallel, config)
    scheduler = scheduler_class(per_rank_tokens, _PoolSize(parallel.dp))
    widest = scheduler.gpus_needed(max(lengths))
    if widest > parallel.dp:
        raise DoesNotFit(
            f"memory: a {max(lengths)}-token document needs CP {widest} at {per_rank_tokens} tokens per rank, "
            f"more than the {parallel.dp} GPUs of the DP x CP pool; use more GPUs, recompute or tensor parallelism",
            sample_ids=[int(np.argmax(lengths))], group_ranks=widest,
        )
    sample_id_groups = _scheduled_groups(tuple(lengths), per_rank_tokens, parallel.dp)
    return with_input_sources(_hybrid_plan(lengths, sample_id_groups, parallel, cost, config, per_rank_tokens),
                              sources, len(lengths))


@lru_cache(maxsize=8)
def _scheduled_groups(lengths: tuple[int, ...], per_rank_tokens: int, pool: int) -> list[list[list[int]]]:
    """BalancedCPScheduler's groups of sample ids for a batch (read, never changed). They depend on
    these three only, and a layout search asks again for each recompute mode with the same pool and
    per-rank tokens, and for each finalist's batches: the scheduler, a Python loop over every
    document, was seven tenths of that search."""
    scheduler = _balanced_cp_scheduler()(per_rank_tokens, _PoolSize(pool))
    try:
        _, sample_id_groups = scheduler.get_groups_and_subsamples(list(enumerate(lengths)), None)
    except AssertionError as error:
        raise PlanError(f"megatron-hybrid-cp: BalancedCPScheduler failed on this batch: {error}") from error
    return sample_id_groups


def _hybrid_plan(lengths, sample_id_groups, parallel, cost, config, per_rank_tokens) -> Plan:
    samples = samples_of(lengths)
    each_whole = whole_micropacks(lengths, ([i] for i in range(len(lengths))))
    merges: list[ReplicaPlan] = []
    own: list[list[MicroPack]] = [[] for _ in range(parallel.dp)]
    scheduled: list[int] = []
    cp_sizes: dict[int, int] = {}
    for by_ranks in _cp_groups(sample_id_groups):
        for ranks, sample_ids in by_ranks.items():
            scheduled += sample_ids
            cp_sizes.update({sample_id: len(ranks) for sample_id in sample_ids})
            micropacks = [each_whole[i] for i in sample_ids]
            if len(ranks) == 1:
                own[ranks[0]] += micropacks
            else:
                merged = parallel.with_(cp=parallel.cp * len(ranks))
                merges.append(schedule_1f1b(micropacks, merged, list(ranks)))
    if sorted(scheduled) != list(range(len(lengths))):
        raise PlanError("megatron-hybrid-cp: BalancedCPScheduler did not schedule every document exactly once")
    replicas = merges + [schedule_1f1b(m, parallel, [rank]) for rank, m in enumerate(own)]
    metadata = {
        "cost_model": cost.describe(), "max_seqlen_per_cp_rank": per_rank_tokens,
        "scheduler_groups": len(sample_id_groups),
        "cp_size_per_sample": [cp_sizes[i] for i in range(len(lengths))],
    }
    return Plan(replicas, samples, parallel, config.context_length, config.strategy, None, metadata)
