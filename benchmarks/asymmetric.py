"""Asymmetric Partitioning at work: the 1F1B stall asymmetric units could remove, why the
planner's units hold one MicroPack, and what other units give in the simulator.

The cell: llama-70b, 128K context, tp4 pp8 dp4 (cp 1), selective recompute, 512 Wikipedia sequences
(the first batch of seed 0), analytic h100-sxm model; CP-SAT stops on its deterministic limit, so the
plan is the same on any machine (as in tests/test_golden_plans.py).

    python benchmarks/asymmetric.py                       # everything (about 35 s on 2 cores)
    python benchmarks/asymmetric.py --only stall          # the cell: idle time, ratios, constant ratio
    python benchmarks/asymmetric.py --only cell           # ... and the units tried, hand-built alternatives
    python benchmarks/asymmetric.py --only constructed    # the constructed cases (tests/test_asymmetric_units.py)
    python benchmarks/asymmetric.py --only alternating    # MicroPacks whose ratios alternate one by one

Sections:
- idle time: per pipeline stage (mean over the DP ranks), from the simulator's task records: busy
  seconds, and idle seconds split by where the gap lies in its replica's stage order: warm-up
  (before the replica's first backward on the stage; includes the fill after the previous replica),
  steady (between the first backward and the last forward), cool-down (after the last forward), and
  the tail (after the stage's last task, until the step ends: DP imbalance and gradient reduction);
  and the busiest stage's steady idle by replica.
- ratios: per replica, the spread over MicroPacks of backward/forward seconds (middle stage).
- constant ratio: the same plan simulated with every MicroPack's backward set to a constant multiple
  of its forward (the plan's own backward/forward totals per layout): the stall unequal ratios cause.
- alternatives: each own replica's MicroPacks regrouped (k per unit, asymmetric: forward units
  balanced on forward seconds, backward units on backward seconds; symmetric: the planner's
  `slimpack-sym` segmentation; forward units of 2 with backward units of 1; half-size MicroPacks),
  with the planner's 1F1B orders, spliced into the plan and simulated whole (makespan, peak memory).
- constructed: long documents sliced into chains among short ones, llama-7b pp4 dp1, where memory
  keeps one-MicroPack units from running a chain's forwards ahead.
- alternating: hand-built MicroPacks whose backward/forward ratios alternate one by one.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

import megatron_slimpack as ms
from megatron_slimpack.plan import Plan, ReplicaPlan, Sample, pack_figures
from megatron_slimpack.planner.slimpack.memory import activation_budget
from megatron_slimpack.planner.slimpack.pack_phase import (
    MicroPackCosts,
    PackOptions,
    SortedSamples,
    UnitCandidate,
    pack_micropacks,
)
from megatron_slimpack.planner.slimpack.replica import unit_candidates
from megatron_slimpack.planner.work import WorkRates
from megatron_slimpack.simulator.dag import SimulationReport, simulate
from megatron_slimpack.workload import GlobalBatchSampler, load_lengths

ROOT = Path(__file__).resolve().parents[1]
WIKIPEDIA = f"file:{ROOT.parent / 'shared' / 'data' / 'wikipedia_lengths.txt'}"
K = 1024
GIB = 2**30


# ---- the cell ----------------------------------------------------------------------------------
def cell_plan(strategy: str = "slimpack", model: str = "llama-70b", context: int = 128 * K,
              parallel: ms.ParallelConfig | None = None, sequences: int = 512):
    """(plan, cost) of the cell, planned as tests/test_golden_plans.py plans (deterministic limit)."""
    parallel = parallel or ms.ParallelConfig(dp=4, pp=8, tp=4, recompute="selective")
    # Wikipedia holds documents longer than the context: cut at it (the paper's setting).
    batch = GlobalBatchSampler(load_lengths(WIKIPEDIA), context, sequences, seed=0, long_documents="split").next_batch()
    cost = ms.CostModel.analytic(model, "h100-sxm")
    config = ms.SlimPackConfig(strategy=strategy, context_length=context, solver_time_limit_s=120.0,
                               solver_deterministic_limit=0.5)
    plan = ms.plan(batch.lengths, parallel=parallel, cost=cost, config=config, sources=batch.sources)
    return plan, cost


def effective(plan: Plan, replica: ReplicaPlan) -> ms.ParallelConfig:
    """The layout a replica's tasks run with (a merge group of k ranks: k-fold CP)."""
    return plan.parallel.with_(cp=plan.parallel.cp * len(replica.dp_ranks))


