"""The planner's innermost loops, compiled with numba.

A layout search plans one ~10^5-document batch on each of tens of layouts, and each planning
segments, orders and replays thousands of unit candidates per replica: these loops ran as Python
bytecode a few hundred thousand times per layout (cProfile of a 256K search: segmentation 13%,
interleaved walks 4%). Each function here is the loop its caller documents, written
with the same floating-point operations in the same order, so a plan is the same with or without
compilation (`tests/test_compiled_loops.py` checks them against plain-Python transcriptions, and
the golden plans against their fingerprints). Compiled code is cached on disk (`cache=True`): a
process loads it in milliseconds after the first one compiled it.
"""
from __future__ import annotations

import numba
import numpy as np

# Compiled once per machine, then loaded from numba's cache; no fast-math, so every operation
# rounds as Python's float does.
_jit = numba.njit(cache=True, nogil=True)

# ---- linear partition (`orders.segment_bounds`) ------------------------------------------------


@_jit
def _cut_after(sums: np.ndarray, position: int, threshold: float) -> int:
    """The greedy segmentation's next cut after `position`: every position whose prefix sum is
    within `threshold`, at least one (`sums`: prefix sums, non-decreasing)."""
    count = len(sums) - 1
    end = np.searchsorted(sums, threshold, side="right") - 1
    if end < position + 1:
        end = position + 1
    return count if end > count else end


@_jit
def greedy_fits(sums: np.ndarray, limit: float, units: int) -> bool:
    """Whether the greedy segmentation under `limit` needs at most `units` groups."""
    count = len(sums) - 1
    reach = limit * (1 + 1e-12)
    position = groups = 0
    while position < count:
        if groups == units:
            return False
        position = _cut_after(sums, position, sums[position] + reach)
        groups += 1
    return True


@_jit
def greedy_bounds(sums: np.ndarray, limit: float) -> np.ndarray:
    """Cut points of the greedy segmentation under `limit`."""
    count = len(sums) - 1
    bounds = np.empty(count + 1, dtype=np.int64)
    bounds[0] = 0
    groups = 0
    tolerance = limit * 1e-12
    while bounds[groups] < count:
        start = bounds[groups]
        bounds[groups + 1] = _cut_after(sums, start, sums[start] + limit + tolerance)
        groups += 1
    return bounds[:groups + 1]


@_jit
def optimal_bounds(sums: np.ndarray, largest: float, units: int, tolerance: float, ways: int) -> np.ndarray:
    """`orders.segment_bounds`' search on prefix sums `sums` (`largest`: the largest cost; 1 <
    `units` < positions): the bottleneck bracketed `ways` limits at a time to within
    `tolerance`, then stepped down through the bottlenecks the greedy reaches."""
    total = sums[len(sums) - 1]
    low = max(largest, total / units)
    high = min(total, low + largest)
    limits = np.empty(ways)
    while high - low > tolerance * max(high, 1.0):
        step = (high - low) / (ways + 1)
        for index in range(ways):
            limits[index] = low + step * (index + 1)
        first, last = 0, ways  # the first limit that fits, by bisection (fitting is monotone)
        while first < last:
            middle = (first + last) // 2
            if greedy_fits(sums, limits[middle], units):
                last = middle
            else:
                first = middle + 1
        if first < ways:
            high = limits[first]
            low = limits[first - 1] if first > 0 else low
        else:
            low = limits[ways - 1]
    bounds = greedy_bounds(sums, high)
    while True:
        bottleneck = 0.0
        for group in range(len(bounds) - 1):
            cost = sums[bounds[group + 1]] - sums[bounds[group]]
            if cost > bottleneck:
                bottleneck = cost
        below = bottleneck * (1 - 3e-12)
        if below <= low or not greedy_fits(sums, below, units):
            return bounds
        bounds = greedy_bounds(sums, below)


# ---- cost-balanced slices (`pack_phase.cut_document`) --------------------------------------------


