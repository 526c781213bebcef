"""SlimPack's search over one global batch: which plans are tried, in which order, and which wins.

`SlimPackSearch.attempts()` is the one place the fallback order is written. Each attempt is a base
merge (ranks sharing every MicroPack) and a way of sizing the DP-Merge groups of long documents;
planning an attempt runs phase 1 (`assign_to_replicas`) and every replica's search
(`replica.plan_replica`), growing the groups of replicas that do not fit memory.
"""
from __future__ import annotations

import copy
import functools
import itertools
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterator, cast

import numpy as np

from ...config import SlimPackConfig
from ...costmodel import CostModel
from ...plan import Plan, PlanError, ReplicaPlan, Sample, samples_of
from ...specs import ParallelConfig
from ..orders import LEANER_SCHEDULES
from ..outcomes import DoesNotFit, PlannedBatch, ReplicaOutcome, ReplicasDoNotFit, kept
from ..work import WorkRates
from .dp_phase import Assignment, MergeGroup, assign_to_replicas
from .ladder import SizeLadder
from .memory import activation_budget, auto_token_cap, largest_merged_micropack, merge_group_sizes
from .replica import ReplicaSearch, SizesWithoutFit, plan_replica, replica_search


class Sizing(Enum):
    """How the DP-Merge groups that long documents need for memory are sized."""

    # Each document in the fewest ranks that hold it next to one of the ladder's MicroPack sizes
    # (its replica's MicroPacks may then shrink to fit next to its chain); the cap stays.
    SMALLEST_GROUPS = "smallest-groups"
    # The largest MicroPack next to which every document fits some group, as the cap (the
    # groups may then be larger and idle their ranks on the document).
    LARGEST_MICROPACKS = "largest-micropacks"


@dataclass(frozen=True)
class Attempt:
    """One way to plan the batch: every MicroPack shared by `base_merge` ranks (planned as that much
    more context parallelism over dp / base_merge replicas), groups sized by `sizing`."""

    base_merge: int
    sizing: Sizing


@dataclass(frozen=True)
class GroupSizing:
    """A sizing's result: the MicroPack cap and each document's merge group (ranks)."""

    token_cap: int
    group_ranks: np.ndarray

    def same_as(self, other: "GroupSizing") -> bool:
        return self.token_cap == other.token_cap and np.array_equal(self.group_ranks, other.group_ranks)


