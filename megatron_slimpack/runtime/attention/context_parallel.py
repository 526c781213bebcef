"""Context-parallel sliced attention inside a DP-Merge group (docs/design.md sections 2, 3, 5).

The k replicas of a merge group run the group's MicroPacks together: every MicroPack's tokens
are split across the k members, each member runs the model on its share only, and inside every
attention layer the K/V of the MicroPack's slices are all-gathered within the group.

Token split (`split_slice`), balanced for causal cost
-----------------------------------------------------
A slice of n >= 2k tokens is cut into 2k contiguous chunks of (almost) equal size (the n mod 2k
leftover tokens go one per rank); group rank i takes chunks i and 2k-1-i ("zigzag", as in
Megatron/TE's load-balanced CP). A query at position p attends p+1 keys (prefix included), so
the cost of a chunk grows linearly with its position;
pairing the i-th chunk from the front with the i-th from the back gives every rank the same
query count and (up to the +-1 token of uneven chunk sizes) the same number of attention pairs.
The prefix [0, start) adds the same per-query cost on every rank, so it does not unbalance.
A slice shorter than 2k tokens is dealt round-robin, token by token, continuing the rotation
from the previous short slice of the MicroPack, so that a MicroPack of >= k tokens gives every
rank at least one token (megatron's layers cannot run on zero tokens). A MicroPack with fewer
than k tokens cannot be merged: `build_cp_batch` raises.

Each member's local tokens are laid out slice by slice (pack order), and within a slice in
position order; the model gets `SlicedSeqParams` whose cu_seqlens describe these *local* tokens
(a slice may have zero local tokens: an empty segment), `position_ids` and
`token_positions` hold the tokens' absolute positions (RoPE and learned embeddings follow them
token by token, see rope.py), and `cp` holds the `CPLayout` below.

K/V exchange and gradients
--------------------------
In each layer, the members' local K and V (stacked, padded to the largest share) are gathered
with `all_gather_into_tensor` by `GatherFromGroup`, whose backward is the matching
`reduce_scatter_tensor` (sum): the gradient of a token's K/V is the sum over every member's
queries that attend it, delivered to the member that owns the token. The gathered rows are put
back into natural order (`CPLayout.gather_index`, an `index_select` whose backward scatter-adds),
so every member holds the full K/V of the MicroPack's slices. From there the single-device logic
of docs/design.md section 3 applies unchanged to these full tensors:
  * the KV prefix of earlier slices comes from the KV store, where it sits as full (gathered)
    K/V leaves on every member;
  * a slice that a later slice continues stores its full K/V as detached leaves; later slices'
    backward on *this* member accumulates (this member's queries') dK/dV into their `.grad`;
  * the gradient hand-off (`_InjectKVGrad`) adds those accumulated leaves' gradients to the
    gradient of the gathered full K/V, i.e. *before* the reduce-scatter, so the reduce-scatter
    sums every member's contributions of later slices as well and delivers them to the owners.
Weight gradients need nothing extra: each member's parameter gradients are its tokens' share;
the data-parallel all-reduce sums them (and the other replicas' own work) as usual.

Collectives are issued in the same order on every member as long as all members run the group's
MicroPacks in the plan's forward/backward order (one all-gather per layer in forward, one
reduce-scatter per layer in backward, layers in reverse order by autograd's data dependencies).

Kernels: what is and isn't supported
------------------------------------
* Every backend (Transformer Engine, flash-attn, the torch kernel on CPU) goes through
  `PositionRuns`: a member's local tokens of a slice form runs of consecutive positions (two per
  slice for the zigzag split, single tokens for short slices dealt round-robin). Run [a, b)
  attends keys [0, b) of the slice's natural-order (prefix + slice) keys, which is bottom-right
  causal for b - a queries against b keys, so one varlen call over all runs, with each run's keys
  gathered into its own key segment, computes the member's attention. The key copies cost memory
  (about twice the slice's keys per member); the runs are built once per MicroPack, on the host
  from the plan's boundaries (no layer reads a boundary back from the device), and shared by its
  layers. `torch_position_kernel` (one masked call per slice, any permutation of the tokens)
  is the reference the tests check the runs and the key gathering against; the GPU kernels
  themselves are the ones the non-merged path uses.
"""
from __future__ import annotations

