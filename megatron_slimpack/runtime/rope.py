"""RoPE at absolute positions for sliced THD batches.

megatron's THD RoPE restarts at position 0 for every `cu_seqlens` segment, which is right for
whole documents but wrong for a continuation slice [start, end): its tokens must rotate with the
phases they have in the whole document, or its queries would not match the prefix keys stored
by earlier slices. megatron does apply a frequency table row per token when the table has
exactly one row per packed token (`_apply_rotary_pos_emb_thd`, "exact mapping"), so we hand it
that table. Rope fusion must be off (the fused THD kernel has no per-token mode).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .seq_params import SlicedSeqParams


def slice_positions(params: SlicedSeqParams) -> Tensor:
    """Absolute position of every packed token: start..end-1 for each slice, in pack order (or
    the explicit per-token positions of a context-parallel share, see context_parallel.py)."""
    if getattr(params, "token_positions", None) is not None:
        return params.token_positions
    lengths = (params.cu_seqlens_q[1:] - params.cu_seqlens_q[:-1]).tolist()
    starts = list(params.starts) + [0] * (len(lengths) - len(params.starts))  # padding: positions 0..
    device = params.cu_seqlens_q.device
    return torch.cat([torch.arange(start, start + n, device=device) for start, n in zip(starts, lengths)])


def rotary_freqs_at(rotary_embedding, positions: Tensor) -> Tensor:
    """[T, 1, 1, rotary_dim] frequencies of the given absolute positions.

    `rotary_embedding` is megatron's `RotaryEmbedding`; its table up to the largest position is
    computed (and cached) by megatron, then one row is taken per token.
    """
    table = rotary_embedding(int(positions.max()) + 1 if positions.numel() else 1)
    return table.index_select(0, positions.to(table.device))
