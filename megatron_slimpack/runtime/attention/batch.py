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

import numpy as np
import torch
from torch import Tensor

from ...plan import MicroPack
from .kv_store import KVStore
from .seq_params import SlicedSeqParams, gather_to_device, to_device


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


def host_cu_seqlens(lengths: Sequence[int]) -> list[int]:
    """Cumulative segment boundaries [0, l0, l0 + l1, ...] as host ints."""
    return [0, *itertools.accumulate(lengths)]


def cumulative(lengths: np.ndarray) -> np.ndarray:
    """`host_cu_seqlens` as an int64 numpy array."""
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])


class PackedRows:
    """Where each row of a packed MicroPack comes from, as host arrays built once per MicroPack:
    one read of the token source per slice, then index arithmetic over all rows at once (no Python
    per token). `ids` holds every slice's ids as read (the slice's tokens, plus the next token when
    the document continues) followed by one 0: the label of a document's last token and the token
    and label of padding rows."""

    def __init__(self, ids: Tensor, token_index: np.ndarray, label_index: np.ndarray, loss_mask: np.ndarray,
                 positions: np.ndarray, keeps_kv: list[bool]):
        self.ids, self.token_index, self.label_index = ids, token_index, label_index
        self.loss_mask, self.positions = loss_mask, positions
        self.keeps_kv = keeps_kv  # per slice: the source returned the next token (the document goes on)

    @property
    def zero(self) -> int:
        """The index of the trailing 0 in `ids`."""
        return len(self.ids) - 1

    def select(self, rows: np.ndarray) -> "PackedRows":
        """These rows only (a merge-group member's share), in the given order."""
        return PackedRows(self.ids, self.token_index[rows], self.label_index[rows], self.loss_mask[rows],
                          self.positions[rows], self.keeps_kv)

    def padded(self, rows: int) -> "PackedRows":
        """`rows` padding rows appended: token and label 0, no loss, positions 0.. (any value would
        do: padding attends to nothing)."""
        if not rows:
            return self
        zeros = np.full(rows, self.zero, dtype=np.int64)
        return PackedRows(self.ids, np.concatenate([self.token_index, zeros]),
                          np.concatenate([self.label_index, zeros]),
                          np.concatenate([self.loss_mask, np.zeros(rows, dtype=np.float32)]),
                          np.concatenate([self.positions, np.arange(rows, dtype=np.int64)]), self.keeps_kv)

    def on(self, device: torch.device | str) -> dict[str, Tensor]:
        """The [1, T] rows on `device` (pinned host buffers and non_blocking copies on a GPU)."""
        return {"tokens": gather_to_device(self.ids, self.token_index, device).unsqueeze(0),
                "labels": gather_to_device(self.ids, self.label_index, device).unsqueeze(0),
                "loss_mask": to_device(self.loss_mask, torch.float32, device).unsqueeze(0),
                "position_ids": to_device(self.positions, torch.long, device).unsqueeze(0)}


def slice_table(micropack: MicroPack) -> np.ndarray:
    """The MicroPack's slices as an [S, 3] int64 array of (sample_id, start, end)."""
    return np.array(micropack.slices, dtype=np.int64).reshape(-1, 3)


def read_rows(micropack: MicroPack, source: TokenSource, table: np.ndarray | None = None) -> PackedRows:
    """Read every slice's ids from `source` (checking their count) and lay out the packed rows."""
    table = slice_table(micropack) if table is None else table
    lengths = table[:, 2] - table[:, 1]
    pieces, read = [], np.empty(len(table), dtype=np.int64)
    for i, piece in enumerate(micropack.slices):
        ids = source.tokens(piece.sample_id, piece.start, piece.end)
        n, got = piece.end - piece.start, len(ids)
        if got != n and got != n + 1:
            raise ValueError(
                f"token source returned {got} tokens for sample {piece.sample_id} [{piece.start}, {piece.end}); "
                f"expected {n + 1} (or {n} at the document's end)"
            )
        pieces.append(ids)
        read[i] = got
    if all(isinstance(ids, np.ndarray) for ids in pieces):  # an indexed dataset's reads: one numpy concatenation
        joined = torch.from_numpy(np.concatenate([*pieces, np.zeros(1, dtype=np.int64)]).astype(np.int64, copy=False))
    else:
        joined = torch.cat([*(torch.as_tensor(ids, dtype=torch.long) for ids in pieces),
                            torch.zeros(1, dtype=torch.long)])
    row_starts = np.concatenate([[0], np.cumsum(lengths)])
    piece_starts = np.concatenate([[0], np.cumsum(read)])
    offset = np.arange(row_starts[-1], dtype=np.int64) - np.repeat(row_starts[:-1], lengths)
    token_index = np.repeat(piece_starts[:-1], lengths) + offset
    label_index = token_index + 1  # the next id read: within the slice, or the next slice's first token
    ends = (read == lengths) & (lengths > 0)  # the source had no next token: the document ends here
    last_rows = row_starts[1:][ends] - 1
    label_index[last_rows] = piece_starts[-1]  # the trailing 0
    loss_mask = np.ones(len(offset), dtype=np.float32)
    loss_mask[last_rows] = 0.0  # the document's last token predicts nothing
    positions = np.repeat(table[:, 1], lengths) + offset
    return PackedRows(joined, token_index, label_index, loss_mask, positions,
                      (read == lengths + 1).tolist())


def build_batch(micropack: MicroPack, source: TokenSource, kv_store: KVStore | None,
                device: torch.device | str = "cpu", pad_to: int = 1) -> MicroPackBatch:
    """The MicroPack's slices as one packed batch, padded to a multiple of `pad_to` rows. For a
    CUDA device every row and boundary is built in pinned host memory and copied non_blocking."""
    table = slice_table(micropack)
    rows = read_rows(micropack, source, table)
    lengths, kv_lengths = table[:, 2] - table[:, 1], table[:, 2]  # kv: prefix [0, start) + the slice
    padding = padding_rows(int(lengths.sum()), pad_to)
    rows = rows.padded(padding)
    segments = np.concatenate([lengths, [padding]]) if padding else lengths
    bounds_q, bounds_kv = cumulative(segments), cumulative(kv_lengths)
    cu_q = to_device(bounds_q, torch.int32, device)
    tensors = rows.on(device)
    params = SlicedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_q,
        max_seqlen_q=int(segments.max()), max_seqlen_kv=int(segments.max()),
        sample_ids=table[:, 0].tolist(), starts=table[:, 1].tolist(),
        keeps_kv=rows.keeps_kv, kv_store=kv_store,
        cu_seqlens_attn_kv=to_device(bounds_kv, torch.int32, device), max_seqlen_attn_kv=int(kv_lengths.max()),
        padding=padding, token_positions=tensors["position_ids"][0],
        host_cu_seqlens_q=bounds_q.tolist(), host_cu_seqlens_attn_kv=bounds_kv.tolist(),
    )
    return MicroPackBatch(packed_seq_params=params, **tensors)
