"""Baselines: the peers SlimPack is compared against, in the same framework.

Every baseline is a strategy in the registry (`registry.py`, with its `StrategySpec` facts): it
turns one global batch of document lengths into a `Plan` that `Plan.validate()` accepts, priced
by the same cost model and timed by the same simulator as SlimPack, so a comparison is a
comparison of schedules only. The building blocks are the planner's own (`stage_orders`,
`cut_document`, `WorkRates`); what differs is how documents become micro-batches and where the
micro-batches run.

Registered names and what each reproduces (details in each function's docstring):

    megatron-fixed      Megatron-LM GPTDataset: concatenate, cut at exactly the context length
    megatron-stock      the same sequences, attending across document boundaries (stock pretrain_gpt.py;
                        a different training semantic, a reference simulated for comparison only)
    bfd                 best-fit-decreasing token packing (TRL / NeMo)
    sorted              LongAlign sorted batching
    wlb-llm             WLB-LLM: cost-balanced variable-length packing + outlier-delay queues (stateful)
    megatron-hybrid-cp  Megatron-Core's BalancedCPScheduler (hybrid context parallel), called as a library
    slimpipe            SlimPipe: uniform slices of each sequence, slice-level 1F1B

All of them schedule each data-parallel replica with Megatron's 1F1B: one forward and one
backward unit per micro-batch, pp - s - 1 warm-up forwards on stage s; those Megatron-LM runs
(all but SlimPipe) also with virtual stages, in Megatron's interleaved order and under its rule
on the micro-batch count (`schedule_1f1b`), which the variable-count packers meet by splitting or merging
micro-batches (`meet_interleaved_count`).
"""
from __future__ import annotations

import bisect
import functools
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..config import SlimPackConfig
from ..costmodel import CostModel, format_bytes
from ..plan import (
    MicroPack,
    Plan,
    PlanError,
    ReplicaPlan,
    Sample,
    SampleSource,
    Slice,
    backward_sequence,
    check_sources,
    overlapping_documents,
    samples_of,
)
from ..specs import ParallelConfig
from .orders import interleaved_microbatch_error, interleaved_orders, stage_orders
from .outcomes import DoesNotFit
from .registry import LayoutConstraints, StepPlanner, register, register_stateful, with_input_sources
from .slimpack.pack_phase import PackOptions, cut_document
from .work import WorkRates

# ==== shared building blocks ====================================================================


# Megatron-LM's schedules run these strategies: interleaved 1F1B is theirs to use (v searched).
INTERLEAVED = LayoutConstraints(vpp=None, reason="Megatron-LM's interleaved 1F1B runs any vpp dividing the "
                                                 "layers per stage")


def schedule_1f1b(micropacks: list[MicroPack], parallel: ParallelConfig, dp_ranks: list[int]) -> ReplicaPlan:
    """One forward unit and one backward unit per MicroPack, stages ordered by classic 1F1B.

    The backward sequence is the plan's (chains reversed), so sliced documents (SlimPipe) get
    SlimPipe's slice-level 1F1B. No memory-driven extra warm-up: stage s warms up with exactly
    pp - s - 1 forwards (fewer when it has fewer), as Megatron-LM's
    `forward_backward_pipelining_without_interleaving` does. With virtual stages (vpp > 1) the
    order is `forward_backward_pipelining_with_interleaving`'s (`interleaved_orders`), under its
    check on the micro-batch count (a PlanError where Megatron would refuse the step).
    """
    if not micropacks:  # a rank with nothing to do (fewer micro-batches than ranks)
        return ReplicaPlan([], [], [], [[] for _ in range(parallel.pp)], list(dp_ranks))
    forward_units = [[index] for index in range(len(micropacks))]
    backward_units = [[index] for index in backward_sequence(micropacks)]
    if parallel.vpp > 1:
        refused = interleaved_microbatch_error(len(micropacks), parallel.pp)
        if refused:
            raise PlanError(f"data-parallel ranks {list(dp_ranks)}: {refused}")
        orders = interleaved_orders(forward_units, backward_units, parallel.pp, parallel.vpp)
        return ReplicaPlan(micropacks, forward_units, backward_units, orders, list(dp_ranks))
    warmups = [min(parallel.pp - stage - 1, len(micropacks)) for stage in range(parallel.pp)]
    orders = stage_orders(forward_units, backward_units, warmups)
    return ReplicaPlan(micropacks, forward_units, backward_units, orders, list(dp_ranks))


def meet_interleaved_count(per_rank: list[list[MicroPack]], parallel: ParallelConfig, capacity: int,
                           strategy: str) -> list[list[MicroPack]]:
    """Each rank's micro-batches brought to a count Megatron's interleaved 1F1B takes (a multiple
    of pp, at least pp: `interleaved_microbatch_error`), for packers whose count varies from batch
    to batch. Without virtual stages the lists are returned as they are; a rank with nothing to
    run stays empty.

    Nothing is padded or dropped. Up to the next multiple: the micro-batch of the most tokens among
    those of two or more documents is split in two (whole documents, halves of about equal tokens:
    `_halves`). Where too few hold two documents, down to the multiple below: the two of the fewest
    tokens are merged while they fit `capacity` tokens. A PlanError names the rank where neither
    reaches a multiple (too few documents)."""
    if parallel.vpp == 1:
        return per_rank
    return [_to_multiple(micropacks, parallel.pp, capacity, f"{strategy}, data-parallel rank {rank}")
            for rank, micropacks in enumerate(per_rank)]