@_jit
def bounds_at_work(targets: np.ndarray, per_token: float, per_pair: float, length: int) -> np.ndarray:
    """Slice bounds of a `length`-token document where its cumulative work per_token*x +
    per_pair*x^2/2 reaches each of the increasing `targets` (one slice more than targets), each
    slice at least one token and room left for the slices after it."""
    count = len(targets) + 1
    bounds = np.empty(count + 1, dtype=np.int64)
    bounds[0] = 0
    for index in range(len(targets)):
        target = targets[index]
        if per_pair > 0:
            x = 2 * target / (per_token + np.sqrt(per_token * per_token + 2 * per_pair * target))
        else:
            x = target / per_token
        cut = max(np.int64(np.rint(x)), bounds[index] + 1)
        bounds[index + 1] = min(cut, length - (count - index - 1))
    bounds[count] = length
    return bounds


@_jit
def _block_sum(values: np.ndarray, first: int, count: int) -> float:
    """numpy's pairwise summation of at most 128 values: one loop below 8, else eight accumulators."""
    if count < 8:
        total = -0.0
        for index in range(first, first + count):
            total += values[index]
        return total
    r0, r1, r2, r3 = values[first], values[first + 1], values[first + 2], values[first + 3]
    r4, r5, r6, r7 = values[first + 4], values[first + 5], values[first + 6], values[first + 7]
    index = 8
    whole = count - count % 8
    while index < whole:
        at = first + index
        r0 += values[at]
        r1 += values[at + 1]
        r2 += values[at + 2]
        r3 += values[at + 3]
        r4 += values[at + 4]
        r5 += values[at + 5]
        r6 += values[at + 6]
        r7 += values[at + 7]
        index += 8
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while index < count:
        total += values[first + index]
        index += 1
    return total


@_jit
def pairwise_sum(values: np.ndarray, first: int, count: int) -> float:
    """numpy's pairwise summation of values[first:first + count] (what `ndarray.sum` does on a
    contiguous float64 array: blocks of at most 128 values summed by `_block_sum`, a longer run
    the sum of its two halves, the first a multiple of 8), so a sum rounds exactly as numpy's does.
    The halving walked with an explicit stack: numba's cache loads recursive functions unsafely."""
    if count <= 128:
        return _block_sum(values, first, count)
    # Frames of the halving: a run, its left half's sum once known, and how far it has got.
    starts, counts = np.empty(64, dtype=np.int64), np.empty(64, dtype=np.int64)
    lefts, stages = np.empty(64), np.zeros(64, dtype=np.int64)  # stage 0: fresh, 1: left pending, 2: right pending
    starts[0], counts[0] = first, count
    top = 1
    value = 0.0  # the sum of the run last finished
    while top > 0:
        frame = top - 1
        if counts[frame] > 128 and stages[frame] < 2:
            # its left half next (fresh), or its right half (the left one's sum just came back)
            half = _left_half(counts[frame])
            if stages[frame] == 1:
                lefts[frame] = value
                starts[top], counts[top] = starts[frame] + half, counts[frame] - half
            else:
                starts[top], counts[top] = starts[frame], half
            stages[frame] += 1
            stages[top] = 0
            top += 1
            continue
        value = _block_sum(values, starts[frame], counts[frame]) if counts[frame] <= 128 else lefts[frame] + value
        top -= 1
    return value


@_jit
def _left_half(count: int) -> int:
    half = count // 2
    return half - half % 8


# `WorkRates` as an array for the compiled cut: its fields in this order.
RATE_FIELDS = ("forward_per_token", "forward_per_pair", "backward_per_token", "backward_per_pair",
               "reference_tokens", "half_tokens", "per_pack")


@_jit
def _rates_total(rates: np.ndarray, tokens: float, pairs: float) -> float:
    """`WorkRates.total`."""
    return (rates[0] * tokens + rates[1] * pairs) + (rates[2] * tokens + rates[3] * pairs)


