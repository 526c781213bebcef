"""megatron-fixed (the sequences with per-document attention) and megatron-stock (the same
sequences attending across document boundaries, as stock pretrain_gpt.py trains)."""
from __future__ import annotations

import numpy as np

from ...config import SlimPackConfig
from ...costmodel import FIXED_SHAPE, CostModel
from ...plan import (
    MicroPack,
    Plan,
    Sample,
    Slice,
    samples_of,
)
from ...specs import ParallelConfig
from ..registry import register
from .common import INTERLEAVED, assemble_plan, deal_contiguous, input_sources, meet_interleaved_count, whole_documents
from .sequences import concatenate_and_cut, cut_into_slices, piece_metadata, piece_sources, sequence_first_sources


def _fixed_length_plan(lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig,
                       sources, *, cross_document: bool) -> Plan:
    """Megatron-LM's fixed-length sequences (`concatenate_and_cut`), one micro-batch each, dealt in
    contiguous blocks to the data-parallel ranks, classic 1F1B. `cross_document`: each sequence is
    one sample attending causally over its whole length (stock `pretrain_gpt.py`); otherwise each
    piece of a document is its own sample (`--reset-attention-mask`)."""
    sequences = concatenate_and_cut(lengths, config.context_length)
    if cross_document:
        new = tuple.__new__
        samples = [new(Sample, (index, sum(piece.sample.length for piece in sequence)))
                   for index, sequence in enumerate(sequences)]
        micropacks = [MicroPack([new(Slice, (sample.sample_id, 0, sample.length))]) for sample in samples]
        metadata = {
            "num_sequences": len(sequences),
            "attention": "causal over each whole sequence, across document boundaries",
            # sequence (sample id) -> its pieces as [index of its length in the batch, first token, tokens]
            "sequence_pieces": [[[piece.document, piece.offset, piece.sample.length] for piece in sequence]
                                for sequence in sequences],
        }
        where = sequence_first_sources(sequences, lengths, sources)
    else:
        samples = [piece.sample for sequence in sequences for piece in sequence]
        micropacks = [whole_documents([piece.sample for piece in sequence]) for sequence in sequences]
        metadata = piece_metadata(sequences)
        where = piece_sources(sequences, lengths, sources)
    per_rank = deal_contiguous(micropacks, parallel.dp)
    return assemble_plan(per_rank, samples, parallel, cost, config, config.context_length, metadata, where)


def prefix_keeping_fixed_plan(lengths: list[int], parallel: ParallelConfig, cost: CostModel,
                              config: SlimPackConfig) -> Plan:
    """Megatron-LM's fixed-length grouping trained as SlimPack trains: the same sequences,
    MicroPacks and 1F1B order as `megatron-fixed`, but a document that crosses a cut keeps its
    prefix (its later piece is a continuation slice reading the earlier piece's K/V). So it trains
    every document whole, and the SlimPack runtime runs it: SlimPack's planner keeps it as a
    candidate (its plan is never priced slower than this), and the demo measures megatron-fixed's
    packing with it without changing the objective. With data parallelism a document's pieces
    must stay on one replica (the K/V prefix is local), so the documents are dealt to the replicas
    in contiguous runs of about equal tokens, each cut into sequences of its own; with virtual
    stages a rank's count is brought to what interleaved 1F1B takes (`meet_interleaved_count`).
    Samples are the input lengths."""
    per_rank: list[list[MicroPack]] = []
    sequences = 0
    for first, last in _contiguous_runs(lengths, parallel.dp):
        cut = cut_into_slices(lengths[first:last], first, config.context_length)
        sequences += len(cut)
        per_rank.append([MicroPack(slices) for slices in cut])
    # A rank's own cut may end one sequence short of what interleaved 1F1B takes: split one in two.
    per_rank = meet_interleaved_count(per_rank, parallel, config.context_length, "the fixed-length grouping")
    return assemble_plan(per_rank, samples_of(lengths), parallel, cost, config, config.context_length,
                         {"fixed_length_grouping": True, "num_sequences": sequences},
                         input_sources(lengths, None))