def _to_multiple(micropacks: list[MicroPack], pp: int, capacity: int, where: str) -> list[MicroPack]:
    if not micropacks or len(micropacks) % pp == 0:
        return micropacks
    up, down = math.ceil(len(micropacks) / pp) * pp, len(micropacks) // pp * pp
    documents = sum(len(micropack.slices) for micropack in micropacks)
    micropacks = list(micropacks)
    if documents >= up:  # each split adds one micro-batch while some pack holds two documents
        while len(micropacks) < up:
            index = max((i for i, micropack in enumerate(micropacks) if len(micropack.slices) > 1),
                        key=lambda i: micropacks[i].num_tokens)
            micropacks[index:index + 1] = _halves(micropacks[index])
        return micropacks
    while down and len(micropacks) > down:
        first, second = sorted(sorted(range(len(micropacks)), key=lambda i: micropacks[i].num_tokens)[:2])
        if micropacks[first].num_tokens + micropacks[second].num_tokens > capacity:
            break
        micropacks[first] = MicroPack(micropacks[first].slices + micropacks.pop(second).slices)
    if down and len(micropacks) == down:
        return micropacks
    raise PlanError(f"{where}: {len(micropacks)} micro-batches of {documents} documents can neither be split into "
                    f"{up} nor merged into {down} within {capacity} tokens, and Megatron's interleaved 1F1B needs a "
                    f"multiple of pp={pp}; use a larger --global-batch-size or no virtual pipeline stages")


def _halves(micropack: MicroPack) -> list[MicroPack]:
    """Two MicroPacks of the slices (whole documents), longest first into the one with fewer
    tokens; each keeps the slices' order."""
    tokens, side = [0, 0], {}
    for position in sorted(range(len(micropack.slices)), key=lambda i: -micropack.slices[i].length):
        half = 0 if tokens[0] <= tokens[1] else 1
        side[position] = half
        tokens[half] += micropack.slices[position].length
    return [MicroPack([s for position, s in enumerate(micropack.slices) if side[position] == half]) for half in (0, 1)]


def whole_documents(samples: list[Sample]) -> MicroPack:
    """A micro-batch holding each sample whole (per-document attention masking)."""
    return MicroPack([Slice(s.sample_id, 0, s.length) for s in samples])


def deal_contiguous(items: list, dp: int) -> list[list]:
    """Rank r gets a contiguous block; with a remainder the first ranks get one more."""
    base, extra = divmod(len(items), dp)
    blocks, start = [], 0
    for rank in range(dp):
        size = base + (rank < extra)
        blocks.append(items[start:start + size])
        start += size
    return blocks


def deal_round_robin(items: list, dp: int) -> list[list]:
    """Item i goes to rank i % dp."""
    return [items[rank::dp] for rank in range(dp)]


def assemble_plan(
    per_rank: list[list[MicroPack]], samples: list[Sample], parallel: ParallelConfig, cost: CostModel,
    config: SlimPackConfig, token_cap: int | None, metadata: dict,
    sources: tuple[list[SampleSource], list[int]] | None = None,
) -> Plan:
    """One 1F1B replica plan per data-parallel rank. `sources`: (where samples[i] comes from, for
    every i; the documents the input holds twice), as `input_sources` gives them (None: each
    sample is the input length of its id)."""
    replicas = [schedule_1f1b(micropacks, parallel, [rank]) for rank, micropacks in enumerate(per_rank)]
    metadata = {"cost_model": cost.describe(), "micro_batches_per_rank": [len(m) for m in per_rank], **metadata}
    sample_sources, repeated = sources if sources is not None else (None, [])
    return Plan(replicas, samples, parallel, config.context_length, config.strategy, token_cap, metadata,
                sample_sources, repeated)


def input_sources(lengths: list[int], sources) -> tuple[list[SampleSource], list[int]]:
    """(each input length's source, default (i, 0); the documents of which the input holds
    overlapping pieces)."""
    sources = check_sources(sources, len(lengths))
    return sources, overlapping_documents(sources, lengths)


# ==== megatron-fixed ============================================================================


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
    return _cut(tuple(lengths), context_length)


# Room for every batch of a search: its finalist layouts each plan all of them in turn, and a
# cache smaller than the batch count (the paper grid runs 10) would evict every one before reuse.
BATCHES_CACHED = 16


@functools.lru_cache(maxsize=BATCHES_CACHED)
def _cut(lengths: tuple[int, ...], context_length: int) -> tuple[tuple[Piece, ...], ...]:
    sequences: list[list[Piece]] = [[]]
    filled = 0
    next_id = 0
    for document, length in enumerate(lengths):
        offset = 0
        while offset < length:
            if filled == context_length:
                sequences.append([])
                filled = 0
            take = min(length - offset, context_length - filled)
            sequences[-1].append(Piece(Sample(next_id, take), document, offset))
            next_id += 1
            offset += take
            filled += take
    return tuple(tuple(sequence) for sequence in sequences if sequence)


