"""DP-Merge at run time: the members of a merge group run its ReplicaPlan together.

A merge group is a `ReplicaPlan` whose `dp_ranks` name k > 1 data-parallel ranks; every one of
them runs it, before its own replica plan (`Plan.replicas_of_rank`). Each member runs every
MicroPack of the group on its share of the tokens (context_parallel.py: zigzag split, K/V
all-gathered in attention, dK/dV reduce-scattered), in exactly the plan's task order, so the
group's collectives line up. The loss is the sum over the member's tokens, scaled by
1 / global loss tokens (one division for the whole global batch); the sum over members is the
group's loss. Weight gradients need nothing extra: each member's `.grad` holds its tokens'
share, and the data-parallel all-reduce after the step sums them together with every replica's
own work.

With pipeline parallelism a merge group is pipelined like any replica plan: member i's stage s
sends its share's activations to member i's stage s + 1 (the member's own pipeline group), and
the attention layers of stage s gather K/V over the merge group of stage s's ranks. There is one
data-parallel group per (pipeline stage, tensor rank), and `merge_groups` creates the layouts of
every one of them, so each rank holds the groups of its own stage.

The schedule does all of this (`runtime.schedule.slimpack_forward_backward`, any PP, one stage
included):

    merge = merge_groups(plan, dp_group_ranks)             # once, at start-up, on every rank
    slimpack_forward_backward(model=chunk, plan=plan, token_source=source,
                              groups=ScheduleGroups.from_parallel_state(merge_groups=merge))
                                                           # merge groups, own plan, DP reduction
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed as dist

from ...plan import Plan, ReplicaPlan
from ..attention.context_parallel import build_cp_batch
from ..attention.kv_store import KVStore


def merge_layouts(dp: int) -> list[tuple[int, ...]]:
    """Every merge group the planner can produce (planner/slimpack/dp_phase.py): aligned blocks of k DP
    ranks, k a power of two, 2 <= k <= dp, k dividing dp. Smallest blocks first."""
    layouts, size = [], 2
    while size <= dp:
        if dp % size == 0:
            layouts += [tuple(range(start, start + size)) for start in range(0, dp, size)]
        size *= 2
    return layouts


def merge_groups(plan: Plan | int, dp_group_ranks: Optional[Sequence[int]] = None, *,
                 all_dp_groups: Optional[Sequence[Sequence[int]]] = None, backend: Optional[str] = None
                 ) -> dict[tuple[int, ...], object]:
    """Create a process group for every merge layout; returns {tuple(dp_ranks): group} for the
    layouts this rank belongs to.

    Call once, at start-up, on *every* rank of the world (torch's `new_group` is collective and
    must be called in the same order everywhere). `dp_group_ranks`: the global ranks of this
    rank's data-parallel group in DP-rank order (default: the whole world, i.e. DP only). With
    PP/TP there are several DP groups, and every rank must create the groups of all of them:
    pass `all_dp_groups` (e.g. from your launcher's rank layout), or leave it None and the DP
    groups are exchanged with one `all_gather_object` over the world.
    """
    dp = plan if isinstance(plan, int) else plan.parallel.dp
    world = dist.get_world_size()
    if dp_group_ranks is None:
        dp_group_ranks = list(range(world))
    dp_group_ranks = [int(r) for r in dp_group_ranks]
    if len(dp_group_ranks) != dp:
        raise ValueError(f"merge_groups: the plan has dp={dp} but the data-parallel group has {len(dp_group_ranks)} "
                         f"ranks {dp_group_ranks}")
    if all_dp_groups is None:
        if len(dp_group_ranks) == world:
            all_dp_groups = [dp_group_ranks]
        else:
            everyone: list = [None] * world
            dist.all_gather_object(everyone, tuple(dp_group_ranks))
            all_dp_groups = sorted(set(everyone))
    all_dp_groups = sorted({tuple(int(r) for r in g) for g in all_dp_groups})
    if tuple(dp_group_ranks) not in all_dp_groups:
        raise ValueError(f"merge_groups: this rank's DP group {dp_group_ranks} is not among {all_dp_groups}")
    me = dist.get_rank()
    groups: dict[tuple[int, ...], object] = {}
    for dp_group in all_dp_groups:
        for layout in merge_layouts(dp):
            ranks = [dp_group[i] for i in layout]
            group = dist.new_group(ranks, backend=backend)
            if me in ranks and tuple(dp_group) == tuple(dp_group_ranks):
                groups[layout] = group
    return groups


def member_batches(replica: ReplicaPlan, token_source, kv_store: KVStore, group, group_rank: int, device,
                   pad_to: int = 1) -> list:
    """This member's share of every MicroPack of a merge group, as context-parallel batches
    (padded to a multiple of `pad_to` rows under sequence parallelism)."""
    return [build_cp_batch(mp, token_source, kv_store, group=group, group_size=len(replica.dp_ranks),
                           group_rank=group_rank, device=device, pad_to=pad_to) for mp in replica.micropacks]
