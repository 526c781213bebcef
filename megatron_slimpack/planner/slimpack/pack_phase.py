"""Phase 2: within one replica, cut slices, pack MicroPacks, segment units, order stages.

- Slicing is cost-balanced: a long document is cut so every slice costs about the same seconds,
  which makes later slices shorter (their attention prefix is longer). With pipeline parallelism
  (`even_costs`), documents that fit a MicroPack but cost more than a typical full one are sliced
  too, so MicroPacks cost about the same.
- Each slice opens its own MicroPack, topped up with the smallest documents up to the heaviest
  slice's cost and the token cap; the other documents, largest first, fill MicroPacks of their own,
  each topped up the same way (so packs stay full even when its documents are over half the cap).
- A chain (a long document's MicroPacks) stays contiguous in the forward sequence, so its
  backward can start as soon as its last slice is forwarded.
- Forward units balance forward cost over the forward sequence; backward units balance backward
  cost over the backward sequence (Asymmetric Partitioning). `symmetric=True` derives the
  backward units from the forward grouping instead (the `slimpack-sym` ablation).
"""
from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import NamedTuple

import numpy as np

from ...config import PlannerTunables
from ...costmodel import CostModel
from ...plan import (
    MicroPack,
    ReplicaPlan,
    Sample,
    Slice,
    backward_sequence,
    pack_figures,
    slice_table,
    whole_slices,
)
from ...specs import ParallelConfig
from .. import compiled
from ..orders import (
    InterleavedSchedule,
    StageWork,
    forward_targets,
    interleaved_schedules,
    no_interleaved_order,
    orders_of_targets,
    peaks_of_targets,
    replay_targets,
    segment_bounds,
    warmup_counts,
)
from ..work import WorkRates, causal_pairs


@dataclass(frozen=True)
class PackOptions:
    token_cap: int  # most tokens in one MicroPack
    slice_tokens: int  # documents longer than this are sliced
    cost_balanced_slices: bool = True
    # Also slice documents that cost more than a typical full MicroPack, so MicroPacks cost about
    # the same: what a pipeline needs (each stage waits on its neighbours' slower unit).
    even_costs: bool = False
    # The search's knobs: packing reads even_cost_tolerance, extra_slices and balancing_rounds.
    tunables: PlannerTunables = PlannerTunables()


def cut_document(sample: Sample, options: PackOptions, rates: WorkRates,
                 slice_cost: float | None = None) -> list[Slice]:
    """Cut a document into slices of equal cost, none longer than the token cap and, with
    `slice_cost`, none costing more than it (seconds at a cap-full MicroPack's efficiency).

    The count starts where work-balanced slices fit the cap (the first, longest one holds
    1/count of the work). Balancing seconds makes short slices shorter still (they run less
    efficiently), so it gets a few more slices to fit; past those the work-balanced cut is kept:
    with a small cap and a long document, chasing seconds would cut thousands of tiny slices.
    Without cost-balanced slices (`PackOptions.cost_balanced_slices`), equal lengths: `rates`
    may then be None. Compiled (`compiled.cut_bounds`): a planning cuts ~10^3 documents per
    packing, tens of packings per replica."""
    bounds = compiled.cut_bounds(_rate_array(rates), sample.length, *_cut_options(options, slice_cost))
    return _slices(sample, bounds.tolist())


def cut_documents(samples: list[Sample], options: PackOptions, rates: WorkRates,
                  slice_cost: float | None = None) -> list[list[Slice]]:
    """`cut_document` of each sample, in one compiled call."""
    lengths = np.fromiter(map(operator.attrgetter("length"), samples), dtype=np.int64, count=len(samples))
    starts, flat = compiled.cut_bounds_of_all(_rate_array(rates), lengths, *_cut_options(options, slice_cost))
    flat_bounds, starts_list = flat.tolist(), starts.tolist()
    return [_slices(sample, flat_bounds[first:end])
            for sample, first, end in zip(samples, starts_list, starts_list[1:])]


