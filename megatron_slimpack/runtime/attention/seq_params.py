"""The metadata that travels with a MicroPack into megatron-core's layers (docs/design.md section 3).

`SlicedSeqParams` is a `PackedSeqParams` (THD) describing the *current* tokens only
(cu_seqlens_q == cu_seqlens_kv, so megatron's RoPE and reshapes stay right), plus which slice each
segment is, where its K/V prefix lives and the kernel's own key lengths (prefix + slice). For a
DP-Merge member's share of a MicroPack (context_parallel.py), `cp` holds the `CPLayout` (how the
shares fit together) and `token_positions` the local tokens' absolute positions; `PositionRuns`
is the member's queries as runs of consecutive positions, built once per MicroPack.

Pure data: no module of the runtime is imported here, so every other one can import it.

Host -> device: every host array bound for a CUDA device goes through `to_device`/`gather_to_device`:
built in page-locked (pinned) memory and copied with `non_blocking=True`, so the copy is queued
behind the stream's work instead of blocking the host until the stream has drained (a copy from
pageable memory does). On CPU nothing is pinned and nothing changes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from .kv_store import KVStore

HostValues = Union[np.ndarray, Tensor, Sequence[int], Sequence[float]]


def pins_for(device: torch.device | str) -> bool:
    """Whether host tensors bound for `device` are staged in pinned memory: only for a CUDA device
    on a machine that has one (elsewhere pinning is unavailable or useless)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def to_device(values: HostValues, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """Host values (numpy array, host tensor, list) as a `dtype` tensor on `device`. For a CUDA
    device they are staged in pinned memory and copied non_blocking (the pinned buffer is held by
    torch's host allocator until the copy has run); for CPU they stay on the host (no copy where
    the dtype already matches a numpy array or tensor)."""
    host = torch.as_tensor(values, dtype=dtype)
    if not pins_for(device):
        return host.to(device)
    if not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def gather_to_device(source: Tensor, index: np.ndarray, device: torch.device | str) -> Tensor:
    """`source[index]` (a host tensor's rows) on `device`: gathered on the host straight into a
    pinned buffer and copied non_blocking for a CUDA device; a plain host gather for CPU."""
    rows = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))
    if not pins_for(device):
        return source.index_select(0, rows).to(device)
    out = torch.empty((len(rows), *source.shape[1:]), dtype=source.dtype, pin_memory=True)
    torch.index_select(source, 0, rows, out=out)
    return out.to(device, non_blocking=True)


@dataclass
class SlicedSeqParams(PackedSeqParams):
    """THD metadata of one MicroPack: the standard fields describe its current tokens; the
    extra fields say which slice each segment is and where its K/V prefix lives."""

    sample_ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    keeps_kv: list[bool] = field(default_factory=list)  # a later slice of the sample follows
    kv_store: Optional[KVStore] = None
    cu_seqlens_attn_kv: Optional[Tensor] = None  # prefix + slice per segment: the kernel's keys
    max_seqlen_attn_kv: Optional[int] = None
    # The current tokens' absolute positions (RoPE follows them; under DP-Merge, context_parallel.py,
    # the tokens are this member's share of the MicroPack), and how the shares fit together.
    token_positions: Optional[Tensor] = None
    cp: Optional["CPLayout"] = None  # how a merged MicroPack's tokens are shared
    # The same boundaries as host ints, from the plan: reading them back from the device would
    # stall the stream once per layer and MicroPack.
    host_cu_seqlens_q: Optional[list[int]] = None
    host_cu_seqlens_attn_kv: Optional[list[int]] = None
    # Set by the model per forward (model.py): one rotary table row per current token, applied by
    # the core attention (rope.py).
    rotary_freqs: Optional[Tensor] = None
    # Sequence parallelism: trailing rows that pad the tokens to a multiple of the TP size. They
    # are the last segment of cu_seqlens_q/kv (megatron's reshapes and RoPE see every row), have
    # no slice (sample_ids, starts, keeps_kv, cu_seqlens_attn_kv list only slices), no loss, and
    # attention gives them zeros: they never meet a real token.
    padding: int = 0

    def __post_init__(self):
        if not (len(self.sample_ids) == len(self.starts) == len(self.keeps_kv)):
            raise ValueError("SlicedSeqParams: sample_ids, starts and keeps_kv must have one entry per slice")

    @property
    def slice_cu_seqlens(self) -> Tensor:
        """cu_seqlens_q of the slices alone (the padding segment left out)."""
        return self.cu_seqlens_q[:-1] if self.padding else self.cu_seqlens_q

    @property
    def slice_bounds(self) -> list[int]:
        """`slice_cu_seqlens` as host ints."""
        bounds = self.host_cu_seqlens_q if self.host_cu_seqlens_q is not None else self.cu_seqlens_q.tolist()
        return bounds[:-1] if self.padding else list(bounds)

    @property
    def attn_kv_bounds(self) -> Optional[list[int]]:
        """`cu_seqlens_attn_kv` as host ints (None where only the device copy exists)."""
        return self.host_cu_seqlens_attn_kv

    @property
    def rotary_rows(self) -> Optional[int]:
        """Rows of a rotary table that covers every current token's position, known on the host
        (slices end by the longest prefix + slice, padding rows count from 0), rounded up to a
        power of two: megatron caches one table per length asked for, so the tables of a run stay
        at most twice the largest (the cost model's `rope_table_bytes`)."""
        if self.max_seqlen_attn_kv is None:
            return None
        rows = max(self.max_seqlen_attn_kv, self.padding, 1)
        return 1 << (rows - 1).bit_length()


