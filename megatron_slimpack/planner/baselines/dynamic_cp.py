"""megatron-dynamic-cp: Megatron-LM dev's packing-aware dynamic context parallelism
(`--dynamic-context-parallel --sequence-packing-scheduler default_dynamic_cp`).

The rule, read from Megatron-LM's dev branch (d48bd6be): `DefaultDynamicCPScheduler` in
megatron/core/datasets/data_schedule.py, and `next_hdp_group_packing_aware`, `dcp_gpus_needed` and
`align_sample_id_groups` in megatron/core/datasets/data_schedule_utils.py; the benchmark is
examples/dynamic_context_parallel/ (README.md, benchmark_dcp.sh). Names below: P GPUs in the DP x CP
pool, m = `--max-seqlen-per-dp-cp-rank`, a sample's work on k GPUs is L^2 / k per GPU.

1. Samples are taken longest first (stable). Micro-batches are formed one after another from the
   samples left, each over all P GPUs, until none is left.
2. A sample's CP size is at least the smallest power of two k with k x m >= L
   (`--min-dynamic-context-parallel-size`, default 1, is a floor).
3. One micro-batch: the longest sample left opens a CP group on GPUs 0..k-1. Each following sample
   (in order) considers every k from its minimum, doubling, up to P: joining an existing group of
   exactly k GPUs whose per-GPU tokens stay within m, or opening a group on the first k free GPUs.
   Each candidate is scored by the most work any GPU of the pool would then have; it must be at
   most 1.05 x L_tallest x m (L_tallest: the micro-batch's first sample) and strictly below the best
   so far (ties: the smaller k, an existing group before a new one, earlier groups first). A
   sample with no candidate is left for a later micro-batch.
4. While GPUs are left without a sample, the first group of the smallest size whose GPUs can grow
   doubles (to at most P), pushing the groups after it onto the free GPUs. When no group can grow,
   the micro-batch is rebuilt as one group of all P GPUs holding, of the samples left (longest
   first), every one that still fits m tokens per GPU; the others wait.
5. A group's samples are packed into one THD micro-batch run with CP of its size.

Conversion to a plan (the project's plans express a sample's CP size as a DP-Merge group, like
`megatron-hybrid-cp`): the layout's dp is the pool (cp must be 1). A group of k > 1 GPUs is a
DP-Merge replica plan over those k ranks (the simulator runs it with CP k); a 1-GPU group's
micro-batch goes to that rank's own replica plan. A rank set's micro-batches form one replica plan
in micro-batch order (one 1F1B over them), the rank sets in order of first use.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from ...config import SlimPackConfig
from ...costmodel import VARIABLE_SHAPE_RING_CP, CostModel
from ...plan import MicroPack, Plan, PlanError, ReplicaPlan, samples_of
from ...specs import ParallelConfig
from ..outcomes import DoesNotFit
from ..registry import LayoutConstraints, register, with_input_sources
from .common import schedule_1f1b, whole_micropacks
from .dp_balanced import WHOLE_DOCUMENTS, per_rank_token_cap

# The scheduler lets a micro-batch's busiest GPU reach this much over the tallest sample's own work.
WORKLOAD_SLACK = 0.05


def cp_size_needed(length: int, per_rank_tokens: int, minimum: int = 1) -> int:
    """The smallest power of two k with k x per_rank_tokens >= length, at least `minimum`."""
    return max(1 << (-(-length // per_rank_tokens) - 1).bit_length(), minimum)


@dataclass
class CPGroup:
    """GPUs first..first+size-1 of the pool running `samples` packed into one micro-batch with CP
    `size`; `work` is each member's L^2 / size summed over the samples (equal on every member)."""

    first: int
    size: int
    samples: list[int] = field(default_factory=list)
    tokens: int = 0
    work: float = 0.0

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.first, self.first + self.size))

    def add(self, sample: int, length: int) -> None:
        self.samples.append(sample)
        self.tokens += length
        self.work += length * length / self.size


