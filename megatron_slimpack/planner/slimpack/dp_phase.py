"""Phase 1: assign documents to data-parallel replicas (DP-aware micro-packing).

Minimise the maximum replica load with OR-Tools CP-SAT. Only the heaviest documents are real
decisions; the long tail of short ones is "sand" that fills whatever gaps remain, so the model
holds the heavy ones as booleans and the sand as one integer amount per replica, and the sand is
then poured greedily to meet those amounts. The hint, LPT for the heavy documents with the sand
water-filled over them, is also the fallback: CP-SAT's answer is used only when it beats it (a
FEASIBLE answer under a short time limit on a loaded machine can be worse than its own hint).

DP-Merge: a document heavier than `merge_threshold` x the mean replica load cannot be balanced
by any assignment; it goes to a merge group of k replicas (a power of two dividing dp) that run
it together with context parallelism, and contributes 1/k of its cost to each member.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
from ortools.sat.python import cp_model

from ...config import PlannerTunables
from ..outcomes import CpSatOutcome


@dataclass
class MergeGroup:
    dp_ranks: list[int]
    sample_indices: list[int]


@dataclass
class Assignment:
    """Document indices per replica, merge groups, and what the solver returned."""

    replica_samples: list[list[int]]
    merge_groups: list[MergeGroup]
    replica_loads: list[float]
    outcome: CpSatOutcome = CpSatOutcome(CpSatOutcome.TRIVIAL)

    @property
    def solver(self) -> dict:
        """The outcome as the plan metadata's "phase1" entry (`CpSatOutcome.to_dict`)."""
        return self.outcome.to_dict()


def assign_to_replicas(
    costs: np.ndarray,
    dp: int,
    *,
    time_limit_s: float = 0.5,
    deterministic_limit: float | None = None,
    seed: int = 0,
    workers: int = 1,
    dp_merge: bool = True,
    merge_threshold: float = 1.0,
    min_group: np.ndarray | None = None,
    merged_cost: Callable[[int, int], float] | None = None,
    tunables: PlannerTunables = PlannerTunables(),
) -> Assignment:
    """Balance `costs` (seconds per document) over `dp` replicas. `min_group[i]` > 1 says document
    i only fits memory when that many replicas share it (DP-Merge driven by memory);
    `merged_cost(i, k)` is what document i costs each of k replicas sharing it (default: an even
    split at 90% efficiency). `tunables`: how many documents CP-SAT decides, at what resolution,
    and how much of the sand is dealt one by one."""
    costs = np.asarray(costs, dtype=float)
    started = time.perf_counter()
    fixed_load = np.zeros(dp)
    min_group = np.ones(len(costs), dtype=int) if min_group is None else np.asarray(min_group, dtype=int)
    merged_cost = merged_cost or (lambda index, size: costs[index] / (0.9 * size))
    merge_groups = (_merge_outliers(costs, dp, merge_threshold, merged_cost, fixed_load, min_group)
                    if dp_merge and dp > 1 else [])
    unmerged = np.ones(len(costs), dtype=bool)
    unmerged[[i for group in merge_groups for i in group.sample_indices]] = False
    by_cost = np.argsort(-costs, kind="stable")
    free = by_cost[unmerged[by_cost]].astype(int)  # heaviest first, ~10^5 documents

    if dp == 1:
        replicas, outcome = [free.tolist()], CpSatOutcome(CpSatOutcome.TRIVIAL)
    else:
        replicas, outcome = _solve(costs, free, fixed_load, time_limit_s, deterministic_limit, seed, workers,
                                   tunables)
    loads = [fixed_load[r] + costs[replicas[r]].sum() for r in range(dp)]
    outcome = replace(outcome, time_s=time.perf_counter() - started,
                      imbalance=max(loads) / (sum(loads) / dp) if sum(loads) > 0 else 1.0)
    return Assignment([sorted(r) for r in replicas], merge_groups, loads, outcome)