from typing import Sequence, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ...plan import MicroPack
from .batch import MicroPackBatch, cumulative, padding_rows, read_rows, slice_table
from .kernels import segment_attention
from .kv_store import stored_and_prefixed
from .seq_params import CPLayout, PositionRuns, SlicedSeqParams, to_device


# ---- token split ---------------------------------------------------------------------------
def split_slice(length: int, group_size: int, rotation: int = 0) -> list[list[int]]:
    """Offsets (0..length-1) of a slice's tokens per group rank, each list in position order.

    length >= 2k: 2k near-equal chunks, rank i takes chunks i and 2k-1-i (causal balance).
    length < 2k: round-robin, token j to rank (rotation + j) % k.
    """
    k = group_size
    if k == 1:
        return [list(range(length))]
    if length < 2 * k:
        shares: list[list[int]] = [[] for _ in range(k)]
        for j in range(length):
            shares[(rotation + j) % k].append(j)
        return shares
    base, extra = divmod(length, 2 * k)
    # the `extra` leftover tokens go one per rank (front chunks 0.., then back chunks 2k-1..), so
    # members' token counts differ by at most one
    sizes = [base] * (2 * k)
    for j in range(extra):
        sizes[j if j < k else 3 * k - 1 - j] += 1
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [list(range(bounds[i], bounds[i + 1])) + list(range(bounds[2 * k - 1 - i], bounds[2 * k - i]))
            for i in range(k)]


def split_micropack(lengths: Sequence[int], group_size: int) -> list[list[list[int]]]:
    """Per slice, per rank: the slice offsets that rank holds (see `split_slice`)."""
    rotation, out = 0, []
    for n in lengths:
        out.append(split_slice(n, group_size, rotation))
        if n < 2 * group_size:
            rotation = (rotation + n) % group_size
    return out