@lru_cache(maxsize=64)
def _rate_array(rates: WorkRates | None) -> np.ndarray:
    """`rates` as the compiled cut reads them (`compiled.RATE_FIELDS`; zeros without rates)."""
    if rates is None:
        return np.zeros(len(compiled.RATE_FIELDS))
    return np.array([float(getattr(rates, name)) for name in compiled.RATE_FIELDS])


def _cut_options(options: PackOptions, slice_cost: float | None) -> tuple:
    tunables = options.tunables
    return (options.slice_tokens, options.token_cap, options.cost_balanced_slices, tunables.extra_slices,
            tunables.balancing_rounds, math.nan if slice_cost is None else float(slice_cost))


def _slices(sample: Sample, bounds: Sequence[int]) -> list[Slice]:
    new, sample_id = tuple.__new__, sample.sample_id  # tuple.__new__: see plan.types.whole_slices
    return [new(Slice, (sample_id, a, b)) for a, b in zip(bounds, bounds[1:]) if b > a]


def _at_cap_efficiency(lengths, pairs, rates: WorkRates, token_cap: int):
    """Factor turning work of MicroPacks of `lengths` tokens and `pairs` attention pairs into
    seconds at a cap-full one's efficiency."""
    return rates.size_penalty(lengths, pairs) / rates.size_penalty(token_cap)


class SortedSamples:
    """A replica's documents, longest first, with their whole-document slices and costs: computed
    once and shared by every MicroPack size the planner tries."""

    def __init__(self, samples: list[Sample], rates: WorkRates):
        lengths = np.fromiter((s.length for s in samples), dtype=float, count=len(samples))
        order = np.argsort(-lengths, kind="stable")
        self.samples = [samples[i] for i in order.tolist()]
        self.lengths = lengths[order]
        self.whole = whole_slices(self.samples)
        self.costs = rates.total(self.lengths, self.lengths * (self.lengths + 1) / 2)

    def split(self, slice_tokens: int) -> int:
        """Index of the first document short enough to stay whole."""
        return int(np.searchsorted(-self.lengths, -slice_tokens, side="left"))


def pack_micropacks(samples: list[Sample] | SortedSamples, options: PackOptions, rates: WorkRates) -> list[MicroPack]:
    ordered = samples if isinstance(samples, SortedSamples) else SortedSamples(samples, rates)
    first_short = ordered.split(options.slice_tokens)
    slice_cost = None
    if options.even_costs:
        slice_cost = (options.tunables.even_cost_tolerance
                      * _typical_pack_cost(ordered, first_short, options.token_cap, rates))
        first_short = max(first_short, int(np.searchsorted(-ordered.costs, -slice_cost, side="left")))
    chains = cut_documents(ordered.samples[:first_short], options, rates, slice_cost)
    short, short_cost = ordered.whole[first_short:], ordered.costs[first_short:]
    pieces = [piece for chain in chains for piece in chain]
    slice_costs = np.array([rates.total(p.length, p.attention_pairs) for p in pieces])
    # A slice's MicroPack runs at its own size's efficiency: a later, shorter slice costs more in
    # seconds than its work says. Costs are compared at a cap-full MicroPack's efficiency.
    scale = _at_cap_efficiency(np.array([p.length for p in pieces], dtype=float),
                               np.array([p.attention_pairs for p in pieces], dtype=float), rates, options.token_cap)
    full_pack = rates.document(1) * options.token_cap  # a cap-full MicroPack without attention
    target = max((slice_costs * scale).tolist()
                 + [min(full_pack, float(short_cost.sum())), float(short_cost.max(initial=0.0))])

    # The smallest documents are the sand that tops up each slice's MicroPack to the target cost:
    # each takes the longest run of the smallest remaining documents that fits its room (costs are
    # positive, so prefix sums from the small end find the run with one search).
    small_first_cost = np.concatenate([[0.0], np.cumsum(short_cost[::-1])])
    small_first_tokens = np.concatenate([[0], np.cumsum(ordered.lengths[first_short:][::-1])])
    takens = compiled.sand_for_slices(small_first_cost, small_first_tokens, target, slice_costs, scale,
                                      np.array([p.length for p in pieces], dtype=np.int64), options.token_cap)
    chain_packs: list[list[Slice]] = []
    taken = 0  # documents taken from the small end
    for piece, until in zip(pieces, takens.tolist()):
        chain_packs.append([piece] + short[len(short) - until:len(short) - taken][::-1])
        taken = until
    # The rest fill MicroPacks of their own: the largest first (next fit: a pack closes when the
    # next document would pass the target cost or the token cap), each topped up with the longest
    # run of the smallest remaining documents that fits what it has left, so packs stay full.
    rest = len(short) - taken
    cost_prefix = np.concatenate([[0.0], np.cumsum(short_cost[:rest])])
    token_prefix = np.concatenate([[0], np.cumsum(ordered.lengths[first_short:first_short + rest])])
    others = [short[start:end] + short[sand:small_end] for start, end, sand, small_end in
              compiled.next_fit_with_sand(cost_prefix, token_prefix, target, options.token_cap, rest).tolist()]
    return _interleave([MicroPack(p) for p in chain_packs], chains, [MicroPack(p) for p in others])


