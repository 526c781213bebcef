"""DAG simulation of one training step of a `Plan` (docs/design.md section 6).

Model
-----
Devices: one per (data-parallel rank r, pipeline stage s); TP and CP inside a device are folded
into the cost model's per-stage times. Rank r runs `plan.replicas_of_rank(r)` in that order and,
within a replica, stage s runs exactly `replica.stage_orders[s]` (program order).

Virtual pipeline stages (`parallel.vpp` > 1, Megatron's interleaved 1F1B): the model is cut into
pp x vpp chunks; chunk c of stage s is virtual stage v = c * pp + s, and the tasks below are per
virtual stage (a chunk's layers, the output layer only on the last virtual stage). Stage s's
order names each task's chunk; the activation of virtual stage v goes to v + 1, so the last
rank's chunk c feeds the first rank's chunk c + 1 (one more p2p per chunk boundary). A device's
memory holds every in-flight chunk's activations; its parameters, all its chunks'.

Tasks and edges:
- F u on stage s lasts the sum of its MicroPacks' `forward_time`; it needs F u of stage s-1 plus
  a p2p transfer of the unit's activations.
- B v on stage s lasts the sum of `backward_time`; it needs B v of stage s+1 plus a p2p transfer,
  and the forward unit holding the last of its MicroPacks on stage s.
- P2P transfers are non-blocking sends: they occupy a link, not the compute stream. Each
  (rank, stage, direction) has one link; transfers on it run one at a time in the order the
  sender issues them (its program order), starting when the sending task ends.
- A DP-Merge group's task occupies stage s of every member rank at once (synchronous: it starts
  when all member devices are free and its inputs arrived). Its duration uses
  `parallel.with_(cp=parallel.cp * k, dp=parallel.dp // k)` (k = group size): its CP term is the
  group's K/V traffic, and a stage still spans tp * cp * dp ranks (the pipeline links' stride).
- DP gradient reduction per stage (see `_dp_reduction`).

Timing is list scheduling in topological order of the DAG whose edges are program order on
every device a task occupies plus the data dependencies above: a task starts at the max of its
devices' free time and its inputs' arrival. If Kahn's algorithm stops with tasks left, the graph
has a cycle (the stage orders would deadlock) and `SimulationError` names one, task by task.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
import weakref
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, cast

import numpy as np

from ..costmodel import CostModel, Overlaps, overlaps_of
from ..plan import PackFigures, Plan, ReplicaPlan, pack_figures, sequence_sharded_pairs, slice_table, task_chunk
from ..specs import GIB, ParallelConfig
from .compiled import list_schedule, program_successors
from .memory import MemoryLedger, MemoryTimeline

# Megatron DDP's default gradient bucket: max(40M, 1M * dp) parameters.
DDP_BUCKET_PARAMS = 40_000_000


class SimulationError(ValueError):
    """The plan cannot be simulated: its stage orders deadlock or reference unknown units."""

    def __init__(self, message: str, cycle: list[str] | None = None):
        super().__init__(message)
        self.cycle = cycle or []


@dataclass(slots=True)
class TaskRecord:
    """One bar of the timeline. kind: F, B (compute; `detail` "merge group [ranks]" for a
    DP-Merge group's task), P2P (transfer sent by `stage`; `detail` e.g. "F 0->1") or DP
    (gradient reduction; replica and unit -1). Times in seconds."""

    rank: int
    stage: int
    replica: int
    kind: str
    unit: int
    start: float
    end: float
    detail: str = ""
    chunk: int = 0  # the model chunk (virtual pipeline stages); 0 without

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SimulationReport:
    """What one simulated step costs. Per-stage lists are indexed by pipeline stage.

    - stage_busy_s / stage_idle_s: compute time and idle time of a stage's devices, mean over
      ranks (busy + idle = iteration time); `device_busy_s[rank][stage]` has every device.
    - bubble_ratio: idle share of all devices' timelines (1 - busy / (devices * iteration)).
    - dp_imbalance: max/mean over ranks of the rank's compute (all its stages);
      pp_imbalance: max/mean over stages of the stage's compute (all ranks).
    - dp_reduce_overlap_s / dp_reduce_exposed_s: per stage, how much of the gradient reduction
      ran under the last backward, and how much after it.
    - lower_bound_s = max(work_bound_s, critical_path_s): total compute / devices, and the
      longest chain of data dependencies (p2p included, link contention and program order not)
      plus the last gradient bucket.
    - tasks: `TaskRecord`s (empty when simulated with detail=False, as is memory_timeline).
    """

    strategy: str
    layout: str
    dp: int
    pp: int
    world_size: int
    num_tokens: int
    iteration_time_s: float
    tokens_per_s: float
    mfu: float
    stage_busy_s: list[float]
    stage_idle_s: list[float]
    device_busy_s: list[list[float]]
    bubble_ratio: float
    dp_imbalance: float
    pp_imbalance: float
    peak_memory_bytes: list[float]
    memory_budget_bytes: float | None
    fits_memory: bool
    dp_reduce_time_s: float
    dp_reduce_overlap_s: list[float]
    dp_reduce_exposed_s: list[float]
    work_bound_s: float
    critical_path_s: float
    lower_bound_s: float
    memory_timeline: list[MemoryTimeline] = field(default_factory=list)
    tasks: list[TaskRecord] = field(default_factory=list)

    def __repr__(self) -> str:
        """A few lines a person reads (the dataclass's own repr would hold every task): the step's
        time and lower bound, MFU, bubble, imbalances and each stage's peak memory against the budget."""
        peaks = ", ".join(f"{peak / GIB:.2f}" for peak in self.peak_memory_bytes)
        budget = f" of {self.memory_budget_bytes / GIB:.1f} GiB" if self.memory_budget_bytes else ""
        return "\n".join([
            f"SimulationReport: {self.strategy} {self.layout}, {self.num_tokens:,} tokens",
            f"  makespan {self.iteration_time_s:.4g} s (lower bound {self.lower_bound_s:.4g} s), "
            f"{self.tokens_per_s:,.0f} tokens/s, MFU {100 * self.mfu:.1f}%",
            f"  bubble {100 * self.bubble_ratio:.1f}%, DP imbalance {self.dp_imbalance:.3f}, "
            f"PP imbalance {self.pp_imbalance:.3f} (max/mean)",
            f"  peak memory per stage (GiB): [{peaks}]{budget}: {'fits' if self.fits_memory else 'DOES NOT FIT'}",
        ])

    def to_dict(self) -> dict:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data["memory_timeline"] = [m.to_dict() for m in self.memory_timeline]
        data["tasks"] = [t.to_dict() for t in self.tasks]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "SimulationReport":
        values = dict(data)
        values["memory_timeline"] = [MemoryTimeline.from_dict(m) for m in data.get("memory_timeline", [])]
        values["tasks"] = [TaskRecord(**t) for t in data.get("tasks", [])]
        return cls(**values)


def per_batch_report(reports: list[SimulationReport], num_batches: int) -> SimulationReport:
    """Several steps of one layout as one report per global batch: times, bounds and busy/idle
    seconds summed and divided by `num_batches` (a stateful strategy's final flush is an extra
    report, counted in, not an extra batch); MFU, bubble and imbalances weighted by time; peak
    memory the largest. Each figure is of the same steps, so the time never beats the bound."""
    if not reports or num_batches < 1:
        raise ValueError("per_batch_report needs at least one report and one batch")
    times = np.array([r.iteration_time_s for r in reports])
    total = float(times.sum())

    def per_batch(values) -> float:
        return float(np.sum(values)) / num_batches

    def time_weighted(values) -> float:
        return float(np.dot(values, times) / total) if total > 0 else float(np.mean(values))

    def per_batch_lists(name: str) -> list:
        return (np.sum([getattr(r, name) for r in reports], axis=0) / num_batches).tolist()

    return replace(
        reports[0],
        num_tokens=round(per_batch([r.num_tokens for r in reports])),
        iteration_time_s=total / num_batches,
        tokens_per_s=sum(r.num_tokens for r in reports) / total if total > 0 else 0.0,
        mfu=time_weighted([r.mfu for r in reports]),
        stage_busy_s=per_batch_lists("stage_busy_s"), stage_idle_s=per_batch_lists("stage_idle_s"),
        device_busy_s=per_batch_lists("device_busy_s"),
        bubble_ratio=time_weighted([r.bubble_ratio for r in reports]),
        dp_imbalance=time_weighted([r.dp_imbalance for r in reports]),
        pp_imbalance=time_weighted([r.pp_imbalance for r in reports]),
        peak_memory_bytes=np.max([r.peak_memory_bytes for r in reports], axis=0).tolist(),
        fits_memory=all(r.fits_memory for r in reports),
        dp_reduce_time_s=per_batch([r.dp_reduce_time_s for r in reports]),
        dp_reduce_overlap_s=per_batch_lists("dp_reduce_overlap_s"),
        dp_reduce_exposed_s=per_batch_lists("dp_reduce_exposed_s"),
        work_bound_s=per_batch([r.work_bound_s for r in reports]),
        critical_path_s=per_batch([r.critical_path_s for r in reports]),
        lower_bound_s=per_batch([r.lower_bound_s for r in reports]),
        memory_timeline=[], tasks=[],
    )


def simulate(plan: Plan, cost, *, detail: bool = True, dp_buckets: int | None = None,
             overlaps: Overlaps | None = None) -> SimulationReport:
    """Simulate one training step of `plan` with `cost` (a `CostModel` or the same interface).

    detail=False skips the task records and memory timelines (peaks are still computed): the
    planner's inner loop. `dp_buckets` overrides the number of DDP gradient buckets. Communication
    is priced with the overlaps the plan's strategy declares (`StrategySpec.overlaps`), or with
    `overlaps` where given (a peer priced as its authors ran it, in their own system).
    """
    key = (id(plan), id(cost), overlaps, dp_buckets)
    if not detail and _reused is not None and key in _reused:
        return _reused[key][2]
    priced = cost
    if isinstance(cost, CostModel):
        priced = cost.with_overlaps(overlaps if overlaps is not None else overlaps_of(plan.strategy))
    graph = _Graph(plan, priced)
    report = _report(plan, priced, graph, _run(graph), detail, dp_buckets)
    if not detail and _reused is not None:
        _reused[key] = (plan, cost, report)  # the plan and cost held: their ids stay theirs
    return report


def busiest_device_s(plan: Plan, cost, overlaps: Overlaps | None = None) -> float:
    """Compute seconds of the plan's busiest device, priced as `simulate` prices its tasks. A
    device runs its tasks one at a time, so no simulated step of the plan is shorter: whether a
    plan can beat a time is told without scheduling it (about a fifth of a simulation)."""
    if isinstance(cost, CostModel):
        cost = cost.with_overlaps(overlaps if overlaps is not None else overlaps_of(plan.strategy))
    pp, vstages = plan.parallel.pp, plan.parallel.pp * plan.parallel.vpp
    busy = [0.0] * (plan.parallel.dp * pp)
    for index, replica in enumerate(plan.replicas):
        figures = _replica_costs(index, replica, plan, cost, [])
        for vstage in range(vstages):
            last = vstage == vstages - 1
            seconds = sum(figures.forward_unit[last]) + sum(figures.backward_unit[last])
            for rank in figures.ranks:
                busy[rank * pp + vstage % pp] += seconds
    return max(busy, default=0.0)


# Reports kept by `reports_reused` (None: outside it), by plan and cost object.
_reused: dict[tuple, tuple[Plan, object, "SimulationReport"]] | None = None


@contextlib.contextmanager
def reports_reused():
    """Within it, simulating the same plan object with the same cost object again (detail=False)
    returns the first report: a planner that simulated its plan to choose it (SlimPack's
    fixed-grouping floor) and the layout search that prices it simulate it once. For a scope in
    which plans do not change once simulated (planning and pricing one batch)."""
    global _reused
    outer, _reused = _reused, {}
    try:
        yield
    finally:
        _reused = outer


def score(plan: Plan, cost) -> float:
    """Iteration time in seconds (lower is better): the planner's objective."""
    return simulate(plan, cost, detail=False).iteration_time_s


# ---- cost lookups ------------------------------------------------------------------------------
# Scalar cost results per cost object, so that candidate plans sharing MicroPacks (the planner
# tries several unit segmentations of the same packs) look each one up once. Keyed weakly:
# dropping the cost model drops its entries. A cost model must not change after creation.
_MEMO: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_MEMO_LIMIT = 500_000


def _memo(cost, *key) -> dict | None:
    try:
        tables = _MEMO.setdefault(cost, {})
    except TypeError:  # not weak-referenceable: no memo
        return None
    if sum(len(t) for t in tables.values()) > _MEMO_LIMIT:
        tables.clear()
    return tables.setdefault(key, {})


def _per_item(fn, *arrays: np.ndarray, memo: Callable[[], dict | None] | None = None) -> np.ndarray:
    """fn applied to every element; one vectorised call when fn accepts arrays (checked against
    scalar calls on a few elements), else one call per element, memoised in `memo()` if given
    (made only then: most cost objects vectorise)."""
    n = len(arrays[0])
    if n == 0:
        return np.zeros(0)
    try:
        with np.errstate(all="ignore"):
            out = np.broadcast_to(np.asarray(fn(*arrays), dtype=float), (n,)).copy()
        if all(math.isclose(out[i], fn(*(a[i].item() for a in arrays)), rel_tol=1e-9, abs_tol=1e-12)
               for i in {0, n // 2, n - 1}):
            return out
    except (TypeError, ValueError, ArithmeticError):
        pass
    scalars = [a.tolist() for a in arrays]
    table = memo() if memo is not None else None
    if table is None:
        return np.array([fn(*args) for args in zip(*scalars)], dtype=float)
    values = []
    for args in zip(*scalars):
        value = table.get(args)
        if value is None:
            value = table[args] = fn(*args)
        values.append(value)
    return np.array(values, dtype=float)


@dataclass
class _ReplicaCosts:
    """Per-MicroPack and per-unit figures of one replica; index [last] picks the stage kind
    (0: any stage but the last, 1: the last stage, which adds the output layer)."""

    index: int
    replica: ReplicaPlan
    ranks: list[int]
    parallel: ParallelConfig  # the layout its tasks run with (CP widened for a merge group)
    tokens: np.ndarray  # per MicroPack
    pairs: np.ndarray
    kv_tokens: np.ndarray  # tokens of the MicroPack's slices whose sample has later slices
    prefix_tokens: np.ndarray  # KV-prefix tokens its slices read (earlier slices of their samples)
    masked_entries: np.ndarray  # query x key entries of its slices that read a prefix
    num_forward: int
    num_backward: int
    forward_unit_of: np.ndarray  # MicroPack -> forward unit
    backward_unit_of: np.ndarray
    forward_mp: list[np.ndarray]  # [last] -> seconds per MicroPack
    backward_mp: list[np.ndarray]
    forward_unit: list[list[float]]  # [last] -> seconds per unit
    backward_unit: list[list[float]]
    forward_p2p: list[float]  # per forward unit
    backward_p2p: list[float]
    needs_forward: list[int]  # backward unit -> last forward unit it needs


def _micropack_sizes(replica: ReplicaPlan, slice_figures: list, cp: int, per_sequence: bool) -> PackFigures:
    """`PackFigures` of the replica's MicroPacks; appends (tokens, pairs) of each slice. With CP
    sharding each pack as one sequence (`Overlaps.cp_per_sequence`), a pack's pairs are its
    busiest rank's times `cp`, what pricing `pairs / cp` must see."""
    counts, table = slice_table(replica.micropacks)
    length = (table[:, 2] - table[:, 1]).astype(float)
    slice_figures.append(np.stack([length, length * table[:, 1] + length * (length + 1) / 2], axis=1))
    figures = pack_figures(replica.micropacks, (counts, table))
    if per_sequence and cp > 1:
        figures = figures._replace(pairs=sequence_sharded_pairs(replica.micropacks, cp, (counts, table)))
    return figures


def _replica_costs(index: int, replica: ReplicaPlan, plan: Plan, cost, slice_figures) -> _ReplicaCosts:
    parallel = plan.parallel
    group = len(replica.dp_ranks)
    where = f"replica plan {index}"
    count = len(replica.micropacks)
    forward_unit_of = _unit_index(replica.forward_units, count, f"{where} forward units")
    backward_unit_of = _unit_index(replica.backward_units, count, f"{where} backward units")
    # The group as k-fold context parallelism over dp/k replicas: the same ranks per stage, so
    # pipeline neighbours stay tp * cp * dp ranks apart.
    effective = parallel.with_(cp=parallel.cp * group, dp=max(1, parallel.dp // group)) if group > 1 else parallel
    # A cost of the same interface without overlaps (a test's stand-in) shards per document.
    per_sequence = getattr(getattr(cost, "overlaps", None), "cp_per_sequence", False)
    figures = _micropack_sizes(replica, slice_figures, effective.cp, per_sequence)
    # Priced as the runtime runs them: padded for sequence parallelism (padding does no attention).
    tokens, pairs = effective.padded_tokens(figures.tokens), figures.pairs

    def per_mp(method, last: bool, backward: bool) -> np.ndarray:
        seconds = _per_item(lambda t, a: method(t, a, effective, last_stage=last), tokens, pairs,
                            memo=functools.partial(_memo, cost, method.__name__, effective, last))
        return seconds

    kinds = (False, True) if parallel.pp > 1 else (True,)
    forward_mp: list[np.ndarray] = []
    backward_mp: list[np.ndarray] = []
    for last in kinds:
        forward_mp.append(per_mp(cost.forward_time, last, False))
        backward_mp.append(per_mp(cost.backward_time, last, True))
    if parallel.pp == 1:  # the only stage is also the last: both indices name it
        forward_mp.insert(0, forward_mp[0])
        backward_mp.insert(0, backward_mp[0])
    num_forward, num_backward = len(replica.forward_units), len(replica.backward_units)

    def unit_sums(values, unit_of, units):
        return np.bincount(unit_of, weights=values, minlength=units).tolist()

    forward_tokens = np.bincount(forward_unit_of, weights=tokens, minlength=num_forward)
    backward_tokens = np.bincount(backward_unit_of, weights=tokens, minlength=num_backward)
    p2p = (lambda t: cost.p2p_time(t, effective)) if parallel.pp > 1 else (lambda t: 0.0 * t)
    needs = np.full(num_backward, -1)
    np.maximum.at(needs, backward_unit_of, forward_unit_of)
    return _ReplicaCosts(
        index=index, replica=replica, ranks=list(replica.dp_ranks), parallel=effective,
        tokens=tokens, pairs=pairs, kv_tokens=figures.continued, prefix_tokens=figures.prefix,
        masked_entries=figures.masked,
        num_forward=num_forward, num_backward=num_backward,
        forward_unit_of=forward_unit_of, backward_unit_of=backward_unit_of,
        forward_mp=forward_mp, backward_mp=backward_mp,
        forward_unit=[unit_sums(f, forward_unit_of, num_forward) for f in forward_mp],
        backward_unit=[unit_sums(b, backward_unit_of, num_backward) for b in backward_mp],
        forward_p2p=_per_item(p2p, forward_tokens).tolist(),
        backward_p2p=_per_item(p2p, backward_tokens).tolist(),
        needs_forward=needs.tolist(),
    )


def _unit_index(units: list[list[int]], count: int, what: str) -> np.ndarray:
    """MicroPack -> unit; the units must partition the MicroPacks (Plan.validate says more)."""
    sizes = np.array([len(unit) for unit in units], dtype=np.int64)
    flat = np.fromiter((mp for unit in units for mp in unit), dtype=np.int64, count=int(sizes.sum()))
    if (len(flat) != count or (sizes == 0).any() or (count and (flat.min() < 0 or flat.max() >= count))
            or (np.bincount(flat, minlength=count) != 1).any()):
        raise SimulationError(f"{what} do not partition the {count} MicroPacks exactly once")
    unit_of = np.empty(count, dtype=np.int64)
    unit_of[flat] = np.repeat(np.arange(len(units)), sizes)
    return unit_of


# ---- the task graph ----------------------------------------------------------------------------


class _Graph:
    """Tasks are integers: replica r's virtual stage v task list starts at offset[r] + v * (nF + nB);
    F u is at +u, B v at +nF+v. Virtual stage v runs on stage v % pp (chunk v // pp); devices are
    rank * pp + stage."""

    def __init__(self, plan: Plan, cost):
        self.plan = plan
        self.pp = pp = plan.parallel.pp
        self.vpp = plan.parallel.vpp
        self.vstages = vstages = pp * self.vpp
        self.dp = plan.parallel.dp
        self.slice_figures: list[np.ndarray] = []  # per replica: (tokens, attention pairs) of each slice
        self.replicas = [_replica_costs(i, r, plan, cost, self.slice_figures)
                         for i, r in enumerate(plan.replicas)]
        # Per task, as flat arrays filled a replica (all its virtual stages) at a time: a 150B plan
        # has millions of tasks. Replica r's tasks start at offset[r].
        strides = [rc.num_forward + rc.num_backward for rc in self.replicas]
        self.offset: list[int] = np.concatenate(([0], np.cumsum(strides, dtype=np.int64) * vstages)).tolist()
        self.num_tasks = total = self.offset.pop()
        self.replica_of = np.empty(total, dtype=np.int64)
        self.stage_of = np.empty(total, dtype=np.int64)
        self.is_backward = np.empty(total, dtype=bool)
        self.unit_of = np.empty(total, dtype=np.int64)
        self.duration = np.empty(total)
        self.send_offset = np.empty(total, dtype=np.int64)  # +stride (F downstream), -stride (B upstream), 0: none
        self.send_seconds = np.empty(total)
        # Data successors as CSR arrays (each task's run: `*_start[t]:*_start[t + 1]`). Releases
        # are task-id offsets, so the hot loop does no index arithmetic: the same-stage backward
        # units a forward unit releases.
        release_counts = np.empty(total, dtype=np.int64)
        release_offsets: list[np.ndarray] = []
        device_counts = np.empty(total, dtype=np.int64)
        device_ids: list[np.ndarray] = []
        for rc, stride, first in zip(self.replicas, strides, self.offset):
            tasks = slice(first, first + stride * vstages)
            # forward u releases the backward units that need it last, in unit order: the same on
            # every virtual stage
            needs = np.asarray(rc.needs_forward, dtype=np.int64)
            by_need = np.argsort(needs, kind="stable")
            counts = np.concatenate([np.bincount(needs, minlength=rc.num_forward), np.zeros(rc.num_backward, np.int64)])
            release_counts[tasks] = np.tile(counts, vstages)
            release_offsets.append(np.tile(rc.num_forward - needs[by_need] + by_need, vstages))
            device_counts[tasks] = len(rc.ranks)
            # Each virtual stage's block: its forward units, then its backward units; every block
            # alike but for the last stage's durations and the sends at the pipeline's ends.
            stage_devices = np.asarray(rc.ranks, dtype=np.int64)[None, :] * pp + (np.arange(vstages) % pp)[:, None]
            device_ids.append(np.repeat(stage_devices, stride, axis=0).ravel())
            backward = np.repeat([False, True], [rc.num_forward, rc.num_backward])
            self.replica_of[tasks] = rc.index
            self.stage_of[tasks] = np.repeat(np.arange(vstages, dtype=np.int64), stride)
            self.is_backward[tasks] = np.tile(backward, vstages)
            self.unit_of[tasks] = np.tile(np.concatenate([np.arange(rc.num_forward, dtype=np.int64),
                                                          np.arange(rc.num_backward, dtype=np.int64)]), vstages)
            by_stage = self.duration[tasks].reshape(vstages, stride)
            by_stage[:-1] = np.concatenate([rc.forward_unit[False], rc.backward_unit[False]])
            by_stage[-1] = np.concatenate([rc.forward_unit[True], rc.backward_unit[True]])
            sends = self.send_offset[tasks].reshape(vstages, stride)
            sends[:] = np.where(backward, -stride, stride)
            sends[-1, ~backward] = 0  # the last stage's forward units send nothing downstream
            sends[0, backward] = 0  # the first stage's backward units nothing upstream
            self.send_seconds[tasks] = np.tile(np.asarray(rc.forward_p2p + rc.backward_p2p, dtype=float), vstages)
        empty = [np.zeros(0, dtype=np.int64)]
        self.release_start = _csr_starts(release_counts)
        self.release_offsets = np.concatenate(release_offsets + empty)
        self.device_start = _csr_starts(device_counts)
        self.device_ids = np.concatenate(device_ids + empty)
        self.programs = self._programs()

    def devices_of(self, task: int) -> list[int]:
        """The devices a task occupies (several for a DP-Merge group's)."""
        return self.device_ids[self.device_start[task]:self.device_start[task + 1]].tolist()

    def task(self, replica: int, vstage: int, backward: bool, unit: int) -> int:
        rc = self.replicas[replica]
        return (self.offset[replica] + vstage * (rc.num_forward + rc.num_backward)
                + (rc.num_forward if backward else 0) + unit)

    def _programs(self) -> list[np.ndarray]:
        """Each device's task ids in program order."""
        position = {id(r): i for i, r in enumerate(self.plan.replicas)}
        programs: list[list[np.ndarray]] = [[] for _ in range(self.dp * self.pp)]
        for index, replica in enumerate(self.plan.replicas):
            if not replica.dp_ranks or not all(0 <= rank < self.dp for rank in replica.dp_ranks):
                raise SimulationError(f"replica plan {index} has dp_ranks {replica.dp_ranks}, outside 0..{self.dp - 1}")
        for rank in range(self.dp):
            for replica in self.plan.replicas_of_rank(rank):
                index = position[id(replica)]
                if len(replica.stage_orders) != self.pp:
                    raise SimulationError(
                        f"replica plan {index} has {len(replica.stage_orders)} stage orders for pp={self.pp}")
                for stage, order in enumerate(replica.stage_orders):
                    programs[rank * self.pp + stage].append(self._stage_tasks(index, stage, order))
        return [np.concatenate(parts + [np.zeros(0, dtype=np.int64)]) for parts in programs]

    def _stage_tasks(self, index: int, stage: int, order) -> np.ndarray:
        rc = self.replicas[index]
        firsts = np.array([self.task(index, chunk * self.pp + stage, False, 0) for chunk in range(self.vpp)])
        tasks = _task_ids(order, firsts, rc.num_forward, rc.num_backward)
        if tasks is not None:
            return tasks
        for task in order:
            kind, unit = task[0], task[1]
            limit = {"F": rc.num_forward, "B": rc.num_backward}.get(kind)
            if limit is None or not 0 <= unit < limit or not 0 <= task_chunk(task) < self.vpp:
                chunk = f" on chunk {task_chunk(task)}" if self.vpp > 1 or len(task) > 2 else ""
                raise SimulationError(
                    f"replica plan {index} stage {stage} order names unknown task {kind}{unit}{chunk}")
        chunks = f" on each of its {self.vpp} chunks" if self.vpp > 1 else ""
        raise SimulationError(
            f"replica plan {index} stage {stage} order must run each of its {rc.num_forward} forward and "
            f"{rc.num_backward} backward units exactly once{chunks}")

    def where(self, task: int) -> tuple[int, int, int]:
        """(replica, virtual stage, unit) of a task, as ints."""
        return int(self.replica_of[task]), int(self.stage_of[task]), int(self.unit_of[task])

    def data_predecessors(self, task: int) -> list[int]:
        replica, stage, unit = self.where(task)
        if not self.is_backward[task]:
            return [self.task(replica, stage - 1, False, unit)] if stage > 0 else []
        needed = [self.task(replica, stage, False, self.replicas[replica].needs_forward[unit])]
        if stage < self.vstages - 1:
            needed.insert(0, self.task(replica, stage + 1, True, unit))
        return needed

    def name(self, task: int) -> str:
        replica, vstage, unit = self.where(task)
        rc = self.replicas[replica]
        kind = "B" if self.is_backward[task] else "F"
        where = f"{self.stage_name(vstage)} {kind}{unit}"
        if len(rc.ranks) > 1:
            return f"merge group ranks {rc.ranks} {where}"
        return f"rank {rc.ranks[0]} {where}" if self.dp > 1 else where

    def stage_name(self, vstage: int) -> str:
        chunk, stage = divmod(vstage, self.pp)
        return f"stage {stage} chunk {chunk}" if self.vpp > 1 else f"stage {stage}"

    def device_name(self, device: int) -> str:
        rank, stage = divmod(device, self.pp)
        return f"rank {rank} stage {stage}" if self.dp > 1 else f"stage {stage}"


_KIND_CODES = {"F": 0, "B": 1}  # a stage order's task kinds; anything else is not a task


def _task_ids(order, firsts: np.ndarray, num_forward: int, num_backward: int) -> np.ndarray | None:
    """The task ids of a stage's order (`firsts`: each chunk's first task on the stage), or None
    where it does not run each of its chunks' units exactly once (the caller says which rule it
    breaks). Vectorised: a 256K plan has 10^5 tasks per stage and is simulated for every layout
    screened."""
    count = len(order)
    if count != len(firsts) * (num_forward + num_backward):
        return None
    try:
        kinds = np.fromiter(map(_KIND_CODES.get, map(operator.itemgetter(0), order), itertools.repeat(-1)),
                            dtype=np.int64, count=count)
        units = np.fromiter(map(operator.itemgetter(1), order), dtype=np.int64, count=count)
        sizes = np.fromiter(map(len, order), dtype=np.int64, count=count)
        if (sizes == 3).all():  # (kind, unit, chunk)
            chunks = np.fromiter(map(operator.itemgetter(2), order), dtype=np.int64, count=count)
        elif (sizes == 2).all():  # (kind, unit): chunk 0
            chunks = np.zeros(count, dtype=np.int64)
        else:
            chunks = np.fromiter(map(task_chunk, order), dtype=np.int64, count=count)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    backward = kinds == 1
    limits = np.where(backward, num_backward, num_forward)
    if ((kinds < 0).any() or (units < 0).any() or (units >= limits).any() or (chunks < 0).any()
            or (chunks >= len(firsts)).any()):
        return None
    tasks = firsts[chunks] + backward * num_forward + units
    local = (chunks * (num_forward + num_backward) + backward * num_forward + units)
    if (np.bincount(local, minlength=count) != 1).any():  # a task twice, so another missing
        return None
    return tasks


@dataclass
class _Schedule:
    """Per task, as arrays (a 150B plan has millions of tasks: Python lists of them cost more than
    scheduling them); `_records` converts what a detailed report lists."""

    start: np.ndarray
    end: np.ndarray
    chain_end: np.ndarray  # critical path through data edges only
    sent_by: np.ndarray  # transfers: the sending task, when the link starts and ends it
    sent_at: np.ndarray
    arrived_at: np.ndarray


def _run(graph: _Graph) -> _Schedule:
    """List scheduling in topological order (Kahn's algorithm). Edges: program order on each
    device (the next task starts after this one ends) and data (a forward unit releases the
    backward units that need it on its stage; p2p sends to the neighbouring stage). The loop is
    `compiled.list_schedule`, over the graph as flat arrays."""
    n, vstages = graph.num_tasks, graph.vstages
    stage_of, is_backward = graph.stage_of, graph.is_backward
    # Data inputs not yet arrived: F needs the previous stage; B needs the next stage (if any)
    # and its forward unit on this stage. Plus one per device where a task is not first.
    missing = np.where(is_backward, 1 + (stage_of < vstages - 1), stage_of > 0).astype(np.int64)
    programs = graph.programs
    before = np.concatenate([program[:-1] for program in programs] + [np.zeros(0, dtype=np.int64)])
    after = np.concatenate([program[1:] for program in programs] + [np.zeros(0, dtype=np.int64)])
    missing += np.bincount(after, minlength=n)
    program_start, program_next = program_successors(before, after, n)
    start, end, chain_end, sent_by, sent_at, arrived_at, done = list_schedule(
        graph.duration, missing, program_start, program_next, graph.release_start,
        graph.release_offsets, graph.send_offset, graph.send_seconds, graph.device_start, graph.device_ids,
        2 * graph.dp * graph.pp)
    if done < n:
        raise _deadlock(graph, (missing == 0).tolist())
    return _Schedule(start, end, chain_end, sent_by, sent_at, arrived_at)


def _csr_starts(counts: np.ndarray) -> np.ndarray:
    """Where each row starts in a flat array of rows with `counts` entries, and the end."""
    starts = np.empty(len(counts) + 1, dtype=np.int64)
    starts[0] = 0
    np.cumsum(counts, out=starts[1:])
    return starts


def _deadlock(graph: _Graph, finished: list[bool]) -> SimulationError:
    """Walk the wait-for relation from a stuck device until it repeats: that loop is a cycle of
    the dependency graph (program-order edges + data edges), named task by task."""
    head_of = {}
    for device, program in enumerate(graph.programs):
        head = next((t for t in program if not finished[t]), None)
        if head is not None:
            head_of[device] = head

    def blocked_by(task: int) -> tuple[int, str]:
        """The next task on the wait-for path and why."""
        for needed in graph.data_predecessors(task):
            if not finished[needed]:
                return needed, "waits for"
        for device in graph.devices_of(task):
            if head_of.get(device) != task:
                return head_of[device], f"waits for {graph.device_name(device)} to finish"
        raise AssertionError("a task with all inputs done and at the head of its devices was not run")

    def head_before(task: int) -> int | None:
        """If `task` is not yet at the head of one of its devices, the head it waits behind."""
        for device in graph.devices_of(task):
            if head_of.get(device) != task:
                return head_of[device]
        return None

    task = next(iter(head_of.values()))
    steps: list[str] = []
    seen: dict[int, int] = {}
    while task not in seen:
        seen[task] = len(steps)
        target, why = blocked_by(task)
        step = f"{graph.name(task)} {why} {graph.name(target)}"
        behind = head_before(target)
        if behind is not None and why == "waits for":
            step += f", which runs after {graph.name(behind)} in program order"
            target = behind
        steps.append(step)
        task = target
    cycle = steps[seen[task]:]
    return SimulationError(f"deadlock: {'; '.join(cycle)}", cycle=cycle)


# ---- the report --------------------------------------------------------------------------------
def _dp_reduction(parts: list[tuple[list[float], list[float]]], seconds: float, buckets: int) -> tuple[float, float]:
    """(start, end) of one stage's gradient reduction over its data-parallel group. `parts`: per
    model chunk on the stage (one without virtual stages), the (starts, ends) over ranks of the
    chunk's last backward task.

    Rule (Megatron DDP with overlapped, bucketed reduction; gradients are reduced only during
    the last backward): on every rank a chunk's last backward task, from the start of its last
    MicroPack (the only one run outside no_sync), produces the chunk's share of the gradients
    uniformly over that time, in equal buckets (bucket i is ready at start + (i+1)/buckets *
    duration). A bucket's collective starts when every rank has it ready
    and the previous bucket's collective is done, and lasts its share of `seconds`. So the
    reduction starts no earlier than the slowest rank's first-finishing chunk's last backward
    starts, and ends no earlier than the slowest rank's last backward ends plus one bucket's share.
    """
    per_part = max(1, math.ceil(buckets / len(parts)))
    share = seconds / (len(parts) * per_part)
    began: float | None = None
    finished: float | None = None
    for starts, ends in sorted(parts, key=lambda part: max(part[1])):
        for bucket in range(1, per_part + 1):
            ready = max(b + bucket / per_part * (e - b) for b, e in zip(starts, ends))
            bucket_start = ready if finished is None else max(ready, finished)
            began = bucket_start if began is None else began
            finished = bucket_start + share
    # `parts` is never empty (the caller skips a stage without any), so the loop set both.
    return cast(float, began), cast(float, finished)


def _bucket_count(cost, plan: Plan) -> int:
    try:
        params = cost.stage_params(plan.parallel) / plan.parallel.tp
    except AttributeError:
        return 1
    return max(1, math.ceil(params / max(DDP_BUCKET_PARAMS, 1_000_000 * plan.parallel.dp)))


def _report(plan: Plan, cost, graph: _Graph, schedule: _Schedule, detail: bool,
            dp_buckets: int | None) -> SimulationReport:
    parallel, pp, dp = plan.parallel, graph.pp, graph.dp
    start, end, seconds = schedule.start, schedule.end, graph.duration
    busy = [[float(seconds[graph.programs[r * pp + s]].sum()) for s in range(pp)] for r in range(dp)]
    last_task_end = float(end.max()) if len(end) else 0.0

    reduce_seconds = cost.dp_reduce_time(parallel)
    buckets = dp_buckets or _bucket_count(cost, plan)
    overlap, exposed, reduce_windows = [0.0] * pp, [0.0] * pp, []
    for stage in range(pp):
        lasts = [_last_backwards(graph, r * pp + stage) for r in range(dp)]
        chunk_tasks = [[row[chunk] for row in lasts if chunk in row] for chunk in range(graph.vpp)]
        parts = [([_last_micropack_start(graph, t, float(start[t]), float(end[t])) for t in tasks],
                  [float(end[t]) for t in tasks])
                 for tasks in chunk_tasks if tasks]
        if reduce_seconds <= 0 or not parts:
            continue
        last_end = max(max(ends) for _, ends in parts)
        began, finished = _dp_reduction(parts, reduce_seconds, buckets)
        exposed[stage] = finished - last_end
        overlap[stage] = max(0.0, reduce_seconds - exposed[stage])
        reduce_windows.append((stage, began, finished))
    iteration = max([last_task_end] + [w[2] for w in reduce_windows])

    devices = dp * pp
    total_busy = sum(map(sum, busy))
    work_bound = total_busy / devices  # a merge task counts once per device it occupies
    chain = float(schedule.chain_end.max()) if len(schedule.chain_end) else 0.0
    critical = chain + (reduce_seconds / buckets if reduce_seconds > 0 else 0.0)
    slice_tokens, slice_pairs = np.concatenate(graph.slice_figures + [np.zeros((0, 2))]).T
    flops = float(_per_item(cost.model_flops, slice_tokens, slice_pairs).sum())
    peaks, timelines = _memory(plan, cost, graph, schedule, detail)
    budget = cost.memory_budget_bytes() if hasattr(cost, "memory_budget_bytes") else None
    rank_busy = [sum(row) for row in busy]
    num_tokens = plan.num_tokens  # a sum over ~10^5 samples
    stage_busy = [sum(busy[r][s] for r in range(dp)) for s in range(pp)]
    return SimulationReport(
        strategy=plan.strategy,
        layout=parallel.describe(),
        dp=dp, pp=pp, world_size=parallel.world_size,
        num_tokens=num_tokens,
        iteration_time_s=iteration,
        tokens_per_s=num_tokens / iteration if iteration > 0 else 0.0,
        mfu=flops / (iteration * parallel.world_size * cost.hardware.peak_flops) if iteration > 0 else 0.0,
        stage_busy_s=[b / dp for b in stage_busy],
        stage_idle_s=[iteration - b / dp for b in stage_busy],
        device_busy_s=busy,
        bubble_ratio=max(0.0, 1.0 - total_busy / (devices * iteration)) if iteration > 0 else 0.0,
        dp_imbalance=_max_over_mean(rank_busy),
        pp_imbalance=_max_over_mean(stage_busy),
        peak_memory_bytes=peaks,
        memory_budget_bytes=budget,
        fits_memory=budget is None or max(peaks) <= budget,
        dp_reduce_time_s=reduce_seconds,
        dp_reduce_overlap_s=overlap,
        dp_reduce_exposed_s=exposed,
        work_bound_s=work_bound,
        critical_path_s=critical,
        lower_bound_s=max(work_bound, critical),
        memory_timeline=timelines,
        tasks=_records(graph, schedule, reduce_windows) if detail else [],
    )


def _last_micropack_start(graph: _Graph, task: int, start: float, end: float) -> float:
    """When the last MicroPack of backward `task` starts. The runtime runs a unit's earlier
    MicroPacks inside DDP's no_sync (runtime/pipeline/schedule.py), so only the last one's backward makes
    gradients ready for the overlapped reduction."""
    rc = graph.replicas[int(graph.replica_of[task])]
    last_stage = bool(graph.stage_of[task] == graph.vstages - 1)
    unit = int(graph.unit_of[task])
    whole = rc.backward_unit[last_stage][unit]
    share = rc.backward_mp[last_stage][rc.replica.backward_units[unit][-1]] / whole if whole > 0 else 1.0
    return end - share * (end - start)


def _last_backwards(graph: _Graph, device: int) -> dict[int, int]:
    """model chunk -> the last backward task of that chunk on the device."""
    lasts: dict[int, int] = {}
    for task in map(int, reversed(graph.programs[device])):  # the last ones are near the end
        if graph.is_backward[task]:
            lasts.setdefault(int(graph.stage_of[task]) // graph.pp, task)
            if len(lasts) == graph.vpp:
                break
    return lasts


def _max_over_mean(values: list[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


def _records(graph: _Graph, schedule: _Schedule, reduce_windows) -> list[TaskRecord]:
    records = []
    pp = graph.pp
    replica_of, stage_of, unit_of = graph.replica_of.tolist(), graph.stage_of.tolist(), graph.unit_of.tolist()
    is_backward = graph.is_backward.tolist()
    start, end = schedule.start.tolist(), schedule.end.tolist()
    for task in range(graph.num_tasks):
        replica, unit = replica_of[task], unit_of[task]
        chunk, stage = divmod(stage_of[task], pp)
        kind = "B" if is_backward[task] else "F"
        ranks = graph.replicas[replica].ranks
        detail = f"merge group {ranks}" if len(ranks) > 1 else ""
        for rank in ranks:
            records.append(TaskRecord(rank, stage, replica, kind, unit, start[task], end[task],
                                      detail, chunk))
    for task, began, finished in zip(schedule.sent_by.tolist(), schedule.sent_at.tolist(),
                                     schedule.arrived_at.tolist()):
        replica, vstage, unit = replica_of[task], stage_of[task], unit_of[task]
        chunk, stage = divmod(vstage, pp)
        detail = (f"B {stage}->{(vstage - 1) % pp}" if is_backward[task] else f"F {stage}->{(vstage + 1) % pp}")
        for rank in graph.replicas[replica].ranks:
            records.append(TaskRecord(rank, stage, replica, "P2P", unit, began, finished, detail, chunk))
    for stage, began, finished in reduce_windows:
        for rank in range(graph.dp):
            records.append(TaskRecord(rank, stage, -1, "DP", -1, began, finished, "gradient reduction"))
    records.sort(key=lambda r: (r.rank, r.stage, r.start, r.kind))
    return records


def _memory(plan: Plan, cost, graph: _Graph, schedule: _Schedule, detail: bool):
    """Activations from each MicroPack's forward start to its backward unit's end; KV cache of
    a slice with later slices over the same span; the recompute transient during a backward."""
    parallel, pp = plan.parallel, graph.pp
    ledger = MemoryLedger(graph.dp * pp)
    start, end = schedule.start, schedule.end
    for rc in graph.replicas:
        effective, tokens, pairs, kv_tokens = rc.parallel, rc.tokens, rc.pairs, rc.kv_tokens
        kv = _per_item(lambda t, effective=effective: cost.kv_cache_bytes(t, effective), kv_tokens) * (kv_tokens > 0)
        recompute = _per_item(lambda t, a, effective=effective: cost.recompute_peak_bytes(t, a, effective),
                              tokens, pairs)
        recompute_unit = np.zeros(rc.num_backward)
        np.maximum.at(recompute_unit, rc.backward_unit_of, recompute)
        held, offsets = {}, {}
        for last in {vstage == graph.vstages - 1 for vstage in range(graph.vstages)}:
            activation = _per_item(lambda t, a, prefix, masked, effective=effective, last=last: cost.activation_bytes(
                t, a, effective, last_stage=last, prefix_tokens=prefix, masked_entries=masked),
                tokens, pairs, rc.prefix_tokens, rc.masked_entries)
            held[last] = activation + kv
            offsets[last] = _offsets_in_unit(rc.forward_mp[last], rc.replica.forward_units, rc.forward_unit_of)
        for vstage in range(graph.vstages):
            last, stage = vstage == graph.vstages - 1, vstage % pp
            first_f = graph.task(rc.index, vstage, False, 0)
            first_b = graph.task(rc.index, vstage, True, 0)
            f_start = start[first_f:first_f + rc.num_forward]
            b_start, b_end = start[first_b:first_b + rc.num_backward], end[first_b:first_b + rc.num_backward]
            mp_start = f_start[rc.forward_unit_of] + offsets[last]
            mp_free = b_end[rc.backward_unit_of]
            for rank in rc.ranks:
                device = rank * pp + stage
                ledger.hold(device, mp_start, mp_free, held[last])
                ledger.hold(device, b_start, b_end, recompute_unit)
    static = cost.static_memory_bytes(parallel)
    peaks = [static] * pp
    timelines = []
    for device in range(graph.dp * pp):
        rank, stage = divmod(device, pp)
        peak, points = ledger.timeline(device, static, with_points=detail)
        peaks[stage] = max(peaks[stage], peak)
        if detail:
            timelines.append(MemoryTimeline(rank, stage, peak, points))
    return peaks, timelines


def _offsets_in_unit(seconds: np.ndarray, units: list[list[int]], unit_of: np.ndarray) -> np.ndarray:
    """Start of each MicroPack relative to its unit's start (a unit runs its MicroPacks in order)."""
    if len(seconds) == 0:  # a rank whose only work is in merge groups
        return np.zeros(0)
    flat = np.fromiter((mp for unit in units for mp in unit), dtype=np.int64, count=len(seconds))
    before = np.cumsum(seconds[flat]) - seconds[flat]  # exclusive prefix sum along the units
    first_of_unit = np.cumsum([0] + [len(unit) for unit in units[:-1]])
    offsets = np.empty(len(seconds))
    offsets[flat] = before - before[first_of_unit][unit_of[flat]]
    return offsets
