"""Unit segmentation and per-stage task orders.

`segment` cuts a sequence of MicroPack costs into contiguous units minimising the heaviest unit
(the linear-partition problem, solved exactly by binary search over the bottleneck).

`build_stage_orders` fixes what each pipeline stage runs, in which order: a generalised 1F1B.
Stage s warms up with pp - s - 1 forward units (one more where its activation budget allows, which
absorbs uneven unit sizes), then alternates backward and forward units; a backward unit is always
preceded by every forward unit holding its MicroPacks (a long document's chain), and those are run
one per backward ahead of time rather than in a burst (at most `chain_lead` units ahead, where memory
cannot hold a long chain's whole run-up next to the previous chain's drain).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import numpy as np

from ..plan import PlanError, last_forward_needed
from . import compiled


def segment(costs: list[float] | np.ndarray, units: int) -> list[list[int]]:
    """Contiguous segmentation of positions 0..n-1 into at most `units` groups, minimising the
    maximum group cost; returns lists of positions."""
    bounds = segment_bounds(costs, units)
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def segment_bounds(costs: list[float] | np.ndarray, units: int) -> list[int]:
    """`segment`'s groups as cut points: group g holds positions bounds[g]..bounds[g + 1] - 1.

    Greedy with limit L (each group takes as many positions as fit, at least one) needs fewer
    groups as L grows, and L = mean + max always fits: the bottleneck is bracketed SEARCH_WAYS
    limits at a time (the first that fits, by bisection) to within BRACKET_TOLERANCE, then the
    search finishes exactly: the optimal bottleneck is the sum of a contiguous run, so it steps
    down through the bottlenecks the greedy reaches until a limit just below one no longer fits
    (`compiled.optimal_bounds`)."""
    costs = np.asarray(costs, dtype=float)
    count = len(costs)
    if count == 0:
        return [0]
    units = max(1, min(units, count))
    if units == count:
        return list(range(count + 1))
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    return compiled.optimal_bounds(prefix, float(costs.max()), units, BRACKET_TOLERANCE, SEARCH_WAYS).tolist()


BRACKET_TOLERANCE = 1e-6
SEARCH_WAYS = 16


@dataclass
class StageWork:
    """Per-stage durations and activation bytes of every unit, indexed [stage][unit]."""

    forward_time: list[list[float]]
    backward_time: list[list[float]]
    forward_transfer: list[float]  # p2p seconds after F u
    backward_transfer: list[float]  # p2p seconds after B v
    forward_bytes: list[list[float]]  # activation bytes F u allocates on a stage
    backward_frees: list[list[float]]  # activation bytes B v frees on a stage
    budget: list[float]  # in-flight activation budget per stage
    # rows already converted to arrays (`row`, `chunk_rows`, `levels`): a candidate's orders and
    # schedules read the same rows many times
    _arrays: dict = field(default_factory=dict, repr=False, compare=False)

    def row(self, name: str, stage: int | None = None) -> np.ndarray:
        """Field `name` (row `stage` of a per-stage one) as a float array, made once (read only)."""
        source = getattr(self, name) if stage is None else getattr(self, name)[stage]
        key = (name, id(source))  # the stages before the last share their rows
        if key not in self._arrays:
            self._arrays[key] = np.asarray(source, dtype=float)
        return self._arrays[key]

    def table(self, name: str) -> np.ndarray:
        """A per-stage field as a [stage, unit] float array, made once (read only)."""
        key = ("table", name)
        if key not in self._arrays:
            self._arrays[key] = np.array(getattr(self, name), dtype=float)
        return self._arrays[key]

    def chunk_rows(self, name: str, vpp: int) -> np.ndarray:
        """A per-stage time field as a row per virtual stage (chunk * pp + stage): the last stage's
        row (output layer) only for the last virtual stage, a middle one for every other (read only)."""
        key = ("chunks", name, vpp)
        if key not in self._arrays:
            rows = getattr(self, name)
            table = np.empty((len(rows) * vpp, len(rows[0])))
            table[:] = self.row(name, 0)
            table[-1] = self.row(name, len(rows) - 1)
            self._arrays[key] = table
        return self._arrays[key]

    def levels(self, stage: int) -> tuple[np.ndarray, np.ndarray]:
        """(bytes the stage's first k forwards allocate, bytes its first k backwards free), k = 0 ..:
        cumulative sums of its rows, made once per distinct row (read only)."""
        forward_bytes, frees = self.forward_bytes[stage], self.backward_frees[stage]
        key = ("levels", id(forward_bytes), id(frees))
        if key not in self._arrays:
            self._arrays[key] = (np.concatenate([[0.0], np.cumsum(forward_bytes)]),
                                 np.concatenate([[0.0], np.cumsum(frees)[:-1]]))
        return self._arrays[key]

    @cached_property
    def stage_totals(self) -> list[tuple[float, float, float, float]]:
        """Per stage: (sum of forward times, sum of backward times, largest forward, largest
        backward), summed once per distinct row (the stages before the last share theirs)."""
        by_rows: dict[tuple[int, int], tuple[float, float, float, float]] = {}
        totals = []
        for forward, backward in zip(self.forward_time, self.backward_time):
            key = (id(forward), id(backward))
            if key not in by_rows:
                by_rows[key] = (sum(forward), sum(backward), max(forward), max(backward))
            totals.append(by_rows[key])
        return totals


def warmup_counts(work: StageWork, pp: int) -> list[int]:
    """Forward units each stage runs before its first backward: 1F1B's pp - s - 1, plus as many
    more as the stage's activation budget holds beyond 1F1B's own need (slack for uneven units)."""
    counts = []
    for stage in range(pp):
        sizes = work.forward_bytes[stage]
        classic = min(pp - stage - 1, len(sizes))
        used = sum(sizes[: classic + 1])
        extra = 0
        while (classic + extra + 1 < len(sizes) and extra < 1
               and used + sizes[classic + extra + 1] <= work.budget[stage]):
            used += sizes[classic + extra + 1]
            extra += 1
        counts.append(classic + extra)
    return counts


def build_stage_orders(
    forward_units: list[list[int]], backward_units: list[list[int]], work: StageWork, chain_lead: int | None = None
) -> list[list[tuple[str, int]]]:
    """`stage_orders` with the warm-ups the work's activation budget allows (`replay` times them)."""
    return stage_orders(forward_units, backward_units, warmup_counts(work, len(work.forward_time)), chain_lead)


def stage_orders(forward_units: list[list[int]], backward_units: list[list[int]],
                 warmups: list[int], chain_lead: int | None = None) -> list[list[tuple[str, int]]]:
    """Each stage's task order under `forward_targets` (see there)."""
    return orders_of_targets(forward_targets(forward_units, backward_units, warmups, chain_lead))


def forward_targets(forward_units: Sequence, backward_units: Sequence,
                    warmups: list[int], chain_lead: int | None = None,
                    needs: np.ndarray | None = None) -> np.ndarray:
    """How many forward units each stage has run before each backward unit, [stage][backward]:
    the whole of a stage's order (`orders_of_targets`), small enough to judge many orders by.

    Each stage s runs `warmups[s]` forwards (at least 1F1B's pp - s - 1 where it has that
    many), then alternates one backward and one forward. Before backward unit b the last stage has
    run every forward unit b needs, and stage s is pp - 1 - s units further ahead, as in 1F1B.
    A chain's forwards are pulled ahead of the backwards before it, at most `chain_lead` units
    beyond what those backwards need (None: the whole chain; 0: a burst). `needs`:
    `last_forward_needed` of the units, where the caller has it (then only the units' counts are read).
    Stage s never runs fewer forwards before a given backward than stage s + 1, and the forwards
    needed never decrease from one backward to the next, so every receive is matched: no deadlock.
    """
    pp = len(warmups)
    # The last forward unit the last stage must have run before backward unit b: at least its
    # share b * forwards / backwards of the forwards (b itself where the counts are equal, as in
    # 1F1B; with twice as many backward units as forward units, one forward per two backwards),
    # and never fewer than before b - 1.
    needed_by_unit = last_forward_needed(forward_units, backward_units) if needs is None else needs
    steady = np.arange(len(needed_by_unit)) * len(forward_units) // max(len(needed_by_unit), 1)
    required = np.maximum.accumulate(np.maximum(needed_by_unit, steady)).astype(np.int64)
    # A chain's backward needs all its forwards first. Run them one per backward ahead of time
    # instead of in a burst right before it: a burst stalls the neighbours, which wait on this
    # stage's next backward (or forward) while it runs forward after forward. Without neighbours
    # (pp == 1) running them early would only hold memory longer.
    if pp > 1:
        required = compiled.run_chains_ahead(required, -1 if chain_lead is None else chain_lead)
    extra = [count - (pp - stage - 1) for stage, count in enumerate(warmups)]
    for stage in range(pp - 2, -1, -1):  # keep the lead over the next stage at least one unit
        extra[stage] = max(extra[stage], extra[stage + 1])
    # stage s stays pp - 1 - s units ahead of the last, as in 1F1B
    lead = np.array([1 + (pp - 1 - stage) + extra[stage] for stage in range(pp)], dtype=np.int64)
    return np.minimum(len(forward_units), required[None, :] + lead[:, None])


def orders_of_targets(targets: np.ndarray, forwards: list | None = None,
                      backwards: list | None = None) -> list[list[tuple]]:
    """Stage orders from `forward_targets`: before backward b, the forwards up to targets[s][b]
    (then any forwards left). `forwards`/`backwards`: the task sequences (default ("F", u) and
    ("B", v) in unit order; interleaved orders pass their (kind, unit, chunk) tables)."""
    # Tasks are shared tuples, and forwards are added as slices: the planner builds these orders
    # for every unit count of every MicroPack size it tries.
    targets = np.asarray(targets)
    if forwards is None:
        forwards = [("F", unit) for unit in range(int(targets.max()) if targets.size else 0)]
    if backwards is None:
        backwards = [("B", unit) for unit in range(targets.shape[1])]
    orders = []
    for row in targets.tolist():
        order: list[tuple] = []
        done = 0
        for backward, target in zip(backwards, row):
            if target > done:
                order += forwards[done:target]
                done = target
            order.append(backward)
        orders.append(order + forwards[done:])
    return orders


def peaks_of_targets(targets: np.ndarray, work: StageWork) -> list[float]:
    """`peak_in_flight` of the orders `targets` describe, without building them: a stage holds
    the most right before some backward, after the forwards run ahead of it."""
    peaks = []
    for stage, row in enumerate(targets):
        allocated, freed = work.levels(stage)
        levels = allocated[row] - freed[:len(row)]
        peaks.append(max(0.0, float(levels.max())) if len(row) else 0.0)
    return peaks


def peak_in_flight(orders: list[list[tuple[str, int]]], work: StageWork) -> list[float]:
    """Most activation bytes each stage holds while running its order: a forward unit's
    MicroPacks stay until the backward unit that frees them has run (a long document's chain
    keeps every slice), so large units or a long warm-up can exceed memory."""
    peaks = []
    for stage, order in enumerate(orders):
        level = peak = 0.0
        for kind, unit in order:
            if kind == "F":
                level += work.forward_bytes[stage][unit]
                peak = max(peak, level)
            else:
                level -= work.backward_frees[stage][unit]
        peaks.append(peak)
    return peaks


def replay(orders: list[list[tuple[str, int]]], work: StageWork) -> float:
    """Makespan of running `orders` with blocking receives and non-blocking sends (the loop is
    `compiled.replay_programs`)."""
    codes = [np.fromiter((unit if kind == "F" else -unit - 1 for kind, unit in order), dtype=np.int64,
                         count=len(order)) for order in orders]
    starts = np.concatenate([[0], np.cumsum([len(order) for order in orders])]).astype(np.int64)
    return _replayed(starts, np.concatenate(codes + [np.zeros(0, dtype=np.int64)]), work)


def replay_targets(targets: np.ndarray, work: StageWork) -> float:
    """`replay` of `orders_of_targets(targets)`, without building the orders: the planner replays
    every candidate that fits memory, and only the chosen one's orders are used."""
    return _replayed(*compiled.programs_of_targets(np.asarray(targets, dtype=np.int64)), work)


def _replayed(starts: np.ndarray, codes: np.ndarray, work: StageWork) -> float:
    makespan = compiled.replay_programs(starts, codes, work.table("forward_time"), work.table("backward_time"),
                                        work.row("forward_transfer"), work.row("backward_transfer"))
    if math.isnan(makespan):
        raise RuntimeError("stage orders deadlock; this is a bug in build_stage_orders")
    return makespan


# ---- interleaved 1F1B (virtual pipeline stages) -----------------------------------------------
@dataclass(frozen=True, eq=False)
class TaskTable:
    """One direction of an interleaved schedule, the same on every rank: its tasks ("F" or "B",
    unit, chunk) in order (`task_table`; backwards with chunks reversed) and their units and
    chunks as arrays. Built once per groups and vpp (`task_table`) and shared: the planner orders
    many candidates with the same unit counts, several schedules each."""

    tasks: list[tuple[str, int, int]]
    units: np.ndarray
    chunks: np.ndarray

    @cached_property
    def positions(self) -> np.ndarray:
        """[chunk, unit]: where that task is in the table."""
        index = np.zeros((int(self.chunks.max(initial=-1)) + 1, int(self.units.max(initial=-1)) + 1), dtype=np.int64)
        index[self.chunks, self.units] = np.arange(len(self.tasks))
        return index


@lru_cache(maxsize=64)
def task_table(kind: str, group_sizes: tuple[int, ...], vpp: int) -> TaskTable:
    """The forward ("F") or backward ("B") tasks every rank runs in this order under interleaved
    1F1B: units in consecutive groups of `group_sizes`, each group through chunk 0, then chunk 1,
    ... (backwards with chunks reversed: the last chunk's backward comes first)."""
    sizes = np.asarray(group_sizes, dtype=np.int64)
    group_of = np.repeat(np.arange(len(sizes)), sizes * vpp)  # each task's group
    group_first = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # its first unit
    offset = np.arange(len(group_of)) - np.repeat(group_first * vpp, sizes * vpp)  # within the group's block
    units = group_first[group_of] + offset % sizes[group_of]
    chunks = offset // sizes[group_of]
    if kind == "B":
        chunks = vpp - 1 - chunks
    return TaskTable(list(zip([kind] * len(units), units.tolist(), chunks.tolist())), units, chunks)


def megatron_groups(num_units: int, group: int, pp: int) -> list[int]:
    """Megatron's groups of `group` units (microbatch_group_size_per_vp_stage, default pp), the
    last taking what remains; a remainder shorter than pp joins the group before (Megatron refuses
    such a step: a last group shorter than pp makes the first rank wait on the last one's previous
    chunk)."""
    whole, remainder = divmod(num_units, group)
    if whole == 0 or remainder == 0:
        return [group] * whole or [num_units]
    if remainder >= pp:
        return [group] * whole + [remainder]
    return [group] * (whole - 1) + [group + remainder]


def interleaved_groupings(num_units: int, group: int, pp: int) -> list[list[int]]:
    """The group sizes to try for `num_units`, Megatron's first. A group of g > pp units makes
    the last rank run (vpp - 1) * (g - pp) more forwards before its backwards need them, and every
    rank then holds that many more chunks in flight (pp=8, vpp=6: 90 instead of 55 for 39 units).
    Where a remainder joined the group before, two groupings that hold fewer: the remainder spread
    one unit over each of the last groups (at most one extra unit per group), and the remainder as
    a short first group (Megatron's count in flight; a bubble where rank 0 waits on the last rank's
    previous chunk, and a circular wait for some counts, which the walk finds)."""
    groupings = [megatron_groups(num_units, group, pp)]
    whole, remainder = divmod(num_units, group)
    if whole >= 1 and 0 < remainder < pp:
        if remainder > 1 and whole >= remainder:
            groupings.append([group] * (whole - remainder) + [group + 1] * remainder)
        groupings.append([remainder] + [group] * whole)
    return groupings


@dataclass
class InterleavedSchedule:
    """Every rank's interleaved order in short: the forward and backward tables all ranks share
    (`task_table`) and how many forwards each rank has run before each backward
    ([rank][backward], as `forward_targets`). Walked, timed and measured without building the
    orders (`orders` builds them): the planner judges many and keeps one."""

    targets: np.ndarray
    forward_table: TaskTable
    backward_table: TaskTable
    needs: list[int]  # the last forward unit each backward unit needs (`last_forward_needed`)
    pp: int
    vpp: int
    grouping: int = 0  # which of `interleaved_groupings` its tables follow (0: Megatron's)

    @property
    def forwards(self) -> list[tuple[str, int, int]]:
        return self.forward_table.tasks

    @property
    def backwards(self) -> list[tuple[str, int, int]]:
        return self.backward_table.tasks

    def orders(self) -> list[list[tuple[str, int, int]]]:
        return orders_of_targets(self.targets, self.forwards, self.backwards)

    def runs_through(self) -> bool:
        """Whether every rank can run its order to the end (no circular wait)."""
        return self._walk(None) is not None

    def walked_s(self, work: StageWork) -> float | None:
        """`makespan_s`, or None where the ranks would wait in a circle (the walk does not depend
        on the times: it runs through with them exactly where it does without)."""
        return self._walk(work)

    def makespan_s(self, work: StageWork) -> float:
        """`replay` for interleaved orders: `work`'s times are per chunk. A PlanError where the
        ranks would wait in a circle (a schedule handed out unwalked, `InterleavedCandidate`)."""
        makespan = self.walked_s(work)
        if makespan is None:
            raise no_interleaved_order(len(self.forwards) // self.vpp, len(self.needs), self.pp, self.vpp)
        return makespan

    def peak_bytes(self, work: StageWork) -> float:
        """`peak_in_flight` over ranks: a rank holds every chunk's in-flight units, and holds the
        most right before some backward, after the forwards run ahead of it (or at its end). Every
        rank but the last allocates and frees the same bytes (middle chunks only), so their levels
        are one array operation."""
        pp, vpp = self.pp, self.vpp
        forward_units, backward_units = self.forward_table.units, self.backward_table.units
        targets = np.asarray(self.targets)
        allocated = work.row("forward_bytes", 0)[forward_units]  # copies: changed below
        frees = work.row("backward_frees", 0)[backward_units]
        peak = _peak_of_rows(targets[:pp - 1], allocated, frees)
        # the last rank's last chunk holds the output layer's activations
        last_forward, last_backward = self.forward_table.chunks == vpp - 1, self.backward_table.chunks == vpp - 1
        allocated[last_forward] = work.row("forward_bytes", pp - 1)[forward_units[last_forward]]
        frees[last_backward] = work.row("backward_frees", pp - 1)[backward_units[last_backward]]
        return max(0.0, peak, _peak_of_rows(targets[pp - 1:], allocated, frees))

    def _walk(self, work: StageWork | None) -> float | None:
        """Run every rank's order, each task once its inputs are done: a forward on virtual stage
        v after the same unit's forward on v - 1; a backward after its needed forward on v and
        its own backward on v + 1. With `work`, times them (per-chunk durations, p2p between
        ranks) and returns the makespan; without, returns 0.0. None: a circular wait
        (`compiled.interleaved_walk`)."""
        pp, vpp = self.pp, self.vpp
        forward_count, backward_count = len(self.forwards) // vpp, len(self.needs)
        if work is None:
            forward_rows, backward_rows = np.zeros((pp * vpp, forward_count)), np.zeros((pp * vpp, backward_count))
            forward_transfer, backward_transfer = np.zeros(forward_count), np.zeros(backward_count)
        else:
            forward_rows, backward_rows = work.chunk_rows("forward_time", vpp), work.chunk_rows("backward_time", vpp)
            forward_transfer, backward_transfer = work.row("forward_transfer"), work.row("backward_transfer")
        makespan = compiled.interleaved_walk(
            np.asarray(self.targets, dtype=np.int64), self.forward_table.units, self.forward_table.chunks,
            self.backward_table.units, self.backward_table.chunks, np.asarray(self.needs, dtype=np.int64),
            forward_rows, backward_rows, forward_transfer, backward_transfer, pp, vpp)
        if makespan < 0.0:
            return None
        return makespan if work is not None else 0.0


def _peak_of_rows(targets: np.ndarray, allocated: np.ndarray, frees: np.ndarray) -> float:
    """The most any of these ranks holds (each row of `targets`: before backward b, forwards up to
    targets[b] have run), given what each forward allocates and each backward frees, in program
    order: right before some backward, or at the end."""
    if not len(targets):
        return 0.0
    held = np.concatenate([[0.0], np.cumsum(allocated)])
    before = held[targets] - np.concatenate([[0.0], np.cumsum(frees)[:-1]])
    at_end = float(held[-1] - frees.sum())
    return max(float(before.max()) if targets.shape[1] else 0.0, at_end)


# What the replica search tries, in this order, for candidates that Megatron's interleaved
# schedules do not fit (`interleaved_schedules`' `which`); a schedule's level is its index + 1.
LEANER_SCHEDULES = ("groupings", "per-rank")


def interleaved_schedules(forward_units: Sequence, backward_units: Sequence, pp: int, vpp: int,
                          group: int | None = None, which: str = "all",
                          needs: np.ndarray | None = None) -> list[InterleavedSchedule]:
    """The interleaved 1F1B schedules to try (`interleaved_orders`), over the groupings of
    `interleaved_groupings`, least in flight first within a grouping. `which`: "all", two per
    grouping, Megatron's first; "megatron", its two; or one of `LEANER_SCHEDULES`, which hold
    less: "groupings", the other groupings' two, and "per-rank", every grouping's per-rank
    targets (`_interleaved_targets`). Megatron's two:

    - forwards follow `task_table` over the forward units; backwards follow it over the
      backward units with chunks reversed (the last chunk's backward comes first);
    - the last rank runs (vpp - 1) * group forwards before its first backward, then one more per
      backward (scaled when forward and backward unit counts differ), and never a backward before
      the forward it needs on that chunk (a long document's later slices, a group longer than
      pp); rank s keeps 2 * (pp - 1 - s) forwards more than the last rank, as Megatron's warm-up does.

    The first adds each backward's need where it arises; the second adds the largest excess as
    one lead to every rank's warm-up (as Megatron adds one for all when it overlaps MoE traffic).
    Every target of the second is at least the first's, so it never holds less in flight.
    Where `needs` is given only the units' counts are read (any sized sequences will do)."""
    group = group or pp
    forward_groupings = interleaved_groupings(len(forward_units), group, pp)
    backward_groupings = interleaved_groupings(len(backward_units), group, pp)
    pairs = []
    for index in range(max(len(forward_groupings), len(backward_groupings))):
        pair = (forward_groupings[min(index, len(forward_groupings) - 1)],
                backward_groupings[min(index, len(backward_groupings) - 1)])
        if pair not in pairs:
            pairs.append(pair)
    jobs = {"all": [(index, "ends") for index in range(len(pairs))], "megatron": [(0, "ends")],
            "groupings": [(index, "ends") for index in range(1, len(pairs))],
            "per-rank": [(index, "per-rank") for index in range(len(pairs))]}[which]
    if needs is None:  # `needs`: `last_forward_needed` of the units, where the caller has it
        needs = last_forward_needed(forward_units, backward_units) if backward_units else np.zeros(0, dtype=np.int64)
    needs_list = needs.tolist()
    schedules = []
    for index, kinds in jobs:
        forward_groups, backward_groups = pairs[index]
        forwards, backwards = task_table("F", tuple(forward_groups), vpp), task_table("B", tuple(backward_groups), vpp)
        for targets in _interleaved_targets(forwards, backwards, needs, pp, vpp, group, kinds):
            schedules.append(InterleavedSchedule(targets, forwards, backwards, needs_list, pp, vpp, index))
    return schedules


def _interleaved_targets(forwards: TaskTable, backwards: TaskTable, needs: np.ndarray, pp: int, vpp: int,
                         group: int, kinds: str = "ends") -> list[np.ndarray]:
    """`interleaved_schedules`' forward targets of one grouping's tables: "ends", each backward's
    need added where it arises (then kept: targets never fall), and the largest excess as one lead
    for all; "per-rank", each rank's warm-up lead added to the steady state only, then its needs (a
    long document's chain is not held on top of the lead: at most what either asks, and the ranks
    stay consistent where the first of "ends" waits in a circle)."""
    total_forwards, total_backwards = len(forwards.tasks), len(backwards.tasks)
    steady = (vpp - 1) * group + np.arange(total_backwards) * total_forwards // max(total_backwards, 1) + 1
    needed = forwards.positions[backwards.chunks, needs[backwards.units]] + 1
    lead = 2 * (pp - 1 - np.arange(pp))[:, None]
    if kinds == "per-rank":
        return [np.minimum(total_forwards, np.maximum.accumulate(
            np.maximum(steady[None, :] + lead, needed[None, :]), axis=1))]
    lift = int((needed - steady).max(initial=0))
    return [np.minimum(total_forwards, required[None, :] + lead)
            for required in (np.maximum.accumulate(np.maximum(steady, needed)), steady + lift)]


def interleaved_orders(forward_units: list[list[int]], backward_units: list[list[int]], pp: int, vpp: int,
                       group: int | None = None) -> list[list[tuple[str, int, int]]]:
    """Each rank's task order ("F"/"B", unit, chunk) under Megatron's interleaved 1F1B
    (`forward_backward_pipelining_with_interleaving`), generalised to units: the first of
    `interleaved_schedules` that runs through.

    With one MicroPack per unit and independent micro-batches this is exactly Megatron's order.
    A long document's backward needs its later slices' forwards first: each backward's need is
    added where it arises, or, where that would make ranks wait in a circle (rank 0's next chunk
    waiting on the last rank, which waits on rank 0's backward), as one lead added to every rank's
    warm-up. Where neither runs (forward and backward unit counts far apart), a PlanError: the
    planner skips such candidates.
    """
    for schedule in interleaved_schedules(forward_units, backward_units, pp, vpp, group):
        if schedule.runs_through():
            return schedule.orders()
    raise no_interleaved_order(len(forward_units), len(backward_units), pp, vpp)


def no_interleaved_order(forward_units: int, backward_units: int, pp: int, vpp: int) -> PlanError:
    # Very different forward and backward unit counts (forward pairs, backward singles) misalign
    # the two tables' chunk groups.
    return PlanError(f"no interleaved 1F1B order runs {forward_units} forward and {backward_units} backward units "
                     f"over pp={pp} x vpp={vpp} without a circular wait; use units of closer counts or vpp=1")


def interleaved_microbatch_error(num_units: int, pp: int, group: int | None = None) -> str | None:
    """Megatron's check on the microbatch count of the interleaved schedule (core 0.16): a group
    size in [pp, num_units], and a last group that is full or at least pp long. None if it holds."""
    group = group or pp
    if not pp <= group <= num_units:
        return (f"{num_units} microbatches with interleaving over pp={pp}: Megatron needs at least pp "
                "microbatches per step")
    remainder = num_units % group
    if 0 < remainder < pp:
        return (f"{num_units} microbatches with interleaving over pp={pp}: Megatron needs a multiple of "
                f"{group} (or a last group of at least pp)")
    return None