def _typical_pack_cost(ordered: SortedSamples, first_short: int, token_cap: int, rates: WorkRates) -> float:
    """What a cap-full MicroPack of the documents short enough to stay whole costs on average
    (without any: a cap-full MicroPack without attention)."""
    tokens = float(ordered.lengths[first_short:].sum())
    if tokens == 0:
        return rates.document(1) * token_cap
    return float(ordered.costs[first_short:].sum()) / tokens * token_cap


def _interleave(chain_packs: list[MicroPack], chains: list[list[Slice]], others: list[MicroPack]) -> list[MicroPack]:
    """Spread whole chains evenly among the independent MicroPacks (chains stay contiguous)."""
    blocks: list[list[MicroPack]] = []
    position = 0
    for chain in chains:
        blocks.append(chain_packs[position:position + len(chain)])
        position += len(chain)
    if not blocks:
        return others
    result: list[MicroPack] = []
    stride = len(others) / len(blocks)
    taken = 0
    for index, block in enumerate(blocks):
        until = int(round(stride * (index + 0.5)))
        result.extend(others[taken:until])
        taken = max(taken, until)
        result.extend(block)
    result.extend(others[taken:])
    return result


@dataclass
class MicroPackCosts:
    """Per-MicroPack times and bytes on a middle stage and on the last stage, and the backward
    sequence (computed once per packing, shared by every unit count the planner tries)."""

    forward: np.ndarray  # [2, n]: row 0 middle stages, row 1 last stage
    backward: np.ndarray
    held: np.ndarray  # bytes held from forward to backward: activations and the KV of continued slices
    tokens: np.ndarray
    backward_order: list[int]
    largest_recompute_bytes: float  # the transient a backward with recompute adds, at most

    @cached_property
    def in_backward_order(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(backward order as an array, and backward seconds, held bytes and tokens in that order):
        every candidate of the packing sums its backward units over them."""
        order = np.asarray(self.backward_order, dtype=np.int64)
        return order, self.backward[:, order], self.held[:, order], self.tokens[order]

    @classmethod
    def of(cls, micropacks: list[MicroPack], cost: CostModel, parallel: ParallelConfig) -> "MicroPackCosts":
        table = slice_table(micropacks)
        figures = pack_figures(micropacks, table)
        # Priced as the runtime runs them and the simulator prices them: padded for sequence
        # parallelism (unpadded, a plan could pass the budget by the padding's activations).
        tokens, pairs = parallel.padded_tokens(figures.tokens), figures.pairs

        def rows(pair: tuple) -> np.ndarray:  # [middle stage, last stage] x MicroPacks
            return np.array([value * np.ones_like(tokens) for value in pair])

        activation = rows(cost.activation_bytes_by_stage(tokens, pairs, parallel, prefix_tokens=figures.prefix,
                                                         masked_entries=figures.masked))
        held = activation + cost.kv_cache_bytes(figures.continued, parallel)
        recompute = cost.recompute_peak_bytes(tokens, pairs, parallel) * np.ones_like(tokens)
        return cls(rows(cost.stage_times(tokens, pairs, parallel, backward=False)),
                   rows(cost.stage_times(tokens, pairs, parallel, backward=True)), held, tokens,
                   backward_sequence(micropacks, table), float(recompute.max(initial=0.0)))

    def busiest_stage_s(self, pp: int) -> float:
        """Forward plus backward seconds of the busiest stage: no schedule of these MicroPacks
        on `pp` stages can be shorter."""
        middle = float(self.forward[0].sum() + self.backward[0].sum()) if pp > 1 else 0.0
        return max(middle, float(self.forward[1].sum() + self.backward[1].sum()))


def segment_units(
    micropacks: list[MicroPack], costs: MicroPackCosts, units: int, symmetric: bool
) -> tuple[list[list[int]], list[list[int]]]:
    """Forward units over the forward sequence; backward units over the backward sequence."""
    starts = _segment_starts(costs, units, symmetric)
    return starts.forward_units(len(micropacks)), starts.backward_units(costs.backward_order)


def _segment_starts(costs: MicroPackCosts, units: int, symmetric: bool) -> "UnitStarts":
    """Where `segment_units`' units start in their sequences."""
    order = costs.backward_order
    if symmetric:
        forward_bounds = segment_bounds(costs.forward[0] + costs.backward[0], units)
        # The backward sequence cut wherever it passes into another forward unit.
        unit_of = np.repeat(np.arange(len(forward_bounds) - 1), np.diff(forward_bounds))
        in_order = unit_of[costs.in_backward_order[0]]
        backward_bounds = [0] + (np.flatnonzero(np.diff(in_order)) + 1).tolist() + [len(order)] if order else [0]
    else:
        forward_bounds = segment_bounds(costs.forward[0], units)
        backward_bounds = segment_bounds(costs.in_backward_order[1][0], units)
    return UnitStarts(np.asarray(forward_bounds[:-1], dtype=np.int64), np.asarray(backward_bounds[:-1], dtype=np.int64))


class UnitStarts(NamedTuple):
    """Where each forward unit starts in the forward sequence (0..n-1) and each backward unit in
    the backward sequence: units are contiguous runs of them, so per-unit sums are one `reduceat`,
    and the unit lists are built only where a plan needs them."""

    forward: np.ndarray
    backward: np.ndarray

    @classmethod
    def of(cls, forward_units: list[list[int]], backward_units: list[list[int]]) -> "UnitStarts":
        def starts(units: list[list[int]]) -> np.ndarray:
            return np.cumsum([0] + [len(unit) for unit in units[:-1]])

        return cls(starts(forward_units), starts(backward_units))

    def forward_units(self, count: int) -> list[list[int]]:
        """The forward units of `count` MicroPacks: runs of the forward sequence 0 .. count - 1."""
        bounds = self.forward.tolist() + [count]
        return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]

    def backward_units(self, backward_order: list[int]) -> list[list[int]]:
        bounds = self.backward.tolist() + [len(backward_order)]
        return [backward_order[a:b] for a, b in zip(bounds, bounds[1:])]

    def needs(self, backward_order: np.ndarray) -> np.ndarray:
        """`last_forward_needed` of the units: for each backward unit, the last forward unit
        holding one of its MicroPacks (forward unit of MicroPack m: the last start at or before m)."""
        if not len(self.backward):
            return np.zeros(0, dtype=np.int64)
        unit_of = np.searchsorted(self.forward, backward_order, side="right") - 1
        return np.maximum.reduceat(unit_of, self.backward)


