"""The planner's compiled loops (`planner/compiled.py`) give exactly what their plain-Python
transcriptions below give: the same cut points, the same slice bounds, the same makespans to the
last bit, and the same circular waits. A difference of one rounding would move a plan (the golden
plans would catch it too, on fewer inputs)."""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
import random

import numpy as np

from megatron_slimpack.config import PlannerTunables
from megatron_slimpack.costmodel import CostModel
from megatron_slimpack.plan import Sample
from megatron_slimpack.plan.types import chain_heads
from megatron_slimpack.planner import compiled
from megatron_slimpack.planner.baselines import pack_in_order
from megatron_slimpack.planner.baselines.wlb_llm import MicroBatch, PendingDocument, pack_by_cost
from megatron_slimpack.planner.orders import (
    BRACKET_TOLERANCE,
    SEARCH_WAYS,
    StageWork,
    interleaved_schedules,
    segment_bounds,
)
from megatron_slimpack.planner.slimpack.pack_phase import PackOptions, cut_document, cut_documents
from megatron_slimpack.planner.work import WorkRates
from megatron_slimpack.specs import ParallelConfig
from test_simulator import build_replica, random_micropacks

# ---- plain-Python transcriptions ---------------------------------------------------------------


def python_segment_bounds(costs: np.ndarray, units: int) -> list[int]:
    count = len(costs)
    units = max(1, min(units, count))
    if units == count:
        return list(range(count + 1))
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    sums = prefix.tolist()

    def fits(limit: float) -> bool:
        reach, position, groups = limit * (1 + 1e-12), 0, 0
        while position < count:
            if groups == units:
                return False
            position = min(max(bisect.bisect_right(sums, sums[position] + reach) - 1, position + 1), count)
            groups += 1
        return True

    def greedy(limit: float) -> list[int]:
        bounds, tolerance = [0], limit * 1e-12
        while bounds[-1] < count:
            start = bounds[-1]
            end = bisect.bisect_right(sums, sums[start] + limit + tolerance) - 1
            bounds.append(min(max(end, start + 1), count))
        return bounds

    low = max(float(costs.max()), float(prefix[-1]) / units)
    high = min(float(prefix[-1]), low + float(costs.max()))
    while high - low > BRACKET_TOLERANCE * max(high, 1.0):
        step = (high - low) / (SEARCH_WAYS + 1)
        limits = [low + step * i for i in range(1, SEARCH_WAYS + 1)]
        first = next((i for i, limit in enumerate(limits) if fits(limit)), len(limits))
        if first < len(limits):
            high = limits[first]
            low = limits[first - 1] if first > 0 else low
        else:
            low = limits[-1]
    bounds = greedy(high)
    while True:
        bottleneck = max(sums[b] - sums[a] for a, b in zip(bounds, bounds[1:]))
        below = bottleneck * (1 - 3e-12)
        if below <= low or not fits(below):
            return bounds
        bounds = greedy(below)


def python_bounds_at_work(targets: list[float], a: float, b: float, length: int) -> list[int]:
    count = len(targets) + 1
    bounds = [0]
    for target in targets:
        x = (2 * target / (a + math.sqrt(a * a + 2 * b * target))) if b > 0 else target / a
        bounds.append(min(max(int(round(x)), bounds[-1] + 1), length - (count - len(bounds))))
    return bounds + [length]