def _merge_outliers(
    costs: np.ndarray, dp: int, threshold: float, merged_cost, fixed_load: np.ndarray, min_group: np.ndarray
) -> list[MergeGroup]:
    """Give each outlier (too heavy to balance, or too long to fit one replica's memory) a group of
    k ranks, k the smallest power of two dividing dp that tames it. Outliers given the same block
    of ranks share one merge group, so the block runs them as one pipeline."""
    mean_load = costs.sum() / dp
    groups: dict[tuple[int, ...], MergeGroup] = {}
    outliers = np.flatnonzero((costs > threshold * mean_load) | (min_group > 1))
    for index in outliers[np.argsort(-costs[outliers], kind="stable")]:
        heavy = costs[index] > threshold * mean_load
        size = max(2, int(min_group[index]))
        while heavy and size < dp and merged_cost(index, size) > threshold * mean_load:
            size *= 2
        if size > dp or dp % size:
            continue  # cannot merge here: the planner's memory check reports it
        # the least-loaded block of `size` consecutive ranks (the first of equal ones)
        start = int(np.argmin(fixed_load.reshape(-1, size).sum(axis=1))) * size
        ranks = tuple(range(start, start + size))
        fixed_load[start:start + size] += merged_cost(index, size)
        if ranks not in groups:  # thousands of outliers where memory merges every sliced document
            groups[ranks] = MergeGroup(list(ranks), [])
        groups[ranks].sample_indices.append(int(index))
    return list(groups.values())


def _lpt(costs: np.ndarray, order: np.ndarray, fixed_load: np.ndarray) -> list[list[int]]:
    """Longest processing time first: each document to the currently lightest replica."""
    heap = [(load, rank) for rank, load in enumerate(fixed_load)]
    heapq.heapify(heap)
    replicas: list[list[int]] = [[] for _ in fixed_load]
    for index in order:
        load, rank = heapq.heappop(heap)
        replicas[rank].append(int(index))
        heapq.heappush(heap, (load + costs[index], rank))
    return replicas


@dataclass
class _Hint:
    """LPT for the heavy documents, sand water-filled over them (costs scaled to integers)."""

    rank_of: dict[int, int]
    sand_amounts: list[int]
    makespan: int


def _hint(scaled: dict[int, int], heavy: np.ndarray, costs: np.ndarray, fixed_load: np.ndarray, fixed: list[int],
          sand_total: int) -> _Hint:
    rank_of = {i: r for r, members in enumerate(_lpt(costs, heavy, fixed_load)) for i in members}
    loads = list(fixed)
    for index, rank in rank_of.items():
        loads[rank] += scaled[index]
    amounts = _water_fill(loads, sand_total)
    return _Hint(rank_of, amounts, max(load + amount for load, amount in zip(loads, amounts)))


def _solve(
    costs: np.ndarray, order: np.ndarray, fixed_load: np.ndarray, time_limit_s: float,
    deterministic_limit: float | None, seed: int, workers: int, tunables: PlannerTunables,
) -> tuple[list[list[int]], CpSatOutcome]:
    scale = tunables.cost_scale
    heavy, sand = order[:tunables.max_model_items], order[tunables.max_model_items:]
    scaled = {int(i): int(round(costs[i] * scale)) for i in heavy}
    sand_total = int(round(costs[sand].sum() * scale))
    fixed = [int(round(load * scale)) for load in fixed_load]
    hint = _hint(scaled, heavy, costs, fixed_load, fixed, sand_total)
    at_bound = CpSatOutcome(CpSatOutcome.HINT_AT_BOUND, heavy_items=int(len(heavy)), sand_items=int(len(sand)),
                            hint_makespan=hint.makespan / scale)  # a solve replaces the status
    bound = _load_bound(scaled, fixed, sand_total)
    if hint.makespan <= bound:
        # No assignment beats one at the bound, and CP-SAT's is used only where it beats the hint:
        # the solve would give this assignment (a 10^5-document batch's sand levels the hint
        # almost always; sampled at 256K, such solves and their models took 12% of a layout's planning).
        outcome = replace(at_bound, makespan=hint.makespan / scale, bound=bound / scale, gap=0.0, source="hint")
        return _poured(costs, sand, heavy, hint.rank_of, hint.sand_amounts, len(fixed_load), tunables), outcome
    model, assign, sand_amount = _build_model(scaled, heavy, fixed, sand_total, hint)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    if deterministic_limit is not None:
        solver.parameters.max_deterministic_time = deterministic_limit
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = workers
    solver.parameters.catch_sigint_signal = False  # Ctrl-C reaches Python as KeyboardInterrupt, not a shortened solve
    # Presolve's symmetry breaking would otherwise declare the LPT hint infeasible and drop it.
    solver.parameters.keep_all_feasible_solutions_in_presolve = True
    status = solver.solve(model)
    outcome = replace(at_bound, status=solver.status_name(status))
    limits = f"{time_limit_s}s" + ("" if deterministic_limit is None else f" ({deterministic_limit} deterministic)")
    # Every status, as the OR-Tools samples check them: a solution (OPTIMAL, FEASIBLE) is used
    # where it beats the hint; otherwise the hint is, and `fallback` says why.
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        objective, solver_bound = solver.objective_value, solver.best_objective_bound
        outcome = replace(outcome, makespan=objective / scale, bound=solver_bound / scale,
                          gap=(objective - solver_bound) / objective if objective else 0.0)
        use_hint = objective >= hint.makespan
        if objective > hint.makespan:
            fallback: str | None = (f"CP-SAT returned {outcome.status} within {limits}, worse than its hint "
                                    f"({outcome.makespan:.6g} vs {outcome.hint_makespan:.6g}); using the LPT hint")
        else:
            fallback = None
    elif status == cp_model.INFEASIBLE:
        # The hint satisfies every constraint: the model itself is wrong.
        use_hint, fallback = True, ("CP-SAT returned INFEASIBLE for a model its hint satisfies (a modelling "
                                    "error); using the LPT hint")
    elif status == cp_model.MODEL_INVALID:
        use_hint, fallback = True, f"CP-SAT returned MODEL_INVALID ({model.validate()}); using the LPT hint"
    else:  # UNKNOWN: no solution within the limits
        use_hint, fallback = True, f"CP-SAT returned {outcome.status} within {limits}; using the LPT hint"
    outcome = replace(outcome, source="hint" if use_hint else "cp-sat", fallback=fallback)
    if use_hint:
        return _poured(costs, sand, heavy, hint.rank_of, hint.sand_amounts, len(fixed_load), tunables), outcome
    rank_of = {int(index): next(r for r in range(len(fixed_load)) if solver.value(assign[int(index), r]))
               for index in heavy}
    amounts = [solver.value(amount) for amount in sand_amount]
    return _poured(costs, sand, heavy, rank_of, amounts, len(fixed_load), tunables), outcome