def stage_work(
    forward_units, backward_units, costs: MicroPackCosts, cost: CostModel, parallel: ParallelConfig,
    budget_bytes: float, starts: UnitStarts | None = None,
) -> StageWork:
    """Each stage's per-unit seconds, transfers and bytes. `starts`: the units' `UnitStarts`,
    where the caller has them."""
    pp = parallel.pp
    forward, backward = starts if starts is not None else UnitStarts.of(forward_units, backward_units)
    _, backward_seconds, backward_held, backward_tokens = costs.in_backward_order

    def per_stage(values: np.ndarray, starts: np.ndarray) -> list[list[float]]:
        middle, last = np.add.reduceat(values[0], starts).tolist(), np.add.reduceat(values[1], starts).tolist()
        return [last if stage == pp - 1 else middle for stage in range(pp)]

    def transfer(tokens: np.ndarray, starts: np.ndarray) -> list[float]:
        sums = np.add.reduceat(tokens, starts)
        return (cost.p2p_time(sums, parallel) + np.zeros_like(sums)).tolist()

    forward_bytes = per_stage(costs.held, forward)
    largest = [max(row) for row in forward_bytes]
    return StageWork(
        forward_time=per_stage(costs.forward, forward),
        backward_time=per_stage(backward_seconds, backward),
        forward_transfer=transfer(costs.tokens, forward),
        backward_transfer=transfer(backward_tokens, backward),
        forward_bytes=forward_bytes,
        backward_frees=per_stage(backward_held, backward),
        budget=[min((pp - stage) * largest[stage], budget_bytes) for stage in range(pp)],
    )