def python_cut_bounds(length: int, options: PackOptions, rates: WorkRates, slice_cost: float | None) -> list[int]:
    """`cut_document`'s bounds as numpy and Python floats compute them (`compiled.cut_bounds`)."""
    def prefix_work(tokens):
        return ((rates.forward_per_token + rates.backward_per_token) * tokens
                + (rates.forward_per_pair + rates.backward_per_pair) * tokens * tokens / 2)

    def balanced(count: int, rounds: int) -> list[int]:
        a = rates.forward_per_token + rates.backward_per_token
        b = rates.forward_per_pair + rates.backward_per_pair
        total, shares = prefix_work(length), np.full(count, 1.0 / count)
        rounds = rounds if rates.half_tokens else 1
        for round_ in range(rounds):
            bounds = python_bounds_at_work((total * np.cumsum(shares)[:-1]).tolist(), a, b, length)
            if round_ == rounds - 1:
                break
            edges = np.asarray(bounds, dtype=float)
            lengths = np.diff(edges)
            weights = 1.0 / rates.size_penalty(lengths, lengths * edges[:-1] + lengths * (lengths + 1) / 2)
            shares = weights / weights.sum()
        return bounds

    def longest(bounds):
        return max(b - a for a, b in zip(bounds, bounds[1:]))

    def heaviest(bounds):
        edges = np.asarray(bounds, dtype=float)
        starts, lengths = edges[:-1], np.diff(edges)
        pairs = lengths * starts + lengths * (lengths + 1) / 2
        efficiency = rates.size_penalty(lengths, pairs) / rates.size_penalty(options.token_cap)
        return float((rates.total(lengths, pairs) * efficiency).max())

    if length <= options.slice_tokens and (slice_cost is None or rates.document(length) <= slice_cost):
        return [0, length]
    if not options.cost_balanced_slices:
        count = max(math.ceil(length / options.slice_tokens), math.ceil(length / options.token_cap))
        return [length * j // count for j in range(count + 1)]
    count = math.ceil(length / options.slice_tokens)
    count = max(count, math.ceil(prefix_work(length) / prefix_work(min(length, options.token_cap))))
    while longest(balanced(count, 1)) > options.token_cap:
        count += 1
    if slice_cost:
        count = max(count, math.ceil(rates.document(length) / slice_cost))
    extra_slices, rounds = options.tunables.extra_slices, options.tunables.balancing_rounds
    for extra in range(extra_slices + 1):
        bounds = balanced(count + extra, rounds)
        if longest(bounds) <= options.token_cap and (slice_cost is None or heaviest(bounds) <= slice_cost):
            return bounds
    return balanced(count + extra_slices, 1)


def python_walk(schedule, work: StageWork) -> float | None:
    pp, vpp, needs = schedule.pp, schedule.vpp, schedule.needs
    forwards, backwards = schedule.forwards, schedule.backwards
    virtual = pp * vpp
    forward_end = [[None] * (len(forwards) // vpp) for _ in range(virtual)]
    backward_end = [[None] * len(needs) for _ in range(virtual)]

    def row(rows, vstage):
        return rows[pp - 1] if vstage == virtual - 1 else rows[0]

    targets = np.asarray(schedule.targets).tolist()
    free, next_f, next_b = [0.0] * pp, [0] * pp, [0] * pp
    progress = True
    while progress:
        progress = False
        for stage in range(pp):
            clock, done_f, done_b = free[stage], next_f[stage], next_b[stage]
            while True:
                if done_b < len(backwards):
                    forward_next = done_f < targets[stage][done_b]
                elif done_f < len(forwards):
                    forward_next = True
                else:
                    break
                if forward_next:
                    _, unit, chunk = forwards[done_f]
                    vstage, ready = chunk * pp + stage, 0.0
                    if vstage > 0:
                        end = forward_end[vstage - 1][unit]
                        if end is None:
                            break
                        ready = end + work.forward_transfer[unit] if pp > 1 else end
                    clock = max(clock, ready) + row(work.forward_time, vstage)[unit]
                    forward_end[vstage][unit] = clock
                    done_f += 1
                else:
                    _, unit, chunk = backwards[done_b]
                    vstage = chunk * pp + stage
                    ready = forward_end[vstage][needs[unit]]
                    if ready is None:
                        break
                    if vstage < virtual - 1:
                        end = backward_end[vstage + 1][unit]
                        if end is None:
                            break
                        end = end + work.backward_transfer[unit] if pp > 1 else end
                        ready = max(ready, end)
                    clock = max(clock, ready) + row(work.backward_time, vstage)[unit]
                    backward_end[vstage][unit] = clock
                    done_b += 1
            progress |= (done_f, done_b) != (next_f[stage], next_b[stage])
            free[stage], next_f[stage], next_b[stage] = clock, done_f, done_b
    if next_f != [len(forwards)] * pp or next_b != [len(backwards)] * pp:
        return None
    return max(free)


# ---- the checks --------------------------------------------------------------------------------


def python_next_fit(order: list[int], lengths: list[int], capacity: int) -> list[list[int]]:
    sequences: list[list[int]] = []
    filled = capacity
    for index in order:
        if filled + lengths[index] > capacity:
            sequences.append([])
            filled = 0
        sequences[-1].append(index)
        filled += lengths[index]
    return sequences


def python_pack_by_cost(documents, micro_batches, rates, capacity):
    """`wlb_llm.pack_by_cost` as heapq loops over the micro-batch objects."""
    lengths = np.array([d.length for d in documents], dtype=float)
    costs = rates.total(lengths, lengths * (lengths + 1) / 2).tolist() if len(documents) else []
    by_cost = [(mb.cost, position) for position, mb in enumerate(micro_batches)]
    heapq.heapify(by_cost)
    parked: list[tuple[int, int]] = []  # (-room, position)
    left: list[int] = []
    for index in sorted(range(len(documents)), key=lambda i: -costs[i]):
        document = documents[index]
        while parked and -parked[0][0] >= document.length:
            position = heapq.heappop(parked)[1]
            heapq.heappush(by_cost, (micro_batches[position].cost, position))
        while by_cost:
            position = by_cost[0][1]
            micro_batch = micro_batches[position]
            if micro_batch.tokens + document.length <= capacity:
                micro_batch.add(document, costs[index])
                heapq.heapreplace(by_cost, (micro_batch.cost, position))
                break
            heapq.heappop(by_cost)
            heapq.heappush(parked, (micro_batch.tokens - capacity, position))
        else:
            left.append(index)
    return [documents[i] for i in sorted(left)]


def python_sand_for_slices(small_first_cost, small_first_tokens, target, piece_costs, penalties, piece_lengths,
                           token_cap) -> list[int]:
    takens, taken = [], 0
    for piece_cost, penalty, length in zip(piece_costs.tolist(), penalties.tolist(), piece_lengths.tolist()):
        room = target / penalty - piece_cost
        fits_cost = small_first_cost.searchsorted(small_first_cost[taken] + room, side="right") - 1
        fits_tokens = small_first_tokens.searchsorted(small_first_tokens[taken] + (token_cap - length),
                                                      side="right") - 1
        taken = max(taken, min(int(fits_cost), int(fits_tokens)))
        takens.append(taken)
    return takens


def python_next_fit_with_sand(cost_prefix, token_prefix, target, token_cap, rest) -> list[list[int]]:
    rows, start, small_end = [], 0, rest
    while start < small_end:
        by_cost = cost_prefix.searchsorted(cost_prefix[start] + target, side="right") - 1
        by_tokens = token_prefix.searchsorted(token_prefix[start] + token_cap, side="right") - 1
        end = min(small_end, max(start + 1, min(int(by_cost), int(by_tokens))))
        room_cost = target - (cost_prefix[end] - cost_prefix[start])
        room_tokens = token_cap - (token_prefix[end] - token_prefix[start])
        sand_cost = cost_prefix.searchsorted(cost_prefix[small_end] - room_cost, side="left")
        sand_tokens = token_prefix.searchsorted(token_prefix[small_end] - room_tokens, side="left")
        sand = min(small_end, max(end, int(sand_cost), int(sand_tokens)))
        rows.append([start, end, sand, small_end])
        start, small_end = end, sand
    return rows


def random_costs(rng: np.random.Generator) -> np.ndarray:
    count = int(rng.integers(2, 160))
    costs = rng.lognormal(0.0, rng.uniform(0.05, 2.0), count)
    return np.round(costs, 1) + 0.1 if rng.random() < 0.3 else costs  # ties: many equal run sums


def test_segmentation_cuts_where_the_python_search_does():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        costs = random_costs(rng)
        units = int(rng.choice([2, 3, 4, 8, 16, 32, len(costs) - 1]))
        assert segment_bounds(costs, units) == python_segment_bounds(costs, units)


def test_cost_balanced_slice_bounds_are_the_python_inversion():
    rng = np.random.default_rng(1)
    for _ in range(2000):
        length, count = int(rng.integers(2, 600_000)), int(rng.integers(2, 200))
        count = min(count, length)
        a, b = float(rng.uniform(1e-9, 1e-6)), float(rng.choice([0.0, rng.uniform(1e-15, 1e-10)]))
        total = a * length + b * length * length / 2
        shares = rng.dirichlet(np.ones(count))
        targets = total * np.cumsum(shares)[:-1]
        assert (compiled.bounds_at_work(targets, a, b, length).tolist()
                == python_bounds_at_work(targets.tolist(), a, b, length))


def test_pairwise_sum_rounds_as_numpy():
    rng = np.random.default_rng(5)
    for _ in range(3000):
        values = rng.random(int(rng.integers(0, 700))) * 10.0 ** rng.uniform(-6, 6)
        assert compiled.pairwise_sum(values, 0, len(values)) == values.sum()


def test_document_cuts_are_the_python_cuts():
    """Every branch: whole, equal lengths, work-balanced, seconds-balanced with extra slices, the
    even-cost bound (and its fallback), rates with and without an efficiency curve."""
    rng = np.random.default_rng(6)
    costs = [CostModel.analytic(model, "h100-sxm") for model in ("llama-7b", "llama-70b")]
    layouts = [ParallelConfig(tp=1, pp=2, dp=4), ParallelConfig(tp=4, pp=4, cp=2, dp=1), ParallelConfig(tp=8, pp=8)]
    for case in range(600):
        cost, parallel = costs[case % 2], layouts[case % 3]
        context = int(rng.choice([32768, 65536, 131072, 262144]))
        rates = WorkRates.from_cost(cost, parallel, int(rng.integers(1024, context)))
        if case % 5 == 0:
            rates = dataclasses.replace(rates, half_tokens=0.0)
        token_cap = int(rng.integers(512, context))
        options = PackOptions(token_cap, int(rng.integers(256, token_cap + 1)), cost_balanced_slices=case % 7 != 0,
                              tunables=PlannerTunables(extra_slices=int(rng.integers(0, 9)),
                                                       balancing_rounds=int(rng.integers(1, 4))))
        lengths = rng.integers(1, 4 * context, size=8)
        slice_cost = None if case % 3 == 0 else float(rates.document(token_cap) * rng.uniform(0.05, 2.0))
        samples = [Sample(index, int(length)) for index, length in enumerate(lengths)]
        expected = [python_cut_bounds(sample.length, options, rates, slice_cost) for sample in samples]
        one_by_one = [cut_document(sample, options, rates, slice_cost) for sample in samples]
        assert cut_documents(samples, options, rates, slice_cost) == one_by_one
        assert [[0] + [piece.end for piece in pieces] for pieces in one_by_one] == expected


def test_chains_run_ahead_as_the_python_loop():
    rng = np.random.default_rng(7)
    for _ in range(2000):
        required = np.maximum.accumulate(rng.integers(0, 40, size=int(rng.integers(1, 60))))
        lead = int(rng.choice([-1, 0, 1, 2, 4, 8]))
        expected = required.tolist()
        for b in range(len(expected) - 2, -1, -1):
            ahead = expected[b + 1] - 1
            if lead >= 0:
                ahead = min(ahead, int(required[b]) + lead)
            expected[b] = max(expected[b], ahead)
        assert compiled.run_chains_ahead(required.astype(np.int64), lead).tolist() == expected


def python_chain_heads(counts: np.ndarray, table: np.ndarray) -> list[int]:
    """Union-find over a dict, MicroPacks joined in slice order, each root its chain's first."""
    parent = list(range(len(counts)))

    def find(index: int) -> int:
        while parent[index] != index:
            index = parent[index]
        return index

    first_pack: dict[int, int] = {}
    continued = set(table[table[:, 1] > 0, 0].tolist())
    for (sample_id, _, _), pack in zip(table.tolist(), np.repeat(np.arange(len(counts)), counts).tolist()):
        if sample_id in continued:
            root, other = find(pack), find(first_pack.setdefault(sample_id, pack))
            parent[max(root, other)] = min(root, other)
    return [find(index) for index in range(len(counts))]


def test_chain_heads_are_the_python_union_find():
    rng = np.random.default_rng(8)
    for _ in range(2000):
        counts = rng.integers(1, 5, size=int(rng.integers(1, 40)))
        starts = rng.choice([0, 0, 7], size=int(counts.sum()))
        table = np.stack([rng.integers(0, 30, size=len(starts)), starts, starts + 10], axis=1).astype(np.int64)
        assert chain_heads([None] * len(counts), (counts, table)).tolist() == python_chain_heads(counts, table)


def test_interleaved_walks_time_and_stall_as_the_python_walk():
    walked = circular = 0
    for seed, (pp, vpp) in itertools.product(range(8), [(1, 2), (2, 2), (4, 2), (3, 3), (2, 4)]):
        rng = random.Random(seed)
        packs, _, _ = random_micropacks(rng, 0, 9 + seed, 512, long_share=0.5)
        replica = build_replica(packs, [0], 2, rng, max_unit=1 + seed % 3)
        forwards, backwards = len(replica.forward_units), len(replica.backward_units)
        work = StageWork([[rng.random() for _ in range(forwards)] for _ in range(pp)],
                         [[rng.random() for _ in range(backwards)] for _ in range(pp)],
                         [rng.random() / 10 for _ in range(forwards)], [rng.random() / 10 for _ in range(backwards)],
                         [[1.0] * forwards] * pp, [[1.0] * backwards] * pp, [float("inf")] * pp)
        for schedule in interleaved_schedules(replica.forward_units, replica.backward_units, pp, vpp):
            expected = python_walk(schedule, work)
            assert schedule.walked_s(work) == expected
            assert schedule.runs_through() == (expected is not None)
            walked += expected is not None
            circular += expected is None
    assert walked and circular  # the cases run through, and some wait in a circle


def test_next_fit_packs_as_the_python_loop():
    rng = random.Random(5)
    for _ in range(500):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(0, 60))]
        order = rng.sample(range(len(lengths)), len(lengths))
        capacity = rng.randint(1, 120)  # also below the longest: it gets a sequence of its own
        assert pack_in_order(order, lengths, capacity) == python_next_fit(order, lengths, capacity)


def test_cost_packing_fills_as_the_heapq_loop():
    """Same micro-batches (documents in order, tokens, cost to the last bit) and the same documents
    left, from empty and part-filled micro-batches, with equal costs (ties) and too little room."""
    rng = random.Random(11)
    rates = WorkRates(1.0, 0.01, 2.0, 0.02)
    for _ in range(300):
        lengths = [rng.choice([rng.randint(1, 50), 8]) for _ in range(rng.randint(0, 80))]  # 8: equal costs
        documents = [PendingDocument(0, i, length, i, 0) for i, length in enumerate(lengths)]
        capacity = rng.randint(20, 150)
        starts = [(rng.randint(0, capacity), rng.choice([0.0, rng.random() * 50])) for _ in range(rng.randint(1, 12))]
        sides = []
        for pack in (python_pack_by_cost, pack_by_cost):
            micro_batches = [MicroBatch([], tokens, load) for tokens, load in starts]
            left = pack(documents, micro_batches, rates, capacity)
            sides.append((left, [(mb.documents, mb.tokens, mb.cost) for mb in micro_batches]))
        assert sides[0] == sides[1]


def test_micropack_filling_takes_the_documents_the_python_loops_take():
    """SlimPack's MicroPack filling (`pack_phase.pack_micropacks`): the smallest documents each
    slice's MicroPack takes as sand, then the next-fit packs of the rest with their sand; costs
    with ties (equal documents), caps below a document, slices longer than the cap's room."""
    rng = np.random.default_rng(7)
    for _ in range(500):
        count = int(rng.integers(0, 120))
        drawn = rng.integers(1, 4000, count) if rng.random() < 0.7 else np.full(count, 512)  # ties
        lengths = np.sort(drawn)[::-1].astype(float)
        costs = lengths * 1e-6 + lengths * (lengths + 1) / 2 * 1e-12
        token_cap = int(rng.integers(256, 16384))
        target = float(rng.uniform(0.2, 2.0)) * token_cap * 2e-6
        pieces = int(rng.integers(0, 12))
        piece_lengths = rng.integers(1, 2 * token_cap, pieces)
        piece_costs, penalties = piece_lengths * 1.5e-6, rng.uniform(1.0, 1.6, pieces)
        small_first_cost = np.concatenate([[0.0], np.cumsum(costs[::-1])])
        small_first_tokens = np.concatenate([[0], np.cumsum(lengths[::-1])])
        takens = compiled.sand_for_slices(small_first_cost, small_first_tokens, target, piece_costs, penalties,
                                          piece_lengths, token_cap)
        assert takens.tolist() == python_sand_for_slices(small_first_cost, small_first_tokens, target, piece_costs,
                                                         penalties, piece_lengths, token_cap)
        rest = count - (int(takens[-1]) if pieces else 0)
        cost_prefix = np.concatenate([[0.0], np.cumsum(costs[:rest])])
        token_prefix = np.concatenate([[0], np.cumsum(lengths[:rest])])
        rows = compiled.next_fit_with_sand(cost_prefix, token_prefix, target, token_cap, rest)
        assert rows.tolist() == python_next_fit_with_sand(cost_prefix, token_prefix, target, token_cap, rest)