def _load_bound(scaled: dict[int, int], fixed: list[int], sand_total: int) -> int:
    """No assignment's makespan is below this: the mean load (rounded up, loads are integers),
    the heaviest fixed load, and the heaviest document on the least-loaded replica."""
    total = sum(scaled.values()) + sand_total + sum(fixed)
    heaviest = max(scaled.values(), default=0) + min(fixed)
    return max(-(-total // len(fixed)), max(fixed), heaviest)


def _poured(costs: np.ndarray, sand: np.ndarray, heavy: np.ndarray, rank_of: dict[int, int], amounts: list[int],
            dp: int, tunables: PlannerTunables) -> list[list[int]]:
    """The replicas of an assignment: each heavy document on its rank, the sand poured to each
    replica's amount (scaled)."""
    replicas: list[list[int]] = [[] for _ in range(dp)]
    for index in map(int, heavy):
        replicas[rank_of[index]].append(index)
    targets = [amount / tunables.cost_scale for amount in amounts]
    _pour_sand(costs, sand, replicas, targets, tunables.dealt_sand_per_replica)
    return replicas


class _CpModel(cp_model.CpModel):
    """OR-Tools' CpModel (9.15) binds camelCase aliases of its methods onto each instance, a
    reference cycle: every model, with its C++ proto, then lives until the cyclic collector runs.
    A layout search pauses the collector and plans hundreds of layouts, and those models held
    gigabytes. We use only the snake_case API, so the aliases are not made."""

    def _add_pre_pep8_methods(self) -> None:
        pass


def _build_model(scaled: dict[int, int], heavy: np.ndarray, fixed: list[int], sand_total: int, hint: _Hint):
    """min makespan s.t. each heavy document on one replica; sand split freely (integer amounts)."""
    dp = len(fixed)
    model = _CpModel()
    upper = sum(scaled.values()) + sand_total + max(fixed)
    assign = {}
    for index in heavy:
        index = int(index)
        for rank in range(dp):
            assign[index, rank] = model.new_bool_var(f"doc{index}_on_{rank}")
            model.add_hint(assign[index, rank], hint.rank_of.get(index) == rank)
        model.add_exactly_one(assign[index, rank] for rank in range(dp))
    sand_amount = [model.new_int_var(0, sand_total, f"sand_{rank}") for rank in range(dp)]
    model.add(sum(sand_amount) == sand_total)
    for rank, amount in enumerate(hint.sand_amounts):
        model.add_hint(sand_amount[rank], amount)
    makespan = model.new_int_var(0, upper, "makespan")
    model.add_hint(makespan, hint.makespan)
    for rank in range(dp):
        load = sum(scaled[int(i)] * assign[int(i), rank] for i in heavy) + sand_amount[rank] + fixed[rank]
        model.add(load <= makespan)
    # Replicas are interchangeable when they carry no fixed load: break the symmetry.
    if len(heavy) and not any(fixed):
        model.add(assign[int(heavy[0]), 0] == 1)
    model.minimize(makespan)
    return model, assign, sand_amount


def _water_fill(loads: list[int], total: int) -> list[int]:
    """Integer amounts summing to `total` that raise the lowest loads to a common level."""
    order = sorted(range(len(loads)), key=lambda r: loads[r])
    amounts = [0] * len(loads)
    remaining = total
    for count in range(1, len(order) + 1):
        group = order[:count]
        level = loads[order[0]] + amounts[order[0]]  # the group's members share this level
        if count < len(order) and (loads[order[count]] - level) * count <= remaining:
            rise = loads[order[count]] - level
            for rank in group:
                amounts[rank] += rise
            remaining -= rise * count
            continue
        share, extra = divmod(remaining, count)
        for position, rank in enumerate(group):
            amounts[rank] += share + (1 if position < extra else 0)
        return amounts
    return amounts


# The light tail of the sand is poured in up to this many strata of as many documents (largest
# first), each split over the replicas by what they still lack: every replica gets documents of
# every size. Poured in one run, the first replica took the largest tail documents and the last
# the smallest, and their MicroPacks filled unevenly (llama-70b 64K Wikipedia, tp8 pp4 dp4: packs
# 89.8% full on the first replica, 99.7% on the last, whose planned makespans spread 1.9%). A
# stratum holds at least TAIL_PER_STRATUM documents a replica, so a short tail is poured in
# fewer, down to one run.
SAND_STRATA = 256
TAIL_PER_STRATUM = 64


def _pour_sand(costs, sand, replicas, targets, dealt_per_replica: int) -> None:
    """Deal the sand (largest first) so each replica meets its target: the heavy head
    (`dealt_per_replica` documents per replica) one document at a time to the replica furthest
    below its target, then the light tail, each no heavier than any of those, in strata
    (`_pour_tail`). Each replica ends within about one tail document of its target, even when the
    sand's head holds whole long documents (a batch with more long ones than CP-SAT decides,
    `PlannerTunables.max_model_items`)."""
    if len(sand) == 0:
        return
    dealt = min(len(sand), dealt_per_replica * len(replicas))
    head, tail = sand[:dealt], sand[dealt:]
    gaps = [(-target, rank) for rank, target in enumerate(targets)]  # (minus the amount still wanted, rank)
    heapq.heapify(gaps)
    for index, cost in zip(head.tolist(), costs[head].tolist()):
        wanted, rank = heapq.heappop(gaps)
        replicas[rank].append(index)
        heapq.heappush(gaps, (wanted + cost, rank))
    if len(tail) == 0:
        return
    lacking = np.zeros(len(replicas))
    for wanted, rank in gaps:
        lacking[rank] = max(-wanted, 0.0)
    _pour_tail(costs, tail, replicas, lacking)


def _pour_tail(costs, tail, replicas, lacking: np.ndarray) -> None:
    """The tail (largest first) poured in strata of as many documents (`SAND_STRATA`). Each stratum
    is cut into contiguous runs, one a replica, in proportion to what each still lacks (scaled to the
    tail's cost), so a replica's share of one stratum makes up for what the ones before gave it too
    much or too little; the replica that takes the stratum's largest documents rotates."""
    tail_costs = costs[tail]
    total = float(tail_costs.sum())
    lacking = lacking * (total / lacking.sum()) if lacking.sum() > 0 else np.full(len(replicas), total / len(replicas))
    strata = max(1, min(SAND_STRATA, len(tail) // (TAIL_PER_STRATUM * len(replicas))))
    cuts = len(tail) * np.arange(1, strata) // strata
    owner = np.empty(len(tail), dtype=np.int64)
    for stratum, (start, stop) in enumerate(zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [len(tail)])))):
        if start == stop:
            continue
        order = np.roll(np.arange(len(replicas)), -stratum)
        stratum_costs = tail_costs[start:stop]
        wanted = np.maximum(lacking[order], 0.0)
        wanted = wanted if wanted.sum() > 0 else np.ones(len(replicas))
        boundaries = np.cumsum(wanted * (stratum_costs.sum() / wanted.sum()))[:-1]
        slot = np.searchsorted(boundaries, np.cumsum(stratum_costs) - stratum_costs / 2, side="right")
        owner[start:stop] = order[slot]
        lacking -= np.bincount(owner[start:stop], weights=stratum_costs, minlength=len(replicas))
    for rank in range(len(replicas)):
        replicas[rank].extend(tail[owner == rank].tolist())