@_jit
def _size_penalty(rates: np.ndarray, tokens: float, pairs: float) -> float:
    """`WorkRates.size_penalty`."""
    if rates[5] == 0.0:
        return 1.0 + 0.0 * tokens
    spread = rates[6] * (1.0 - tokens / rates[4])
    return 1.0 + spread / _rates_total(rates, tokens, pairs)


@_jit
def _prefix_work(rates: np.ndarray, tokens: float) -> float:
    """Work of a document's first `tokens` tokens (causal attention among them)."""
    return (rates[0] + rates[2]) * tokens + (rates[1] + rates[3]) * tokens * tokens / 2


@_jit
def balanced_bounds(rates: np.ndarray, length: int, count: int, rounds: int) -> np.ndarray:
    """Bounds of `count` slices of equal cost. Cumulative work of the first x tokens is
    a*x + b*x^2/2; inverted at equal steps it balances work (`rounds` 1). A later, shorter slice
    runs at lower kernel efficiency, so with more `rounds` the steps are then reweighted by each
    slice's size penalty (twice in 3 rounds: the penalties barely move after that) to balance
    seconds."""
    a, b = rates[0] + rates[2], rates[1] + rates[3]
    total = _prefix_work(rates, float(length))
    shares = np.full(count, 1.0 / count)
    if rates[5] == 0.0:  # no efficiency curve: work is seconds
        rounds = 1
    weights = np.empty(count)
    targets = np.empty(count - 1)
    bounds = np.empty(count + 1, dtype=np.int64)
    for round_ in range(rounds):
        running = 0.0
        for index in range(count - 1):
            running += shares[index]
            targets[index] = total * running
        bounds = bounds_at_work(targets, a, b, length)
        if round_ == rounds - 1:  # the last round's bounds are the answer
            break
        for index in range(count):
            start = float(bounds[index])
            size = float(bounds[index + 1]) - start
            weights[index] = 1.0 / _size_penalty(rates, size, size * start + size * (size + 1) / 2)
        shares = weights / pairwise_sum(weights, 0, count)
    return bounds


@_jit
def _longest(bounds: np.ndarray) -> int:
    longest = 0
    for index in range(len(bounds) - 1):
        longest = max(longest, bounds[index + 1] - bounds[index])
    return longest


@_jit
def _heaviest(rates: np.ndarray, bounds: np.ndarray, token_cap: int) -> float:
    """The most any of these slices costs, in seconds at a cap-full MicroPack's efficiency."""
    at_cap = _size_penalty(rates, float(token_cap), 0.0)
    heaviest = -np.inf
    for index in range(len(bounds) - 1):
        start = float(bounds[index])
        size = float(bounds[index + 1]) - start
        pairs = size * start + size * (size + 1) / 2
        heaviest = max(heaviest, _rates_total(rates, size, pairs) * (_size_penalty(rates, size, pairs) / at_cap))
    return heaviest


@_jit
def _fewest_balanced_slices(rates: np.ndarray, length: int, slice_tokens: int, token_cap: int) -> int:
    """Fewest work-balanced slices of a document, none longer than `slice_tokens` nor the cap."""
    count = int(np.ceil(length / slice_tokens))
    count = max(count, int(np.ceil(_prefix_work(rates, float(length))
                                   / _prefix_work(rates, float(min(length, token_cap))))))
    while _longest(balanced_bounds(rates, length, count, 1)) > token_cap:  # 1 round: work-balanced
        count += 1  # rounding only: the estimate above is exact up to it
    return count


