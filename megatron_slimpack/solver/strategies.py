"""Strategy registry and the SlimPack planner entry point.

A strategy turns one global batch of document lengths into a validated `Plan`. `slimpack` is the
full method (phase 1 DP balance with DP-Merge, phase 2 cost-balanced slicing and asymmetric
units, candidates scored by simulation); `slimpack-sym` and `slimpack-nomerge` are its
ablations. Baselines register themselves from `baselines.py` in the same registry.
"""
from __future__ import annotations

import contextlib
import gc
import time
from functools import cached_property
from typing import Callable, Optional, Sequence

import numpy as np

from ..config import SlimPackConfig
from ..costmodel import CostModel, format_bytes
from ..plan import Plan, PlanError, ReplicaPlan, Sample, check_sources, overlapping_documents, samples_of
from ..specs import ParallelConfig
from .dp_phase import assign_to_replicas
from .pack_phase import MicroPackCosts, PackOptions, SortedSamples, UnitCandidate, pack_micropacks
from .work import WorkRates

# strategy(lengths, parallel, cost, config, *, sources=None) -> Plan; `sources`: one (document,
# offset) pair per length (None: (i, 0) for the i-th), recorded per sample in `Plan.sample_sources`.
Strategy = Callable[..., Plan]
Sources = Optional[Sequence[tuple[int, int]]]