def _piece_metadata(sequences: list[list[Piece]]) -> dict:
    return {
        "num_sequences": len(sequences),
        # sample id -> [index of its length in the batch, first token of the piece in it] (read by
        # fidelity.py; the token source reads Plan.sample_sources, which also holds the corpus offset)
        "pieces": [[piece.document, piece.offset] for sequence in sequences for piece in sequence],
    }


def _piece_sources(sequences, lengths: list[int], sources) -> tuple[list[SampleSource], list[int]]:
    """Each piece's (document, offset): its input length's source, `piece.offset` tokens further
    (and the documents the input holds twice)."""
    sources, repeated = input_sources(lengths, sources)
    new = tuple.__new__
    return [new(SampleSource, (sources[piece.document][0], sources[piece.document][1] + piece.offset))
            for sequence in sequences for piece in sequence], repeated


def _sequence_first_sources(sequences, lengths: list[int], sources) -> tuple[list[SampleSource], list[int]]:
    """For megatron-stock, whose samples are whole sequences: each sequence's source is that of its
    first piece (where its tokens begin; the rest follow in stream order, in the plan's metadata
    "sequence_pieces"), and the documents whose recorded ranges may overlap. A sequence that runs
    on into the next document records one range past its first document's end; with the
    sampler's batches (a long document's entries consecutive, in order) or default sources no two
    such ranges overlap except in a document the input holds twice, and any other overlap is
    listed too, so that the plan validates."""
    piece_sources, repeated = _piece_sources(sequences, lengths, sources)
    firsts = np.cumsum([0] + [len(sequence) for sequence in sequences[:-1]]).tolist()
    first_sources = [piece_sources[index] for index in firsts]
    spans = [sum(piece.sample.length for piece in sequence) for sequence in sequences]
    return first_sources, sorted(set(repeated) | set(overlapping_documents(first_sources, spans)))


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
        where = _sequence_first_sources(sequences, lengths, sources)
    else:
        samples = [piece.sample for sequence in sequences for piece in sequence]
        micropacks = [whole_documents([piece.sample for piece in sequence]) for sequence in sequences]
        metadata = _piece_metadata(sequences)
        where = _piece_sources(sequences, lengths, sources)
    per_rank = deal_contiguous(micropacks, parallel.dp)
    return assemble_plan(per_rank, samples, parallel, cost, config, config.context_length, metadata, where)


@register("megatron-fixed", role="baseline", trainable=True,
          description="Megatron-LM GPTDataset: concatenate, cut at exactly the context length",
          minimum_in_flight="sequence", splits_documents=True, renumbers_samples=True, constraints=INTERLEAVED,
          fixed_sequences_per_rank=True)
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
@register("megatron-stock", role="baseline", trainable=False,
          description="stock Megatron-LM pretrain_gpt.py (no --reset-attention-mask): megatron-fixed's sequences, "
                      "each attending causally across its document boundaries (a different training semantic; "
                      "a reference, simulated for comparison only)",
          minimum_in_flight="sequence", splits_documents=True, renumbers_samples=True,
          different_semantics=STOCK_SEMANTICS, constraints=INTERLEAVED, fixed_sequences_per_rank=True)
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