@_jit
def cut_bounds(rates: np.ndarray, length: int, slice_tokens: int, token_cap: int, cost_balanced: bool,
               extra_slices: int, rounds: int, slice_cost: float) -> np.ndarray:
    """`pack_phase.cut_document`'s slice bounds of one document (`slice_cost` NaN: none)."""
    has_cost = not np.isnan(slice_cost)
    whole_cost = _rates_total(rates, float(length), float(length * (length + 1) // 2))
    if length <= slice_tokens and (not has_cost or whole_cost <= slice_cost):
        bounds = np.empty(2, dtype=np.int64)
        bounds[0], bounds[1] = 0, length
        return bounds
    if not cost_balanced:
        count = max(int(np.ceil(length / slice_tokens)), int(np.ceil(length / token_cap)))
        bounds = np.empty(count + 1, dtype=np.int64)
        for index in range(count + 1):
            bounds[index] = length * index // count
        return bounds
    count = _fewest_balanced_slices(rates, length, slice_tokens, token_cap)
    if has_cost and slice_cost != 0.0:
        count = max(count, int(np.ceil(whole_cost / slice_cost)))
    for extra in range(extra_slices + 1):
        bounds = balanced_bounds(rates, length, count + extra, rounds)
        if _longest(bounds) <= token_cap and (not has_cost or _heaviest(rates, bounds, token_cap) <= slice_cost):
            return bounds
    return balanced_bounds(rates, length, count + extra_slices, 1)


@_jit
def cut_bounds_of_all(rates: np.ndarray, lengths: np.ndarray, slice_tokens: int, token_cap: int,
                      cost_balanced: bool, extra_slices: int, rounds: int,
                      slice_cost: float) -> tuple[np.ndarray, np.ndarray]:
    """`cut_bounds` of every document: (where document i's bounds start in the flat array, and
    the end; the bounds)."""
    starts = np.empty(len(lengths) + 1, dtype=np.int64)
    flat = np.empty(max(16, 4 * len(lengths)), dtype=np.int64)
    used = 0
    for index in range(len(lengths)):
        starts[index] = used
        bounds = cut_bounds(rates, lengths[index], slice_tokens, token_cap, cost_balanced, extra_slices, rounds,
                            slice_cost)
        if used + len(bounds) > len(flat):
            grown = np.empty(2 * (used + len(bounds)), dtype=np.int64)
            grown[:used] = flat[:used]
            flat = grown
        flat[used:used + len(bounds)] = bounds
        used += len(bounds)
    starts[len(lengths)] = used
    return starts, flat[:used]


# ---- 1F1B forward targets (`orders.forward_targets`) -------------------------------------------


@_jit
def run_chains_ahead(required: np.ndarray, chain_lead: int) -> np.ndarray:
    """The forwards the last stage has run before each backward, a chain's forwards pulled ahead
    one per backward: each backward at least one fewer than the next one's, at most `chain_lead`
    (-1: no limit) beyond its own need (`required`, non-decreasing)."""
    pulled = required.copy()
    for backward in range(len(required) - 2, -1, -1):
        ahead = pulled[backward + 1] - 1
        if chain_lead >= 0:
            ahead = min(ahead, required[backward] + chain_lead)
        pulled[backward] = max(pulled[backward], ahead)
    return pulled


# ---- interleaved 1F1B (`orders.InterleavedSchedule`) -------------------------------------------


@_jit
def interleaved_walk(targets: np.ndarray, forward_units: np.ndarray, forward_chunks: np.ndarray,
                     backward_units: np.ndarray, backward_chunks: np.ndarray, needs: np.ndarray,
                     forward_rows: np.ndarray, backward_rows: np.ndarray, forward_transfer: np.ndarray,
                     backward_transfer: np.ndarray, pp: int, vpp: int) -> float:
    """`InterleavedSchedule._walk`: every rank runs its order (before backward b, forwards up to
    targets[rank, b]), each task once its inputs are done; -1.0 on a circular wait, else the
    makespan. `forward_rows`/`backward_rows`: [virtual stage, unit] seconds; transfers: p2p
    seconds after each unit, left out with one rank (its virtual stages share the device)."""
    virtual = pp * vpp
    forward_count = len(forward_units) // vpp
    total_forwards, total_backwards = len(forward_units), len(backward_units)
    forward_end = np.full((virtual, forward_count), -1.0)
    backward_end = np.full((virtual, len(needs)), -1.0)
    free = np.zeros(pp)
    next_forward = np.zeros(pp, dtype=np.int64)
    next_backward = np.zeros(pp, dtype=np.int64)
    between_ranks = pp > 1
    progress = True
    while progress:
        progress = False
        for stage in range(pp):
            clock, done_f, done_b = free[stage], next_forward[stage], next_backward[stage]
            while True:
                if done_b < total_backwards:
                    forward_next = done_f < targets[stage, done_b]
                elif done_f < total_forwards:
                    forward_next = True
                else:
                    break
                if forward_next:
                    unit, chunk = forward_units[done_f], forward_chunks[done_f]
                    vstage = chunk * pp + stage
                    ready = 0.0
                    if vstage > 0:
                        end = forward_end[vstage - 1, unit]
                        if end < 0.0:
                            break
                        ready = end + forward_transfer[unit] if between_ranks else end
                    clock = (clock if clock > ready else ready) + forward_rows[vstage, unit]
                    forward_end[vstage, unit] = clock
                    done_f += 1
                else:
                    unit, chunk = backward_units[done_b], backward_chunks[done_b]
                    vstage = chunk * pp + stage
                    ready = forward_end[vstage, needs[unit]]
                    if ready < 0.0:
                        break
                    if vstage < virtual - 1:
                        end = backward_end[vstage + 1, unit]
                        if end < 0.0:
                            break
                        end = end + backward_transfer[unit] if between_ranks else end
                        ready = ready if ready > end else end
                    clock = (clock if clock > ready else ready) + backward_rows[vstage, unit]
                    backward_end[vstage, unit] = clock
                    done_b += 1
            if done_f != next_forward[stage] or done_b != next_backward[stage]:
                progress = True
            free[stage], next_forward[stage], next_backward[stage] = clock, done_f, done_b
    for stage in range(pp):
        if next_forward[stage] != total_forwards or next_backward[stage] != total_backwards:
            return -1.0
    return free.max()


__all__ = ["greedy_fits", "greedy_bounds", "optimal_bounds", "bounds_at_work", "interleaved_walk"]


# ---- next-fit packing (`baselines.packing.pack_in_order`) --------------------------------------


@_jit
def next_fit_starts(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Where each sequence of the next-fit packing of `lengths` (in order) starts: a document
    opens a new sequence when it would take the current one past `capacity` tokens (the first
    always does). Integer arithmetic only."""
    starts = np.empty(len(lengths), dtype=np.int64)
    count = 0
    filled = capacity
    for index in range(len(lengths)):
        if filled + lengths[index] > capacity:
            starts[count] = index
            count += 1
            filled = 0
        filled += lengths[index]
    return starts[:count]


# ---- cost-ordered packing (`baselines.wlb_llm.pack_by_cost`) -----------------------------------
# Two binary min-heaps of (key, position) pairs, as arrays: positions are unique, so every key pair
# is, and the top of a heap is the same pair whatever the heap's inner arrangement (heapq's or this).


@_jit
def _before(keys: np.ndarray, items: np.ndarray, a: int, b: int) -> bool:
    return keys[a] < keys[b] or (keys[a] == keys[b] and items[a] < items[b])


@_jit
def _sift_up(keys: np.ndarray, items: np.ndarray, index: int) -> None:
    while index > 0:
        parent = (index - 1) // 2
        if not _before(keys, items, index, parent):
            return
        keys[index], keys[parent] = keys[parent], keys[index]
        items[index], items[parent] = items[parent], items[index]
        index = parent


@_jit
def _sift_down(keys: np.ndarray, items: np.ndarray, size: int, index: int) -> None:
    while True:
        smallest, left = index, 2 * index + 1
        if left < size and _before(keys, items, left, smallest):
            smallest = left
        if left + 1 < size and _before(keys, items, left + 1, smallest):
            smallest = left + 1
        if smallest == index:
            return
        keys[index], keys[smallest] = keys[smallest], keys[index]
        items[index], items[smallest] = items[smallest], items[index]
        index = smallest


@_jit
def _push(keys: np.ndarray, items: np.ndarray, size: int, key: float, item: int) -> int:
    keys[size], items[size] = key, item
    _sift_up(keys, items, size)
    return size + 1


@_jit
def _pop(keys: np.ndarray, items: np.ndarray, size: int) -> int:
    size -= 1
    keys[0], items[0] = keys[size], items[size]
    _sift_down(keys, items, size, 0)
    return size


@_jit
def pack_by_cost_targets(order: np.ndarray, lengths: np.ndarray, costs: np.ndarray, tokens: np.ndarray,
                         loads: np.ndarray, capacity: int) -> np.ndarray:
    """Each document, in `order`, into the micro-batch of least load (`loads`, ties: lowest
    position) whose `tokens` leave room for it within `capacity`; a micro-batch found too full
    waits, roomiest first, until a document short enough comes. `tokens` and `loads` are updated
    in place; returns each document's micro-batch, -1 where none had room."""
    count = len(tokens)
    cheap_keys, cheap = loads.copy(), np.arange(count)
    for start in range(count // 2 - 1, -1, -1):
        _sift_down(cheap_keys, cheap, count, start)
    full_keys, full = np.empty(count, dtype=np.float64), np.empty(count, dtype=np.int64)  # key: -room
    cheap_size, full_size = count, 0
    targets = np.full(len(lengths), -1, dtype=np.int64)
    for index in order:
        length = lengths[index]
        while full_size and -full_keys[0] >= length:
            position = full[0]
            full_size = _pop(full_keys, full, full_size)
            cheap_size = _push(cheap_keys, cheap, cheap_size, loads[position], position)
        while cheap_size:
            position = cheap[0]
            if tokens[position] + length <= capacity:
                tokens[position] += length
                loads[position] += costs[index]
                targets[index] = position
                cheap_keys[0] = loads[position]  # heapreplace: the top's key grew
                _sift_down(cheap_keys, cheap, cheap_size, 0)
                break
            cheap_size = _pop(cheap_keys, cheap, cheap_size)
            full_size = _push(full_keys, full, full_size, float(tokens[position] - capacity), position)
    return targets


# ---- SlimPack's MicroPack filling (`pack_phase.pack_micropacks`) -------------------------------


@_jit
def sand_for_slices(small_first_cost: np.ndarray, small_first_tokens: np.ndarray, target: float,
                    piece_costs: np.ndarray, penalties: np.ndarray, piece_lengths: np.ndarray,
                    token_cap: int) -> np.ndarray:
    """How many of the smallest documents have been taken after each slice's MicroPack is topped
    up (`small_first_*`: prefix sums of the documents' costs and tokens from the small end)."""
    takens = np.empty(len(piece_costs), dtype=np.int64)
    taken = 0
    for index in range(len(piece_costs)):
        room = target / penalties[index] - piece_costs[index]
        fits_cost = np.searchsorted(small_first_cost, small_first_cost[taken] + room, side="right") - 1
        fits_tokens = np.searchsorted(small_first_tokens, small_first_tokens[taken]
                                      + (token_cap - piece_lengths[index]), side="right") - 1
        taken = max(taken, min(fits_cost, fits_tokens))
        takens[index] = taken
    return takens


@_jit
def next_fit_with_sand(cost_prefix: np.ndarray, token_prefix: np.ndarray, target: float, token_cap: int,
                       rest: int) -> np.ndarray:
    """Rows (start, end, sand, small_end): each MicroPack of the documents left after the slices'
    sand holds documents start .. end - 1 (the largest first, next fit) and sand .. small_end - 1
    (the smallest that fit what it has left)."""
    rows = np.empty((rest, 4), dtype=np.int64)
    count = 0
    start, small_end = 0, rest
    while start < small_end:
        by_cost = np.searchsorted(cost_prefix, cost_prefix[start] + target, side="right") - 1
        by_tokens = np.searchsorted(token_prefix, token_prefix[start] + token_cap, side="right") - 1
        end = min(small_end, max(start + 1, min(by_cost, by_tokens)))
        room_cost = target - (cost_prefix[end] - cost_prefix[start])
        room_tokens = token_cap - (token_prefix[end] - token_prefix[start])
        sand_cost = np.searchsorted(cost_prefix, cost_prefix[small_end] - room_cost, side="left")
        sand_tokens = np.searchsorted(token_prefix, token_prefix[small_end] - room_tokens, side="left")
        sand = min(small_end, max(end, sand_cost, sand_tokens))
        rows[count, 0], rows[count, 1], rows[count, 2], rows[count, 3] = start, end, sand, small_end
        count += 1
        start, small_end = end, sand
    return rows[:count]


# ---- 1F1B replay (`orders.replay`, `orders.replay_targets`) -------------------------------------


@_jit
def programs_of_targets(targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The stage orders `orders_of_targets` makes of `targets` (forwards F 0 .. max - 1, before
    backward b the forwards up to targets[s][b], then any left), as `replay_programs` reads them:
    (each stage's start in `codes`, and the end; the task codes)."""
    pp, backwards = targets.shape
    forwards = targets.max() if targets.size else 0
    starts = np.arange(pp + 1) * (forwards + backwards)
    codes = np.empty(pp * (forwards + backwards), dtype=np.int64)
    count = 0
    for stage in range(pp):
        done = 0
        for backward in range(backwards):
            while done < targets[stage, backward]:
                codes[count] = done
                count += 1
                done += 1
            codes[count] = -(backward + 1)
            count += 1
        while done < forwards:
            codes[count] = done
            count += 1
            done += 1
    return starts, codes


@_jit
def replay_programs(starts: np.ndarray, codes: np.ndarray, forward_time: np.ndarray, backward_time: np.ndarray,
                    forward_transfer: np.ndarray, backward_transfer: np.ndarray) -> float:
    """Makespan of stage orders run with blocking receives and non-blocking sends. Stage s runs
    `codes[starts[s]:starts[s + 1]]`: forward unit u is u, backward unit v is -(v + 1). A stage
    runs until it waits on a neighbour; only a neighbour's progress can unblock it, so only those
    are revisited (a sweep over all stages per step is quadratic on deep pipelines). NaN where the
    stages wait on each other in a circle."""
    pp = len(starts) - 1
    forward_end = np.full((pp, forward_time.shape[1]), np.nan)
    backward_end = np.full((pp, backward_time.shape[1]), np.nan)
    free_at = np.zeros(pp)
    position = starts[:-1].copy()
    pending = np.empty(pp, dtype=np.int64)  # a stack of stages to advance, each in it at most once
    queued = np.zeros(pp, dtype=np.bool_)
    top = 0
    for stage in range(pp - 1, -1, -1):
        pending[top] = stage
        queued[stage] = True
        top += 1
    while top > 0:
        top -= 1
        stage = pending[top]
        queued[stage] = False
        start = position[stage]
        clock = free_at[stage]
        done = start
        while done < starts[stage + 1]:
            task = codes[done]
            if task >= 0:
                ready = 0.0
                if stage > 0:
                    ready = forward_end[stage - 1, task]
                    if np.isnan(ready):
                        break
                    ready += forward_transfer[task]
                clock = (clock if clock > ready else ready) + forward_time[stage, task]
                forward_end[stage, task] = clock
            else:
                unit = -task - 1
                ready = 0.0
                if stage < pp - 1:
                    ready = backward_end[stage + 1, unit]
                    if np.isnan(ready):
                        break
                    ready += backward_transfer[unit]
                clock = (clock if clock > ready else ready) + backward_time[stage, unit]
                backward_end[stage, unit] = clock
            done += 1
        free_at[stage] = clock
        position[stage] = done
        if done > start:
            for neighbour in (stage - 1, stage + 1):
                if 0 <= neighbour < pp and not queued[neighbour]:
                    pending[top] = neighbour
                    queued[neighbour] = True
                    top += 1
    for stage in range(pp):
        if position[stage] < starts[stage + 1]:
            return np.nan
    return free_at.max()
