"""What every baseline shares: Megatron's 1F1B (and interleaved) schedule of a replica's
micro-batches, meeting the interleaved schedule's micro-batch count, dealing micro-batches to
replicas, and assembling the plan."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TypeVar

from ...config import SlimPackConfig
from ...costmodel import CostModel
from ...plan import (
    MicroPack,
    Plan,
    PlanError,
    ReplicaPlan,
    Sample,
    SampleSource,
    backward_sequence,
    check_sources,
    default_sources,
    overlapping_documents,
    whole_slices,
    whole_slices_of,
)
from ...specs import ParallelConfig
from ..orders import interleaved_microbatch_error, interleaved_orders, stage_orders
from ..registry import LayoutConstraints

T = TypeVar("T")

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
        chunk_orders = interleaved_orders(forward_units, backward_units, parallel.pp, parallel.vpp)
        return ReplicaPlan(micropacks, forward_units, backward_units, chunk_orders, list(dp_ranks))
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
    return MicroPack(whole_slices(samples))


def whole_micropacks(lengths: list[int], groups: Iterable[Sequence[int]]) -> list[MicroPack]:
    """A micro-batch per group of documents (indices into `lengths`, each its sample id), each
    document whole: `whole_documents` of the groups' samples, their slices taken from the batch's
    (`whole_slices_of`, made once for the many layouts a search plans the batch on)."""
    slices = whole_slices_of(lengths)
    return [MicroPack([slices[index] for index in members]) for members in groups]


def deal_contiguous(items: list[T], dp: int) -> list[list[T]]:
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
    if sources is None:  # each length a document of its own: no two overlap
        return default_sources(len(lengths)), []
    sources = check_sources(sources, len(lengths))
    return sources, overlapping_documents(sources, lengths)