class StepPlanner:
    """Plans consecutive global batches. Stateless strategies are plain functions wrapped here;
    a stateful one (e.g. WLB-LLM's outlier-delay queues, whose delayed documents roll into later
    steps) subclasses it and keeps its state between `plan` calls.

    Every planner can be brought to its state after N batches without planning them (`advance`,
    e.g. when a training run resumes at step N) and saves/restores that state as JSON-able
    `state_dict()` / `load_state_dict()` (empty for stateless strategies)."""

    def __init__(self, function: Strategy | None = None):
        self.function = function

    def plan(self, lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig, *,
             sources: Sources = None) -> Plan:
        """The plan of one global batch; `sources[i]` = (document, offset) of `lengths[i]` (default
        (i, 0)), recorded for every sample of the plan in `Plan.sample_sources`."""
        assert self.function is not None
        return self.function(lengths, parallel, cost, config, sources=sources)

    def advance(self, lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig, *,
                sources: Sources = None) -> None:
        """Update the state exactly as `plan` on this batch would, without building the plan
        (stateless strategies: nothing to do)."""

    def state_dict(self) -> dict:
        """The planner's state between batches, JSON-able (stateless strategies: empty)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise PlanError(f"{type(self).__name__} is stateless but was given the state {sorted(state)}")


STRATEGIES: dict[str, Callable[[], StepPlanner]] = {}


def register(name: str):
    """Register a stateless strategy function `f(lengths, parallel, cost, config, *, sources=None)`
    (it records every sample's (document, offset) source in the plan)."""
    def wrap(function: Strategy) -> Strategy:
        STRATEGIES[name] = lambda: StepPlanner(function)
        return function

    return wrap


def register_stateful(name: str):
    """Register a StepPlanner subclass; each comparison run gets a fresh instance."""
    def wrap(cls: type[StepPlanner]) -> type[StepPlanner]:
        STRATEGIES[name] = cls
        return cls

    return wrap


def new_planner(name: str) -> StepPlanner:
    _load_baselines()
    if name not in STRATEGIES:
        raise PlanError(f"unknown strategy {name!r}; known: {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[name]()


def get_strategy(name: str) -> Strategy:
    """A one-shot function for `name` (stateful strategies start from an empty state)."""
    planner = new_planner(name)
    return planner.plan


def strategy_names() -> list[str]:
    _load_baselines()
    return sorted(STRATEGIES)


def _load_baselines() -> None:
    from . import baselines  # noqa: F401  (registers the baselines on first import)


@contextlib.contextmanager
def cyclic_gc_paused():
    """Planning allocates ~10^5 small tuples (samples, slices) that hold no reference cycles; the
    cyclic collector would rescan them over and over (a third of the planning time at 256K), and
    with them everything else alive (a layout search keeps every finalist's plans). Paused for one
    planning (`plan()`) or one layout search (`best_layout`); what cycles there are go in the next
    pass after it. The planner that runs beside training does not pause it: that would pause it for
    the training loop too."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def plan_global_batch(lengths, *, parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig,
                      sources=None) -> Plan:
    """One global batch with `config.strategy`; `sources`: (document, offset) of each length
    (default (i, 0)), carried into `Plan.sample_sources`."""
    lengths = check_plan_input(lengths, config.context_length)
    sources = None if sources is None else check_sources(sources, len(lengths))
    parallel.check_model(cost.model)
    with cyclic_gc_paused():
        started = time.perf_counter()
        plan = get_strategy(config.strategy)(lengths, parallel, cost, config, sources=sources)
        plan.metadata.setdefault("planning_time_s", time.perf_counter() - started)
        return plan.validate()


def check_plan_input(lengths, context_length: int) -> list[int]:
    from ..workload import check_lengths

    return check_lengths(lengths, context_length)


def with_input_sources(plan: Plan, sources, count: int) -> Plan:
    """`plan` (whose samples are the input lengths: sample id i is lengths[i]) with sample i's
    source `sources[i]` (None: the default (i, 0), which the Plan already holds) and the documents
    the input holds twice."""
    if sources is not None:
        sources = check_sources(sources, count)
        ids = [sample_id for sample_id, _ in plan.samples]
        plan.sample_sources = sources if ids == list(range(count)) else [sources[i] for i in ids]
        plan.repeated_documents = overlapping_documents(plan.sample_sources, [n for _, n in plan.samples])
    return plan


# ---- SlimPack -------------------------------------------------------------------------------

def activation_budget(cost: CostModel, parallel: ParallelConfig) -> float:
    """Bytes a stage may hold in flight (activations and KV caches): memory minus weights,
    gradients and optimizer state."""
    return cost.memory_budget_bytes() - cost.static_memory_bytes(parallel)


def fullest_stage_bytes(cost: CostModel, parallel: ParallelConfig, tokens: float, pairs: float,
                        other_pack_tokens: float = 0.0) -> float:
    """Activations on the fullest pipeline stage while `tokens` (with `pairs`) are in flight next to
    the pp - 1 MicroPacks of `other_pack_tokens` that 1F1B keeps on stage 0. Stage s holds pp - s
    packs; only the last stage (one pack) adds its logits, so the peak is on stage 0 or the last."""
    last = cost.activation_bytes(tokens, pairs, parallel, last_stage=True)
    if parallel.pp == 1:
        return last
    others = (parallel.pp - 1) * cost.activation_bytes(other_pack_tokens, other_pack_tokens ** 2 / 2, parallel)
    return max(cost.activation_bytes(tokens, pairs, parallel) + others, last)


MIN_MICROPACK_TOKENS = 1024


def auto_token_cap(cost: CostModel, parallel: ParallelConfig, config: SlimPackConfig) -> int:
    """The largest MicroPack that lets stage 0 hold pp of them (and the last stage one with its
    logits), at most the context: the largest power of two that fits, then grown in eighths of it
    while they fit (activation memory is linear in tokens, so the memory between two powers of two
    buys up to 7/8 more tokens)."""
    if config.max_micropack_tokens:
        return config.max_micropack_tokens
    # Long documents' KV caches are the DP-Merge sizing's concern (merge_group_sizes), not the cap's.
    budget = cost.memory_budget_bytes() - cost.static_memory_bytes(parallel)

    def need(cap: int) -> float:
        return fullest_stage_bytes(cost, parallel, cap, cap * cap / 2, cap)

    cap = 1 << (config.context_length.bit_length() - 1)
    while cap > MIN_MICROPACK_TOKENS and need(cap) > budget:
        cap //= 2
    if need(cap) > budget:
        total = cost.static_memory_bytes(parallel) + need(cap)
        raise PlanError(
            f"memory: weights, optimizer state and {parallel.pp} MicroPacks of {cap} tokens need at least "
            f"{format_bytes(total)} per device with {parallel.describe()} but {format_bytes(cost.memory_budget_bytes())} "
            f"is usable on {cost.hardware.name}; use activation recompute, more tensor or pipeline parallelism, "
            f"or a shorter context"
        )
    step = max(cap // 8, 1)
    grown = cap
    while grown + step < 2 * cap and grown + step <= config.context_length and need(grown + step) <= budget:
        grown += step
    return min(grown, config.context_length)


def document_memory_bytes(length: int, cost: CostModel, parallel: ParallelConfig, token_cap: int | None = None) -> float:
    """Per-device memory of one document whose slices are all in flight, as its backward needs.

    Without `token_cap` this is a lower bound (the document alone, in one MicroPack). With it, the
    document's MicroPacks count as filled to the cap (short documents top them up), a document
    longer than the cap also holds the KV cache of its sliced prefix, and stage 0 also holds the
    pp - 1 other MicroPacks that 1F1B keeps in flight. A document within the cap is one MicroPack
    like any other: it has no KV cache and needs no more than the cap itself."""
    pairs = length * (length + 1) / 2
    in_flight, kv, other_pack_tokens = length, 0.0, 0
    if token_cap:
        in_flight = -(-length // token_cap) * token_cap
        kv = cost.kv_cache_bytes(length, parallel) if length > token_cap else 0.0
        other_pack_tokens = token_cap
    return (cost.static_memory_bytes(parallel) + fullest_stage_bytes(cost, parallel, in_flight, pairs, other_pack_tokens)
            + kv)


def merge_group_sizes(lengths: list[int], cost: CostModel, parallel: ParallelConfig, micropack_tokens: list[int],
                      dp_merge: bool) -> np.ndarray:
    """For each document, how many replicas must share it (context parallelism across a DP-Merge
    group) for it to fit memory with one of the MicroPack sizes the replica planner tries
    (`micropack_tokens`; smaller MicroPacks leave more room for a long document's slices next to
    the ones 1F1B keeps in flight): 1 for nearly all. Raises PlanError when no group size suffices."""
    budget = cost.memory_budget_bytes()
    sizes = np.ones(len(lengths), dtype=int)
    largest_group = parallel.dp if dp_merge else 1

    def need(length: int, size: int) -> float:
        # A merge group's MicroPacks hold `size` x the MicroPack size: each member keeps its share.
        merged = parallel.with_(cp=parallel.cp * size)
        return min(document_memory_bytes(length, cost, merged, tokens * size) for tokens in micropack_tokens)

    for index in np.argsort(lengths)[::-1]:
        length = int(lengths[index])
        if need(length, 1) <= budget:
            break  # shorter documents fit too
        size = 2
        while size <= largest_group and need(length, size) > budget:
            size *= 2
        if size > largest_group or parallel.dp % size:
            raise PlanError(
                f"memory: a {length}-token document needs at least {format_bytes(need(length, 1))} per device with "
                f"{parallel.describe()} but {format_bytes(budget)} is usable on {cost.hardware.name}"
                f"{'' if dp_merge else ' (DP-Merge is off)'}; use activation recompute (recompute='full'), "
                f"more tensor or pipeline parallelism, {'DP-Merge, ' if not dp_merge else 'more data-parallel replicas, '}"
                f"or a shorter context"
            )
        sizes[index] = size
    return sizes


def slice_candidates(token_cap: int, config: SlimPackConfig) -> list[int]:
    """MicroPack sizes to try, largest first: the cap, halved three times, and three quarters of
    each but the last (at least 1024 tokens). Where memory is tight (a deep pipeline holding a long
    chain) the largest size that fits is often between two halvings, and a MicroPack a quarter
    smaller than needed costs a few percent more per token."""
    if config.slice_tokens:
        return [min(config.slice_tokens, token_cap)]
    halvings = [token_cap]
    while halvings[-1] // 2 >= MIN_MICROPACK_TOKENS and len(halvings) < 4:
        halvings.append(halvings[-1] // 2)
    quarters = [size * 3 // 4 for size in halvings[:-1]]
    return sorted(set(halvings + quarters), reverse=True)


def unit_candidates(pp: int, micropacks: int) -> list[int]:
    """Unit counts to try: a few multiples of pp, and one unit per MicroPack."""
    if pp == 1:  # no pipeline to fill: the smallest units hold the least memory
        return [micropacks]
    return sorted({min(k * pp, micropacks) for k in (2, 4, 8)} | {micropacks})


REPLAYED_CANDIDATES = 3  # candidates with the best quick estimates get a full replay
SIZE_GRANULE = 256  # sizes found by bisection are multiples of this many tokens
REFINE_FRACTION = 16  # bisection stops within 1/16 of the size that fits


class ReplicaDoesNotFit(PlanError):
    """No schedule of a replica's (or merge group's) documents fits memory."""

    def __init__(self, sample_ids: list[int], group_size: int, message: str):
        super().__init__(message)
        self.sample_ids = sample_ids
        self.group_size = group_size


class ReplicasDoNotFit(PlanError):
    """Every replica (or merge group) of one planning that did not fit memory."""

    def __init__(self, failures: list[ReplicaDoesNotFit]):
        super().__init__(str(failures[0]))
        self.failures = failures


def plan_replica(
    samples: list[Sample], cost: CostModel, parallel: ParallelConfig, config: SlimPackConfig,
    rates: WorkRates, token_cap: int, dp_ranks: list[int], symmetric: bool, sizes: list[int] | None = None,
    budget: float | None = None, first_fit: bool = False,
) -> tuple[ReplicaPlan, float, dict]:
    """Try MicroPack sizes (default: all candidates) and unit counts; keep the shortest schedule
    that fits the activation `budget` (default: `activation_budget` of `parallel`). With
    `first_fit`, the first size (in the given order) that fits ends the search.

    Per size: if even the busiest stage's total work (a lower bound for any unit count) is no
    better than the best schedule so far, the size is skipped. Otherwise every unit count is
    segmented and given a quick pipeline estimate; the few best by estimate that fit memory are
    ordered and replayed, and the shortest replay wins. Large units hold many MicroPacks in flight
    (1F1B keeps pp - s forward units per stage), so few units can be fast on paper and not fit.
    Where a size does not fit and the next one tried does, the sizes between them are bisected
    (not with `first_fit`: the replicas after the heaviest start from its size)."""
    if not samples:  # a rank whose only work is its share of a merge group
        return ReplicaPlan([], [], [], [[] for _ in range(parallel.pp)], list(dp_ranks)), 0.0, {}
    search = _ReplicaSearch(SortedSamples(samples, rates), rates, cost, parallel, symmetric, dp_ranks,
                            activation_budget(cost, parallel) if budget is None else budget)
    too_large = None  # the smallest size tried with no schedule that fits
    for size in sizes or slice_candidates(token_cap, config):
        if not search.try_size(size):
            too_large = size
            continue
        if too_large is not None and not first_fit:
            search.refine(size, too_large)
            too_large = None
        if first_fit and search.best is not None:
            break
    if search.best is None:
        assert search.leanest is not None
        peak, size = search.leanest
        raise ReplicaDoesNotFit(
            [s.sample_id for s in samples], len(dp_ranks),
            f"memory: replica {dp_ranks} does not fit: its leanest schedule holds {format_bytes(peak)} of "
            f"activations and KV cache on a pipeline stage (MicroPacks of {size} tokens) with "
            f"{parallel.describe()}, but only {format_bytes(max(search.budget, 0.0))} is left after weights, "
            f"gradients and optimizer state on "
            f"{cost.hardware.name}; use activation recompute, more tensor or pipeline parallelism, "
            f"a smaller MicroPack size (max_micropack_tokens) or a shorter context")
    return search.best


class _ReplicaSearch:
    """One replica's search over MicroPack sizes: the best schedule found so far, and the leanest
    need seen (for the error)."""

    def __init__(self, ordered: SortedSamples, rates: WorkRates, cost: CostModel, parallel: ParallelConfig,
                 symmetric: bool, dp_ranks: list[int], budget: float):
        self.ordered, self.rates = ordered, rates
        self.cost, self.parallel, self.symmetric, self.dp_ranks, self.budget = cost, parallel, symmetric, dp_ranks, budget
        self.best: tuple[ReplicaPlan, float, dict] | None = None
        self.leanest: tuple[float, int] | None = None  # (peak bytes, MicroPack size) of the smallest need seen

    @cached_property
    def lengths(self) -> dict[int, int]:
        """Document lengths by sample id, built on first use: only a pipelined packing that
        sliced a document looks one up (`try_size`)."""
        return {sample.sample_id: sample.length for sample in self.ordered.samples}

    def try_size(self, size: int) -> bool:
        """Pack to MicroPacks of `size` tokens and consider the packing; True when a schedule fits
        memory or none can beat the best one (then neither can a smaller size's).

        With a pipeline, MicroPacks are first packed to even costs, which also slices documents
        that fit one; a chain holds all its MicroPacks until its backward, so where that packing
        does not fit and it sliced such a document, the plain packing is tried too."""
        if self.best is not None and packing_bound_s(self.ordered, size, self.cost, self.parallel) >= self.best[1]:
            return True
        even = self.parallel.pp > 1
        micropacks = pack_micropacks(self.ordered, PackOptions(size, size, even_costs=even), self.rates)
        if self.consider(micropacks, {"micropack_tokens": size}):
            return True
        if not (even and any(piece.start > 0 and self.lengths[piece.sample_id] <= size
                             for pack in micropacks for piece in pack.slices)):
            return False
        return self.consider(pack_micropacks(self.ordered, PackOptions(size, size), self.rates),
                             {"micropack_tokens": size})

    def refine(self, fits: int, too_large: int) -> None:
        """Bisect between a size that fits and the next larger one tried that does not: the ladder
        of sizes is coarse (a quarter to a third apart), and where memory decides the size, the
        largest that fits costs the least per token."""
        largest_fitting(self.try_size, fits, too_large, REFINE_FRACTION)

    def consider(self, micropacks, choice: dict) -> bool:
        """Segment, order and replay the most promising unit counts of one packing; True when a
        schedule of it fits memory (or it cannot beat the best one anyway)."""
        costs = MicroPackCosts.of(micropacks, self.cost, self.parallel)
        if self.best is not None and costs.busiest_stage_s(self.parallel.pp) >= self.best[1]:
            return True
        candidates = [(UnitCandidate.of(micropacks, costs, units, self.symmetric, self.cost, self.parallel, self.budget),
                       units) for units in unit_candidates(self.parallel.pp, len(micropacks))]
        candidates.sort(key=lambda entry: entry[0].estimate_s)
        replayed = 0
        for candidate, units in candidates:
            if replayed == REPLAYED_CANDIDATES:
                break
            if candidate.warmup_bytes + costs.largest_recompute_bytes > self.budget and self.leanest is not None:
                continue  # its stage 0 cannot fit even before the first backward: not worth ordering
            result = candidate.order(self.dp_ranks, self.budget - costs.largest_recompute_bytes)
            peak = result.peak_activation_bytes + costs.largest_recompute_bytes
            if self.leanest is None or peak < self.leanest[0]:
                self.leanest = (peak, choice["micropack_tokens"])
            if peak > self.budget:
                continue
            replayed += 1
            if self.best is None or result.makespan_s < self.best[1]:
                self.best = (result.replica, result.makespan_s, {**choice, "units": units})
        return replayed > 0


def packing_bound_s(ordered: SortedSamples, size: int, cost: CostModel, parallel: ParallelConfig) -> float:
    """A lower bound, before packing, of the last stage's work with MicroPacks of at most `size`
    tokens: all tokens in full MicroPacks (`CostModel.pass_time_bound`; slicing keeps a
    document's attention pairs)."""
    tokens = float(ordered.lengths.sum())
    if tokens == 0:
        return 0.0
    pairs = float((ordered.lengths * (ordered.lengths + 1) / 2).sum())
    return cost.pass_time_bound(tokens, pairs, parallel, size)


def merged_cost_function(lengths: list[int], cost: CostModel, parallel: ParallelConfig, token_cap: int):
    """Per-rank seconds of document i run by k replicas with context parallelism k."""
    rates_by_size: dict[int, WorkRates] = {}

    def merged_cost(index: int, size: int) -> float:
        if size not in rates_by_size:
            rates_by_size[size] = WorkRates.from_cost(cost, parallel.with_(cp=parallel.cp * size), token_cap * size)
        return rates_by_size[size].document(lengths[index])

    return merged_cost


def plan_slimpack(
    lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig,
    *, symmetric: bool = False, dp_merge: bool | None = None, sources=None,
) -> Plan:
    """SlimPack's plan of one global batch. With `config.base_merge` k > 1, or where no plan of
    the layout fits memory (then k = 2, 4, ...), every MicroPack is shared by a DP-Merge group of
    k replicas: planned as k-fold context parallelism over dp / k replicas (`base_merge` in the
    metadata), run as DP-Merge groups."""
    use_merge = config.dp_merge if dp_merge is None else dp_merge
    base, first_error = config.base_merge, None
    if base > 1 and (not use_merge or parallel.dp % base):
        raise PlanError(f"base_merge {base} needs DP-Merge and a data-parallel size divisible by it; got dp "
                        f"{parallel.dp}{'' if use_merge else ' with DP-Merge off'}")
    while True:
        view = parallel.with_(dp=parallel.dp // base, cp=parallel.cp * base)
        try:
            plan = _plan_fitted(lengths, view, cost, config, symmetric, use_merge)
            plan = plan if base == 1 else shared_by_groups(plan, parallel, base)
            return with_input_sources(plan, sources, len(lengths))
        except PlanError as error:
            first_error = first_error or error
            base *= 2
            if not (use_merge and str(error).startswith("memory") and parallel.dp % base == 0):
                raise first_error from None


def shared_by_groups(plan: Plan, parallel: ParallelConfig, base: int) -> Plan:
    """A plan made for dp/base replicas with base-fold context parallelism, as the runtime runs
    it on `parallel` (dp replicas): view rank r is the DP-Merge group of ranks r*base .. r*base +
    base - 1, and every rank keeps an (empty) replica plan of its own. It costs the same in the
    simulator: a group of k ranks is priced as k-fold context parallelism."""
    replicas = [ReplicaPlan(r.micropacks, r.forward_units, r.backward_units, r.stage_orders,
                            [rank * base + k for rank in r.dp_ranks for k in range(base)]) for r in plan.replicas]
    replicas += [ReplicaPlan([], [], [], [[] for _ in range(parallel.pp)], [rank]) for rank in range(parallel.dp)]
    metadata = {**plan.metadata, "base_merge": base}
    return Plan(replicas, plan.samples, parallel, plan.context_length, plan.strategy, plan.max_micropack_tokens,
                metadata, plan.sample_sources)


def _plan_fitted(lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig,
                 symmetric: bool, use_merge: bool) -> Plan:
    token_cap = auto_token_cap(cost, parallel, config)
    # A long document kept in a replica forces that replica's MicroPacks down to what fits next to
    # its chain; merged into a larger group it leaves them at the largest size that fits next to the
    # group's share but idles the group's ranks on it. Neither wins everywhere (70B tp4 pp8 dp4 at
    # 128K: 1094 s merging for 16K MicroPacks, 1386 s for the smallest size), so both are planned
    # and the faster prediction kept. A slice size the user set is kept: no second sizing.
    plans, first_error, tried = [], None, []
    sizings = [lambda: (token_cap, merge_group_sizes(lengths, cost, parallel, slice_candidates(token_cap, config),
                                                     use_merge))]
    if not config.slice_tokens:
        sizings.append(lambda: largest_merged_micropack(lengths, cost, parallel, token_cap, use_merge))
    for sizing in sizings:
        try:
            cap, group_sizes = sizing()
            if any(cap == seen_cap and np.array_equal(group_sizes, seen) for seen_cap, seen in tried):
                continue
            tried.append((cap, group_sizes))
            plans.append(_plan_growing_groups(lengths, parallel, cost, config, cap, slice_candidates(cap, config),
                                              group_sizes, symmetric, use_merge))
        except PlanError as error:
            first_error = first_error or error
    if not plans:
        raise first_error
    return min(plans, key=predicted_iteration_s)


def largest_merged_micropack(lengths: list[int], cost: CostModel, parallel: ParallelConfig, token_cap: int,
                             use_merge: bool) -> tuple[int, np.ndarray]:
    """The largest MicroPack size, at most the cap, next to which every document fits memory (in a
    merge group where it needs one), with those group sizes. Bisected in SIZE_GRANULE steps (the
    need grows with the size): the cap is a memory bound for short documents only, and a fixed
    ladder of sizes below it misses the one a long document allows by up to a third."""
    try:
        return token_cap, merge_group_sizes(lengths, cost, parallel, [token_cap], use_merge)
    except PlanError as error:
        first_error = error
    groups: dict[int, np.ndarray] = {}

    def fits(size: int) -> bool:
        try:
            groups[size] = merge_group_sizes(lengths, cost, parallel, [size], use_merge)
            return True
        except PlanError:
            return False

    if not fits(MIN_MICROPACK_TOKENS):
        raise first_error
    size = largest_fitting(fits, MIN_MICROPACK_TOKENS, token_cap)
    return size, groups[size]


def largest_fitting(fits, low: int, high: int, fraction: int = 0) -> int:
    """Bisect, in SIZE_GRANULE steps, for the largest size with `fits(size)` between `low` (fits)
    and `high` (does not); with `fraction`, stop within low / fraction."""
    while high - low > max(low // fraction if fraction else 0, SIZE_GRANULE):
        middle = (low + high) // 2 // SIZE_GRANULE * SIZE_GRANULE
        if middle <= low:
            break
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def predicted_iteration_s(plan: Plan) -> float:
    """The planner's own estimate of a plan's time: the busiest rank's replica makespans (its merge
    groups', then its own), from the plan's metadata."""
    busy = [0.0] * plan.parallel.dp
    for entry in plan.metadata["replicas"]:
        for rank in entry["dp_ranks"]:
            busy[rank] += entry["makespan_s"]
    return max(busy)


def _plan_growing_groups(lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig,
                         token_cap: int, sizes: list[int], group_sizes: np.ndarray, symmetric: bool,
                         use_merge: bool) -> Plan:
    # The group sizes come from a per-document estimate; where replicas' real schedules still do
    # not fit, their sliced documents get twice the group and the batch is planned again (all the
    # replicas that failed at once: replicas are alike, so one at a time took a planning each).
    while True:
        try:
            return _plan_with_groups(lengths, parallel, cost, config, token_cap, group_sizes, symmetric, use_merge)
        except ReplicasDoNotFit as error:
            for failure in error.failures:
                grown = _grown_groups(failure, group_sizes, lengths, min(sizes), parallel.dp if use_merge else 1)
                if grown is None:
                    raise failure from None
                group_sizes = grown


def _grown_groups(error: ReplicaDoesNotFit, group_sizes: np.ndarray, lengths: list[int], smallest_micropack: int,
                  largest_group: int) -> np.ndarray | None:
    """Twice the group of the failed replica's sliced documents (its longest one if none is
    sliced); None when that group would exceed `largest_group` replicas."""
    size = 2 * error.group_size
    if size > largest_group or largest_group % size or not error.sample_ids:
        return None
    sliced = [i for i in error.sample_ids if lengths[i] > smallest_micropack * error.group_size]
    grown = group_sizes.copy()
    for index in sliced or [max(error.sample_ids, key=lambda i: lengths[i])]:
        grown[index] = max(grown[index], size)
    return grown


def _plan_with_groups(lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig,
                      token_cap: int, group_sizes: np.ndarray, symmetric: bool, use_merge: bool) -> Plan:
    rates = WorkRates.from_cost(cost, parallel, token_cap)
    samples = samples_of(lengths)
    as_array = np.asarray(lengths, dtype=float)
    document_costs = rates.total(as_array, as_array * (as_array + 1) / 2)
    assignment = assign_to_replicas(
        document_costs, parallel.dp, time_limit_s=config.solver_time_limit_s,
        deterministic_limit=config.solver_deterministic_limit, seed=config.seed,
        workers=config.solver_workers, dp_merge=use_merge, merge_threshold=config.merge_threshold,
        min_group=group_sizes, merged_cost=merged_cost_function(lengths, cost, parallel, token_cap),
    )
    replicas: list[ReplicaPlan] = []
    predicted: list[dict] = []
    failures: list[ReplicaDoesNotFit] = []  # every replica is still planned, so all are grown at once
    budget = activation_budget(cost, parallel)  # a merge member's static memory is its own, not the merged view's
    for group in assignment.merge_groups:
        merged = parallel.with_(cp=parallel.cp * len(group.dp_ranks))
        members = [samples[i] for i in group.sample_indices]
        size = len(group.dp_ranks)  # each member holds 1/size of a merged MicroPack: the cap scales
        merged_rates = WorkRates.from_cost(cost, merged, token_cap * size)
        try:
            replica, makespan, choice = plan_replica(members, cost, merged, config, merged_rates, token_cap * size,
                                                     group.dp_ranks, symmetric, budget=budget)
        except ReplicaDoesNotFit as failure:
            failures.append(failure)
            continue
        replicas.append(replica)
        predicted.append({"dp_ranks": group.dp_ranks, "makespan_s": float(makespan), **choice})
    # Replicas hold statistically alike batches: the MicroPack size is searched on the heaviest
    # one and reused by the others (unit counts are still searched per replica).
    heaviest = int(np.argmax(assignment.replica_loads))
    order = [heaviest] + [rank for rank in range(parallel.dp) if rank != heaviest]
    own: dict[int, ReplicaPlan] = {}
    chosen_sizes: list[int] | None = None
    for rank in order:
        # A rank may get no documents of its own (fewer heavy documents than ranks): it then idles
        # until the gradient reduction, which the simulator shows as DP imbalance.
        members = [samples[i] for i in assignment.replica_samples[rank]]
        # After the heaviest: its size, or where that does not fit (a longer chain) the largest
        # smaller one that does (a smaller size only costs more per token).
        try:
            replica, makespan, choice = plan_replica(members, cost, parallel, config, rates, token_cap, [rank],
                                                     symmetric, sizes=chosen_sizes, first_fit=chosen_sizes is not None)
        except ReplicaDoesNotFit as failure:
            failures.append(failure)
            continue
        if members and chosen_sizes is None:
            chosen = choice["micropack_tokens"]  # may lie between two candidates (bisected)
            chosen_sizes = [chosen] + [size for size in slice_candidates(token_cap, config) if size < chosen]
        own[rank] = replica
        predicted.append({"dp_ranks": [rank], "makespan_s": float(makespan), **choice})
    if failures:
        raise ReplicasDoNotFit(failures)
    replicas += [own[rank] for rank in range(parallel.dp)]
    predicted.sort(key=lambda entry: (len(entry["dp_ranks"]) == 1, entry["dp_ranks"]))
    metadata = {
        "token_cap": token_cap,
        "phase1": assignment.solver,
        "replica_loads_s": assignment.replica_loads,
        "replicas": predicted,
        "cost_model": cost.describe(),
    }
    return Plan(replicas, samples, parallel, config.context_length, config.strategy, token_cap, metadata)


@register("slimpack")
def _slimpack(lengths, parallel, cost, config, *, sources=None):
    return plan_slimpack(lengths, parallel, cost, config, sources=sources)


@register("slimpack-sym")
def _slimpack_symmetric(lengths, parallel, cost, config, *, sources=None):
    return plan_slimpack(lengths, parallel, cost, config, symmetric=True, sources=sources)


@register("slimpack-nomerge")
def _slimpack_no_merge(lengths, parallel, cost, config, *, sources=None):
    return plan_slimpack(lengths, parallel, cost, config, dp_merge=False, sources=sources)