def dynamic_cp_micro_batch(order: list[int], lengths: list[int], pool: int, per_rank_tokens: int,
                           min_cp: int = 1) -> tuple[list[CPGroup], list[int]]:
    """One micro-batch of the samples `order` (longest first): its CP groups (covering GPUs
    0..pool-1 in order) and the samples left for later micro-batches (still longest first).
    Rules 3 and 4 of the module docstring."""
    tallest = lengths[order[0]]
    first_size = cp_size_needed(tallest, per_rank_tokens, min_cp)
    if first_size > pool:
        raise DoesNotFit(
            f"memory: a {tallest}-token document needs CP {first_size} at {per_rank_tokens} tokens per rank, more "
            f"than the {pool} GPUs of the DP x CP pool; use more GPUs, recompute or tensor parallelism",
            sample_ids=[order[0]], group_ranks=first_size)
    bound = tallest * per_rank_tokens * (1.0 + WORKLOAD_SLACK)
    groups = [CPGroup(0, first_size)]
    groups[0].add(order[0], tallest)
    used = first_size
    left: list[int] = []
    # Kept up to date after each placement, so a sample's candidates cost O(groups of its sizes):
    # the groups of each size in creation order, the most tokens one of them can still take (and
    # the most of any size), and the two largest works (a group's rivals are the busiest other
    # group, or the free GPUs' 0).
    by_size: dict[int, list[CPGroup]] = {first_size: [groups[0]]}
    room = {first_size: first_size * per_rank_tokens - tallest}
    busiest, runner_up = groups[0], 0.0
    most_room = room[first_size]
    for sample in order[1:]:
        length = lengths[sample]
        if used == pool and length > most_room:  # no free GPU and no group can take it
            left.append(sample)
            continue
        best: tuple[float, CPGroup | None, int] | None = None  # (busiest GPU's work, group joined or None, size)
        size = cp_size_needed(length, per_rank_tokens, min_cp)
        while size <= pool:
            work = length * length / size
            if room.get(size, -1) >= length:
                for group in by_size[size]:
                    if group.tokens + length > size * per_rank_tokens:
                        continue
                    others = runner_up if group is busiest else busiest.work
                    projected = max(others, group.work + work)
                    if projected <= bound and (best is None or projected < best[0]):
                        best = (projected, group, size)
            if pool - used >= size:  # the free GPUs have no work yet
                projected = max(busiest.work, work)
                if projected <= bound and (best is None or projected < best[0]):
                    best = (projected, None, size)
            size *= 2
        if best is None:
            left.append(sample)
            continue
        _, joined, size = best
        if joined is None:
            joined = CPGroup(used, size)
            groups.append(joined)
            by_size.setdefault(size, []).append(joined)
            used += size
        joined.add(sample, length)
        room[size] = max(size * per_rank_tokens - group.tokens for group in by_size[size])
        most_room = max(room.values())
        ranked = sorted(groups, key=lambda group: group.work, reverse=True)
        busiest, runner_up = ranked[0], ranked[1].work if len(ranked) > 1 else 0.0
    while used < pool:
        grown = _grow_smallest(groups, lengths, pool, used)
        if grown is None:
            return _full_pool_group(order, lengths, pool, per_rank_tokens)
        used += grown
    return groups, left


def _grow_smallest(groups: list[CPGroup], lengths: list[int], pool: int, used: int) -> int | None:
    """Rule 4's growth step: the first group of the smallest size that can double (to at most the
    pool) does, and the groups after it move up by the GPUs it gained. Returns the GPUs gained, or
    None when no group can grow. A group grows only if the groups after it still fit the pool."""
    smallest = min(group.size for group in groups)
    gain = min(2 * smallest, pool) - smallest
    for position, group in enumerate(groups):
        if group.size != smallest or group.first + group.size - 1 + gain >= pool or used + gain > pool:
            continue
        group.size += gain
        group.work = sum(lengths[i] * lengths[i] for i in group.samples) / group.size
        for later in groups[position + 1:]:
            later.first += gain
        return gain
    return None


def _full_pool_group(order: list[int], lengths: list[int], pool: int,
                     per_rank_tokens: int) -> tuple[list[CPGroup], list[int]]:
    """Rule 4's fallback: one group of the whole pool with every sample (longest first) that still
    fits `per_rank_tokens` per GPU; the rest are left."""
    group, left = CPGroup(0, pool), []
    for sample in order:
        if group.tokens + lengths[sample] <= pool * per_rank_tokens:
            group.add(sample, lengths[sample])
        else:
            left.append(sample)
    return [group], left


def dynamic_cp_schedule(lengths: list[int], pool: int, per_rank_tokens: int,
                        min_cp: int = 1) -> list[list[CPGroup]]:
    """Every micro-batch of the batch (rules 1-4): lists of CP groups, each list covering the pool."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    micro_batches = []
    while order:
        groups, order = dynamic_cp_micro_batch(order, lengths, pool, per_rank_tokens, min_cp)
        micro_batches.append(groups)
    return micro_batches


@lru_cache(maxsize=8)
def _schedule_of(lengths: tuple[int, ...], pool: int, per_rank_tokens: int) -> list[list[CPGroup]]:
    """`dynamic_cp_schedule`, kept for the planner (its groups are read, never changed): it depends
    on these three only, and a layout search asks again for each recompute mode with the same pool
    and per-rank tokens, and for each finalist's batches."""
    return dynamic_cp_schedule(list(lengths), pool, per_rank_tokens)