def owner_runs(lengths: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A MicroPack's tokens (natural pack order) as runs of consecutive tokens held by one group
    rank, exactly as `split_micropack` deals them: the 2k chunks of each slice of >= 2k tokens,
    and every single token of a shorter slice. Returns each run's (owner, size, slice), computed
    for all runs at once: there are at most 2k per slice, far fewer than tokens."""
    k, lengths = group_size, np.asarray(lengths, dtype=np.int64)
    long = lengths >= 2 * k
    runs = np.where(long, 2 * k, lengths)
    run_slice = np.repeat(np.arange(len(lengths)), runs)
    index = np.arange(int(runs.sum()), dtype=np.int64) - np.repeat(np.cumsum(runs) - runs, runs)  # within its slice
    # short slices: round-robin, the rotation carried over the MicroPack's short slices
    short = np.where(long, 0, lengths)
    rotation = (np.cumsum(short) - short) % k
    # long slices: 2k chunks of `base` tokens, the first `a` and the last `b` one token longer
    base, extra = np.divmod(lengths[run_slice], 2 * k)
    a, b = np.minimum(extra, k), np.maximum(extra - k, 0)
    in_long = long[run_slice]
    size = np.where(in_long, base + ((index < a) | (index >= 2 * k - b)), 1)
    owner = np.where(in_long, np.where(index < k, index, 2 * k - 1 - index),  # rank i: chunks i and 2k-1-i
                     (rotation[run_slice] + index) % k)
    return owner, size, run_slice


def token_owners(lengths: np.ndarray, group_size: int) -> np.ndarray:
    """The group rank that holds each token of a MicroPack (natural pack order)."""
    owner, size, _ = owner_runs(lengths, group_size)
    return np.repeat(owner, size)


def _run_offsets(size: np.ndarray) -> np.ndarray:
    """Each token's offset within its run, for runs of these sizes laid end to end."""
    return np.arange(int(size.sum()), dtype=np.int64) - np.repeat(np.cumsum(size) - size, size)


class _Split:
    """A MicroPack's tokens over a merge group, as host arrays built from the owner runs
    (`owner_runs`): each member holds its tokens slice by slice in pack order, within a slice in
    position order, i.e. in natural pack order."""

    def __init__(self, table: np.ndarray, group_size: int, group_rank: int):
        lengths = table[:, 2] - table[:, 1]
        owner, size, run_slice = owner_runs(lengths, group_size)
        counts = np.bincount(owner, weights=size, minlength=group_size).astype(np.int64)
        run_start = np.cumsum(size) - size  # natural index of each run's first token
        # each run's first row in its owner's share: the sizes of the owner's earlier runs
        order = np.argsort(owner, kind="stable")
        ahead = np.cumsum(size[order]) - size[order]
        local_start = np.empty_like(size)
        local_start[order] = ahead - (np.cumsum(counts) - counts)[owner[order]]
        self.counts = counts.tolist()
        self.bounds = np.concatenate([[0], np.cumsum(lengths)])
        # row of the padded, gathered buffer (member-major, `padded` rows each) of each natural token
        self.gather_index = np.repeat(owner * int(counts.max(initial=0)) + local_start, size) + _run_offsets(size)
        mine = np.flatnonzero(owner == group_rank)
        self.mine = np.repeat(run_start[mine], size[mine]) + _run_offsets(size[mine])  # natural indices
        slice_of = np.repeat(run_slice[mine], size[mine])
        self.positions = table[slice_of, 1] + self.mine - self.bounds[slice_of]
        self.per_slice = np.bincount(run_slice[mine], weights=size[mine], minlength=len(lengths)).astype(np.int64)


def _check_mergeable(micropack: MicroPack, group_size: int) -> None:
    if micropack.num_tokens < group_size:
        raise ValueError(
            f"a MicroPack of {micropack.num_tokens} tokens cannot be split over a merge group of {group_size} "
            "ranks (every member needs at least one token): the planner must not merge it")


def _layout(split: _Split, group, group_size: int, group_rank: int, device) -> CPLayout:
    return CPLayout(
        group=group, group_size=group_size, group_rank=group_rank, local_counts=split.counts,
        gather_index=to_device(split.gather_index, torch.long, device), full_bounds=split.bounds.tolist(),
        local_positions=to_device(split.positions, torch.long, device), host_positions=split.positions.tolist(),
    )


def build_layout(micropack: MicroPack, group, group_size: int, group_rank: int,
                 device: torch.device | str = "cpu") -> tuple[CPLayout, Tensor, list[int]]:
    """The member's layout, the natural-pack-order indices of its local tokens, and its local
    token count per slice."""
    _check_mergeable(micropack, group_size)
    split = _Split(slice_table(micropack), group_size, group_rank)
    return (_layout(split, group, group_size, group_rank, device), torch.from_numpy(split.mine),
            split.per_slice.tolist())


def build_cp_batch(micropack: MicroPack, source, kv_store, *, group, group_size: int, group_rank: int,
                   device: torch.device | str = "cpu", pad_to: int = 1):
    """This member's share of a MicroPack as model inputs (a `MicroPackBatch` of local tokens),
    padded to a multiple of `pad_to` rows (sequence parallelism; see batch.py). Only the member's
    rows are gathered (pinned and copied non_blocking on a GPU, as `build_batch`)."""
    _check_mergeable(micropack, group_size)
    table = slice_table(micropack)
    split = _Split(table, group_size, group_rank)
    layout = _layout(split, group, group_size, group_rank, device)
    padding = padding_rows(len(split.mine), pad_to)
    rows = read_rows(micropack, source, table).select(split.mine).padded(padding)
    segments = np.concatenate([split.per_slice, [padding]]) if padding else split.per_slice
    bounds_q, bounds_kv = cumulative(segments), cumulative(table[:, 2])  # kv: prefix + the whole slice
    cu_q = to_device(bounds_q, torch.int32, device)
    # Every boundary is known here, on the host, from the plan: the layers read none back.
    layout.runs = PositionRuns.from_host(cumulative(split.per_slice), bounds_kv, split.positions, device)
    tensors = rows.on(device)
    params = SlicedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_q,
        max_seqlen_q=int(segments.max()), max_seqlen_kv=int(segments.max()),
        sample_ids=table[:, 0].tolist(), starts=table[:, 1].tolist(), keeps_kv=rows.keeps_kv, kv_store=kv_store,
        cu_seqlens_attn_kv=to_device(bounds_kv, torch.int32, device), max_seqlen_attn_kv=int(table[:, 2].max()),
        token_positions=tensors["position_ids"][0], cp=layout, padding=padding,
        host_cu_seqlens_q=bounds_q.tolist(), host_cu_seqlens_attn_kv=bounds_kv.tolist(),
    )
    return MicroPackBatch(packed_seq_params=params, **tensors)