# ==== bfd =======================================================================================


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of document indices: documents in decreasing length (ties: lower index first), each
    into the open bin with the least room that still holds it, else a new bin. Bins in order of
    opening."""
    bins: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # sorted (room left, bin index)
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        position = bisect.bisect_left(rooms, (length, -1))
        if position == len(rooms):
            bins.append([index])
            bisect.insort(rooms, (capacity - length, len(bins) - 1))
            continue
        room, chosen = rooms.pop(position)
        bins[chosen].append(index)
        bisect.insort(rooms, (room - length, chosen))
    return bins


@register("bfd", role="baseline", trainable=True, description="best-fit-decreasing token packing (TRL, NeMo)",
          minimum_in_flight="document", constraints=INTERLEAVED)
def plan_bfd(lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig, *,
             sources=None) -> Plan:
    """Best-fit-decreasing token packing (TRL `pack_dataset(strategy="bfd")`, NeMo packed SFT).

    Reproduces: whole documents (never split) packed into bins of `context_length` tokens by
    best-fit decreasing (`best_fit_decreasing`); one bin per micro-batch, per-document attention
    masking. Bins are sorted by token count, largest first (stable), and dealt round-robin to
    data-parallel ranks (bin i to rank i % dp); each rank runs classic 1F1B (with virtual stages
    Megatron's interleaved 1F1B, a rank's bins split or merged to a multiple of pp: `meet_interleaved_count`).
    """
    samples = samples_of(lengths)
    bins = best_fit_decreasing(lengths, config.context_length)
    bins.sort(key=lambda members: -sum(lengths[i] for i in members))
    micropacks = [whole_documents([samples[i] for i in members]) for members in bins]
    per_rank = meet_interleaved_count(deal_round_robin(micropacks, parallel.dp), parallel,
                                      config.context_length, "bfd")
    return assemble_plan(per_rank, samples, parallel, cost, config, config.context_length, {"num_bins": len(bins)},
                         input_sources(lengths, sources))


# ==== sorted ====================================================================================


def pack_in_order(order: list[int], lengths: list[int], capacity: int) -> list[list[int]]:
    """Next-fit: documents in `order` fill a sequence until the next one does not fit."""
    sequences: list[list[int]] = []
    filled = capacity
    for index in order:
        if filled + lengths[index] > capacity:
            sequences.append([])
            filled = 0
        sequences[-1].append(index)
        filled += lengths[index]
    return sequences


@register("sorted", role="baseline", trainable=True, description="LongAlign sorted batching",
          minimum_in_flight="document", constraints=INTERLEAVED)
def plan_sorted(lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig, *,
                sources=None) -> Plan:
    """LongAlign's sorted batching.

    Reproduces: documents sorted by length (ascending, stable), packed greedily in that order
    into sequences of at most `context_length` tokens (next-fit, `pack_in_order`); consecutive
    sequences form groups of dp (one micro-batch step of all data-parallel ranks, so ranks see
    similar lengths at the same time); the order of the groups is shuffled with
    `random.Random(config.seed)` (LongAlign shuffles its sorted batches) and within a group
    sequence j goes to rank j (a last, partial group leaves the last ranks one micro-batch
    short). Each rank runs classic 1F1B (with virtual stages Megatron's interleaved 1F1B, a rank's
    sequences split or merged to a multiple of pp: `meet_interleaved_count`).
    """
    samples = samples_of(lengths)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    sequences = pack_in_order(order, lengths, config.context_length)
    groups = [sequences[start:start + parallel.dp] for start in range(0, len(sequences), parallel.dp)]
    random.Random(config.seed).shuffle(groups)
    per_rank: list[list[MicroPack]] = [[] for _ in range(parallel.dp)]
    for group in groups:
        for rank, members in enumerate(group):
            per_rank[rank].append(whole_documents([samples[i] for i in members]))
    per_rank = meet_interleaved_count(per_rank, parallel, config.context_length, "sorted")
    return assemble_plan(per_rank, samples, parallel, cost, config, config.context_length,
                         {"num_sequences": len(sequences), "group_order_seed": config.seed},
                         input_sources(lengths, sources))


# ==== wlb-llm ===================================================================================


@dataclass(frozen=True)
class PendingDocument:
    """A document waiting to be scheduled: `lengths[index]` of the batch of step `step`, tokens
    [offset, offset + length) of corpus document `document` (its source, kept while it waits)."""

    step: int
    index: int
    length: int
    document: int = 0
    offset: int = 0

    def to_list(self) -> list[int]:
        return [self.step, self.index, self.length, self.document, self.offset]

    @classmethod
    def from_list(cls, values) -> "PendingDocument":
        step, index, length, document, offset = (int(v) for v in values)
        return cls(step, index, length, document, offset)


@dataclass
class MicroBatch:
    documents: list[PendingDocument]
    tokens: int = 0
    cost: float = 0.0

    def add(self, document: PendingDocument, cost: float) -> None:
        self.documents.append(document)
        self.tokens += document.length
        self.cost += cost


@register_stateful("wlb-llm", role="baseline", trainable=True,
                   description="WLB-LLM: cost-balanced variable-length packing, outlier-delay queues",
                   minimum_in_flight="document", renumbers_samples=True, constraints=INTERLEAVED)
class WlbLlmPlanner(StepPlanner):
    """WLB-LLM (OSDI'25): workload-balanced variable-length packing with outlier delay.

    Reproduces, per global batch:
    - Micro-batch count fixed as in Megatron: M = ceil(new tokens / (context_length * dp)) per
      replica, dp * M micro-batches in all, each capped at `context_length` tokens; with virtual
      stages M is rounded up to a multiple of pp (Megatron's interleaved 1F1B needs it), and a
      replica left with fewer non-empty micro-batches is split or merged to one (`meet_interleaved_count`).
    - Multi-level outlier-delay queues: a new document longer than `context_length *
      LEVEL_FRACTIONS[i]` (and not longer than the previous level's threshold) joins queue i
      instead of being packed. A queue releases documents only once it holds as many as there
      are micro-batches, and then releases exactly one per micro-batch (oldest first; the
      longest released document goes to the micro-batch with the most token room). It keeps
      releasing rounds while it still holds a full round and the previous round fitted; a
      released document that does not fit its micro-batch's token room goes back to the queue.
    - The other documents are packed, those carried over from the previous step before the new
      ones, each group longest-cost first, each document into the micro-batch with the least cost
      that has token room; cost is the profiled quadratic + linear cost (`WorkRates.document`).
      A document that fits no micro-batch is carried over to the next step.
    - Micro-batches are dealt to data-parallel replicas greedily by cost (heaviest first to the
      least-loaded replica that has fewer than M), so replicas are balanced too; classic 1F1B.
    Nothing is dropped: a plan contains exactly the documents it schedules (sample ids 0..k-1,
    each with its source (document, offset) in `Plan.sample_sources`, also for a document delayed
    from an earlier batch); delayed ones stay in `pending`. Without `sources`, the documents are
    numbered in order of arrival over all steps (the first batch's are (i, 0)). At the end of a
    run, `flush()` plans everything still pending as one more step (enough micro-batches for all
    of it, no delay). If a step would otherwise schedule nothing (every new document delayed and
    no queue full), it is planned like `flush()` so that training makes progress.
    `advance()` updates the queues as `plan()` would without building the plan (a resumed run);
    `state_dict()` / `load_state_dict()` save and restore the queues, carried documents and step.
    """

    LEVEL_FRACTIONS = (0.5, 0.25)  # level 0: > context/2; level 1: (context/4, context/2]

    def __init__(self):
        super().__init__()
        self.step = 0
        self.arrived = 0  # documents given so far (numbers them when no sources are given)
        self.queues: list[deque[PendingDocument]] = [deque() for _ in self.LEVEL_FRACTIONS]
        self.carried: list[PendingDocument] = []

    # ---- state ---------------------------------------------------------------------------
    @property
    def pending(self) -> list[PendingDocument]:
        """Documents delayed so far and not yet scheduled."""
        return [d for queue in self.queues for d in queue] + list(self.carried)

    def untrained_lengths(self) -> list[int]:
        return [document.length for document in self.pending]

    def state_dict(self) -> dict:
        """Step counter, documents seen, delay queues and carried documents (with their sources)."""
        return {
            "strategy": "wlb-llm", "step": self.step, "arrived": self.arrived,
            "queues": [[d.to_list() for d in queue] for queue in self.queues],
            "carried": [d.to_list() for d in self.carried],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("strategy") != "wlb-llm" or len(state.get("queues", ())) != len(self.LEVEL_FRACTIONS):
            raise PlanError(f"wlb-llm: not a wlb-llm planner state with {len(self.LEVEL_FRACTIONS)} delay queues: "
                            f"{sorted(state)}")
        self.step = int(state["step"])
        self.arrived = int(state["arrived"])
        self.queues = [deque(PendingDocument.from_list(d) for d in queue) for queue in state["queues"]]
        self.carried = [PendingDocument.from_list(d) for d in state["carried"]]

    def _levels(self, lengths: list[int], context_length: int) -> list[int | None]:
        """Each length's delay queue (None: packed at once), the thresholds computed once."""
        thresholds = [(level, context_length * fraction) for level, fraction in enumerate(self.LEVEL_FRACTIONS)]
        return [next((level for level, threshold in thresholds if length > threshold), None) for length in lengths]

    # ---- planning ------------------------------------------------------------------------
    def plan(self, lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig, *,
             sources=None) -> Plan:
        micro_batches, per_replica, rates, metadata = self._pack_step(lengths, parallel, cost, config, sources)
        if micro_batches is None:
            return self._plan_pending(parallel, cost, config, rates, metadata)
        return self._finish(micro_batches, per_replica, parallel, cost, config, rates, metadata)

    def advance(self, lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig, *,
                sources=None) -> None:
        """The state after planning this batch (queues, carried documents, step), without the plan:
        the packing decides what is carried over, the plan's assembly and schedule are skipped."""
        micro_batches, _, _, _ = self._pack_step(lengths, parallel, cost, config, sources)
        if micro_batches is None:
            self._take_pending()
        self.step += 1

    def flush(self, parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig) -> Plan | None:
        """Plan every pending document as one last step (None when nothing is pending)."""
        if not self.pending:
            return None
        rates = WorkRates.from_cost(cost, parallel, config.context_length)
        return self._plan_pending(parallel, cost, config, rates, {"flush": True})

    def _pack_step(self, lengths, parallel, cost, config, sources):
        """Queue, release and pack one batch; (micro-batches, per replica, rates, metadata), the
        micro-batches None when nothing was scheduled (then everything pending is planned)."""
        if sources is None:
            sources = [(self.arrived + i, 0) for i in range(len(lengths))]
        else:
            sources = check_sources(sources, len(lengths))
        self.arrived += len(lengths)
        context = config.context_length
        rates = WorkRates.from_cost(cost, parallel, context)
        per_replica = _micro_batches_per_replica(sum(lengths), context, parallel)
        micro_batches = [MicroBatch([]) for _ in range(per_replica * parallel.dp)]
        fresh: list[PendingDocument] = []
        for index, (length, level, (document, offset)) in enumerate(
                zip(lengths, self._levels(lengths, context), sources)):
            pending = PendingDocument(self.step, index, length, document, offset)
            (fresh if level is None else self.queues[level]).append(pending)
        released = [self._release(queue, micro_batches, rates, context) for queue in self.queues]
        carried, self.carried = self.carried, []
        self.carried = _pack_by_cost(carried, micro_batches, rates, context)  # they waited: first
        self.carried += _pack_by_cost(fresh, micro_batches, rates, context)
        metadata = {"micro_batches_per_replica": per_replica, "released_per_level": released}
        if not any(mb.documents for mb in micro_batches):
            return None, per_replica, rates, metadata
        return micro_batches, per_replica, rates, metadata

    def _take_pending(self) -> list[PendingDocument]:
        """Every pending document; the queues and the carried list are emptied."""
        documents = self.pending
        self.queues = [deque() for _ in self.LEVEL_FRACTIONS]
        self.carried = []
        return documents

    def _plan_pending(self, parallel, cost, config, rates, metadata) -> Plan:
        """All pending documents, packed by cost into just enough micro-batches."""
        documents = self._take_pending()
        context = config.context_length
        per_replica = _micro_batches_per_replica(sum(d.length for d in documents), context, parallel)
        while True:
            micro_batches = [MicroBatch([]) for _ in range(per_replica * parallel.dp)]
            if not _pack_by_cost(documents, micro_batches, rates, context):
                break
            # Greedy packing left some out: more micro-batches per replica (pp more with virtual stages).
            per_replica += parallel.pp if parallel.vpp > 1 else 1
        metadata = {**metadata, "micro_batches_per_replica": per_replica, "released_all_pending": len(documents)}
        return self._finish(micro_batches, per_replica, parallel, cost, config, rates, metadata)

    def _release(self, queue: deque, micro_batches: list[MicroBatch], rates: WorkRates, context: int) -> int:
        """Release rounds of one document per micro-batch while the queue holds a full round."""
        released = 0
        while len(queue) >= len(micro_batches):
            batch = [queue.popleft() for _ in range(len(micro_batches))]
            roomiest = sorted(micro_batches, key=lambda mb: mb.tokens)
            unfit = []
            for document, micro_batch in zip(sorted(batch, key=lambda d: -d.length), roomiest):
                if micro_batch.tokens + document.length <= context:
                    micro_batch.add(document, rates.document(document.length))
                    released += 1
                else:
                    unfit.append(document)
            if unfit:
                queue.extendleft(sorted(unfit, key=lambda d: (d.step, d.index), reverse=True))
                break
        return released

    def _finish(self, micro_batches, per_replica, parallel, cost, config, rates, metadata) -> Plan:
        used = [mb for mb in micro_batches if mb.documents]
        per_rank = _deal_by_cost(used, parallel.dp, per_replica)
        documents = [d for mbs in per_rank for mb in mbs for d in mb.documents]
        sample_of = {(d.step, d.index): Sample(i, d.length) for i, d in enumerate(documents)}
        micropacks = [[whole_documents([sample_of[d.step, d.index] for d in mb.documents]) for mb in mbs]
                      for mbs in per_rank]
        # A replica left short (empty micro-batches: documents delayed).
        micropacks = meet_interleaved_count(micropacks, parallel, config.context_length, "wlb-llm")
        pending = self.pending
        metadata = {
            **metadata, "step": self.step,
            "micro_batch_costs_s": [[mb.cost for mb in mbs] for mbs in per_rank],
            "delayed_documents": len(pending), "delayed_tokens": sum(d.length for d in pending),
        }
        self.step += 1
        samples = list(sample_of.values())
        new = tuple.__new__
        sources = [new(SampleSource, (d.document, d.offset)) for d in documents]
        # Its samples are whole input documents, some from earlier batches: any two that overlap are
        # one document drawn twice (an epoch boundary of a small corpus).
        repeated = overlapping_documents(sources, [d.length for d in documents])
        return assemble_plan(micropacks, samples, parallel, cost, config, config.context_length, metadata,
                             (sources, repeated))


def _micro_batches_per_replica(tokens: int, context_length: int, parallel: ParallelConfig) -> int:
    """WLB-LLM's micro-batch count per replica, Megatron's: ceil(tokens / (context x dp)); with
    virtual stages rounded up to the multiple of pp Megatron's interleaved 1F1B needs."""
    count = max(1, math.ceil(tokens / (context_length * parallel.dp)))
    return math.ceil(count / parallel.pp) * parallel.pp if parallel.vpp > 1 else count


def _pack_by_cost(documents: list[PendingDocument], micro_batches: list[MicroBatch], rates: WorkRates,
                  capacity: int) -> list[PendingDocument]:
    """Heaviest document first into the cheapest micro-batch with token room; returns the
    documents that fit nowhere (in their given order)."""
    lengths = np.array([d.length for d in documents], dtype=float)
    costs = rates.total(lengths, lengths * (lengths + 1) / 2).tolist() if len(documents) else []
    by_cost = [(mb.cost, position) for position, mb in enumerate(micro_batches)]
    heapq.heapify(by_cost)
    # Micro-batches found too full for a document wait here, roomiest first, until a document
    # short enough for them comes (documents come longest first, so each waits about once).
    parked: list[tuple[int, int]] = []  # (-room, position)
    left: list[int] = []
    for index in sorted(range(len(documents)), key=lambda i: -costs[i]):
        document = documents[index]
        while parked and -parked[0][0] >= document.length:
            position = heapq.heappop(parked)[1]
            heapq.heappush(by_cost, (micro_batches[position].cost, position))
        while by_cost:  # the cheapest micro-batch with room
            position = by_cost[0][1]
            micro_batch = micro_batches[position]
            if micro_batch.tokens + document.length <= capacity:
                micro_batch.add(document, costs[index])
                heapq.heapreplace(by_cost, (micro_batch.cost, position))
                break
            heapq.heappop(by_cost)
            heapq.heappush(parked, (micro_batch.tokens - capacity, position))
        else:
            left.append(index)  # no micro-batch has room
    return [documents[i] for i in sorted(left)]


def _deal_by_cost(micro_batches: list[MicroBatch], dp: int, per_replica: int) -> list[list[MicroBatch]]:
    """Heaviest micro-batch first to the least-loaded replica with fewer than `per_replica`."""
    per_rank: list[list[MicroBatch]] = [[] for _ in range(dp)]
    heap = [(0.0, rank) for rank in range(dp)]
    for micro_batch in sorted(micro_batches, key=lambda mb: -mb.cost):
        load, rank = heapq.heappop(heap)
        per_rank[rank].append(micro_batch)
        if len(per_rank[rank]) < per_replica:
            heapq.heappush(heap, (load + micro_batch.cost, rank))
    return per_rank


# ==== megatron-hybrid-cp ========================================================================


class _PoolSize:
    """Stand-in for the DP x CP process group: `BalancedCPScheduler.__init__` only calls
    `dp_cp_group.size()`; nothing else of a process group is used by the scheduling code."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def _balanced_cp_scheduler():
    try:
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    except ImportError as error:
        raise PlanError(
            "megatron-hybrid-cp: the installed megatron-core has no "
            "megatron.core.pipeline_parallel.hybrid_cp_schedule.BalancedCPScheduler "
            f"({error}); it needs megatron-core >= 0.16"
        ) from error
    return BalancedCPScheduler


def max_tokens_per_rank(cost: CostModel, parallel: ParallelConfig, config: SlimPackConfig) -> int:
    """Megatron's `--max-seqlen-per-cp-rank`: `config.max_micropack_tokens` if set, else the
    largest power of two (at most the context) whose activations fit one device next to the
    weights and optimizer state (one sub-sample in flight: forward then backward at once)."""
    if config.max_micropack_tokens:
        return config.max_micropack_tokens
    budget = cost.memory_budget_bytes() - cost.static_memory_bytes(parallel)
    tokens = 1 << max(config.context_length.bit_length() - 1, 0)

    def need(n: int) -> float:
        pairs = n * (n + 1) / 2
        activations = cost.activation_bytes(n, pairs, parallel, last_stage=True)
        return activations + cost.recompute_peak_bytes(n, pairs, parallel)

    while tokens > 256 and need(tokens) > budget:
        tokens //= 2
    if need(tokens) > budget:
        raise DoesNotFit(
            f"memory: with {parallel.describe()} a {cost.model.name} replica has "
            f"{format_bytes(max(budget, 0))} left after weights and optimizer state on {cost.hardware.name}, "
            f"not enough for {tokens} tokens per rank; use more tensor parallelism or recompute",
            bytes_needed=cost.static_memory_bytes(parallel) + need(tokens), bytes_available=cost.memory_budget_bytes(),
        )
    return min(tokens, config.context_length)


def _cp_groups(sample_id_groups: list[list[list[int]]]) -> list[dict[tuple[int, ...], list[int]]]:
    """Per scheduler group: rank set -> the sample ids it runs together, in order."""
    groups = []
    for per_gpu in sample_id_groups:
        ranks_of: dict[int, list[int]] = {}
        order: list[int] = []
        for rank, sample_ids in enumerate(per_gpu):
            for sample_id in sample_ids:
                if sample_id not in ranks_of:
                    ranks_of[sample_id] = []
                    order.append(sample_id)
                if rank not in ranks_of[sample_id]:
                    ranks_of[sample_id].append(rank)
        by_ranks: dict[tuple[int, ...], list[int]] = {}
        for sample_id in order:
            by_ranks.setdefault(tuple(sorted(ranks_of[sample_id])), []).append(sample_id)
        groups.append(by_ranks)
    return groups


# Simulated for comparison only: the SlimPack runtime does not run Megatron's hybrid CP schedule.
@register("megatron-hybrid-cp", role="baseline", trainable=False,
          description="Megatron-Core BalancedCPScheduler (hybrid context parallel)",
          minimum_in_flight="none", constraints=LayoutConstraints(
              pp=(1,), cp=(1,),
              reason="BalancedCPScheduler supports no pipeline parallelism and picks CP sizes per sample from the "
                     "DP x CP pool (given as dp)"))
def plan_megatron_hybrid_cp(lengths: list[int], parallel: ParallelConfig, cost: CostModel,
                            config: SlimPackConfig, *, sources=None) -> Plan:
    """Megatron-Core's hybrid context parallelism (`hybrid_cp_schedule.BalancedCPScheduler`).

    Reproduces: the installed megatron-core's scheduler is called as a library
    (`get_groups_and_subsamples`) on the documents of the batch, with the data-parallel ranks as
    its DP x CP pool (`parallel.dp` GPUs; `parallel.cp` must be 1, since CP sizes are chosen per
    sample) and `max_tokens_per_rank` as `--max-seqlen-per-cp-rank`. It gives each document a
    power-of-two CP size (tokens / max per rank, rounded up; cost L^2/cp) and forms groups in
    which every GPU gets a balanced list of sub-samples. Conversion: a document on k > 1 GPUs
    becomes a DP-Merge replica plan over those k ranks (the simulator runs it with CP of k,
    which is the scheduler's semantics: CP ranks taken from the DP x CP pool); documents on one
    GPU form that rank's own replica plan. Every sub-sample is its own micro-batch, forward then
    backward at once (the scheduler's loop; 1F1B with one stage).
    Approximation: our plans order a rank's work as its merge groups (in scheduler-group order)
    and then its own documents, and the simulator synchronises ranks only inside merge groups;
    the scheduler's barrier between groups is not modelled, which slightly favours this baseline.
    Supported regime only: pipeline parallelism is refused ("PP not yet supported" upstream).
    """
    if parallel.pp > 1:
        raise PlanError(
            f"megatron-hybrid-cp: Megatron-Core's BalancedCPScheduler does not support pipeline parallelism "
            f"(hybrid_cp_schedule.py: 'PP not yet supported'); got pp={parallel.pp}, use pp=1"
        )
    if parallel.cp > 1:
        raise PlanError(
            f"megatron-hybrid-cp: CP sizes are chosen per sample from the DP x CP pool; give the whole pool "
            f"as data parallelism (dp={parallel.dp * parallel.cp}, cp=1) instead of cp={parallel.cp}"
        )
    scheduler_class = _balanced_cp_scheduler()
    per_rank_tokens = max_tokens_per_rank(cost, parallel, config)
    scheduler = scheduler_class(per_rank_tokens, _PoolSize(parallel.dp))
    widest = scheduler.gpus_needed(max(lengths))
    if widest > parallel.dp:
        raise DoesNotFit(
            f"memory: a {max(lengths)}-token document needs CP {widest} at {per_rank_tokens} tokens per rank, "
            f"more than the {parallel.dp} GPUs of the DP x CP pool; use more GPUs, recompute or tensor parallelism",
            sample_ids=[int(np.argmax(lengths))], group_ranks=widest,
        )
    try:
        _, sample_id_groups = scheduler.get_groups_and_subsamples(list(enumerate(lengths)), None)
    except AssertionError as error:
        raise PlanError(f"megatron-hybrid-cp: BalancedCPScheduler failed on this batch: {error}") from error
    return with_input_sources(_hybrid_plan(lengths, sample_id_groups, parallel, cost, config, per_rank_tokens),
                              sources, len(lengths))


def _hybrid_plan(lengths, sample_id_groups, parallel, cost, config, per_rank_tokens) -> Plan:
    samples = samples_of(lengths)
    merges: list[ReplicaPlan] = []
    own: list[list[MicroPack]] = [[] for _ in range(parallel.dp)]
    scheduled: list[int] = []
    cp_sizes: dict[int, int] = {}
    for by_ranks in _cp_groups(sample_id_groups):
        for ranks, sample_ids in by_ranks.items():
            scheduled += sample_ids
            cp_sizes.update({sample_id: len(ranks) for sample_id in sample_ids})
            micropacks = [whole_documents([samples[i]]) for i in sample_ids]
            if len(ranks) == 1:
                own[ranks[0]] += micropacks
            else:
                merged = parallel.with_(cp=parallel.cp * len(ranks))
                merges.append(schedule_1f1b(micropacks, merged, list(ranks)))
    if sorted(scheduled) != list(range(len(lengths))):
        raise PlanError("megatron-hybrid-cp: BalancedCPScheduler did not schedule every document exactly once")
    replicas = merges + [schedule_1f1b(m, parallel, [rank]) for rank, m in enumerate(own)]
    metadata = {
        "cost_model": cost.describe(), "max_seqlen_per_cp_rank": per_rank_tokens,
        "scheduler_groups": len(sample_id_groups),
        "cp_size_per_sample": [cp_sizes[i] for i in range(len(lengths))],
    }
    return Plan(replicas, samples, parallel, config.context_length, config.strategy, None, metadata)


# ==== slimpipe ==================================================================================


def slice_sequence(sequence: tuple[Piece, ...], slice_tokens: int) -> list[MicroPack]:
    """Cut a packed sequence into uniform slices of at most `slice_tokens` tokens (SlimPipe);
    a slice holds the parts of the pieces it overlaps, each attending to its piece's prefix."""
    total = sum(piece.sample.length for piece in sequence)
    options = PackOptions(token_cap=slice_tokens, slice_tokens=slice_tokens, cost_balanced_slices=False)
    bounds = [(s.start, s.end) for s in cut_document(Sample(-1, total), options, rates=None)]
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


@register("slimpipe", role="baseline", trainable=True, description="SlimPipe: uniform slices, slice-level 1F1B",
          minimum_in_flight="half-document", splits_documents=True, renumbers_samples=True)
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
    per_rank = [[mp for micropacks in block for mp in micropacks] for block in deal_contiguous(sliced, parallel.dp)]
    metadata = {**_piece_metadata(sequences), "slice_tokens": slice_tokens}
    return assemble_plan(per_rank, samples, parallel, cost, config, slice_tokens, metadata,
                         _piece_sources(sequences, lengths, sources))


@functools.lru_cache(maxsize=BATCHES_CACHED)
def _sliced_sequences(lengths: tuple[int, ...], context_length: int, slice_tokens: int) -> tuple[list[MicroPack], ...]:
    """Each fixed-length sequence's slices (the same on every layout the search tries)."""
    return tuple(slice_sequence(sequence, slice_tokens) for sequence in _cut(lengths, context_length))


__all__ = [
    "schedule_1f1b", "concatenate_and_cut", "best_fit_decreasing", "pack_in_order", "WlbLlmPlanner",
    "max_tokens_per_rank", "slice_sequence", "plan_megatron_fixed", "plan_megatron_stock", "plan_bfd", "plan_sorted",
    "plan_megatron_hybrid_cp", "plan_slimpipe", "Piece", "PendingDocument",
]
