"""RoPE at absolute positions for sliced THD batches.

megatron's THD RoPE restarts at position 0 for every `cu_seqlens` segment, which is right for
whole documents but wrong for a continuation slice [start, end): its tokens must rotate with the
phases they have in the whole document, or its queries would not match the prefix keys stored
by earlier slices. So the table has one row per packed token, taken at the token's position
(positions and the table's size come from the plan, on the host), and the core attention applies
it (`apply_rotary_rows`) to the packed rows at once: the same arithmetic as megatron's THD RoPE
with such a table (`_apply_rotary_pos_emb_thd`, "exact mapping"), without its host reads of
every segment's boundaries, which stall the GPU twice per segment per layer. Rope fusion must be
off (the fused THD kernel has no per-token mode).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .seq_params import SlicedSeqParams


def slice_positions(params: SlicedSeqParams) -> Tensor:
    """Absolute position of every packed token: start..end-1 for each slice, in pack order (the
    batch's own `token_positions` where it has them: batch.py, context_parallel.py)."""
    positions = getattr(params, "token_positions", None)
    if positions is not None:
        return positions
    lengths = (params.cu_seqlens_q[1:] - params.cu_seqlens_q[:-1]).tolist()
    starts = list(params.starts) + [0] * (len(lengths) - len(params.starts))  # padding: positions 0..
    device = params.cu_seqlens_q.device
    return torch.cat([torch.arange(start, start + n, device=device) for start, n in zip(starts, lengths)])


def rotary_freqs_at(rotary_embedding, positions: Tensor, rows: Optional[int] = None) -> Tensor:
    """[T, 1, 1, rotary_dim] frequencies of the given absolute positions.

    `rotary_embedding` is megatron's `RotaryEmbedding`; its table of `rows` rows (more than the
    largest position; default: read from `positions`, a host sync) is computed (and cached) by
    megatron, then one row is taken per token.
    """
    if rows is None:
        rows = int(positions.max()) + 1 if positions.numel() else 1
    table = rotary_embedding(rows)
    return table.index_select(0, positions.to(table.device))


def rope_mscale(config) -> float:
    """megatron's attention scale of rotated q/k (YaRN's concentration factor; 1 otherwise)."""
    try:
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
            _yarn_get_concentration_factor_from_config,
        )
    except ImportError:
        return 1.0
    return _yarn_get_concentration_factor_from_config(config)


def apply_rotary_rows(t: Tensor, freqs: Tensor, config) -> Tensor:
    """Packed rows t [T, heads, dim] rotated by their own rows of `freqs` [T, 1, 1, rotary_dim]
    (megatron's unfused RoPE, row by row: exact, with gradients)."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    mscale = rope_mscale(config)
    scale = {"mscale": mscale} if mscale != 1.0 else {}
    return apply_rotary_pos_emb(t.unsqueeze(1), freqs, config=config, **scale).squeeze(1)
