"""SlimPipe: uniform slices of each fixed-length sequence, slice-level 1F1B."""
from __future__ import annotations

import functools

from ...config import SlimPackConfig
from ...costmodel import SLIMPACK_RUNTIME, CostModel
from ...plan import (
    MicroPack,
    Plan,
    Sample,
    Slice,
)
from ...specs import ParallelConfig
from ..registry import register
from ..slimpack.pack_phase import PackOptions, cut_document
from .common import assemble_plan, deal_contiguous
from .sequences import BATCHES_CACHED, Piece, concatenate_and_cut, cut_cached, piece_metadata, piece_sources


def slice_sequence(sequence: tuple[Piece, ...], slice_tokens: int) -> list[MicroPack]:
    """Cut a packed sequence into uniform slices of at most `slice_tokens` tokens (SlimPipe);
    a slice holds the parts of the pieces it overlaps, each attending to its piece's prefix."""
    total = sum(piece.sample.length for piece in sequence)
    options = PackOptions(token_cap=slice_tokens, slice_tokens=slice_tokens, cost_balanced_slices=False)
    # Uniform slices (no cost balancing, no cost cap) never read the rates.
    bounds = [(s.start, s.end) for s in cut_document(Sample(-1, total), options, rates=None)]  # type: ignore[arg-type]
    micropacks, offset, starts = [], 0, []
    for piece in sequence:
        starts.append(offset)
        offset += piece.sample.length
    first = 0  # bounds and pieces are both in sequence order: one sweep over each
    for begin, end in bounds:
        while starts[first] + sequence[first].sample.length <= begin:
            first += 1
        pieces, index = [], first
        while index < len(sequence) and starts[index] < end:
            start, sample = starts[index], sequence[index].sample
            low, high = max(begin, start), min(end, start + sample.length)
            pieces.append(Slice(sample.sample_id, low - start, high - start))
            index += 1
        micropacks.append(MicroPack(pieces))
    return micropacks


@register("slimpipe", overlaps=SLIMPACK_RUNTIME, role="baseline", trainable=True,
          description="SlimPipe: uniform slices, slice-level 1F1B",
          minimum_in_flight="half-document", splits_documents=True, renumbers_samples=True,
          plans_by_shape=True)
def plan_slimpipe(lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig, *,
                  sources=None) -> Plan:
    """SlimPipe (SC'25): uniform slicing with a slice-level 1F1B pipeline.

    Reproduces: the sequences of `megatron-fixed` (same concatenation, cuts, pieces and
    contiguous dealing to data-parallel ranks), each cut into n uniform slices of at most
    `config.slice_tokens` tokens (default context/8): a slice is a MicroPack, one forward and
    one backward unit each (the same grouping for both passes). A slice attends to the KV of its
    piece's earlier slices, so a piece's slices form a chain: its backward runs last slice first,
    after all its forwards, which is SlimPipe's slice-level 1F1B (classic warm-up of pp - s - 1
    slices per stage).
    """
    slice_tokens = config.slice_tokens or max(1, config.context_length // 8)
    sequences = concatenate_and_cut(lengths, config.context_length)
    samples = [piece.sample for sequence in sequences for piece in sequence]
    sliced = _sliced_sequences(tuple(lengths), config.context_length, slice_tokens)
    blocks = deal_contiguous(list(sliced), parallel.dp)
    per_rank = [[mp for micropacks in block for mp in micropacks] for block in blocks]
    metadata = {**piece_metadata(sequences), "slice_tokens": slice_tokens}
    return assemble_plan(per_rank, samples, parallel, cost, config, slice_tokens, metadata,
                         piece_sources(sequences, lengths, sources))


@functools.lru_cache(maxsize=BATCHES_CACHED)
def _sliced_sequences(lengths: tuple[int, ...], context_length: int, slice_tokens: int) -> tuple[list[MicroPack], ...]:
    """Each fixed-length sequence's slices (the same on every layout the search tries)."""
    return tuple(slice_sequence(sequence, slice_tokens) for sequence in cut_cached(lengths, context_length))