@dataclass
class CPLayout:
    """How one MicroPack's tokens are spread over a merge group, seen from one member."""

    group: Optional[dist.ProcessGroup]  # None: a group of one, for tests
    group_size: int
    group_rank: int
    local_counts: list[int]  # tokens each member holds (all members)
    gather_index: Tensor  # natural pack order -> row of the padded, gathered buffer
    full_bounds: list[int]  # slices' full lengths, cumulative (natural pack order), host ints
    local_positions: Tensor  # absolute position of each local token
    host_positions: list[int]  # the same positions on the host (runs are built from them)
    runs: Optional["PositionRuns"] = None  # set with the batch (context_parallel.build_cp_batch)

    @property
    def padded(self) -> int:
        return max(self.local_counts)


@dataclass
class PositionRuns:
    """A member's local queries as maximal runs of consecutive positions, per segment: run
    [a, b) of segment i attends keys [0, b) of that segment's (prefix + slice) keys, which is
    exactly bottom-right causal for a run of b - a queries against b keys. The keys of each run
    are gathered (`key_index`) so that one varlen call covers every run."""

    cu_q: Tensor        # run boundaries over the local queries
    cu_kv: Tensor       # run boundaries over the gathered keys
    key_index: Tensor   # rows of the packed (prefix + slice) keys, run after run
    max_q: int
    max_kv: int
    bounds_q: list[int]   # cu_q and cu_kv as host ints: kernels that cut segments on the host
    bounds_kv: list[int]  # need not read them back

    @classmethod
    def of(cls, cu_q: Tensor, cu_kv: Tensor, q_positions: Tensor) -> "PositionRuns":
        """From device tensors: reads them back (one host sync each); the runtime uses `from_host`."""
        bounds_q, bounds_kv, positions = (t.detach().cpu().tolist() for t in (cu_q, cu_kv, q_positions))
        return cls.from_host(bounds_q, bounds_kv, positions, q_positions.device)

    @classmethod
    def from_host(cls, bounds_q: Sequence[int] | np.ndarray, bounds_kv: Sequence[int] | np.ndarray,
                  q_positions: Sequence[int] | np.ndarray, device: torch.device | str) -> "PositionRuns":
        """From host ints: the local queries' segment bounds, the keys' (prefix + slice) segment
        bounds and the local queries' absolute positions. Builds on the host, copies to `device`
        (`to_device`: pinned and non_blocking on a GPU)."""
        positions = np.asarray(q_positions, dtype=np.int64)
        bounds = np.asarray(bounds_q, dtype=np.int64)
        key_starts = np.asarray(bounds_kv, dtype=np.int64)[:-1]
        segment = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))
        opens = np.ones(len(positions), dtype=bool)
        opens[1:] = (segment[1:] != segment[:-1]) | (positions[1:] != positions[:-1] + 1)
        first = np.flatnonzero(opens)
        last = np.concatenate([first[1:], [len(positions)]]) - 1
        keys = positions[last] + 1 if len(positions) else np.zeros(0, dtype=np.int64)  # b of each run
        run_key_start = key_starts[segment[first]] if len(positions) else keys
        run_bounds = np.concatenate([first, [len(positions)]])
        offsets = np.concatenate([[0], np.cumsum(keys)])
        key_index = np.arange(offsets[-1]) - np.repeat(offsets[:-1], keys) + np.repeat(run_key_start, keys)

        def to(a, dtype=torch.int32):
            return to_device(a, dtype, device)

        return cls(to(run_bounds), to(offsets), to(key_index, torch.long),
                   int((last - first + 1).max(initial=0)), int(keys.max(initial=0)),
                   run_bounds.tolist(), offsets.tolist())