def singleton_share(plan: Plan) -> tuple[int, int, int]:
    """(forward units, backward units, units of one MicroPack) over all replicas."""
    forward = sum(len(r.forward_units) for r in plan.replicas)
    backward = sum(len(r.backward_units) for r in plan.replicas)
    single = sum(len(u) == 1 for r in plan.replicas for u in r.forward_units + r.backward_units)
    return forward, backward, single


# ---- item 1: where the idle time lies ------------------------------------------------------------
PHASES = ("warm-up", "steady", "cool-down", "tail")


def stall_breakdown(plan: Plan, report: SimulationReport) -> dict[str, np.ndarray]:
    """Per stage, mean over ranks: busy seconds and idle seconds by phase (see the module doc).
    busy + all idle phases = the iteration time on every device."""
    pp, dp = plan.parallel.pp, plan.parallel.dp
    phase_of: dict[tuple[int, int, str, int], int] = {}  # (replica, stage, kind, unit) -> phase index
    for index, replica in enumerate(plan.replicas):
        for stage, order in enumerate(replica.stage_orders):
            kinds = [kind for kind, _ in order]
            first_b = kinds.index("B") if "B" in kinds else len(order)
            last_f = len(kinds) - 1 - kinds[::-1].index("F") if "F" in kinds else -1
            for position, (kind, unit) in enumerate(order):
                phase = 0 if position < first_b else (1 if position <= last_f else 2)
                phase_of[(index, stage, kind, unit)] = phase
    busy = np.zeros((dp, pp))
    idle = np.zeros((len(PHASES), dp, pp))
    by_device: dict[tuple[int, int], list] = {}
    for task in report.tasks:
        if task.kind in ("F", "B"):
            by_device.setdefault((task.rank, task.stage), []).append(task)
    steady_by_replica = np.zeros((len(plan.replicas), pp))  # steady idle, summed over ranks
    for (rank, stage), tasks in by_device.items():
        tasks.sort(key=lambda t: t.start)
        clock = 0.0
        for task in tasks:
            phase = phase_of[(task.replica, stage, task.kind, task.unit)]
            idle[phase, rank, stage] += max(0.0, task.start - clock)
            if phase == 1:
                steady_by_replica[task.replica, stage] += max(0.0, task.start - clock)
            busy[rank, stage] += task.end - task.start
            clock = max(clock, task.end)
        idle[3, rank, stage] += report.iteration_time_s - clock
    out = {"busy": busy.mean(axis=0), "steady_by_replica": steady_by_replica}
    for phase, values in zip(PHASES, idle):
        out[phase] = values.mean(axis=0)
    out["steady_max_rank"] = idle[1].max(axis=0)
    return out


def print_stall(plan: Plan, report: SimulationReport) -> dict[str, np.ndarray]:
    table = stall_breakdown(plan, report)
    print(f"iteration {report.iteration_time_s:.3f} s; lower bound {report.lower_bound_s:.3f} s "
          f"(work {report.work_bound_s:.3f} s, critical path {report.critical_path_s:.3f} s); "
          f"bubble {100 * report.bubble_ratio:.2f}%; busiest device {max(map(max, report.device_busy_s)):.3f} s")
    print("| stage | busy s | idle s | warm-up | steady | cool-down | tail | steady, worst rank |")
    print("|---|---|---|---|---|---|---|---|")
    for stage in range(plan.parallel.pp):
        idle = sum(table[p][stage] for p in PHASES)
        print(f"| {stage} | {table['busy'][stage]:.2f} | {idle:.2f} | "
              + " | ".join(f"{table[p][stage]:.2f}" for p in PHASES)
              + f" | {table['steady_max_rank'][stage]:.2f} |")
    total = {p: float(table[p].mean()) for p in ("busy",) + PHASES}
    print(f"| mean | {total['busy']:.2f} | {sum(total[p] for p in PHASES):.2f} | "
          + " | ".join(f"{total[p]:.2f}" for p in PHASES) + " | |")
    busiest = int(np.argmax(table["busy"]))
    if len(plan.replicas) > 1:
        shares = ", ".join(f"replica {index} {plan.replicas[index].dp_ranks}: {seconds:.2f} s"
                           for index, seconds in enumerate(table["steady_by_replica"][:, busiest]) if seconds > 0)
        print(f"\nSteady-state idle of the busiest stage ({busiest}), by replica (summed over its ranks): {shares}")
    return table