def _contiguous_runs(lengths: list[int], parts: int) -> list[tuple[int, int]]:
    """[first, last) document ranges, `parts` of them in order, cut at the document boundary nearest
    each k/parts of the tokens (one range: everything)."""
    if parts == 1:
        return [(0, len(lengths))]
    ends = np.cumsum(lengths)
    cuts = [0] + [int(np.argmin(np.abs(ends - ends[-1] * k / parts))) + 1 for k in range(1, parts)] + [len(lengths)]
    cuts = np.maximum.accumulate(cuts).tolist()
    return list(zip(cuts, cuts[1:]))


@register("megatron-fixed", overlaps=FIXED_SHAPE, role="baseline", trainable=True,
          description="Megatron-LM GPTDataset: concatenate, cut at exactly the context length",
          minimum_in_flight="sequence", splits_documents=True, renumbers_samples=True, constraints=INTERLEAVED,
          fixed_sequences_per_rank=True, plans_by_shape=True)
def plan_megatron_fixed(lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig, *,
                        sources=None) -> Plan:
    """Megatron-LM's default data path (GPTDataset + 1F1B) with per-document attention.

    Reproduces: documents concatenated in the given (sampled) order and cut at exactly
    `context_length` tokens (`concatenate_and_cut`); a document crossing a cut becomes separate
    samples that do not attend to each other (the continuation loses its prefix), and inside a
    sequence each piece attends only within itself (`--reset-attention-mask`). One sequence is
    one micro-batch (micro-batch size 1). Sequences are dealt to data-parallel ranks in
    contiguous blocks (rank r gets the r-th block of num_sequences/dp; with a remainder the first
    ranks get one more), and each rank runs classic 1F1B. Long sequences need the layout's CP/TP
    to fit; `parallel.cp` is priced by the cost model (context parallelism for every sequence).
    """
    return _fixed_length_plan(lengths, parallel, cost, config, sources, cross_document=False)


# ==== megatron-stock ============================================================================

STOCK_SEMANTICS = ("cross-document attention: each fixed-length sequence is one causal sequence whose tokens attend to "
                   "the documents packed before them (stock pretrain_gpt.py without --reset-attention-mask), a "
                   "different training semantic from every other strategy's per-document attention")


# Simulated for comparison only: a sample of its plans is a whole sequence spanning several
# documents, which the SlimPack runtime's token source (one document range per sample) cannot read.
@register("megatron-stock", overlaps=FIXED_SHAPE, role="baseline", trainable=False,
          description="stock Megatron-LM pretrain_gpt.py (no --reset-attention-mask): megatron-fixed's sequences, "
                      "each attending causally across its document boundaries (a different training semantic; "
                      "a reference, simulated for comparison only)",
          minimum_in_flight="sequence", splits_documents=True, renumbers_samples=True,
          different_semantics=STOCK_SEMANTICS, constraints=INTERLEAVED, fixed_sequences_per_rank=True,
          plans_by_shape=True)
def plan_megatron_stock(lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig, *,
                        sources=None) -> Plan:
    """Stock Megatron-LM `pretrain_gpt.py` without `--reset-attention-mask` (nor
    `--reset-position-ids`): the GPTDataset's fixed-length sequences attend causally across the
    document boundaries inside them.

    Reproduces: megatron-fixed's concatenation, cuts, micro-batches, contiguous dealing to the
    data-parallel ranks and classic 1F1B (the same code, `_fixed_length_plan`), but each sequence
    of L tokens is one sample with one slice of its full length, so it computes L(L+1)/2
    attention pairs (megatron-fixed: the sum over its pieces). Context parallelism is priced as
    for megatron-fixed (the cost model's, for every sequence). Plan format: sample k is sequence
    k; its source is where the sequence begins (its first piece's document and offset), and
    `metadata["sequence_pieces"][k]` lists every piece as [batch index, offset, tokens]. This is
    a different training semantic (tokens see other documents), so it is a reference, never "the
    best other strategy"; the SlimPack runtime does not train it (`trainable=False`).
    """
    return _fixed_length_plan(lengths, parallel, cost, config, sources, cross_document=True)
