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