# ---- collectives ---------------------------------------------------------------------------
# torch 2.13 renamed the flat collectives (`*_single`); older torch has only `*_into_tensor` /
# `reduce_scatter_tensor`. Chosen by name, never by catching a failure (a failed collective
# retried as another one would hang the group).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class GatherFromGroup(torch.autograd.Function):
    """All-gather along dim 0 within the merge group (rank order); backward: reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx, local: Tensor, group, group_size: int) -> Tensor:
        ctx.group, ctx.rows = group, local.shape[0]
        if group_size == 1:
            return local.clone()
        local = local.contiguous()
        out = local.new_empty((group_size * local.shape[0], *local.shape[1:]))
        _all_gather(out, local, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        if grad.shape[0] == ctx.rows:
            return grad, None, None
        output = grad.new_empty((ctx.rows, *grad.shape[1:]))
        _reduce_scatter(output, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return output, None, None


def gather_full(local: Tensor, layout: CPLayout) -> Tensor:
    """Local rows [T_local, ...] of every member -> the MicroPack's rows in natural order [T, ...]."""
    pad = layout.padded - local.shape[0]
    if pad:
        local = torch.cat([local, local.new_zeros((pad, *local.shape[1:]))])
    gathered = GatherFromGroup.apply(local, layout.group, layout.group_size)
    return gathered.index_select(0, layout.gather_index)


# ---- the torch kernel with position masks --------------------------------------------------
def torch_position_kernel(q, k, v, cu_q, cu_kv, q_positions, scale, dropout_p):
    """Reference: packed local queries [Tq, H, D] against per-segment keys [prefix + full slice]
    (natural order, key j at position j): query at position p sees keys 0..p. (Not the runtime's
    path: an explicit mask keeps the CPU kernel from skipping masked blocks, so it computes every
    member's full query x key rectangle.)"""
    bounds_q, bounds_kv = cu_q.tolist(), cu_kv.tolist()
    outputs = []
    for i in range(len(bounds_q) - 1):
        if bounds_q[i + 1] == bounds_q[i]:
            continue  # this member holds no token of this slice
        ks, vs = k[bounds_kv[i]:bounds_kv[i + 1]], v[bounds_kv[i]:bounds_kv[i + 1]]
        key_positions = torch.arange(ks.shape[0], device=q.device)
        mask = key_positions[None, :] <= q_positions[bounds_q[i]:bounds_q[i + 1], None]
        outputs.append(segment_attention(q[bounds_q[i]:bounds_q[i + 1]], ks, vs, mask, scale, dropout_p))
    if not outputs:
        return q.new_zeros((0, q.shape[1], v.shape[-1]))
    return torch.cat(outputs)


def runs_attention(attend, q: Tensor, k: Tensor, v: Tensor, runs: PositionRuns) -> Tensor:
    """Position-causal attention of local queries through `attend(q, k, v, cu_q, cu_kv, max_q,
    max_kv)`, a bottom-right causal varlen kernel (TE THD, flash-attn varlen, the torch one)."""
    if runs.max_q == 0:
        return q.new_zeros((0, q.shape[1] * v.shape[-1]))
    return attend(q, k.index_select(0, runs.key_index), v.index_select(0, runs.key_index),
                  runs.cu_q, runs.cu_kv, runs.max_q, runs.max_kv, bounds=(runs.bounds_q, runs.bounds_kv))


# ---- the CP path of the sliced core attention ----------------------------------------------
def cp_sliced_attention(module, query: Tensor, key: Tensor, value: Tensor, params: SlicedSeqParams) -> Tensor:
    """The sliced core attention for a member's share of a merged MicroPack.

    query/key/value: the member's local tokens [T_local, heads, dim]. Returns [T_local, H*D].
    """
    layout = cast(CPLayout, params.cp)  # a merge group's batches carry their layout (build_cp_batch)
    full = gather_full(torch.stack([key, value], dim=1), layout)  # [T, 2, G, D], natural order
    # The hand-off acts on the gathered K/V, before the reduce-scatter: later slices' dK/dV
    # accumulated on this member reach the owning members together with this slice's own.
    keys, values = stored_and_prefixed(params.kv_store, module.layer_number, full[:, 0], full[:, 1],
                                       layout.full_bounds, params.sample_ids, params.starts, params.keeps_kv)
    if layout.runs is None:
        raise ValueError("CPLayout.runs is missing (build batches with build_cp_batch)")
    return runs_attention(module._attend, query, keys, values, layout.runs)