# Simulated for comparison only: the SlimPack runtime does not change CP groups per micro-batch.
@register("megatron-dynamic-cp", role="baseline", trainable=False, overlaps=VARIABLE_SHAPE_RING_CP,
          description="Megatron-LM dev's dynamic context parallelism (default_dynamic_cp): per-sample CP size from "
                      "its length and max-seqlen-per-dp-cp-rank, work balanced over DP x CP, a group's samples "
                      "packed into one THD micro-batch (trains documents whole)",
          minimum_in_flight="none", constraints=LayoutConstraints(
              cp=(1,), reason="default_dynamic_cp picks CP sizes per sample from the DP x CP pool (given as dp); "
                              "a merge group's micro-batches run as their own pipeline schedule, so Megatron's "
                              "interleaved order across micro-batches of changing CP groups has no plan (no vpp)"))
def plan_megatron_dynamic_cp(lengths: list[int], parallel: ParallelConfig, cost: CostModel,
                             config: SlimPackConfig, *, sources=None) -> Plan:
    """Megatron-LM dev's `DefaultDynamicCPScheduler` (the module docstring has the rule and the
    conversion to a plan).

    The pool is the layout's data-parallel ranks (`parallel.cp` must be 1; Megatron's
    --context-parallel-size only sets how the pool is split, which this scheduler does not use).
    m is `per_rank_token_cap` (`config.max_micropack_tokens`, else what fits one GPU), also the
    plan's per-device MicroPack cap. Pipeline parallelism: each replica plan runs Megatron's 1F1B
    over its micro-batches; Megatron runs one 1F1B over all micro-batches with the CP group
    changing between them, so a rank set's pipeline fill and drain are paid per replica plan here
    (this baseline's simulated step is, if anything, slower than Megatron's). Virtual pipeline
    stages are refused (see the constraints). Objective: documents whole (`WHOLE_DOCUMENTS`).
    """
    if parallel.cp > 1:
        raise PlanError(
            f"megatron-dynamic-cp: CP sizes are chosen per sample from the DP x CP pool; give the whole pool as "
            f"data parallelism (dp={parallel.dp * parallel.cp}, cp=1) instead of cp={parallel.cp}")
    if parallel.vpp > 1:
        raise PlanError(
            "megatron-dynamic-cp: a micro-batch's CP groups change from one micro-batch to the next, which a plan "
            "expresses as separate replica plans; Megatron's interleaved 1F1B across them has no plan, use vpp=1")
    per_rank_tokens = per_rank_token_cap(cost, parallel, config)
    micro_batches = _schedule_of(tuple(lengths), parallel.dp, per_rank_tokens)
    samples = samples_of(lengths)
    by_ranks: dict[tuple[int, ...], list[MicroPack]] = {}
    cp_sizes: dict[int, int] = {}
    groups = [group for in_micro_batch in micro_batches for group in in_micro_batch]
    for group, micropack in zip(groups, whole_micropacks(lengths, (group.samples for group in groups))):
        by_ranks.setdefault(group.ranks, []).append(micropack)
        cp_sizes.update(dict.fromkeys(group.samples, group.size))
    if sorted(cp_sizes) != list(range(len(lengths))):
        raise PlanError("megatron-dynamic-cp: the schedule did not place every document exactly once")
    merges: list[ReplicaPlan] = []
    own: list[list[MicroPack]] = [[] for _ in range(parallel.dp)]
    for ranks, micropacks in by_ranks.items():
        if len(ranks) == 1:
            own[ranks[0]] = micropacks
        else:
            merges.append(schedule_1f1b(micropacks, parallel.with_(cp=len(ranks)), list(ranks)))
    replicas = merges + [schedule_1f1b(micropacks, parallel, [rank]) for rank, micropacks in enumerate(own)]
    metadata = {
        "cost_model": cost.describe(), "max_seqlen_per_dp_cp_rank": per_rank_tokens,
        "micro_batches": len(micro_batches), "cp_size_per_sample": [cp_sizes[i] for i in range(len(lengths))],
        "cp_groups_per_micro_batch": [[list(group.ranks) for group in groups] for groups in micro_batches],
        "training_objective": WHOLE_DOCUMENTS,
    }
    plan = Plan(replicas, samples, parallel, config.context_length, config.strategy, per_rank_tokens, metadata)
    return with_input_sources(plan, sources, len(lengths))
