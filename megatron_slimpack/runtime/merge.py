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

The schedule does all of this (`runtime.schedule.slimpack_forward_backward`, any PP):

    groups = merge_groups(plan, dp_group_ranks)            # once, at start-up, on every rank
    slimpack_forward_backward(model=chunk, plan=plan, token_source=source, dp_rank=dp_rank,
                              merge_process_groups=groups)  # merge groups, own plan, DP reduction

`run_merge_group` is the one-stage building block for callers with their own loop (PP=1).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed as dist

from ..plan import Plan, ReplicaPlan
from .attention import KVStore
from .context_parallel import build_cp_batch
from .executor import StepResult, run_stage_order


def merge_layouts(dp: int) -> list[tuple[int, ...]]:
    """Every merge group the planner can produce (solver/dp_phase.py): aligned blocks of k DP
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


def member_batches(replica: ReplicaPlan, token_source, kv_store: KVStore, group, group_rank: int, device) -> list:
    """This member's share of every MicroPack of a merge group, as context-parallel batches."""
    return [build_cp_batch(mp, token_source, kv_store, group=group, group_size=len(replica.dp_ranks),
                           group_rank=group_rank, device=device) for mp in replica.micropacks]


def run_merge_group(
    replica: ReplicaPlan, *, model, token_source, group, group_rank: Optional[int] = None,
    kv_store: Optional[KVStore] = None, num_loss_tokens: int, pp_group=None, forward_only: bool = False,
    dp_rank: Optional[int] = None,
) -> StepResult:
    """Run a one-stage merge-group ReplicaPlan on this member: its share of every MicroPack, in the
    order of `stage_orders[0]`. Gradients accumulate into the parameters' `.grad` (no DP
    reduction here). Returns this member's share: `loss_sum` over its tokens, `loss` =
    loss_sum / num_loss_tokens (sum over members = the group's contribution to the global loss).

    `group`: the merge group's process group (from `merge_groups`), ranks in `replica.dp_ranks`
    order; `group_rank`: this member's index in `replica.dp_ranks` (or give `dp_rank`).
    `kv_store`: may be shared with the rank's own work; it must be empty of this group's samples.
    """
    if not replica.is_merge_group:
        raise ValueError(f"run_merge_group runs merge groups; this replica plan has dp_ranks {replica.dp_ranks}")
    pp = len(replica.stage_orders)
    if pp != 1 or (pp_group is not None and dist.get_world_size(pp_group) > 1):
        raise ValueError(
            f"run_merge_group runs one-stage merge groups; this one has pp={max(pp, dist.get_world_size(pp_group) if pp_group else 1)} "
            "stages: run it through runtime.schedule.slimpack_forward_backward (merge_process_groups=...), which "
            "pipelines merge groups like any replica plan")
    size = len(replica.dp_ranks)
    if group_rank is None:
        if dp_rank is None or dp_rank not in replica.dp_ranks:
            raise ValueError(f"run_merge_group: give group_rank, or a dp_rank among {replica.dp_ranks}")
        group_rank = replica.dp_ranks.index(dp_rank)
    if group is not None:
        if dist.get_world_size(group) != size or dist.get_rank(group) != group_rank:
            raise ValueError(
                f"run_merge_group: the process group has {dist.get_world_size(group)} ranks and this rank is "
                f"{dist.get_rank(group)} in it; the merge group {replica.dp_ranks} needs {size} ranks with this "
                f"one at {group_rank}")
    elif size > 1:
        raise ValueError("run_merge_group: a merge group of several ranks needs its process group")
    store = kv_store if kv_store is not None else KVStore()
    batches = member_batches(replica, token_source, store, group, group_rank, next(model.parameters()).device)
    try:
        loss_sum, reports = run_stage_order(model, replica, batches, num_loss_tokens, forward_only)
        if not forward_only and store.sample_ids() & set(replica.sample_ids):
            raise RuntimeError("KV store still holds K/V of the merge group's samples after its step: some slice's "
                               "backward did not run")
    finally:
        if forward_only:
            store.discard(replica.sample_ids)
    return StepResult(loss_sum / num_loss_tokens, loss_sum, num_loss_tokens, reports)
