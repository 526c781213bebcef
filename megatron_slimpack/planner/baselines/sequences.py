"""Megatron-LM GPTDataset's fixed-length sequences: documents concatenated and cut at the context
length (cached per batch: a layout search cuts the same batch for every layout it tries), and
where each piece's tokens come from."""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from itertools import repeat
from typing import Sequence

import numpy as np

from ...plan import (
    Sample,
    SampleSource,
    Slice,
    overlapping_documents,
)
from .common import input_sources


@dataclass(frozen=True)
class Piece:
    """Part of a document that landed in one fixed-length sequence: tokens
    [offset, offset + sample.length) of document `document` (an index into the batch's lengths)."""

    sample: Sample
    document: int
    offset: int


def concatenate_and_cut(lengths: list[int], context_length: int) -> tuple[tuple[Piece, ...], ...]:
    """Megatron-LM GPTDataset packing: documents concatenated in the given order and the token
    stream cut every `context_length` tokens. A document crossing a cut becomes two pieces (more
    if it is longer than the context), each a new sample id, numbered in stream order. The last
    sequence keeps the leftover tokens (shorter than the context) so that nothing is dropped.
    (Cached: a layout search cuts the same batch for every layout it tries.)"""
    return cut_cached(tuple(lengths), context_length)


# Room for every batch of a search: its finalist layouts each plan all of them in turn, and a
# cache smaller than the batch count (the paper grid runs 10) would evict every one before reuse.
BATCHES_CACHED = 16


@functools.lru_cache(maxsize=BATCHES_CACHED)
def cut_cached(lengths: tuple[int, ...], context_length: int) -> tuple[tuple[Piece, ...], ...]:
    numbered = itertools.count()  # sample ids in stream order
    return tuple(tuple(Piece(Sample(next(numbered), end - offset), document, offset) for document, offset, end in cut)
                 for cut in cut_into_slices(lengths, 0, context_length))


def cut_into_slices(lengths: Sequence[int], first: int, context_length: int) -> list[list[Slice]]:
    """The cut of `concatenate_and_cut` for documents first, first + 1, ... of a batch (`lengths`
    theirs): each sequence as its pieces' slices (document, offset, offset + tokens), a later piece
    continuing its document. Computed on arrays: SlimPack's fixed-grouping floor cuts each
    replica's documents on every batch it plans, a few hundred thousand pieces at 64K."""
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    starts = ends - np.asarray(lengths, dtype=np.int64)
    total = int(ends[-1]) if len(ends) else 0
    if not total:
        return []
    # every document start and cut, sorted and unique: each gap between two is one piece
    bounds = np.union1d(np.concatenate([starts, np.arange(context_length, total, context_length)]), [total])
    piece_start, piece_end = bounds[:-1], bounds[1:]
    document = np.searchsorted(ends, piece_start, side="right")  # an empty document holds no piece
    offset = piece_start - starts[document]
    slices = list(map(tuple.__new__, repeat(Slice), zip((document + first).tolist(), offset.tolist(),
                                                        (offset + piece_end - piece_start).tolist())))
    sequence = piece_start // context_length
    edges = [0, *(np.flatnonzero(np.diff(sequence)) + 1).tolist(), len(slices)]
    return [slices[begin:end] for begin, end in zip(edges, edges[1:])]


def piece_metadata(sequences: Sequence[Sequence[Piece]]) -> dict:
    return {
        "num_sequences": len(sequences),
        # sample id -> [index of its length in the batch, first token of the piece in it] (read by
        # fidelity.py; the token source reads Plan.sample_sources, which also holds the corpus offset)
        "pieces": [[piece.document, piece.offset] for sequence in sequences for piece in sequence],
    }


def piece_sources(sequences, lengths: list[int], sources) -> tuple[list[SampleSource], list[int]]:
    """Each piece's (document, offset): its input length's source, `piece.offset` tokens further
    (and the documents the input holds twice)."""
    sources, repeated = input_sources(lengths, sources)
    new = tuple.__new__
    return [new(SampleSource, (sources[piece.document][0], sources[piece.document][1] + piece.offset))
            for sequence in sequences for piece in sequence], repeated


def sequence_first_sources(sequences, lengths: list[int], sources) -> tuple[list[SampleSource], list[int]]:
    """For megatron-stock, whose samples are whole sequences: each sequence's source is that of its
    first piece (where its tokens begin; the rest follow in stream order, in the plan's metadata
    "sequence_pieces"), and the documents whose recorded ranges may overlap. A sequence that runs
    on into the next document records one range past its first document's end; with the
    sampler's batches (a long document's entries consecutive, in order) or default sources no two
    such ranges overlap except in a document the input holds twice, and any other overlap is
    listed too, so that the plan validates."""
    of_pieces, repeated = piece_sources(sequences, lengths, sources)
    firsts = np.cumsum([0] + [len(sequence) for sequence in sequences[:-1]]).tolist()
    first_sources = [of_pieces[index] for index in firsts]
    spans = [sum(piece.sample.length for piece in sequence) for sequence in sequences]
    return first_sources, sorted(set(repeated) | set(overlapping_documents(first_sources, spans)))