@dataclass
class UnitCandidate:
    """One (packing, unit count) choice, segmented, with its per-stage work and a quick estimate
    of its pipeline time (used to decide which candidates are worth a full replay). Its units are
    runs of the packing's sequences (`starts`); their lists are built for the few candidates that
    become orders or plans."""

    micropacks: list[MicroPack]
    costs: MicroPackCosts
    starts: UnitStarts
    work: StageWork
    estimate_s: float
    vpp: int = 1  # virtual stages per rank: its work is per chunk, its orders interleaved

    @classmethod
    def of(cls, micropacks: list[MicroPack], costs: MicroPackCosts, units: int, symmetric: bool,
           cost: CostModel, parallel: ParallelConfig, budget_bytes: float) -> "UnitCandidate":
        return cls.of_starts(micropacks, costs, _segment_starts(costs, units, symmetric), cost, parallel,
                             budget_bytes)

    @classmethod
    def paired(cls, micropacks: list[MicroPack], costs: MicroPackCosts, cost: CostModel, parallel: ParallelConfig,
               budget_bytes: float) -> "UnitCandidate":
        """Asymmetric units of different counts: forward units of two MicroPacks (consecutive
        ones: the packing makes their costs about even), backward units of one. Every stage then
        runs one forward unit per two backward units and stays twice as many MicroPacks ahead of
        the next as with one MicroPack per unit: slack for uneven MicroPacks and for a long
        document's chain run-up (benchmarks/results/asymmetric.md)."""
        starts = UnitStarts(np.arange(0, len(micropacks), 2, dtype=np.int64),
                            np.arange(len(costs.backward_order), dtype=np.int64))
        return cls.of_starts(micropacks, costs, starts, cost, parallel, budget_bytes)

    @classmethod
    def of_starts(cls, micropacks: list[MicroPack], costs: MicroPackCosts, starts: UnitStarts, cost: CostModel,
                  parallel: ParallelConfig, budget_bytes: float) -> "UnitCandidate":
        work = stage_work(None, None, costs, cost, parallel, budget_bytes, starts)
        return cls(micropacks, costs, starts, work, parallel.vpp * pipeline_estimate(work), parallel.vpp)

    @cached_property
    def forward_units(self) -> list[list[int]]:
        return self.starts.forward_units(len(self.micropacks))

    @cached_property
    def backward_units(self) -> list[list[int]]:
        return self.starts.backward_units(self.costs.backward_order)

    @property
    def unit_counts(self) -> tuple[int, int]:
        """(forward units, backward units)."""
        return len(self.starts.forward), len(self.starts.backward)

    def same_units(self, other: "UnitCandidate") -> bool:
        """Whether `other`, a candidate of the same packing, has the same units."""
        return (np.array_equal(self.starts.forward, other.starts.forward)
                and np.array_equal(self.starts.backward, other.starts.backward))

    @property
    def lower_bound_s(self) -> float:
        """No order of these units runs faster: on every stage, its work, after the first forward
        unit has passed the stages before it and followed by the last backward unit's way back
        through them (every stage runs the backward units in sequence order)."""
        work, bound = self.work, 0.0
        fill = drain = 0.0
        totals = work.stage_totals
        middle = totals[0][0] + totals[0][1]
        for stage, (forward, backward, _, _) in enumerate(totals):
            # a rank runs its vpp chunks: vpp - 1 middle ones and this stage's (per-chunk times)
            busy = (self.vpp - 1) * middle + forward + backward
            bound = max(bound, fill + busy + drain)
            fill += work.forward_time[stage][0] + work.forward_transfer[0]
            drain += work.backward_time[stage][-1] + work.backward_transfer[-1]
        return bound

    @cached_property
    def needs(self) -> np.ndarray:
        """The last forward unit each backward unit needs (`last_forward_needed`): the schedules
        of every leaner level the search tries on this candidate share it."""
        return self.starts.needs(self.costs.in_backward_order[0])

    @property
    def warmup_bytes(self) -> float:
        """A lower bound of its peak memory: 1F1B runs at least pp forward units on stage 0 before
        the first backward frees anything."""
        first = self.work.forward_bytes[0]
        return float(sum(first[:len(self.work.forward_bytes)]))

    def order(self, dp_ranks: list[int], budget_bytes: float | None = None, schedules: str = "megatron"
              ) -> OrderedCandidate | InterleavedCandidate:
        """Stage orders, the makespan of their replay (no DP reduction) and their peak memory.

        Running a chain's forwards ahead, one per backward, keeps the pipeline full but holds them
        while the previous chain drains. Where that passes `budget_bytes`, the run-up is shortened
        (pp units, then pp / 2) and the first orders that fit are kept; the leanest (a burst right
        before the chain's backward) are returned when none does. Interleaved: Megatron's
        schedules, or `schedules` of `LEANER_SCHEDULES` (`InterleavedCandidate.of`)."""
        if self.vpp > 1:
            return InterleavedCandidate.of(self, dp_ranks, budget_bytes, schedules)
        warmups = warmup_counts(self.work, len(self.work.forward_time))
        pipelined = self._ordered(dp_ranks, warmups, None)
        if budget_bytes is None or pipelined.peak_activation_bytes <= budget_bytes:
            return pipelined
        leanest = self._ordered(dp_ranks, warmups, 0)
        if leanest.peak_activation_bytes > budget_bytes:
            return leanest
        pp = len(self.work.forward_time)
        for lead in sorted({pp, pp // 2} - {0}, reverse=True):
            shortened = self._ordered(dp_ranks, warmups, lead)
            if shortened.peak_activation_bytes <= budget_bytes:
                return shortened
        return leanest

    def _ordered(self, dp_ranks: list[int], warmups: list[int], chain_lead: int | None) -> "OrderedCandidate":
        forward_count, backward_count = self.unit_counts  # the targets need the counts only
        targets = forward_targets(range(forward_count), range(backward_count), warmups, chain_lead, self.needs)
        return OrderedCandidate(self, list(dp_ranks), targets, max(peaks_of_targets(targets, self.work)))


@dataclass
class OrderedCandidate:
    """A candidate with its forward targets fixed; its orders and their replay are built on first
    use, since the search drops most candidates on their peak memory alone."""

    candidate: UnitCandidate
    dp_ranks: list[int]
    targets: np.ndarray  # `forward_targets`: the stage orders in short
    peak_activation_bytes: float  # the most any stage holds at once (activations and KV of continued slices)

    @property
    def work(self) -> StageWork:
        return self.candidate.work

    @cached_property
    def replica(self) -> ReplicaPlan:
        candidate = self.candidate
        return ReplicaPlan(candidate.micropacks, candidate.forward_units, candidate.backward_units,
                           orders_of_targets(self.targets), self.dp_ranks)

    @cached_property
    def makespan_s(self) -> float:
        """The replay of its orders (no DP reduction), computed on first use: orders that do not
        fit memory are dropped without one (replays were ~30% of a 150B pp16 layout search's
        profile), and replayed from the targets, without building the orders, which only the
        chosen candidate needs."""
        return replay_targets(self.targets, self.work)


@dataclass
class InterleavedCandidate:
    """A candidate under interleaved 1F1B (`interleaved_schedules`), with the same interface as
    `OrderedCandidate`: its orders, their peak memory and their replay (chunk-aware)."""

    candidate: UnitCandidate
    dp_ranks: list[int]
    schedule: InterleavedSchedule
    peak_activation_bytes: float
    walked_s: float | None = None  # its makespan, where `of` walked it with its times already

    @classmethod
    def of(cls, candidate: UnitCandidate, dp_ranks: list[int], budget_bytes: float | None = None,
           which: str = "megatron") -> "InterleavedCandidate":
        """The first schedule within `budget_bytes` that runs through, of Megatron's or (`which`)
        of one of `LEANER_SCHEDULES` (`interleaved_schedules`). Each is measured before it is
        walked, so most candidates cost no walk: one over budget is passed by, with the rest of its
        grouping (they never hold less); where all are, the leanest is returned as it is (the
        search drops it for memory). One within budget is walked with its times: the search then
        needs its makespan, and the walk runs through with times exactly where it does without."""
        pp = len(candidate.work.forward_time)
        leanest: tuple[InterleavedSchedule, float] | None = None
        over_budget = set()  # groupings whose first schedule is over budget
        forward_count, backward_count = candidate.unit_counts  # the schedules need the counts only
        for schedule in interleaved_schedules(range(forward_count), range(backward_count), pp, candidate.vpp,
                                              which=which, needs=candidate.needs):
            if schedule.grouping in over_budget:
                continue
            peak = schedule.peak_bytes(candidate.work)
            if budget_bytes is not None and peak > budget_bytes:
                over_budget.add(schedule.grouping)
                if leanest is None or peak < leanest[1]:
                    leanest = (schedule, peak)
            else:
                walked = schedule.walked_s(candidate.work)
                if walked is not None:
                    return cls(candidate, list(dp_ranks), schedule, peak, walked)
        if leanest is not None:
            return cls(candidate, list(dp_ranks), *leanest)
        raise no_interleaved_order(forward_count, backward_count, pp, candidate.vpp)

    @cached_property
    def replica(self) -> ReplicaPlan:
        candidate = self.candidate
        return ReplicaPlan(candidate.micropacks, candidate.forward_units, candidate.backward_units,
                           self.schedule.orders(), self.dp_ranks)

    @cached_property
    def makespan_s(self) -> float:
        return self.walked_s if self.walked_s is not None else self.schedule.makespan_s(self.candidate.work)


def pipeline_estimate(work: StageWork) -> float:
    """1F1B time without a replay: the busiest stage's work, plus the fill and drain of the other
    stages, each paying its largest forward and backward unit (uneven units stall the pipe)."""
    totals = work.stage_totals
    busiest = max(forward + backward for forward, backward, _, _ in totals)
    fill = sum(largest_forward + largest_backward for _, _, largest_forward, largest_backward in totals[:-1])
    return busiest + fill


__all__ = [
    "PackOptions", "cut_document", "pack_micropacks", "segment_units", "MicroPackCosts",
    "UnitCandidate", "OrderedCandidate", "InterleavedCandidate", "pipeline_estimate",
    "causal_pairs",
]
