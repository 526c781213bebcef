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


# ---- cost-balanced slices (`pack_phase._balanced_bounds`) ---------------------------------------


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
