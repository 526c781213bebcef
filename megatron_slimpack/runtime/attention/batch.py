"""MicroPack -> model inputs: one packed THD batch of its slices.

Any dataset feeds the runtime through `TokenSource`: `tokens(sample_id, start, end)` returns the
token ids [start, end + 1) clipped at the document's end. The extra token is the label of the
slice's last token; when the source returns none, the slice ends its document: that token has no
label (masked out of the loss) and its K/V is not stored (no later slice will read it).

Under sequence parallelism every batch is padded to a multiple of the TP size (`pad_to`): the
padding rows are a segment of their own at the end, with no loss and no attention to real
tokens (`SlicedSeqParams.padding`), so real tokens' outputs and every gradient are unchanged.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import torch
from torch import Tensor

from ...plan import MicroPack
from .kernels import cu_seqlens
from .kv_store import KVStore
from .seq_params import SlicedSeqParams


class TokenSource(Protocol):
    def tokens(self, sample_id: int, start: int, end: int) -> Sequence[int]:
        """Token ids of positions [start, end + 1) of the sample, clipped at its end."""
        ...


class InMemoryTokenSource:
    """Documents held in memory: {sample_id: token ids}."""

    def __init__(self, documents: Mapping[int, Sequence[int]]):
        self.documents = {sample_id: torch.as_tensor(ids, dtype=torch.long) for sample_id, ids in documents.items()}

    def tokens(self, sample_id: int, start: int, end: int) -> Tensor:
        return self.documents[sample_id][start:end + 1]

    def lengths(self) -> dict[int, int]:
        return {sample_id: len(ids) for sample_id, ids in self.documents.items()}


@dataclass
class MicroPackBatch:
    """Inputs of one packed forward call ([1, T] tensors, megatron's b=1 THD convention)."""

    tokens: Tensor
    labels: Tensor
    loss_mask: Tensor
    position_ids: Tensor
    packed_seq_params: SlicedSeqParams

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def padding_rows(num_tokens: int, pad_to: int) -> int:
    """Rows that pad `num_tokens` to a multiple of `pad_to`."""
    return -num_tokens % pad_to


def append_padding(rows: int, tokens: list, labels: list, loss_mask: list, positions: list) -> None:
    """Padding rows: token and label 0, no loss, positions 0.. (any value would do: padding
    attends to nothing)."""
    tokens.append(torch.zeros(rows, dtype=torch.long))
    labels.append(torch.zeros(rows, dtype=torch.long))
    loss_mask.append(torch.zeros(rows))
    positions.append(torch.arange(rows))


def host_cu_seqlens(lengths: Sequence[int]) -> list[int]:
    """Cumulative segment boundaries [0, l0, l0 + l1, ...] as host ints."""
    return [0, *itertools.accumulate(lengths)]


def build_batch(micropack: MicroPack, source: TokenSource, kv_store: KVStore | None,
                device: torch.device | str = "cpu", pad_to: int = 1) -> MicroPackBatch:
    """The MicroPack's slices as one packed batch, padded to a multiple of `pad_to` rows."""
    tokens, labels, loss_mask, positions, keeps_kv = [], [], [], [], []
    for piece in micropack.slices:
        ids = torch.as_tensor(source.tokens(piece.sample_id, piece.start, piece.end), dtype=torch.long)
        n = piece.length
        if len(ids) not in (n, n + 1):
            raise ValueError(
                f"token source returned {len(ids)} tokens for sample {piece.sample_id} [{piece.start}, {piece.end}); "
                f"expected {n + 1} (or {n} at the document's end)"
            )
        continues = len(ids) == n + 1
        tokens.append(ids[:n])
        labels.append(torch.cat([ids[1:], ids.new_zeros(n + 1 - len(ids))]))
        mask = torch.ones(n)
        if not continues:
            mask[-1] = 0.0  # the document's last token predicts nothing
        loss_mask.append(mask)
        positions.append(torch.arange(piece.start, piece.end))
        keeps_kv.append(continues)
    lengths = [s.length for s in micropack.slices]
    kv_lengths = [s.end for s in micropack.slices]  # prefix [0, start) + the slice
    padding = padding_rows(sum(lengths), pad_to)
    if padding:
        append_padding(padding, tokens, labels, loss_mask, positions)
    segments = lengths + [padding] * bool(padding)
    cu_q = cu_seqlens(segments, device)
    position_ids = torch.cat(positions).to(device=device, dtype=torch.long).unsqueeze(0)
    params = SlicedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_q,
        max_seqlen_q=max(segments), max_seqlen_kv=max(segments),
        sample_ids=[s.sample_id for s in micropack.slices], starts=[s.start for s in micropack.slices],
        keeps_kv=keeps_kv, kv_store=kv_store,
        cu_seqlens_attn_kv=cu_seqlens(kv_lengths, device), max_seqlen_attn_kv=max(kv_lengths),
        padding=padding, token_positions=position_ids[0],
        host_cu_seqlens_q=host_cu_seqlens(segments), host_cu_seqlens_attn_kv=host_cu_seqlens(kv_lengths),
    )

    def as_row(parts, dtype):
        return torch.cat(parts).to(device=device, dtype=dtype).unsqueeze(0)

    return MicroPackBatch(
        tokens=as_row(tokens, torch.long), labels=as_row(labels, torch.long),
        loss_mask=as_row(loss_mask, torch.float32), position_ids=position_ids,
        packed_seq_params=params,
    )