class SlimPackSearch:
    """SlimPack's plan of one global batch (`plan`), by trying `attempts()` in order."""

    def __init__(self, lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig, *,
                 symmetric: bool = False, dp_merge: bool | None = None):
        self.lengths, self.parallel, self.cost, self.config = lengths, parallel, cost, config
        self.symmetric = symmetric
        self.samples = samples_of(lengths)  # shared by every planning (~10^5 documents at 256K)
        self.known = KnownSearches()
        self.use_merge = config.dp_merge if dp_merge is None else dp_merge
        base = config.base_merge
        if base > 1 and (not self.use_merge or parallel.dp % base):
            raise PlanError(f"base_merge {base} needs DP-Merge and a data-parallel size divisible by it; got dp "
                            f"{parallel.dp}{'' if self.use_merge else ' with DP-Merge off'}")

    def attempts(self) -> Iterator[Attempt]:
        """Every attempt, in the order tried. All sizings of one base merge are planned and the
        fastest predicted plan kept; the next base merge is tried only where none of them fits
        memory (`DoesNotFit`). Within an attempt, replicas that do not fit get larger groups
        (`plan_sizing`), each replica walks its `SizeLadder` (`replica.plan_replica`) and each
        size tries the even-cost packing, then the plain one (`ReplicaSearch.try_size`)."""
        base_merge = self.config.base_merge
        while True:
            # Long documents in the fewest ranks; their replicas' MicroPacks shrink to fit next to
            # their chains. Neither sizing wins everywhere: at 7B this one does.
            yield Attempt(base_merge, Sizing.SMALLEST_GROUPS)
            # The largest MicroPack a merge group allows (bisected in size_granule steps): at 70B
            # tp4 pp8 dp4 128K, 1094 s against 1386 s with the smallest groups.
            # A slice size the user set is kept: no second sizing.
            if not self.config.slice_tokens:
                yield Attempt(base_merge, Sizing.LARGEST_MICROPACKS)
            # Nothing fits: every MicroPack shared by twice the ranks, each holding half of it.
            base_merge *= 2
            if not self.use_merge or self.parallel.dp % base_merge:
                return

    def plan(self) -> Plan:
        """The fastest plan of the first base merge that fits; else the first failure."""
        first_error: PlanError | None = None
        for base_merge, attempts in itertools.groupby(self.attempts(), key=lambda attempt: attempt.base_merge):
            try:
                best = self.best_at(base_merge, [attempt.sizing for attempt in attempts])
                return best.plan if base_merge == 1 else shared_by_groups(best.plan, self.parallel, base_merge)
            except PlanError as error:
                first_error = first_error or kept(error)
                if not isinstance(error, DoesNotFit):
                    break
        raise cast(PlanError, first_error) from None  # attempts() yields one at least: it failed

    def view(self, base_merge: int) -> ParallelConfig:
        """The layout a base merge is planned on: dp / base_merge replicas, base_merge-fold more CP."""
        return self.parallel.with_(dp=self.parallel.dp // base_merge, cp=self.parallel.cp * base_merge)

    def best_at(self, base_merge: int, sizings: list[Sizing]) -> PlannedBatch:
        """Every sizing planned on the base merge's view (a sizing equal to an earlier one is not
        planned again); the fastest prediction wins, the first on a tie. A sizing that fails is
        dropped; where all fail, the first failure is raised.

        A sizing in which a replica fit only with a schedule leaner than Megatron's interleaved
        ones (`LEANER_SCHEDULES`) is planned again with the levels below the one it needed: with it
        the replica holds its long documents slowly, where without it fails and their merge groups
        grow, which can be faster (first batches: llama-150b 256K tp4 pp8 vpp6 2898.3 s with
        per-rank targets, 2852.6 s without; llama-70b 128K tp4 pp8 vpp5 1134.1 s with no leaner
        schedule, 1110.7 s with the groupings)."""
        view = self.view(base_merge)
        token_cap = auto_token_cap(self.cost, view, self.config)
        planned: list[PlannedBatch] = []
        seen: list[GroupSizing] = []
        first_error: PlanError | None = None
        for sizing in sizings:
            try:
                groups = self.size_groups(sizing, view, token_cap)
            except PlanError as error:
                first_error = first_error or kept(error)
                continue
            if any(groups.same_as(other) for other in seen):
                continue
            seen.append(groups)
            self.known.forget_fits()  # another sizing's replicas rarely recur; its fits would only hold memory
            level = len(LEANER_SCHEDULES)
            while level >= 0:
                try:
                    batch = self.plan_sizing(view, groups, level, cut_short=sizing is Sizing.SMALLEST_GROUPS
                                             and view.pp > 1)
                except PlanError as error:  # a replica that fails at a level fails at the ones below
                    first_error = first_error or kept(error)
                    break
                planned.append(batch)
                level = batch.leaner_level_needed - 1  # -1: no replica needed one, planned as without them
        if not planned:
            raise cast(PlanError, first_error)  # each sizing was planned or failed, so one failed
        return min(planned, key=lambda batch: batch.predicted_iteration_s)

    def size_groups(self, sizing: Sizing, view: ParallelConfig, token_cap: int) -> GroupSizing:
        """The MicroPack cap and merge groups of one sizing on `view` (DoesNotFit: none)."""
        ladder = SizeLadder.below_cap(token_cap, self.config)
        if sizing is Sizing.SMALLEST_GROUPS:
            groups = merge_group_sizes(self.lengths, self.cost, view, list(ladder.micropack_tokens), self.use_merge)
            return GroupSizing(token_cap, groups)
        return GroupSizing(*largest_merged_micropack(self.lengths, self.cost, view, ladder, self.use_merge))

    def plan_sizing(self, view: ParallelConfig, sizing: GroupSizing, leaner_level: int = len(LEANER_SCHEDULES),
                    cut_short: bool = False) -> PlannedBatch:
        """Plan with the sizing's groups. They come from a per-document estimate; where replicas'
        real schedules still do not fit, their sliced documents get twice the group and the batch
        is planned again (all the replicas that failed at once: replicas are alike, so one at a
        time took a planning each: 8 plannings instead of 10).

        `cut_short` (the smallest groups, with a pipeline): the first planning stops at its
        heaviest replica where that does not fit, and every sliced document gets twice its group,
        as if every replica had failed. The smallest groups' estimate leaves out what a pipeline
        holds besides a document's chain: on every pipelined layout of llama-7b and llama-13b at
        256K measured, the first planning found no schedule for 60-100% of its replicas and merge
        groups, at 73-93% of the layout's planning time, and each layout keeps the same plan
        from here (benchmarks/results/sizings.md)."""
        group_ranks = sizing.group_ranks
        smallest, largest_group = self.growth_limits(view, sizing.token_cap)
        while True:
            try:
                return self.plan_groups(view, sizing.token_cap, group_ranks, leaner_level, cut_short)
            except PlanningCutShort:
                group_ranks = sliced_grown(group_ranks, self.lengths, smallest, largest_group)
            except ReplicasDoNotFit as error:
                for failure in error.failures:
                    grown = grown_groups(failure, group_ranks, self.lengths, smallest, largest_group)
                    if grown is None:
                        raise failure from None
                    group_ranks = grown
            cut_short = False

    def growth_limits(self, view: ParallelConfig, token_cap: int) -> tuple[int, int]:
        """(the ladder's smallest MicroPack, the largest merge group) that bound a failed
        replica's growth on `view` (`grown_groups`)."""
        return SizeLadder.below_cap(token_cap, self.config).smallest, view.dp if self.use_merge else 1

    def plan_groups(self, view: ParallelConfig, token_cap: int, group_ranks: np.ndarray,
                    leaner_level: int = len(LEANER_SCHEDULES), cut_short: bool = False) -> PlannedBatch:
        """One planning of the batch: phase 1, then every merge group and replica, with leaner
        interleaved schedules up to `leaner_level`. Raises ReplicasDoNotFit with every replica that
        did not fit; with `cut_short`, PlanningCutShort where the heaviest replica does not."""
        return _BatchPlanning(self, view, token_cap, group_ranks, leaner_level, cut_short).run()


class PlanningCutShort(ReplicasDoNotFit):
    """A planning stopped at its heaviest replica, which did not fit (`SlimPackSearch.plan_sizing`)."""


def sliced_grown(group_ranks: np.ndarray, lengths: list[int], smallest_micropack: int,
                 largest_group: int) -> np.ndarray:
    """Twice the group of every document sliced at the smallest MicroPack of its group, where the
    group stays a divisor of `largest_group`: `grown_groups` applied as if every replica failed."""
    doubled = 2 * group_ranks
    sliced = np.asarray(lengths) > smallest_micropack * group_ranks
    return np.where(sliced & (doubled <= largest_group) & (largest_group % doubled == 0), doubled, group_ranks)


def grown_groups(failure: DoesNotFit, group_ranks: np.ndarray, lengths: list[int], smallest_micropack: int,
                 largest_group: int) -> np.ndarray | None:
    """Twice the group of the failed replica's sliced documents; None where it cannot grow
    (`can_grow`)."""
    if not can_grow(failure, lengths, smallest_micropack, largest_group):
        return None
    ranks = 2 * failure.group_ranks
    grown = group_ranks.copy()
    for index in failure.sample_ids:
        if lengths[index] > smallest_micropack * failure.group_ranks:
            grown[index] = max(grown[index], ranks)
    return grown


def can_grow(failure: DoesNotFit, lengths: list[int], smallest_micropack: int, largest_group: int) -> bool:
    """Whether the failed replica's sliced documents can get twice their group: not where that
    group would exceed `largest_group` ranks (without DP-Merge: 1), nor where none of them is
    sliced: then its MicroPacks alone, at the ladder's smallest size, do not fit, and taking
    documents away one planning at a time only moved others into their place (documents kept
    whole, an interleaved layout: 600+ plannings without an end)."""
    ranks = 2 * failure.group_ranks
    return (ranks <= largest_group and largest_group % ranks == 0
            and any(lengths[i] > smallest_micropack * failure.group_ranks for i in failure.sample_ids))


class _BatchPlanning:
    """One planning of the batch on a view, with a MicroPack cap and merge group sizes. Every
    replica is planned even after one fails, so all failures are grown at once; a failure that
    cannot grow ends it (`_stop_if_final`)."""

    def __init__(self, search: SlimPackSearch, view: ParallelConfig, token_cap: int, group_ranks: np.ndarray,
                 leaner_level: int = len(LEANER_SCHEDULES), cut_short: bool = False):
        self.search, self.view, self.token_cap, self.group_ranks = search, view, token_cap, group_ranks
        self.leaner_level, self.cut_short = leaner_level, cut_short
        self.growth_limits = search.growth_limits(view, token_cap)
        self.config, self.cost = search.config, search.cost
        self.samples = search.samples
        self.rates = WorkRates.from_cost(self.cost, view, token_cap)
        self.failures: list[DoesNotFit] = []

    def run(self) -> PlannedBatch:
        assignment = self._assign()
        # Every merge group's search runs only until a schedule fits, then the replicas of their
        # own: where any of them does not fit, this planning is discarded (its groups grow) and
        # the rest of the fitting groups' searches would be wasted (at 256K most plannings of an
        # interleaved layout are such retries). Otherwise the paused searches go on to their end.
        if self.cut_short:  # the heaviest replica first: where it fails, nothing else is searched
            own = self._own_replicas(assignment)
            pending = [self._merge_group(group) for group in assignment.merge_groups]
        else:
            pending = [self._merge_group(group) for group in assignment.merge_groups]
            own = self._own_replicas(assignment)
        if self.failures:
            raise ReplicasDoNotFit(self.failures)
        merged = [group.finish() for group in filter(None, pending)]  # none failed
        replicas = [replica for replica, _ in merged] + [own[rank][0] for rank in range(self.view.dp)]
        outcomes = sorted([outcome for _, outcome in merged] + [outcome for _, outcome in own.values()],
                          key=lambda outcome: outcome.sort_key)
        metadata = {
            "token_cap": self.token_cap,
            "phase1": assignment.outcome.to_dict(),
            "replica_loads_s": assignment.replica_loads,
            "replicas": [outcome.to_dict() for outcome in outcomes],
            "cost_model": self.cost.describe(),
        }
        plan = Plan(replicas, self.samples, self.view, self.config.context_length, self.config.strategy,
                    self.token_cap, metadata)
        return PlannedBatch(plan, outcomes)

    def _assign(self) -> Assignment:
        lengths = np.asarray(self.search.lengths, dtype=float)
        document_costs = self.rates.total(lengths, lengths * (lengths + 1) / 2)
        config = self.config
        return assign_to_replicas(
            document_costs, self.view.dp, time_limit_s=config.solver_time_limit_s,
            deterministic_limit=config.solver_deterministic_limit, seed=config.seed,
            workers=config.solver_workers, dp_merge=self.search.use_merge, merge_threshold=config.merge_threshold,
            min_group=self.group_ranks, merged_cost=merged_cost_function(self.search.lengths, self.cost, self.view,
                                                                         self.token_cap),
            tunables=config.tunables,
        )

    def _merge_group(self, group: MergeGroup) -> "_PendingGroup | None":
        """A merge group's search (as one replica with its ranks' worth of context parallelism),
        run until a schedule fits, to be finished once every replica fits (`_PendingGroup`); None
        (and a failure kept) where none fits. A group known to fit at this level is not searched
        before then."""
        group_ranks = len(group.dp_ranks)
        # k-fold context parallelism over dp/k replicas: the same ranks per stage (p2p strides)
        merged = self.view.with_(cp=self.view.cp * group_ranks, dp=max(1, self.view.dp // group_ranks))
        members = [self.samples[i] for i in group.sample_indices]
        token_cap = self.token_cap * group_ranks  # each member holds 1/group_ranks of a merged MicroPack
        rates = WorkRates.from_cost(self.cost, merged, token_cap)
        budget = activation_budget(self.cost, self.view)  # a member's static memory is its own, not the merged view's
        known = self.search.known
        key = known.key(members, merged, token_cap, group.dp_ranks, budget)
        if known.failed(key, self.leaner_level, self.failures):
            self._stop_if_final()
            return None
        new_search = functools.partial(replica_search, members, self.cost, merged, self.config, rates, token_cap,
                                       group.dp_ranks, self.search.symmetric, budget=budget,
                                       leaner_level=self.leaner_level, sizes_without_fit=known.sizes(key))
        pending = _PendingGroup(known, key, self.leaner_level, members, new_search)
        if known.fits(key, self.leaner_level):
            return pending
        pending.search = new_search()
        if not pending.search.fits():  # its walk is over
            known.record(key, self.leaner_level, pending.search.does_not_fit(members), self.failures)
            self._stop_if_final()
            return None
        known.record_fit(key, self.leaner_level, pending.search.fitting_levels)
        return pending

    def _stop_if_cut_short(self, ladder: SizeLadder | None) -> None:
        """With `cut_short`, a failure before any replica fit (the heaviest's) ends the planning."""
        if self.cut_short and ladder is None:
            raise PlanningCutShort(self.failures)

    def _stop_if_final(self) -> None:
        """A failure whose documents cannot get larger groups (`can_grow`; without DP-Merge, none
        can) ends the planning: `plan_sizing` raises the first such failure whatever else fails,
        so planning the other replicas would be wasted (slimpack-nomerge, llama-7b 256K tp2
        pp16 dp4: three more replicas)."""
        if not can_grow(self.failures[-1], self.search.lengths, *self.growth_limits):
            raise ReplicasDoNotFit(self.failures)

    def _own_replicas(self, assignment: Assignment) -> dict[int, tuple[ReplicaPlan, ReplicaOutcome]]:
        """Each rank's own replica. Replicas hold statistically alike batches: the MicroPack size is
        searched on the heaviest one (every rung, bisected) and the others start from it, first
        fit (where it does not fit, a longer chain, the largest smaller rung that does; bisecting
        every replica cost 65% more planning time for no gain). A rank may get no
        documents (fewer heavy documents than ranks): it idles until the gradient reduction,
        which the simulator shows as DP imbalance."""
        heaviest = int(np.argmax(assignment.replica_loads))
        order = [heaviest] + [rank for rank in range(self.view.dp) if rank != heaviest]
        own: dict[int, tuple[ReplicaPlan, ReplicaOutcome]] = {}
        ladder: SizeLadder | None = None  # set by the first replica with documents
        known = self.search.known
        for rank in order:
            members = [self.samples[i] for i in assignment.replica_samples[rank]]
            if not members:  # a rank whose only work is its share of a merge group
                own[rank] = plan_replica(members, self.cost, self.view, self.config, self.rates, self.token_cap,
                                         [rank], self.search.symmetric)
                continue
            key = known.key(members, self.view, self.token_cap, [rank], None, ladder)
            if known.failed(key, self.leaner_level, self.failures):
                self._stop_if_cut_short(ladder)
                self._stop_if_final()
                continue
            found = known.result(key, self.leaner_level)
            if found is None:
                search = replica_search(members, self.cost, self.view, self.config, self.rates, self.token_cap,
                                        [rank], self.search.symmetric, ladder=ladder, first_fit=ladder is not None,
                                        leaner_level=self.leaner_level, sizes_without_fit=known.sizes(key))
                try:
                    found = search.finish(members)
                except DoesNotFit as failure:
                    known.record(key, self.leaner_level, failure, self.failures)
                    self._stop_if_cut_short(ladder)
                    self._stop_if_final()
                    continue
                known.record_fit(key, self.leaner_level, search.fitting_levels, found)
            own[rank] = found
            if members and ladder is None:
                # May lie between two rungs (bisected); never None, since the rank has documents.
                chosen = cast(int, own[rank][1].micropack_tokens)
                ladder = SizeLadder.below_cap(self.token_cap, self.config).starting_at(chosen)
        return own


class _PendingGroup:
    """A merge group that fits, whose search is finished only where the whole planning fits: a
    paused `search` (run until its first fit), or none where the group was known to fit at this
    level (`KnownSearches.fits`), made with `new_search` if its result is not known either."""

    def __init__(self, known: "KnownSearches", key: tuple, leaner_level: int, members: list[Sample],
                 new_search: Callable[[], ReplicaSearch]):
        self.known, self.key, self.leaner_level, self.members = known, key, leaner_level, members
        self.new_search = new_search
        self.search: ReplicaSearch | None = None

    def finish(self) -> tuple[ReplicaPlan, ReplicaOutcome]:
        found = self.known.result(self.key, self.leaner_level)
        if found is not None:
            return found
        search = self.search or self.new_search()
        found = search.finish(self.members)  # fits: its first steps found a schedule at this level before
        self.known.record_fit(self.key, self.leaner_level, search.fitting_levels, found)
        return found


@dataclass(frozen=True)
class _KnownFit:
    """A replica search that found a schedule at leaner level `searched_at`; `result` is what it
    planned, or None where only its first fit is known (a merge group's walk, paused)."""

    searched_at: int
    highest_fitting: int  # the highest leaner level at which one of its schedules fit
    result: tuple[ReplicaPlan, ReplicaOutcome] | None

    def holds_at(self, leaner_level: int) -> bool:
        """Whether a search at `leaner_level` runs the same steps: the levels it leaves out
        (above `leaner_level`, up to `searched_at`) had no schedule that fit, so their replays
        changed only the leanest need kept for a failure's message."""
        return self.highest_fitting <= leaner_level <= self.searched_at


class KnownSearches:
    """Replica searches of one batch already run, by their input, with the leaner level they ran
    at. A sizing is planned again at lower leaner levels from the same groups (the same phase 1,
    so the same replicas), and growth can repeat a replica's documents.

    A search that fails at a level fails at every level below: it replays a subset of the same
    schedules, and with none fitting it prunes nothing. Such a search is not run again (at
    llama-7b 256K tp1 pp2 vpp4 dp64 the first planning at level 0 then takes 0.8 s, 13.5 s when
    searched). The failure kept names the leanest schedule of the deeper search; a lower level's
    failure is never reported, as a lower level is planned only where the sizing fit at a higher
    one.

    A search that fits at a level, where none of the schedules that fit needed a level above L,
    takes the same steps at every level from L up: its result (or, for a paused merge group, that
    it fits) is used there without searching (`_KnownFit.holds_at`).

    The sizes at which a replica found nothing are kept apart from its ladder (`sizes`): a
    replica planned first fit from another replica's size, or from none, tries some of the same."""

    def __init__(self):
        self._failures: dict[tuple, tuple[int, DoesNotFit]] = {}
        self._fits: dict[tuple, list[_KnownFit]] = {}
        self._sizes: dict[tuple, SizesWithoutFit] = {}

    @staticmethod
    def key(samples: list[Sample], parallel: ParallelConfig, token_cap: int, dp_ranks: list[int],
            budget: float | None, ladder: SizeLadder | None = None) -> tuple:
        """Every input of a replica search of one batch (its rates follow from the layout and cap;
        the ranks appear in the failure's message); a ladder given makes it a first-fit search."""
        return (tuple(sample.sample_id for sample in samples), parallel, token_cap, tuple(dp_ranks), budget,
                None if ladder is None else ladder.micropack_tokens)

    def sizes(self, key: tuple) -> SizesWithoutFit:
        """The sizes without a fit of the replica of `key`, whatever its ladder."""
        return self._sizes.setdefault(key[:-1], SizesWithoutFit())

    def failed(self, key: tuple, leaner_level: int, failures: list[DoesNotFit]) -> bool:
        """Whether the search of `key` is known to fail at `leaner_level`; if so its failure (a
        copy) joins `failures`."""
        entry = self._failures.get(key)
        if entry is None or entry[0] < leaner_level:
            return False
        failures.append(copy.copy(entry[1]))
        return True

    def record(self, key: tuple, leaner_level: int, failure: DoesNotFit, failures: list[DoesNotFit]) -> None:
        """The search of `key` failed at `leaner_level`: kept for the levels below, and joins
        `failures`."""
        failures.append(kept(failure))
        if key not in self._failures or self._failures[key][0] < leaner_level:
            self._failures[key] = (leaner_level, copy.copy(failure))

    def fits(self, key: tuple, leaner_level: int) -> bool:
        """Whether the search of `key` is known to find a schedule at `leaner_level`."""
        return any(fit.holds_at(leaner_level) for fit in self._fits.get(key, ()))

    def result(self, key: tuple, leaner_level: int) -> tuple[ReplicaPlan, ReplicaOutcome] | None:
        """What the search of `key` plans at `leaner_level`, where known."""
        return next((fit.result for fit in self._fits.get(key, ())
                     if fit.result is not None and fit.holds_at(leaner_level)), None)

    def record_fit(self, key: tuple, leaner_level: int, fitting_levels: set[int],
                   result: tuple[ReplicaPlan, ReplicaOutcome] | None = None) -> None:
        """The search of `key` at `leaner_level` found schedules at `fitting_levels`, and planned
        `result` (None: it was only run until its first fit)."""
        self._fits.setdefault(key, []).append(_KnownFit(leaner_level, max(fitting_levels), result))

    def forget_fits(self) -> None:
        """Drop the known fits (and the plans they hold); failures are kept."""
        self._fits.clear()


def merged_cost_function(lengths: list[int], cost: CostModel, parallel: ParallelConfig, token_cap: int):
    """Per-rank seconds of document i run by k replicas with context parallelism k."""
    rates_by_ranks: dict[int, WorkRates] = {}

    def merged_cost(index: int, group_ranks: int) -> float:
        if group_ranks not in rates_by_ranks:
            rates_by_ranks[group_ranks] = WorkRates.from_cost(cost, parallel.with_(cp=parallel.cp * group_ranks),
                                                              token_cap * group_ranks)
        return rates_by_ranks[group_ranks].document(lengths[index])

    return merged_cost


def shared_by_groups(plan: Plan, parallel: ParallelConfig, base_merge: int) -> Plan:
    """A plan made for dp/base_merge replicas with base_merge-fold context parallelism, as the
    runtime runs it on `parallel` (dp replicas): view rank r is the DP-Merge group of ranks
    r*base_merge .. r*base_merge + base_merge - 1, and every rank keeps an (empty) replica plan of
    its own. It costs the same in the simulator: a group of k ranks is priced as k-fold context
    parallelism."""
    replicas = [ReplicaPlan(r.micropacks, r.forward_units, r.backward_units, r.stage_orders,
                            [rank * base_merge + k for rank in r.dp_ranks for k in range(base_merge)])
                for r in plan.replicas]
    replicas += [ReplicaPlan([], [], [], [[] for _ in range(parallel.pp)], [rank]) for rank in range(parallel.dp)]
    metadata = {**plan.metadata, "base_merge": base_merge}
    return Plan(replicas, plan.samples, parallel, plan.context_length, plan.strategy, plan.max_micropack_tokens,
                metadata, plan.sample_sources)


__all__ = ["Sizing", "Attempt", "GroupSizing", "SlimPackSearch", "PlanningCutShort", "grown_groups", "can_grow",
           "sliced_grown", "merged_cost_function", "shared_by_groups"]
