"""Phase 2's search for one replica (or merge group): MicroPack sizes from a `SizeLadder`, two
packings per size, a few unit counts per packing; the shortest replayed schedule that fits
memory wins."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from functools import cached_property

from ...config import PlannerTunables, SlimPackConfig
from ...costmodel import CostModel, format_bytes
from ...plan import MicroPack, PlanError, ReplicaPlan, Sample
from ...specs import ParallelConfig
from ..orders import LEANER_SCHEDULES
from ..outcomes import DoesNotFit, ReplicaOutcome
from ..work import WorkRates
from .ladder import SizeLadder
from .memory import activation_budget
from .pack_phase import (
    InterleavedCandidate,
    MicroPackCosts,
    OrderedCandidate,
    PackOptions,
    SortedSamples,
    UnitCandidate,
    pack_micropacks,
)


def unit_candidates(pp: int, micropacks: int) -> list[int]:
    """Unit counts to try: a few multiples of pp, and one unit per MicroPack."""
    if pp == 1:  # no pipeline to fill: the smallest units hold the least memory
        return [micropacks]
    return sorted({min(k * pp, micropacks) for k in (2, 4, 8)} | {micropacks})


def packing_bound_s(ordered: SortedSamples, micropack_tokens: int, cost: CostModel,
                    parallel: ParallelConfig) -> float:
    """A lower bound, before packing, of the last stage's work with MicroPacks of at most
    `micropack_tokens`: all tokens in full MicroPacks (`CostModel.pass_time_bound`; slicing keeps
    a document's attention pairs)."""
    tokens = float(ordered.lengths.sum())
    if tokens == 0:
        return 0.0
    pairs = float((ordered.lengths * (ordered.lengths + 1) / 2).sum())
    return cost.pass_time_bound(tokens, pairs, parallel, micropack_tokens)


def plan_replica(
    samples: list[Sample], cost: CostModel, parallel: ParallelConfig, config: SlimPackConfig,
    rates: WorkRates, token_cap: int, dp_ranks: list[int], symmetric: bool, ladder: SizeLadder | None = None,
    budget: float | None = None, first_fit: bool = False, leaner_level: int = len(LEANER_SCHEDULES),
) -> tuple[ReplicaPlan, ReplicaOutcome]:
    """The shortest schedule of `samples` that fits the activation `budget` (default:
    `activation_budget` of `parallel`), over the MicroPack sizes of `ladder` (default: the ladder
    below `token_cap`): every size, bisecting where one does not fit above one that does, or with
    `first_fit` up to the first size that fits (the replicas after the heaviest start from its size).
    Interleaved candidates that Megatron's schedules do not fit also try the first `leaner_level`
    of `LEANER_SCHEDULES` (`ReplicaSearch.consider`); the outcome says the lowest level at which
    some schedule fit (0: Megatron's), i.e. the level the replica needs.
    Raises DoesNotFit with the leanest schedule seen."""
    if not samples:  # a rank whose only work is its share of a merge group
        idle = ReplicaPlan([], [], [], [[] for _ in range(parallel.pp)], list(dp_ranks))
        return idle, ReplicaOutcome(tuple(dp_ranks), 0.0)
    return replica_search(samples, cost, parallel, config, rates, token_cap, dp_ranks, symmetric, ladder, budget,
                          first_fit, leaner_level).finish(samples)


def replica_search(
    samples: list[Sample], cost: CostModel, parallel: ParallelConfig, config: SlimPackConfig,
    rates: WorkRates, token_cap: int, dp_ranks: list[int], symmetric: bool, ladder: SizeLadder | None = None,
    budget: float | None = None, first_fit: bool = False, leaner_level: int = len(LEANER_SCHEDULES),
    sizes_without_fit: "SizesWithoutFit | None" = None,
) -> "ReplicaSearch":
    """`plan_replica`'s search of non-empty `samples`, not yet run: `ReplicaSearch.fits` runs it
    until a schedule fits, `ReplicaSearch.finish` to its end. `sizes_without_fit`: what earlier
    searches of the same replica found of single sizes (read and added to)."""
    search = ReplicaSearch(SortedSamples(samples, rates), rates, cost, parallel, symmetric, dp_ranks,
                           activation_budget(cost, parallel) if budget is None else budget, config.tunables,
                           leaner_level, sizes_without_fit)
    return search.follow(ladder or SizeLadder.below_cap(token_cap, config), first_fit)


Leanest = tuple[float, int]  # (peak bytes, MicroPack tokens) of the leanest schedule seen


class SizesWithoutFit:
    """MicroPack sizes at which one replica's search found no schedule, by size: the leaner
    level it tried (nothing fits at the levels below either) and the leanest need it saw.
    Until a schedule fits, a size's try depends on the size alone (nothing prunes), so a later
    search of the same replica (another first-fit ladder, a lower leaner level) skips it and
    only takes its leanest need (at llama-7b 256K tp1 pp2 vpp4 dp64 the first planning at level
    1 re-walks 59 failing replicas from another ladder)."""

    def __init__(self):
        self._by_size: dict[int, tuple[int, Leanest | None]] = {}

    def known(self, micropack_tokens: int, leaner_level: int) -> tuple[bool, Leanest | None]:
        """Whether nothing fits at this size and level, and the leanest need seen there."""
        entry = self._by_size.get(micropack_tokens)
        if entry is None or entry[0] < leaner_level:
            return False, None
        return True, entry[1]

    def record(self, micropack_tokens: int, leaner_level: int, leanest: Leanest | None) -> None:
        if micropack_tokens not in self._by_size or self._by_size[micropack_tokens][0] < leaner_level:
            self._by_size[micropack_tokens] = (leaner_level, leanest)


class ReplicaSearch:
    """One replica's search over MicroPack sizes: the best schedule found so far, and the leanest
    need seen (for the error)."""

    def __init__(self, ordered: SortedSamples, rates: WorkRates, cost: CostModel, parallel: ParallelConfig,
                 symmetric: bool, dp_ranks: list[int], budget: float, tunables: PlannerTunables = PlannerTunables(),
                 leaner_level: int = len(LEANER_SCHEDULES), sizes_without_fit: SizesWithoutFit | None = None):
        self.ordered, self.rates, self.tunables = ordered, rates, tunables
        self.leaner_level = leaner_level
        self.sizes_without_fit = sizes_without_fit or SizesWithoutFit()
        self.fitting_levels: set[int] = set()  # the leaner levels (0: Megatron's) of schedules that fit
        self.cost, self.parallel, self.symmetric = cost, parallel, symmetric
        self.dp_ranks, self.budget = dp_ranks, budget
        # The fastest fitting schedule so far: its candidate (orders built only for the last one,
        # `finish`: the best improves many times in a search of thousands of MicroPacks) and outcome.
        self.best: tuple[OrderedCandidate | InterleavedCandidate, ReplicaOutcome] | None = None
        self.leanest: Leanest | None = None  # the smallest need seen
        self._leanest_of_size: Leanest | None = None  # the smallest need seen at the size being tried
        self._walk: Iterator[int] = iter(())  # the sizes left to try (`follow`)

    def follow(self, ladder: SizeLadder, first_fit: bool = False) -> "ReplicaSearch":
        """Set the walk over `ladder`'s sizes that `fits` and `finish` run (`plan_replica`)."""
        self._walk = ladder.walk(self.try_size, first_fit)
        return self

    def fits(self) -> bool:
        """Walk until a schedule fits (or the sizes run out); whether one does. The walk so far
        is the full search's first steps (it prunes by the best schedule only once one fits), so
        it fits exactly where the full search does, and `finish` goes on from here."""
        while self.best is None and next(self._walk, None) is not None:
            pass
        return self.best is not None

    def finish(self, samples: list[Sample]) -> tuple[ReplicaPlan, ReplicaOutcome]:
        """Walk to the end: the best schedule of `samples` (this search's), or DoesNotFit."""
        for _ in self._walk:
            pass
        if self.best is None:
            raise self.does_not_fit(samples)
        chosen, outcome = self.best
        return chosen.replica, replace(outcome, leaner_level=min(self.fitting_levels))

    @property
    def best_makespan_s(self) -> float | None:
        return None if self.best is None else self.best[1].makespan_s

    @cached_property
    def lengths(self) -> dict[int, int]:
        """Document lengths by sample id, built on first use: only a pipelined packing that
        sliced a document looks one up (`try_size`)."""
        return {sample.sample_id: sample.length for sample in self.ordered.samples}

    def try_size(self, micropack_tokens: int) -> bool:
        """Pack to MicroPacks of `micropack_tokens` and consider the packing; True when a schedule
        fits memory or none can beat the best one (then neither can a smaller size's).

        With a pipeline, MicroPacks are first packed to even costs, which also slices documents
        that fit one; a chain holds all its MicroPacks until its backward, so where that packing
        does not fit and it sliced such a document, the plain packing is tried too (13B tp2 pp2
        cp4 runs whole documents in 64K MicroPacks more than 5% faster than half-size ones)."""
        if self.best is not None and packing_bound_s(self.ordered, micropack_tokens, self.cost,
                                                     self.parallel) >= self.best[1].makespan_s:
            return True
        if self.best is not None:
            return self._try_packings(micropack_tokens)
        known, leanest = self.sizes_without_fit.known(micropack_tokens, self.leaner_level)
        # Its replays may all have been skipped for a need seen at an earlier size (leanest None):
        # tried again where this search has seen none yet, so that a failure names one.
        if known and (leanest is not None or self.leanest is not None):
            self._note_leanest(leanest)
            return False
        self._leanest_of_size = None
        fits = self._try_packings(micropack_tokens)
        if self.best is None:
            self.sizes_without_fit.record(micropack_tokens, self.leaner_level, self._leanest_of_size)
        return fits

    def _try_packings(self, micropack_tokens: int) -> bool:
        even = self.parallel.pp > 1
        micropacks = self._pack(micropack_tokens, even_costs=even)
        if self.consider(micropacks, micropack_tokens):
            return True
        if not (even and self._sliced_a_whole_fitting_document(micropacks, micropack_tokens)):
            return False
        return self.consider(self._pack(micropack_tokens, even_costs=False), micropack_tokens)

    def _pack(self, micropack_tokens: int, even_costs: bool) -> list[MicroPack]:
        options = PackOptions(micropack_tokens, micropack_tokens, even_costs=even_costs, tunables=self.tunables)
        return pack_micropacks(self.ordered, options, self.rates)

    def _sliced_a_whole_fitting_document(self, micropacks: list[MicroPack], micropack_tokens: int) -> bool:
        # A slice that starts past its document's first token is a chain's piece, which `pack_micropacks`
        # puts first in its MicroPack (the documents topping it up are whole).
        return any(pack.slices[0].start > 0 and self.lengths[pack.slices[0].sample_id] <= micropack_tokens
                   for pack in micropacks)

    def consider(self, micropacks: list[MicroPack], micropack_tokens: int) -> bool:
        """Segment, order and replay the most promising unit counts of one packing; True when a
        schedule of it fits memory (or it cannot beat the best one anyway). Large units hold many
        MicroPacks in flight (1F1B keeps pp - s forward units per stage), so few units can be
        fast on paper and not fit: candidates are replayed best estimate first, those that fit
        only, `replayed_candidates` at most."""
        costs = MicroPackCosts.of(micropacks, self.cost, self.parallel)
        if self.best is not None and costs.busiest_stage_s(self.parallel.pp) >= self.best[1].makespan_s:
            return True
        # Asymmetric planning also tries the symmetric segmentation of each unit count: its search
        # is then a superset of slimpack-sym's on these MicroPacks, never worse for lack of a candidate.
        kinds = (True,) if self.symmetric else (False, True)
        candidates: list[tuple[UnitCandidate, int]] = []
        for units in unit_candidates(self.parallel.pp, len(micropacks)):
            for symmetric in kinds:
                candidate = UnitCandidate.of(micropacks, costs, units, symmetric, self.cost, self.parallel, self.budget)
                if not any(c.same_units(candidate) for c, _ in candidates):
                    candidates.append((candidate, units))
        candidates.sort(key=lambda entry: entry[0].estimate_s)
        replayed, not_fitting = 0, []
        for candidate, units in candidates:
            if replayed == self.tunables.replayed_candidates:
                break
            fits = self._replay(candidate, units, costs, micropack_tokens)
            replayed += fits
            if not fits:
                not_fitting.append((candidate, units))
        if not self.symmetric and self.parallel.pp > 1 and len(micropacks) > 1:
            # Forward units of two MicroPacks, backward units of one (`UnitCandidate.paired`):
            # where memory keeps one-MicroPack units from running a long document's chain ahead,
            # the pairs' extra lead can (benchmarks/results/asymmetric.md). Tried on top of the
            # candidates above, and only where its lower bound beats the best schedule so far.
            paired = UnitCandidate.paired(micropacks, costs, self.cost, self.parallel, self.budget)
            if self._can_win(paired):
                fits = self._replay(paired, paired.unit_counts[0], costs, micropack_tokens)
                replayed += fits
                if not fits:
                    not_fitting.append((paired, paired.unit_counts[0]))
        if self.parallel.vpp > 1:
            # Megatron's interleaved schedules hold more chunks in flight than the cap was sized
            # for where the unit count is no multiple of pp, and stack a long document's chain on
            # every rank's warm-up lead; the candidates they do not fit get the leaner schedules,
            # level by level (`LEANER_SCHEDULES`). What these find is kept, but does not count as
            # this size fitting: their bubble can make a larger size slower than the next smaller
            # one, so the ladder walks the sizes as it would without them.
            for level in range(1, self.leaner_level + 1):
                not_fitting = [(candidate, units) for candidate, units in not_fitting
                               if self._can_win(candidate)
                               and not self._replay(candidate, units, costs, micropack_tokens, level)]
        return replayed > 0

    def _can_win(self, candidate: UnitCandidate) -> bool:
        """Whether `candidate` may beat the best schedule so far (its pipeline's lower bound)."""
        return self.best is None or candidate.lower_bound_s < self.best[1].makespan_s

    def _replay(self, candidate: UnitCandidate, units: int, costs: MicroPackCosts, micropack_tokens: int,
                leaner_level: int = 0) -> bool:
        """Order and replay one candidate (interleaved: in Megatron's schedules, or at
        `leaner_level` > 0 in that level's), keeping it where it is the fastest that fits memory;
        True when it fits."""
        if candidate.warmup_bytes + costs.largest_recompute_bytes > self.budget and self.leanest is not None:
            return False  # its stage 0 cannot fit even before the first backward: not worth ordering
        try:
            schedules = LEANER_SCHEDULES[leaner_level - 1] if leaner_level else "megatron"
            result = candidate.order(self.dp_ranks, self.budget - costs.largest_recompute_bytes, schedules)
        except PlanError:  # interleaved: no order of these units runs without a circular wait
            return False
        peak = result.peak_activation_bytes + costs.largest_recompute_bytes
        self._note_leanest((peak, micropack_tokens))
        if peak > self.budget:
            return False
        self.fitting_levels.add(leaner_level)
        if self.best is None or result.makespan_s < self.best[1].makespan_s:
            outcome = ReplicaOutcome(tuple(self.dp_ranks), float(result.makespan_s), micropack_tokens, units)
            self.best = (result, outcome)
        return True

    def _note_leanest(self, need: Leanest | None) -> None:
        if need is None:
            return
        if self.leanest is None or need[0] < self.leanest[0]:
            self.leanest = need
        if self._leanest_of_size is None or need[0] < self._leanest_of_size[0]:
            self._leanest_of_size = need

    def does_not_fit(self, samples: list[Sample]) -> DoesNotFit:
        """The failure of a search that found no schedule within the budget, with its leanest one."""
        assert self.leanest is not None
        peak, micropack_tokens = self.leanest
        static = self.cost.memory_budget_bytes() - self.budget  # what the budget leaves out
        return DoesNotFit(
            f"memory: replica {self.dp_ranks} does not fit: its leanest schedule holds {format_bytes(peak)} of "
            f"activations and KV cache on a pipeline stage (MicroPacks of {micropack_tokens} tokens) with "
            f"{self.parallel.describe()}, but only {format_bytes(max(self.budget, 0.0))} is left after weights, "
            f"gradients and optimizer state on "
            f"{self.cost.hardware.name}; use activation recompute, more tensor or pipeline parallelism, "
            f"a smaller MicroPack size (max_micropack_tokens) or a shorter context",
            sample_ids=[sample.sample_id for sample in samples], group_ranks=len(self.dp_ranks),
            bytes_needed=static + peak, bytes_available=static + self.budget)


__all__ = ["unit_candidates", "packing_bound_s", "plan_replica", "replica_search", "SizesWithoutFit",
           "ReplicaSearch"]