# ---- item 2: backward/forward ratios ---------------------------------------------------------------
def ratio_rows(plan: Plan, cost) -> list[dict]:
    rows = []
    for index, replica in enumerate(plan.replicas):
        if not replica.micropacks:
            continue
        parallel = effective(plan, replica)
        figures = pack_figures(replica.micropacks)
        forward = np.asarray(cost.forward_time(figures.tokens, figures.pairs, parallel), dtype=float)
        backward = np.asarray(cost.backward_time(figures.tokens, figures.pairs, parallel), dtype=float)
        ratio = backward / forward
        rows.append(dict(replica=index, ranks=replica.dp_ranks, micropacks=len(replica.micropacks),
                         tokens_median=float(np.median(figures.tokens)),
                         forward_cv=float(forward.std() / forward.mean()),
                         backward_cv=float(backward.std() / backward.mean()),
                         ratio=np.percentile(ratio, [0, 5, 50, 95, 100]),
                         ratio_cv=float(ratio.std() / ratio.mean()),
                         forward_median=float(np.median(forward))))
    return rows


def print_ratios(plan: Plan, cost) -> None:
    print("| replica | ranks | MicroPacks | median tokens | median F s | F cv | B cv | B/F min | p5 | p50 | p95 | max "
          "| B/F cv |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in ratio_rows(plan, cost):
        print(f"| {row['replica']} | {row['ranks']} | {row['micropacks']} | {row['tokens_median']:.0f} | "
              f"{row['forward_median']:.4f} | {row['forward_cv']:.3f} | {row['backward_cv']:.3f} | "
              + " | ".join(f"{v:.3f}" for v in row["ratio"]) + f" | {row['ratio_cv']:.4f} |")


class ConstantRatioCost:
    """A cost model whose backward is `ratio[(layout, last stage)]` times its forward (the rest
    delegated): the plan's backward/forward totals kept, the spread between MicroPacks removed."""

    def __init__(self, cost, ratios: dict):
        self._cost, self._ratios = cost, ratios

    def __getattr__(self, name):
        return getattr(self._cost, name)

    def backward_time(self, tokens, pairs, parallel, last_stage: bool = False):
        return self._ratios[(parallel, bool(last_stage))] * self._cost.forward_time(tokens, pairs, parallel,
                                                                                     last_stage=last_stage)


def constant_ratio_cost(plan: Plan, cost) -> ConstantRatioCost:
    totals: dict = {}
    for replica in plan.replicas:
        if not replica.micropacks:
            continue
        parallel = effective(plan, replica)
        figures = pack_figures(replica.micropacks)
        for last in (False, True):
            f = float(np.sum(cost.forward_time(figures.tokens, figures.pairs, parallel, last_stage=last)))
            b = float(np.sum(cost.backward_time(figures.tokens, figures.pairs, parallel, last_stage=last)))
            entry = totals.setdefault((parallel, last), [0.0, 0.0])
            entry[0] += f
            entry[1] += b
    return ConstantRatioCost(cost, {key: b / f for key, (f, b) in totals.items()})


# ---- item 2: hand-built units ------------------------------------------------------------------------
def with_replica(plan: Plan, index: int, replica: ReplicaPlan) -> Plan:
    replicas = list(plan.replicas)
    replicas[index] = replica
    return replace(plan, replicas=replicas)


def regrouped(micropacks, cost, parallel: ms.ParallelConfig, dp_ranks, units: int, symmetric: bool,
              budget: float) -> tuple[ReplicaPlan, float]:
    """The planner's own segmentation and 1F1B orders for `units` units (asymmetric: forward units
    balanced on forward seconds, backward units on backward seconds over the backward sequence);
    returns the replica and its activation peak as the planner estimates it."""
    costs = MicroPackCosts.of(micropacks, cost, parallel)
    candidate = UnitCandidate.of(micropacks, costs, units, symmetric, cost, parallel, budget)
    ordered = candidate.order(list(dp_ranks), budget - costs.largest_recompute_bytes)
    return ordered.replica, ordered.peak_activation_bytes + costs.largest_recompute_bytes


def paired(micropacks, cost, parallel: ms.ParallelConfig, dp_ranks, budget: float) -> tuple[ReplicaPlan, float]:
    """Forward units of two MicroPacks, backward units of one (`UnitCandidate.paired`), the
    planner's orders."""
    costs = MicroPackCosts.of(micropacks, cost, parallel)
    candidate = UnitCandidate.paired(micropacks, costs, cost, parallel, budget)
    ordered = candidate.order(list(dp_ranks), budget - costs.largest_recompute_bytes)
    return ordered.replica, ordered.peak_activation_bytes + costs.largest_recompute_bytes


def repacked(plan: Plan, replica: ReplicaPlan, cost, micropack_tokens: int, token_cap: int):
    """The replica's documents packed again into MicroPacks of `micropack_tokens` (the planner's
    even-cost packing), with the rates of the planner's phase 2."""
    parallel = effective(plan, replica)
    lengths = plan.sample_lengths()
    samples = [Sample(sid, lengths[sid]) for sid in sorted(set(replica.sample_ids))]
    rates = WorkRates.from_cost(cost, parallel, token_cap)
    options = PackOptions(micropack_tokens, micropack_tokens, even_costs=parallel.pp > 1)
    return pack_micropacks(SortedSamples(samples, rates), options, rates)


def alternatives(plan: Plan, cost, report: SimulationReport, per_unit=(2, 3, 4)) -> list[dict]:
    """Each own (non-merge) replica regrouped at once; the merge groups keep their units."""
    rows = []
    base = dict(name="planner (1 MicroPack per unit)", makespan=report.iteration_time_s,
                peak=max(report.peak_memory_bytes), fits=report.fits_memory)
    rows.append(base)
    own = [i for i, r in enumerate(plan.replicas) if len(r.dp_ranks) == 1 and r.micropacks]
    budget = activation_budget(cost, plan.parallel)

    def evaluate(name: str, build) -> None:
        altered, estimate = plan, 0.0
        for index in own:
            replica, peak = build(plan.replicas[index])
            estimate = max(estimate, peak)
            altered = with_replica(altered, index, replica)
        altered.validate()
        simulated = simulate(altered, cost, detail=False)
        rows.append(dict(name=name, makespan=simulated.iteration_time_s, peak=max(simulated.peak_memory_bytes),
                         fits=simulated.fits_memory, planner_peak=estimate, budget=budget))

    for k in per_unit:
        for symmetric in (False, True):
            label = "symmetric" if symmetric else "asymmetric"
            evaluate(f"{k} MicroPacks per unit, {label}",
                     lambda r, k=k, symmetric=symmetric: regrouped(
                         r.micropacks, cost, plan.parallel, r.dp_ranks, max(1, len(r.micropacks) // k), symmetric,
                         budget))
    evaluate("forward units of 2 MicroPacks, backward units of 1",
             lambda r: paired(r.micropacks, cost, plan.parallel, r.dp_ranks, budget))
    cap = plan.max_micropack_tokens
    sizes = {tuple(entry["dp_ranks"]): entry["micropack_tokens"] for entry in plan.metadata["replicas"]}
    size = min(sizes[tuple(plan.replicas[index].dp_ranks)] for index in own)
    for symmetric in (False, True):
        label = "symmetric" if symmetric else "asymmetric"

        def finer(r, symmetric=symmetric):
            micropacks = repacked(plan, r, cost, size // 2, cap)
            return regrouped(micropacks, cost, plan.parallel, r.dp_ranks, max(1, len(micropacks) // 2), symmetric,
                             budget)
        evaluate(f"half-size MicroPacks ({size // 2} tokens), 2 per unit, {label}", finer)

    def finer_single(r):
        micropacks = repacked(plan, r, cost, size // 2, cap)
        return regrouped(micropacks, cost, plan.parallel, r.dp_ranks, len(micropacks), False, budget)
    evaluate(f"half-size MicroPacks ({size // 2} tokens), 1 per unit", finer_single)
    return rows


def print_candidates(plan: Plan) -> None:
    """The unit counts the planner's search tries for each replica (`replica.unit_candidates`)."""
    for index, replica in enumerate(plan.replicas):
        count = len(replica.micropacks)
        if not count:
            continue
        tried = unit_candidates(plan.parallel.pp, count)
        print(f"- replica {index} {replica.dp_ranks}: {count} MicroPacks; unit counts tried {tried} "
              f"(MicroPacks per unit: {', '.join(f'{count / units:.1f}' for units in tried)})")


def print_alternatives(rows: list[dict]) -> None:
    base = rows[0]["makespan"]
    print("| own replicas' units | makespan s | vs planner | peak memory GiB | fits |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['name']} | {row['makespan']:.3f} | {100 * (row['makespan'] / base - 1):+.2f}% | "
              f"{row['peak'] / GIB:.1f} | {row['fits']} |")


# ---- item 3: the constructed case (tests/test_asymmetric_units.py) --------------------------------------
def constructed(documents: int = 2, short: int = 2000, tp: int = 4) -> dict:
    """`documents` 128K documents among `short` short ones (seed 0, 100-2999 tokens), llama-7b, tp`tp`
    pp4, one replica, selective recompute: the planner's symmetric plan, the planner's plan, and
    forward pairs / backward singles on the symmetric plan's MicroPacks."""
    cost = ms.CostModel.analytic("llama-7b", "h100-sxm")
    parallel = ms.ParallelConfig(dp=1, pp=4, tp=tp, recompute="selective")
    lengths = [128 * K] * documents + np.random.default_rng(0).integers(100, 3000, size=short).tolist()
    plans = {}
    for strategy in ("slimpack-sym", "slimpack"):
        config = ms.SlimPackConfig(strategy=strategy, context_length=128 * K, solver_time_limit_s=30.0,
                                   solver_deterministic_limit=0.2)
        plans[strategy] = ms.plan(lengths, parallel=parallel, cost=cost, config=config)
    sym = plans["slimpack-sym"]
    replica = sym.replicas[0]
    budget = activation_budget(cost, parallel)
    hand, _ = paired(replica.micropacks, cost, parallel, replica.dp_ranks, budget)
    plans["paired units on the symmetric plan's MicroPacks"] = with_replica(sym, 0, hand)
    plans["1 MicroPack per unit, warm-up 2(pp-1-s), fastest chain lead that fits"] = deeper_singletons(
        sym, cost, budget)
    for units in ((len(replica.micropacks) + 1) // 2,):
        for symmetric in (False, True):
            grouped, _ = regrouped(replica.micropacks, cost, parallel, replica.dp_ranks, units, symmetric, budget)
            label = "symmetric" if symmetric else "asymmetric"
            plans[f"2 MicroPacks per unit, {label}, on the same MicroPacks"] = with_replica(sym, 0, grouped)
    return {"cost": cost, "plans": plans}


def deeper_singletons(plan: Plan, cost, budget: float) -> Plan:
    """One replica's MicroPacks in units of one, each stage two units ahead of the next
    (`forward_targets` with warm-ups 2(pp-1-s)); of the chain leads None, pp, pp/2 and 0 the
    fastest whose simulated peak fits (else the leanest)."""
    from megatron_slimpack.planner.orders import forward_targets, orders_of_targets

    replica, pp = plan.replicas[0], plan.parallel.pp
    forward_units = [[mp] for mp in range(len(replica.micropacks))]
    backward_units = [[mp] for mp in replica.backward_sequence()]
    best = None
    for lead in (None, pp, pp // 2, 0):
        targets = forward_targets(forward_units, backward_units, [2 * (pp - 1 - s) for s in range(pp)], lead)
        altered = with_replica(plan, 0, ReplicaPlan(replica.micropacks, forward_units, backward_units,
                                                    orders_of_targets(targets), replica.dp_ranks))
        report = simulate(altered, cost, detail=False)
        key = (not report.fits_memory, report.iteration_time_s if report.fits_memory else max(report.peak_memory_bytes))
        if best is None or key < best[0]:
            best = (key, altered)
    return best[1]


def print_constructed(documents: int = 2, short: int = 2000, tp: int = 4, stall: bool = True) -> None:
    case = constructed(documents, short, tp)
    cost, plans = case["cost"], case["plans"]
    base = simulate(plans["slimpack-sym"], cost, detail=False).iteration_time_s
    print(f"\n### {documents} x 128K + {short} short documents, llama-7b tp{tp} pp4 dp1 rc-selective\n")
    print("| plan | MicroPacks | forward units | backward units | makespan s | vs slimpack-sym | peak GiB | fits |")
    print("|---|---|---|---|---|---|---|---|")
    for name, plan in plans.items():
        report = simulate(plan, cost, detail=False)
        replica = plan.replicas[0]
        print(f"| {name} | {len(replica.micropacks)} | {len(replica.forward_units)} | {len(replica.backward_units)} | "
              f"{report.iteration_time_s:.3f} | {100 * (report.iteration_time_s / base - 1):+.2f}% | "
              f"{max(report.peak_memory_bytes) / GIB:.1f} | {report.fits_memory} |")
    flat = constant_ratio_cost(plans["slimpack-sym"], cost)
    times = {name: simulate(plans[name], flat, detail=False).iteration_time_s for name in ("slimpack-sym", "slimpack")}
    print(f"\nWith one backward/forward ratio for all MicroPacks (`ConstantRatioCost`): slimpack-sym "
          f"{times['slimpack-sym']:.3f} s, slimpack {times['slimpack']:.3f} s "
          f"({100 * (times['slimpack'] / times['slimpack-sym'] - 1):+.2f}%)")
    if stall:
        for name in ("slimpack-sym", "slimpack"):
            print(f"\nIdle time per stage, {name}:\n")
            print_stall(plans[name], simulate(plans[name], cost))


# ---- a pure ratio-alternation case -----------------------------------------------------------------------
def alternating(pairs: int = 128, document: int = 16 * K, short: int = 512) -> None:
    """Hand-built MicroPacks that alternate between one whole `document`-token document (attention
    heavy: the higher backward/forward ratio) and a pack of `short`-token documents of the same
    total seconds (linear: the lower ratio), `pairs` of each, on a llama-7b whose vocabulary is
    256 tokens (so the output layer does not make the last stage the bottleneck that hides every
    other stage's stalls), tp4 pp4 dp1, selective recompute."""
    import dataclasses

    from megatron_slimpack.plan import MicroPack, Slice
    from megatron_slimpack.planner.orders import forward_targets, orders_of_targets
    from megatron_slimpack.specs import get_model

    model = dataclasses.replace(get_model("llama-7b"), name="llama-7b-vocab256", vocab_size=256)
    cost = ms.CostModel.analytic(model, "h100-sxm")
    parallel = ms.ParallelConfig(dp=1, pp=4, tp=4, recompute="selective")
    pair_pack = (document, document * (document + 1) / 2)
    target = cost.forward_time(*pair_pack, parallel) + cost.backward_time(*pair_pack, parallel)
    per_pack = 1
    while True:  # short documents per pack: the most whose seconds stay within the document's
        tokens, pairs_ = (per_pack + 1) * short, (per_pack + 1) * short * (short + 1) / 2
        if cost.forward_time(tokens, pairs_, parallel) + cost.backward_time(tokens, pairs_, parallel) > target:
            break
        per_pack += 1
    samples, micropacks = [], []
    for _ in range(pairs):
        samples.append(Sample(len(samples), document))
        micropacks.append(MicroPack([Slice(samples[-1].sample_id, 0, document)]))
        first = len(samples)
        samples += [Sample(first + j, short) for j in range(per_pack)]
        micropacks.append(MicroPack([Slice(first + j, 0, short) for j in range(per_pack)]))
    costs = MicroPackCosts.of(micropacks, cost, parallel)
    budget = activation_budget(cost, parallel)
    ratio = costs.backward[0] / costs.forward[0]
    print(f"\n{pairs} x (one {document}-token document, B/F {ratio[0]:.3f}) alternating with {pairs} x "
          f"({per_pack} x {short}-token documents, B/F {ratio[1]:.3f}), llama-7b with a 256-token vocabulary, "
          f"tp4 pp4 dp1 rc-selective\n")
    count = len(micropacks)
    rows = {}
    for units, symmetric, label in ((count, False, "1 MicroPack per unit (what the planner emits)"),
                                    (count // 2, False, "2 per unit, asymmetric"),
                                    (count // 2, True, "2 per unit, symmetric")):
        candidate = UnitCandidate.of(micropacks, costs, units, symmetric, cost, parallel, budget)
        rows[label] = candidate.order([0], budget)
    rows["forward units of 2, backward units of 1"] = UnitCandidate.paired(
        micropacks, costs, cost, parallel, budget).order([0], budget)
    single = UnitCandidate.of(micropacks, costs, count, False, cost, parallel, budget)
    deeper = orders_of_targets(forward_targets(single.forward_units, single.backward_units,
                                               [2 * (parallel.pp - 1 - s) for s in range(parallel.pp)]))
    print("| units | makespan s | vs 1 per unit | peak GiB | fits |")
    print("|---|---|---|---|---|")
    base = None
    entries = [(label, ordered.replica) for label, ordered in rows.items()]
    entries.append(("1 MicroPack per unit, each stage 2 units ahead of the next (warm-up 2(pp-1-s))",
                    ReplicaPlan(micropacks, single.forward_units, single.backward_units, deeper, [0])))
    for label, replica in entries:
        plan = Plan([replica], samples, parallel, document, "hand", max(document, per_pack * short)).validate()
        report = simulate(plan, cost, detail=False)
        base = base or report.iteration_time_s
        print(f"| {label} | {report.iteration_time_s:.3f} | {100 * (report.iteration_time_s / base - 1):+.2f}% | "
              f"{max(report.peak_memory_bytes) / GIB:.1f} | {report.fits_memory} |")
    for strategy in ("slimpack-sym", "slimpack"):
        config = ms.SlimPackConfig(strategy=strategy, context_length=max(document, per_pack * short),
                                   solver_time_limit_s=30.0, solver_deterministic_limit=0.2)
        plan = ms.plan([sample.length for sample in samples], parallel=parallel, cost=cost, config=config)
        report = simulate(plan, cost, detail=False)
        replica = plan.replicas[0]
        print(f"| the planner's own packing of these documents, {strategy} ({len(replica.micropacks)} MicroPacks, "
              f"{len(replica.forward_units)} forward / {len(replica.backward_units)} backward units) | "
              f"{report.iteration_time_s:.3f} | {100 * (report.iteration_time_s / base - 1):+.2f}% | "
              f"{max(report.peak_memory_bytes) / GIB:.1f} | {report.fits_memory} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("stall", "cell", "constructed", "alternating", "all"), default="all")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.only == "constructed":
        constructed_section()
        return
    if args.only == "alternating":
        alternating()
        return
    plan, cost = cell_plan()
    print(f"# llama-70b 128K tp4 pp8 dp4 rc-selective, Wikipedia 512 sequences ({time.perf_counter() - started:.1f} s)")
    forward, backward, single = singleton_share(plan)
    print(f"plan {plan.fingerprint()}: {forward} forward units, {backward} backward units, "
          f"{single} of them hold one MicroPack")
    report = simulate(plan, cost)
    print("\n## Idle time per stage (mean over DP ranks)\n")
    print_stall(plan, report)
    print("\n## Backward/forward seconds per MicroPack (middle stage)\n")
    print_ratios(plan, cost)
    flat = simulate(plan, constant_ratio_cost(plan, cost), detail=True)
    print("\n## The same plan with one backward/forward ratio for all MicroPacks\n")
    print_stall(plan, flat)
    if args.only == "stall":
        return
    print("\n## Unit counts the planner's search tries\n")
    print_candidates(plan)
    print("\n## Hand-built units for the own replicas (merge groups unchanged)\n")
    print_alternatives(alternatives(plan, cost, report))
    if args.only == "all":
        constructed_section()
        print("\n## Backward/forward ratios that alternate MicroPack by MicroPack")
        alternating()
    print(f"\n({time.perf_counter() - started:.1f} s)")


def constructed_section() -> None:
    print("\n## Constructed case: long documents' chains where memory limits the run-up\n")
    print_constructed()
    for documents, short, tp in ((1, 2000, 4), (1, 3000, 4), (2, 3000, 4), (3, 2000, 4), (3, 3000, 4), (2, 2000, 8)):
        print_constructed(documents, short, tp, stall=False)


if __name__ == "__main__":
    main()
