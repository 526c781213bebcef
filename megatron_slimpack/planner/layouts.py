"""Per-strategy best parallel layout: every strategy gets its fastest feasible layout.

`best_layout(strategy, batches, cost, gpus, context_length, base_config)` (strategy: a `StrategySpec`
or its name, resolved once there; every helper below takes the spec) searches
ParallelConfig(tp, pp, vpp, cp, dp, recompute) with tp * pp * cp * dp == gpus, plans the batches with
the strategy, simulates the plans and returns the layout with the lowest mean iteration time,
with its plans, reports and every rejected layout with its reason.

Search, cheapest checks first:
1. Enumerate: tp within a node and dividing the attention and KV heads, pp dividing the layers,
   virtual stages per rank vpp dividing the layers per stage (pp > 1, up to MAX_VPP; only for
   strategies whose schedule interleaves), cp a power of two, recompute none/selective/
   selective-mlp/full (`specs.RECOMPUTE_MODES`, Megatron's flags in `specs.recompute_flags`) and,
   but for strategies that size their work to memory, block-N for every N below a chunk's layers
   (`_recompute_modes`), minus the strategy's own constraints
   (`StrategySpec.constraints`; every per-strategy fact below is its `StrategySpec`'s, registry.py).
2. Static memory: weights, gradients and optimizer state must fit (`cost.static_memory_bytes`).
3. The strategy's minimum need: static memory plus the activations it must hold at once
   (`minimum_memory_bytes`, `StrategySpec.minimum_in_flight`: a full sequence for Megatron-style
   fixed packing, the longest document for whole-document packers, ...).
4. Screening on the first batch, in order of a lower bound on the iteration time (total compute
   of the batch on the layout, packed perfectly, spread over dp ranks): plan and simulate; a
   PlanError or a simulated peak above `cost.memory_budget_bytes()` rejects the layout. A
   layout whose bound is already above the best screened time is not planned (branch and
   bound). Recompute modes cascade (`_RecomputeCascade`): a mode that re-runs all another re-runs
   (`specs.recompute_includes`: selective within selective-mlp, block-M within block-N for M <= N,
   everything within full) is tried only where that one does not fit, since recompute only adds
   time; block-N of a shape is visited by bisection on N for the smallest that fits
   (`_CascadeOrder`: fitting is monotone in N), and where block-M does not fit no block-N < M is
   tried (not for strategies that size their work to memory, `StrategySpec.sizes_to_memory`:
   more memory can buy larger MicroPacks). Virtual stages cascade too: vpp > 1 is tried only where
   the same layout with vpp = 1 fits and its simulated busy time per device (`work_bound_s`) is
   below the best screened time, since interleaving removes only pipeline idle time (and adds p2p
   and in-flight memory). So a shape's layouts are screened together, lightest recompute mode and
   plain 1F1B first, in the order of the lowest bound among them.
5. The best `finalists` screened layouts run every batch (their first-batch plans validated
   first: screening leaves validation to the layouts finished, a fifth to a third of a baseline's
   screening time); the lowest mean iteration time wins.
   Mean iteration time is the simulated time of all plans divided by the number of batches, so
   it is per global batch trained (a stateful planner's final flush of what it still delays is
   one more plan).
   A finalist that fits the first batch but fails a later one (a later batch's longest document),
   or whose first plan is invalid (a planner's bug), is replaced by the next, and the layouts it
   left unevaluated (the bound, the cascades) are screened again without it.
Stateful strategies (`StrategySpec.stateful`) skip steps 4 and 5: their first batch is a poor guide
to their mean (WLB-LLM's queue fills over the steps; at llama-70b 128K GitHub on 256 H100s its
fastest layout over 10 batches is the 18th fastest on the first). Each layout instead runs every
batch, one layout after another in the order of a lower bound on its mean, skipped where that
bound or the cascades show it cannot be among the `finalists` fastest means so far, and stopped
as soon as its plans so far and the bound on the rest show it (`_run_in_bound_order`).
"""
from __future__ import annotations

import bisect
import copy
import dataclasses
import math
import pickle
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from ..config import SlimPackConfig
from ..costmodel import CostModel, format_bytes
from ..plan import Plan, PlanError
from ..simulator.dag import SimulationError, SimulationReport, reports_reused, simulate
from ..specs import (
    RECOMPUTE_MODES,
    ParallelConfig,
    SpecError,
    block_recompute_layers,
    block_recompute_modes,
    divisors,
    recompute_includes,
    recompute_order,
)
from .outcomes import DoesNotFit
from .registry import LayoutConstraints, StepPlanner, StrategySpec
from .slimpack.memory import auto_token_cap, document_memory_bytes
from .strategies import as_spec, check_plan_input, cyclic_gc_paused
from .work import causal_pairs

# ==== results ===================================================================================


@dataclass
class Rejection:
    """A layout that was not chosen. `kind`: static-memory, minimum-memory, planner (the
    strategy raised DoesNotFit), simulated-memory, recompute-memory (a block-M of its shape with
    more layers recomputed did not fit), simulation, invalid (infeasible) or bound,
    recompute-cascade, interleave-cascade (not evaluated, because they could not win),
    finish-bound (a stateful strategy's layout not run on every batch: it could not win)."""

    parallel: ParallelConfig
    kind: str
    reason: str

    @property
    def infeasible(self) -> bool:
        return self.kind not in NOT_EVALUATED

    def __str__(self) -> str:
        return f"{self.parallel.describe()}: {self.reason}"


@dataclass
class LayoutEvaluation:
    """One layout run over the batches: a plan and a simulation report per step."""

    parallel: ParallelConfig
    plans: list[Plan]
    reports: list[SimulationReport]
    num_batches: int

    @property
    def iteration_times_s(self) -> list[float]:
        return [r.iteration_time_s for r in self.reports]

    @property
    def mean_iteration_time_s(self) -> float:
        """Simulated time of all plans (a final flush included) per global batch."""
        return sum(self.iteration_times_s) / max(self.num_batches, 1)

    @property
    def peak_memory_bytes(self) -> float:
        return max(max(r.peak_memory_bytes) for r in self.reports)


@dataclass
class LayoutResult:
    strategy: str
    gpus: int
    best: LayoutEvaluation
    finalists: list[LayoutEvaluation]
    screened: list[tuple[ParallelConfig, float]]  # (layout, first-batch iteration time), best first
    rejected: list[Rejection]
    search_time_s: float
    candidates: int

    @property
    def parallel(self) -> ParallelConfig:
        return self.best.parallel

    @property
    def plans(self) -> list[Plan]:
        return self.best.plans

    @property
    def reports(self) -> list[SimulationReport]:
        return self.best.reports

    @property
    def mean_iteration_time_s(self) -> float:
        return self.best.mean_iteration_time_s

    @property
    def infeasible(self) -> list[Rejection]:
        return [r for r in self.rejected if r.infeasible]

    def summary(self) -> str:
        lines = [
            f"{self.strategy} on {self.gpus} GPUs: best {self.parallel.describe()} "
            f"({self.mean_iteration_time_s:.3f} s/iteration, peak {format_bytes(self.best.peak_memory_bytes)}); "
            f"{self.candidates} layouts, {len(self.screened)} screened, {len(self.infeasible)} infeasible, "
            f"search {self.search_time_s:.1f} s",
        ]
        lines += [f"  finalist {e.parallel.describe()}: {e.mean_iteration_time_s:.3f} s" for e in self.finalists]
        lines += [f"  rejected {r}" for r in self.rejected]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "strategy": self.strategy,
            "gpus": self.gpus,
            "parallel": self.parallel.to_dict(),
            "layout": self.parallel.describe(),
            "mean_iteration_time_s": self.mean_iteration_time_s,
            "iteration_times_s": self.best.iteration_times_s,
            "finalists": [{"layout": e.parallel.describe(), "mean_iteration_time_s": e.mean_iteration_time_s}
                          for e in self.finalists],
            "screened": [{"layout": p.describe(), "first_batch_time_s": t} for p, t in self.screened],
            "rejected": [{"layout": r.parallel.describe(), "kind": r.kind, "reason": r.reason} for r in self.rejected],
            "search_time_s": self.search_time_s,
            "candidates": self.candidates,
        }


@dataclass(frozen=True)
class SearchProgress:
    """Where a layout search stands, told to `best_layout`'s `progress` callback after each layout
    it decides. `phase`: "screening" (the first batch on each layout that passed the memory
    checks, or was bounded out; a stateful strategy's every batch, and the best mean so far) or
    "finishing" (every batch on the fastest screened); `done` of
    `total` layouts of that phase decided; `best_s`: the best first-batch time screened
    (screening) or the best mean finished (finishing) so far, None before there is one;
    `candidates`: layouts enumerated, before the memory checks."""

    strategy: str
    phase: str
    done: int
    total: int
    best_s: float | None
    elapsed_s: float
    candidates: int


ProgressCallback = Callable[[SearchProgress], None]


class _Ticker:
    """Counts the layouts a search decides in its current phase and tells the callback after each
    one (nothing without a callback). The callback may raise (a caller's time budget, Ctrl-C) to
    stop the search: nothing is left half-done outside the search's own locals."""

    def __init__(self, callback: ProgressCallback | None, strategy: str, started: float, candidates: int):
        self.callback, self.strategy, self.started, self.candidates = callback, strategy, started, candidates
        self.phase, self.done, self.total = "screening", 0, 0
        self.best_s: float | None = None

    def start(self, phase: str, total: int) -> None:
        self.phase, self.done, self.total = phase, 0, max(total, 0)
        self.best_s = None
        self._tell()

    def tick(self, best_s: float | None = None) -> None:
        self.done += 1
        self.total = max(self.total, self.done)
        if best_s is not None and math.isfinite(best_s):
            self.best_s = best_s if self.best_s is None else min(self.best_s, best_s)
        self._tell()

    def each(self, items: Iterable, best_s: Callable[[], float]) -> Iterator:
        """`items`, one tick (with `best_s()` then) as each one's turn ends."""
        for item in items:
            yield item
            self.tick(best_s())

    def _tell(self) -> None:
        if self.callback is not None:
            self.callback(SearchProgress(self.strategy, self.phase, self.done, self.total, self.best_s,
                                         time.perf_counter() - self.started, self.candidates))


# Rejections of layouts that were not evaluated (or not finished) because they could not win (not infeasible).
NOT_EVALUATED = ("bound", "recompute-cascade", "interleave-cascade", "finish-bound")


class NoFeasibleLayout(PlanError):
    """No layout fits; `rejected` says why each one failed."""

    def __init__(self, message: str, rejected: list[Rejection]):
        super().__init__(message)
        self.rejected = rejected

    def __reduce__(self):  # pickled whole (a comparison's worker process hands it back)
        return type(self), (str(self), self.rejected)


# ==== enumeration and cheap checks ==============================================================


def enumerate_layouts(cost: CostModel, gpus: int, strategy: StrategySpec | str,
                      recompute_modes: tuple[str, ...] | None = None) -> list[ParallelConfig]:
    """Every ParallelConfig with tp * pp * cp * dp == gpus that the model, the node size and the
    strategy's constraints allow. `recompute_modes`: those of `_recompute_modes` unless given."""
    spec = as_spec(strategy)
    model, hardware = cost.model, cost.hardware
    constraints = spec.constraints
    layouts = []
    for tp in divisors(gpus):
        if tp > hardware.gpus_per_node or model.num_attention_heads % tp or model.kv_heads % tp:
            continue
        for pp in divisors(gpus // tp):
            if model.num_layers % pp:
                continue
            rest = gpus // (tp * pp)
            for vpp in _virtual_stage_counts(model.num_layers, pp):
                for cp in (c for c in divisors(rest) if c & (c - 1) == 0):
                    chunk_layers = model.num_layers // (pp * vpp)
                    for recompute in recompute_modes or _recompute_modes(spec, chunk_layers):
                        parallel = ParallelConfig(dp=rest // cp, pp=pp, vpp=vpp, tp=tp, cp=cp, recompute=recompute)
                        if constraints.allows(parallel):
                            layouts.append(parallel)
    return layouts


def _recompute_modes(spec: StrategySpec, chunk_layers: int) -> tuple[str, ...]:
    """The recompute modes searched on a layout whose model chunks hold `chunk_layers` layers:
    Megatron's none, selective, selective-mlp and full, and for a strategy whose plans do not depend
    on memory every block-N in between (the recompute cascade visits them by bisection on N, about
    log2(chunk_layers) plannings a shape). A strategy that sizes its work to memory
    (`StrategySpec.sizes_to_memory`: SlimPack's MicroPacks shrink to fit any mode) has no cascade, so
    every block-N would be a planning of its own, a layer count times its screening: its search adds
    at most one block-N a shape, where the bound says the memory it frees may pay
    (`_block_modes_that_may_pay`)."""
    if spec.sizes_to_memory:
        return RECOMPUTE_MODES
    return (*RECOMPUTE_MODES[:-1], *block_recompute_modes(chunk_layers), RECOMPUTE_MODES[-1])


# Interleaving deeper than this multiplies p2p and warm-up memory for a bubble already small;
# Megatron users pick 2-8 virtual stages per rank.
MAX_VPP = 8


def _virtual_stage_counts(num_layers: int, pp: int) -> list[int]:
    """vpp values for pp pipeline ranks: 1, and with pp > 1 every divisor of the layers per stage
    up to MAX_VPP (a chunk holds at least one layer)."""
    if pp == 1:
        return [1]
    return [v for v in divisors(num_layers // pp) if v <= MAX_VPP]


def minimum_memory_bytes(strategy: StrategySpec | str, lengths: list[int] | np.ndarray, cost: CostModel,
                         parallel: ParallelConfig, context_length: int) -> float:
    """A lower bound on the strategy's peak memory per device: static memory plus the
    activations (and, for slicing strategies, the KV cache) of what it must hold at once.
    `lengths`: a list, or an int64 array (a search checks ~10^3 layouts on one ~10^5-document batch)."""
    spec = as_spec(strategy)
    static = cost.static_memory_bytes(parallel)
    rule = spec.minimum_in_flight
    if rule == "none":
        return static
    longest, total = _longest_and_total(lengths)
    if rule == "merged-document":
        group = parallel.dp & -parallel.dp  # merge groups are powers of two dividing dp
        # a merge group of k ranks: k-fold context parallelism over dp/k replicas
        merged = parallel.with_(cp=parallel.cp * group, dp=max(1, parallel.dp // group))
        return document_memory_bytes(longest, cost, merged)
    tokens = {
        "sequence": min(context_length, total),
        "document": longest,
        "half-document": -(-longest // 2),
    }[rule]
    pairs = tokens  # every token attends at least to itself; activations barely depend on pairs
    last_stage = static + cost.activation_bytes(tokens, pairs, parallel, last_stage=True)
    need = last_stage + cost.recompute_peak_bytes(tokens, pairs, parallel)
    if rule == "sequence" and parallel.pp > 1:
        # 1F1B: stage 0 holds min(pp, its micro-batches) full sequences before its first backward;
        # interleaved, its warm-up's 2 (pp - 1) + (vpp - 1) pp chunk forwards and one more.
        full_sequences = total // context_length  # rank 0's block starts with full ones
        first_rank = math.ceil(math.ceil(total / context_length) / parallel.dp)
        in_flight = parallel.pp if parallel.vpp == 1 else 2 * (parallel.pp - 1) + (parallel.vpp - 1) * parallel.pp + 1
        if min(full_sequences, first_rank) * parallel.vpp >= in_flight:
            first_stage = static + in_flight * cost.activation_bytes(tokens, pairs, parallel)
            need = max(need, first_stage)
    return need


def _longest_and_total(lengths: list[int] | np.ndarray) -> tuple[int, int]:
    if isinstance(lengths, np.ndarray):
        return int(lengths.max()), int(lengths.sum())
    return max(lengths), sum(lengths)


def attention_pairs_bound(strategy: StrategySpec | str, lengths: list[int]) -> float:
    """Fewest attention pairs any plan of the strategy computes for these documents."""
    spec = as_spec(strategy)
    if spec.splits_documents:  # a document cut in two keeps at least its halves' pairs
        return float(sum(causal_pairs(n // 2) + causal_pairs(n - n // 2) for n in lengths))
    return float(sum(causal_pairs(n) for n in lengths))


def largest_pack_tokens(strategy: StrategySpec | str, cost: CostModel, parallel: ParallelConfig,
                        config: SlimPackConfig | None = None) -> float:
    """Most tokens one pack can have on this layout (in its context-parallel terms: each device
    holds 1/cp of them). Every strategy's last stage holds at least the pack it runs (activations,
    logits, a recomputed layer) next to the static memory; KV caches and other packs in flight
    only lower that. Given its `config` (the context length, any cap set), SlimPack also never
    exceeds its own MicroPack cap (`_largest_micropack`)."""
    spec = as_spec(strategy)
    room = cost.memory_budget_bytes() - cost.static_memory_bytes(parallel)
    per_token = (cost.activation_bytes(1.0, 1.0, parallel, last_stage=True)
                 + cost.recompute_peak_bytes(1.0, 1.0, parallel))
    largest = max(room, 0.0) / per_token
    if spec.sizes_to_memory and config is not None:
        largest = min(largest, _largest_micropack(cost, parallel, config))
    return largest


def _largest_micropack(cost: CostModel, parallel: ParallelConfig, config: SlimPackConfig) -> float:
    """SlimPack's MicroPacks hold at most `auto_token_cap` tokens of the view it plans: dp/k
    replicas with k-fold context parallelism where it falls back to a base merge of k (a DP-Merge
    group of g shares a g-times larger MicroPack over g-fold more, the same per device). Per device
    that is the cap over the view's cp; the largest over every k, in this layout's terms."""
    largest, base = 0.0, 1
    while parallel.dp % base == 0:
        view = parallel.with_(dp=parallel.dp // base, cp=parallel.cp * base)
        try:
            largest = max(largest, auto_token_cap(cost, view, config) / base)
        except DoesNotFit:  # no MicroPack fits this view: nothing to plan there
            pass
        base *= 2
    return largest


def iteration_lower_bound(strategy: StrategySpec | str, lengths: list[int], cost: CostModel, parallel: ParallelConfig,
                          pairs: float | None = None, config: SlimPackConfig | None = None,
                          sorted_batch: "SortedBatch | None" = None) -> float:
    """Seconds no plan of this batch can beat on this layout: the last stage's forward and
    backward compute of all tokens in the largest packs memory allows (`largest_pack_tokens`;
    efficiency grows with pack size and communication is linear in tokens, so any real split
    costs at least as much), spread over the dp ranks. Bubbles, p2p and the gradient reduction are
    left out. Where memory allows only small packs the bound rises with their lower efficiency,
    which tells the layout search early that a memory-starved layout cannot win. `pairs`:
    `attention_pairs_bound(spec, lengths)`, when the caller has it already; `config`: the
    planner's (its MicroPack cap). A DP-Merge strategy's bound also prices the merges memory
    forces (`merged_work_bound`; `sorted_batch`: `SortedBatch.of(lengths)`, when the caller has it)."""
    spec = as_spec(strategy)
    if pairs is None:
        pairs = attention_pairs_bound(spec, lengths)
    # The sorted batch's token total is the same integer (float sums of integers below 2^53)
    tokens = float(sorted_batch.tokens_before[-1]) if sorted_batch is not None else float(sum(lengths))
    bound = work_lower_bound(spec, tokens, pairs, cost, parallel, config)
    if spec.minimum_in_flight == "merged-document":
        bound = max(bound, merged_work_bound(spec, sorted_batch or SortedBatch.of(lengths), cost, parallel, config))
    return bound


@dataclass(frozen=True)
class SortedBatch:
    """A batch's document lengths, shortest first, with running totals of their tokens and causal
    attention pairs: the documents of a length range summed in O(log n) (a search bounds hundreds
    of layouts on one ~10^5-document batch)."""

    lengths: np.ndarray
    tokens_before: np.ndarray  # [i]: tokens of the i shortest documents
    pairs_before: np.ndarray

    @classmethod
    def of(cls, lengths: list[int] | np.ndarray) -> "SortedBatch":
        ordered = np.sort(np.asarray(lengths, dtype=np.int64))
        as_float = ordered.astype(np.float64)
        return cls(ordered, np.concatenate(([0.0], np.cumsum(as_float))),
                   np.concatenate(([0.0], np.cumsum(as_float * (as_float + 1) / 2))))

    def totals(self, start: int, end: int) -> tuple[float, float]:
        """Tokens and pairs of the documents start .. end - 1 (shortest first)."""
        return (float(self.tokens_before[end] - self.tokens_before[start]),
                float(self.pairs_before[end] - self.pairs_before[start]))


def merged_work_bound(strategy: StrategySpec | str, batch: SortedBatch, cost: CostModel, parallel: ParallelConfig,
                      config: SlimPackConfig | None = None) -> float:
    """A lower bound for a DP-Merge strategy that prices the merges memory forces. A document
    whose slices cannot all be in flight on one replica (`document_memory_bytes` without a cap:
    the document alone, less than any plan holds) is run by a DP-Merge group of at least g
    replicas, the smallest power of two where it fits: k-fold context parallelism over dp / k
    replicas (k = g x the layout's cp), whose exchange and smaller per-device share cost at least
    what the plain layout costs. So the documents needing g are priced on that view, the others
    on the layout, each at the rate of full packs (the cheapest per token, so a document's share
    of any pack it is in costs at least that) and summed: every device runs its share of both."""
    spec = as_spec(strategy)
    budget = cost.memory_budget_bytes()
    total, start, group = 0.0, 0, 1
    while start < len(batch.lengths):
        view = parallel.with_(cp=parallel.cp * group, dp=parallel.dp // group)
        last_group = parallel.dp % (2 * group) != 0
        end = len(batch.lengths) if last_group else int(np.searchsorted(
            batch.lengths, _longest_fitting(int(batch.lengths[-1]), cost, view, budget), side="right"))
        tokens, pairs = batch.totals(start, end)
        total += work_lower_bound(spec, tokens, pairs, cost, view, config, full_packs=True)
        start, group = end, 2 * group
    return total


def _longest_fitting(longest: int, cost: CostModel, parallel: ParallelConfig, budget: float) -> int:
    """The longest document length up to `longest` whose slices all fit on one replica of the
    layout at once (`document_memory_bytes` rises with the length): 0 if none does."""
    if document_memory_bytes(longest, cost, parallel) <= budget:
        return longest
    low, high = 0, longest  # fits(low) or low == 0; not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if document_memory_bytes(middle, cost, parallel) <= budget else (low, middle)
    return low


def work_lower_bound(strategy: StrategySpec | str, tokens: float, pairs: float, cost: CostModel,
                     parallel: ParallelConfig, config: SlimPackConfig | None = None,
                     full_packs: bool = False) -> float:
    """`iteration_lower_bound` of documents given by their totals (`pairs`: their
    `attention_pairs_bound`). Superadditive: the bounds of any split of the documents sum to at
    least the bound of all of them (once packs are full-size it is linear in tokens and pairs, and
    fewer tokens than a full pack only cost more per token). `full_packs`: fewer tokens than a full
    pack priced as their share of one, at the full pack's rate, so linear in tokens and pairs
    throughout (a lower bound on their share of any pack they are in)."""
    spec = as_spec(strategy)
    if tokens <= 0:
        return 0.0
    largest = max(largest_pack_tokens(spec, cost, parallel, config), 1.0)
    share = min(tokens / largest, 1.0) if full_packs else 1.0  # scaled up to a full pack, and back
    priced = cost.with_overlaps(spec.overlaps)
    return priced.pass_time_bound(tokens / share, pairs / share, parallel, largest) / parallel.dp * share


def cheap_rejection(strategy: StrategySpec | str, lengths: list[int] | np.ndarray, cost: CostModel,
                    parallel: ParallelConfig, context_length: int) -> Rejection | None:
    """Static memory, then the strategy's minimum need; None when neither rules the layout out.
    `lengths` as `minimum_memory_bytes` takes them."""
    spec = as_spec(strategy)
    budget = cost.memory_budget_bytes()
    static = cost.static_memory_bytes(parallel)
    if static > budget:
        return Rejection(parallel, "static-memory",
                         f"memory: weights, gradients and optimizer state need {format_bytes(static)} per device, "
                         f"{format_bytes(budget)} usable on {cost.hardware.name}")
    need = minimum_memory_bytes(spec, lengths, cost, parallel, context_length)
    if need > budget:
        rule, (longest, total) = spec.minimum_in_flight, _longest_and_total(lengths)
        what = {
            "sequence": f"full {min(context_length, total)}-token sequences (1F1B keeps up to pp of them "
                        "on stage 0)" if parallel.vpp == 1 else
                        f"full {min(context_length, total)}-token sequences' chunks (interleaved 1F1B keeps "
                        f"2 (pp - 1) + (vpp - 1) pp + 1 of them on stage 0)",
            "document": f"the longest document ({longest} tokens) whole",
            "half-document": f"the larger piece of the longest document ({-(-longest // 2)}+ tokens)",
            "merged-document": f"the longest document ({longest} tokens) whole, even shared by its largest "
                               f"DP-Merge group ({parallel.dp & -parallel.dp} replicas),",
        }[rule]
        return Rejection(parallel, "minimum-memory",
                         f"memory: {spec.name} holds {what} in flight: at least {format_bytes(need)} per device, "
                         f"{format_bytes(budget)} usable on {cost.hardware.name}")
    return None


# ==== planning and simulating one layout ========================================================


@dataclass
class _Run:
    """A layout being evaluated: its planner (state kept across batches) and results so far."""

    parallel: ParallelConfig
    config: SlimPackConfig
    planner: StepPlanner | None = None
    plans: list[Plan] = field(default_factory=list)
    reports: list[SimulationReport] = field(default_factory=list)
    shelved: bytes | None = None  # `plans`, pickled while the run is not among the fastest screened
    # A strategy that plans by shape (`StrategySpec.plans_by_shape`): the search's `_ShapePlans`.
    shape_plans: "_ShapePlans | None" = None
    # The first batch's plan was screened without `Plan.validate` (`_screen`); it is validated
    # when the run is finished (`_finish_run`), before any result can report it.
    unvalidated: bool = False
    # A lower bound on its first-batch time (`iteration_lower_bound`), once screening computed it:
    # a re-screen and the block-N choice of a strategy sized to memory need it again.
    bound: float | None = None

    @property
    def active_planner(self) -> StepPlanner:
        """`planner`, once the run is evaluated (it is set before the first batch is planned)."""
        return cast(StepPlanner, self.planner)

    def shelve(self) -> None:
        """Keep the plans pickled, about 8x smaller (one llama-13b 256K plan of 64 replicas: 50 MiB
        as objects, 6 MiB pickled): a search screens hundreds of layouts, and only its finalists'
        plans are used again. A shape-planned run's plans are its shape's, kept by `shape_plans`:
        dropped, and made again from there (`unshelve`)."""
        if self.plans and self.shape_plans is not None:
            self.plans = []
        elif self.plans:
            self.shelved, self.plans = pickle.dumps(self.plans, protocol=pickle.HIGHEST_PROTOCOL), []

    def unshelve(self) -> None:
        if self.shelved is not None:
            self.plans, self.shelved = pickle.loads(self.shelved), None
        elif self.shape_plans is not None and len(self.plans) < len(self.reports):
            self.plans = [self.shape_plans.own_copy(self, step) for step in range(len(self.reports))]

    def evaluation(self, batches: int) -> "LayoutEvaluation":
        """The run over every batch, its plans objects of their own (a shape-planned run's are
        shallow copies of its shape's plans until then)."""
        if self.shape_plans is not None:
            self.plans[:] = [self.shape_plans.own_copy(self, step) for step in range(len(self.reports))]
        return LayoutEvaluation(self.parallel, self.plans, self.reports, batches)


class _ShapePlans:
    """One search's plans of a strategy that plans by shape (`StrategySpec.plans_by_shape`), by
    (batch, dp, pp, vpp): each batch is planned and validated once per shape, and every other
    layout of the shape gets a copy. The plans are kept pickled (`Plan.__reduce__` makes that
    cheap, and a search over ~10^5-document batches meets tens of shapes), the last few shapes
    used also as objects: a layout being screened gets a shallow copy with its own layout (the
    simulator only reads a plan), a run that is finished its own deep copies (`_Run.evaluation`).
    A planning error is kept too, as a copy without its traceback (`outcomes.kept`: the search
    pauses the cyclic collector), and each later layout of the shape raises a copy of it."""

    RECENT = 4  # shapes kept as objects besides pickled: layouts are screened in bound order, not by shape

    def __init__(self):
        self.plans: dict[tuple[int, ...], bytes | PlanError] = {}
        self.recent: dict[tuple[int, ...], Plan] = {}  # the last RECENT shapes used, oldest first

    @staticmethod
    def key(run: _Run, step: int) -> tuple[int, ...]:
        return step, run.parallel.dp, run.parallel.pp, run.parallel.vpp

    def plan(self, run: _Run, lengths: list[int], cost: CostModel, step: int, validate: bool = True) -> Plan:
        key = self.key(run, step)
        kept = self.plans.get(key)
        if isinstance(kept, PlanError):
            raise copy.copy(kept)
        if kept is None:
            try:  # a batch, not the flush: never None
                planned = cast(Plan, _planned(run, lengths, cost, step, validate))
            except PlanError as error:
                self.plans[key] = copy.copy(error)
                raise
            self.plans[key] = pickle.dumps(planned, protocol=pickle.HIGHEST_PROTOCOL)
            self._remember(key, planned)
            return planned
        master = self.recent.pop(key, None) or pickle.loads(kept)
        self._remember(key, master)
        return dataclasses.replace(master, parallel=run.parallel, metadata=dict(master.metadata))

    def own_copy(self, run: _Run, step: int) -> Plan:
        """The run's plan of `step` sharing no part with another plan (its shape's was planned)."""
        plan = pickle.loads(cast(bytes, self.plans[self.key(run, step)]))
        plan.parallel = run.parallel
        return plan

    def _remember(self, key: tuple[int, ...], plan: Plan) -> None:
        self.recent[key] = plan
        if len(self.recent) > self.RECENT:
            del self.recent[next(iter(self.recent))]


def _planned(run: _Run, lengths: list[int], cost: CostModel, step: int | None, validate: bool = True) -> Plan | None:
    """The run's plan of one batch (or, with step None, the planner's flush: None where it has
    nothing left), validated unless `validate` is False."""
    started = time.perf_counter()
    if step is None:
        # An optional method of stateful planners, called only where there is one (`_flushes`).
        plan = run.active_planner.flush(run.parallel, cost, run.config)  # type: ignore[attr-defined]
        if plan is None:
            return None
    else:
        plan = run.active_planner.plan(lengths, run.parallel, cost, run.config)
    plan.metadata.setdefault("planning_time_s", time.perf_counter() - started)
    return plan.validate() if validate else plan


def _plan_and_simulate(run: _Run, lengths: list[int], cost: CostModel, step: int | None,
                       validate: bool = True) -> Rejection | None:
    """Plan one batch (or, with step None, the planner's flush) and simulate it; the plan is
    validated unless `validate` is False (then `run.unvalidated` says so)."""
    where = "the final flush" if step is None else f"batch {step}"
    try:
        with reports_reused():  # a planner that simulated its plan (SlimPack's floor): not again
            shaped = run.shape_plans is not None and step is not None
            planned = (cast(_ShapePlans, run.shape_plans).plan(run, lengths, cost, cast(int, step), validate)
                       if shaped else _planned(run, lengths, cost, step, validate))
            if planned is None:
                return None
            plan = planned
            try:
                report = simulate(plan, cost, detail=False)
            except Exception:
                if not validate:
                    plan.validate()  # a plan the simulator could not read: the rule it breaks, if any
                raise
    except PlanError as error:
        kind = "planner" if isinstance(error, DoesNotFit) else "invalid"
        return Rejection(run.parallel, kind, f"{where}: {error}")
    except SimulationError as error:
        return Rejection(run.parallel, "simulation", f"{where}: {error}")
    budget = cost.memory_budget_bytes()
    peak = max(report.peak_memory_bytes)
    if peak > budget:
        stage = report.peak_memory_bytes.index(peak)
        return Rejection(run.parallel, "simulated-memory",
                         f"memory: {where} peaks at {format_bytes(peak)} on pipeline stage {stage}, "
                         f"{format_bytes(budget)} usable on {cost.hardware.name}")
    run.plans.append(plan)
    run.reports.append(report)
    run.unvalidated = run.unvalidated or not validate
    return None


def _finish_run(run: _Run, batches: list[list[int]], cost: CostModel, remaining: "_RemainingWork | None" = None,
                beat_s: float = math.inf, validate: bool = True) -> Rejection | None:
    """The batches after the first, then the planner's flush if it has one. Given the `remaining`
    work, a run whose mean can no longer be below `beat_s` stops (a "finish-bound" rejection). A
    first-batch plan screened without validation is validated first: an invalid one (a planner's
    bug) rejects the run as a later batch's failure does. `validate` False: no plan is validated
    here (`run.unvalidated` says so; `_invalid_plan` checks them later)."""
    if run.unvalidated and validate:  # screening skips validation: the first batch's plan
        try:
            run.plans[0].validate()
        except PlanError as error:
            return Rejection(run.parallel, "invalid", f"batch 0: {error}")
        run.unvalidated = False
    for step in range(len(run.plans), len(batches) + 1):
        if remaining is not None and (stop := remaining.stop(run, beat_s)):
            return stop
        if step < len(batches):
            rejection = _plan_and_simulate(run, batches[step], cost, step, validate=validate)
        elif _flushes(run.active_planner):
            rejection = _plan_and_simulate(run, [], cost, None, validate=validate)
        else:
            return None
        if rejection:
            return rejection
    return None


def _invalid_plan(evaluations: dict[int, "LayoutEvaluation"]) -> Rejection | None:
    """The first plan of these evaluations that breaks a rule of the plan format (a planner's bug),
    as an "invalid" rejection; None where every plan is valid."""
    for evaluation in evaluations.values():
        for step, plan in enumerate(evaluation.plans):
            try:
                plan.validate()
            except PlanError as error:
                return Rejection(evaluation.parallel, "invalid", f"plan {step}: {error}")
    return None


def _flushes(planner: StepPlanner) -> bool:
    """Whether the planner plans what it still delays as one last step (so trains every document)."""
    return callable(getattr(planner, "flush", None))


@dataclass
class _RemainingWork:
    """A lower bound on the mean a stateful strategy's layout can still reach. Every document of
    the batches is trained once, in some step or in the final flush, and a step takes at least the
    lower bound of the documents it trains; the bound is superadditive (`work_lower_bound`), so the
    steps still to come take at least the bound of the documents not trained yet: the batches not
    planned and what the planner still delays (`StepPlanner.untrained_lengths`)."""

    spec: StrategySpec
    cost: CostModel
    tokens_from: list[float]  # tokens of batches[k:], k = 0 .. len(batches)
    pairs_from: list[float]  # their `attention_pairs_bound`

    @classmethod
    def of(cls, spec: StrategySpec, batches: list[list[int]], cost: CostModel) -> "_RemainingWork":
        tokens, pairs = [0.0], [0.0]
        for lengths in reversed(batches):
            tokens.insert(0, tokens[0] + sum(lengths))
            pairs.insert(0, pairs[0] + attention_pairs_bound(spec, lengths))
        return cls(spec, cost, tokens, pairs)

    @property
    def batches(self) -> int:
        return len(self.tokens_from) - 1

    def at_start(self, parallel: ParallelConfig, config: SlimPackConfig) -> float:
        """Seconds per batch a layout takes at least over every batch, before any is planned."""
        rest = work_lower_bound(self.spec, self.tokens_from[0], self.pairs_from[0], self.cost, parallel, config)
        return rest / self.batches

    def rest_at_least(self, run: _Run) -> float:
        """Seconds the batches the run has not planned and what its planner delays take at least."""
        planned = len(run.reports)
        delayed = run.active_planner.untrained_lengths()
        tokens = self.tokens_from[planned] + sum(delayed)
        pairs = self.pairs_from[planned] + attention_pairs_bound(self.spec, delayed)
        return work_lower_bound(self.spec, tokens, pairs, self.cost, run.parallel, run.config)

    def mean_at_least(self, run: _Run) -> float:
        """Seconds per batch the run's plans so far and the rest take at least."""
        return (sum(report.iteration_time_s for report in run.reports) + self.rest_at_least(run)) / self.batches

    def stop(self, run: _Run, beat_s: float) -> Rejection | None:
        """Why the run is not worth finishing (None: go on): its mean cannot be below `beat_s`."""
        least = self.mean_at_least(run)
        if least <= beat_s:
            return None
        return Rejection(run.parallel, "finish-bound",
                         f"not finished: after {len(run.reports)} of {self.batches} batches its mean is at least "
                         f"{least:.3f} s (its plans so far and a lower bound on the rest), above the mean "
                         f"{beat_s:.3f} s it would have to beat")


def _finish_fastest(runs: list[_Run], batches: list[list[int]], cost: CostModel, rejected: list[Rejection],
                    finalists: int, evaluations: dict[int, "LayoutEvaluation"], failed: set[int],
                    ticker: _Ticker | None = None) -> bool:
    """Every batch on the `finalists` runs fastest on the first (those not yet finished), skipping
    runs that failed a later batch. True when one failed now. `ticker` counts each run finished
    or failed."""
    finished, failed_now = 0, False
    for run in sorted(runs, key=lambda run: run.reports[0].iteration_time_s):
        if finished == finalists:
            break
        if id(run) in failed:
            continue
        if id(run) not in evaluations:
            run.unshelve()
            rejection = _finish_run(run, batches, cost)
            if rejection:
                rejected.append(rejection)
                failed.add(id(run))
                failed_now = True
                if ticker:
                    ticker.total += 1  # the next one is finished in its place
                    ticker.tick()
                continue
            evaluations[id(run)] = run.evaluation(len(batches))
            _drop_plans_of_slower(evaluations, finalists)
            if ticker:
                ticker.tick(evaluations[id(run)].mean_iteration_time_s)
        finished += 1
    return failed_now


def _drop_plans_of_slower(evaluations: dict[int, "LayoutEvaluation"], finalists: int) -> None:
    """Plans only of the `finalists` fastest evaluations: a stateful strategy finishes every
    layout that could win, tens of them. An evaluation out of the running stays out (means are final)."""
    ranked = sorted(evaluations.values(), key=lambda evaluation: evaluation.mean_iteration_time_s)
    for evaluation in ranked[finalists:]:
        evaluation.plans.clear()  # the run's list too


# ==== the search ================================================================================


# The cyclic collector is paused for the whole search: it would rescan every plan the search keeps
# (13.1 of 101.4 CPU s of a llama-70b search went to full passes). So nothing a planning or a
# simulation makes may rely on it to be freed (CP-SAT models and kept failures once did:
# dp_phase._CpModel, outcomes.kept).
@cyclic_gc_paused()
def best_layout(
    strategy: StrategySpec | str,
    batches: list[list[int]],
    cost: CostModel,
    gpus: int,
    context_length: int,
    base_config: SlimPackConfig | None = None,
    *,
    layouts: list[ParallelConfig] | None = None,
    finalists: int = 3,
    recompute_cascade: bool = True,
    progress: ProgressCallback | None = None,
) -> LayoutResult:
    """The fastest memory-feasible layout of `gpus` GPUs for `strategy` on `batches` (lists of
    document lengths, each at most `context_length`). `layouts` replaces the enumeration (each is
    still checked: world size, model split, strategy constraints). Raises NoFeasibleLayout, whose
    `rejected` lists every layout with its reason, when nothing fits. `progress`, if given, is
    called with a `SearchProgress` as each phase starts and after each layout is decided; what it
    raises stops the search and propagates."""
    spec = as_spec(strategy)
    started = time.perf_counter()
    if not batches:
        raise PlanError("best_layout: no batches given")
    if not isinstance(gpus, int) or gpus < 1:
        raise PlanError(f"best_layout: gpus must be a positive integer, got {gpus!r}")
    batches = [check_plan_input(lengths, context_length) for lengths in batches]
    config = (base_config or SlimPackConfig()).with_(strategy=spec.name, context_length=context_length)
    rejected: list[Rejection] = []
    candidates = _candidates(spec, cost, gpus, layouts, rejected)
    first = batches[0]
    screened: list[_Run] = []
    shape_plans = _ShapePlans() if spec.plans_by_shape else None
    first_lengths = np.asarray(first, dtype=np.int64)  # checked for every candidate: summed in C
    for parallel in candidates:
        rejection = cheap_rejection(spec, first_lengths, cost, parallel, context_length)
        if rejection:
            rejected.append(rejection)
            continue
        screened.append(_Run(parallel, config, shape_plans=shape_plans))
    if spec.sizes_to_memory and layouts is None:
        # Block-N modes are not enumerated: one a shape is added where it may pay, a candidate too.
        added = _block_modes_that_may_pay(spec, screened, first_lengths, cost, context_length)
        screened += added
        candidates = candidates + [run.parallel for run in added]
    ticker = _Ticker(progress, spec.name, started, len(candidates))
    ticker.start("screening", len(screened))
    if spec.stateful:
        started_runs, finished = _run_validating_finalists(spec, screened, batches, cost, rejected, recompute_cascade,
                                                           finalists, ticker)
        return _result(spec, gpus, started_runs, finished, finalists, rejected, started, candidates)
    runs, deferred = _screen(spec, screened, first, cost, rejected, recompute_cascade, finalists, ticker=ticker)
    evaluations: dict[int, LayoutEvaluation] = {}  # id(run) -> the run over every batch
    failed: set[int] = set()
    ticker.start("finishing", min(finalists, len(runs)))
    while _finish_fastest(runs, batches, cost, rejected, finalists, evaluations, failed, ticker) and deferred:
        # A layout that fit the first batch failed a later one. What was left unevaluated because of
        # it (bounded out by its first-batch time, its heavier recompute modes, its interleaved
        # twins) is screened again, without it.
        for _, rejection in deferred:
            rejected.remove(rejection)
        survivors = [run for run in runs if id(run) not in failed]
        ticker.start("screening", len(deferred))
        more, deferred = _screen(spec, [run for run, _ in deferred], first, cost, rejected, recompute_cascade,
                                 finalists, screened=survivors, ticker=ticker)
        runs = survivors + more + [run for run in runs if id(run) in failed]
        alive = sum(id(run) not in failed for run in runs)
        ticker.start("finishing", min(finalists, alive) - len(evaluations))
    return _result(spec, gpus, runs, evaluations, finalists, rejected, started, candidates)


def _run_validating_finalists(spec: StrategySpec, runs: list[_Run], batches: list[list[int]], cost: CostModel,
                              rejected: list[Rejection], recompute_cascade: bool, finalists: int,
                              ticker: _Ticker) -> tuple[list[_Run], dict[int, LayoutEvaluation]]:
    """`_run_in_bound_order` with the plans validated once, those of the finalists (validating
    every plan of every layout run was a fifth of a stateful search). Where one is invalid (a
    planner's bug), every layout is run again validating each plan, so that no bound or cascade
    rests on it: the search ends as one that validated all. Rejections join `rejected`."""
    unvalidated: list[Rejection] = []
    started, evaluations = _run_in_bound_order(spec, [_fresh(run) for run in runs], batches, cost, unvalidated,
                                               recompute_cascade, finalists, ticker, validate=False)
    if _invalid_plan(evaluations) is None:
        rejected += unvalidated
        return started, evaluations
    ticker.start("screening", len(runs))
    return _run_in_bound_order(spec, runs, batches, cost, rejected, recompute_cascade, finalists, ticker)


def _fresh(run: _Run) -> _Run:
    """A run of the same layout, not yet evaluated."""
    return _Run(run.parallel, run.config, bound=run.bound)


def _block_modes_that_may_pay(spec: StrategySpec, runs: list[_Run], lengths: np.ndarray, cost: CostModel,
                              context_length: int) -> list[_Run]:
    """For a strategy that sizes its work to memory, at most one block-N layout a shape (tp, pp,
    vpp, cp, dp): the N of the lowest lower bound, where that is below the bound of every recompute
    mode of the shape that passed the memory checks (`runs`). The memory block-N frees buys larger
    MicroPacks and fewer DP-Merge groups, which the bound prices, for N layers re-run. Scanning N
    upward stops once N's bound with unlimited memory (one pack of everything: recompute added,
    nothing bought) reaches the best, since memory only raises a bound."""
    batch = lengths.tolist()
    pairs, ordered = _set_bounds(spec, runs, batch, cost)
    tokens = float(lengths.sum())
    priced = cost.with_overlaps(spec.overlaps)
    by_shape: dict[tuple[int, ...], list[_Run]] = {}
    for run in runs:
        by_shape.setdefault(_shape(run.parallel), []).append(run)
    added = []
    for shape_runs in by_shape.values():
        base = shape_runs[0]
        best = min(cast(float, run.bound) for run in shape_runs)
        chosen = None
        for layers in range(1, cost.model.num_layers // (base.parallel.pp * base.parallel.vpp)):
            parallel = base.parallel.with_(recompute=f"block-{layers}")
            if priced.pass_time_bound(tokens, pairs, parallel, tokens) / parallel.dp >= best:
                break
            if cheap_rejection(spec, lengths, cost, parallel, context_length):
                continue
            bound = iteration_lower_bound(spec, batch, cost, parallel, pairs, base.config, ordered)
            if bound < best:
                best, chosen = bound, parallel
        if chosen is not None:
            added.append(_Run(chosen, base.config, shape_plans=base.shape_plans, bound=best))
    return added


def _set_bounds(spec: StrategySpec, runs: list[_Run], lengths: list[int], cost: CostModel) -> tuple[float, SortedBatch]:
    """Each run's first-batch lower bound (`_Run.bound`) where it has none yet; returns the
    batch's `attention_pairs_bound` and `SortedBatch`, which every layout's bound reads."""
    pairs, ordered = attention_pairs_bound(spec, lengths), SortedBatch.of(lengths)  # the same for every layout
    for run in runs:
        if run.bound is None:
            run.bound = iteration_lower_bound(spec, lengths, cost, run.parallel, pairs, run.config, ordered)
    return pairs, ordered


def _result(spec: StrategySpec, gpus: int, runs: list[_Run], evaluations: dict[int, LayoutEvaluation], finalists: int,
            rejected: list[Rejection], started: float, candidates: list[ParallelConfig]) -> LayoutResult:
    """The search's result from its runs (those that fit the first batch) and their evaluations."""
    runs = sorted(runs, key=lambda run: run.reports[0].iteration_time_s)
    done = sorted(evaluations.values(), key=lambda evaluation: evaluation.mean_iteration_time_s)[:finalists]
    if not done:
        raise NoFeasibleLayout(_no_layout_message(spec, gpus, rejected), rejected)
    return LayoutResult(
        strategy=spec.name, gpus=gpus, best=done[0], finalists=done,
        screened=[(run.parallel, run.reports[0].iteration_time_s) for run in runs],
        rejected=rejected, search_time_s=time.perf_counter() - started, candidates=len(candidates),
    )


def _candidates(spec: StrategySpec, cost: CostModel, gpus: int, layouts,
                rejected: list[Rejection]) -> list[ParallelConfig]:
    if layouts is None:
        found = enumerate_layouts(cost, gpus, spec)
        if not found:
            raise NoFeasibleLayout(
                f"no layout of {gpus} GPUs splits {cost.model.name} for {spec.name}: tp must divide "
                f"{cost.model.kv_heads} KV heads and be <= {cost.hardware.gpus_per_node}, pp must divide "
                f"{cost.model.num_layers} layers", [])
        return found
    constraints = spec.constraints
    kept = []
    for parallel in layouts:
        try:
            parallel.check_model(cost.model)
        except SpecError as error:
            rejected.append(Rejection(parallel, "invalid", str(error)))
            continue
        if parallel.world_size != gpus:
            rejected.append(Rejection(parallel, "invalid", f"uses {parallel.world_size} GPUs, not {gpus}"))
        elif not constraints.allows(parallel):
            rejected.append(Rejection(parallel, "invalid", f"not a {spec.name} layout: {constraints.reason}"))
        else:
            kept.append(parallel)
    return kept


def _shape(parallel: ParallelConfig) -> tuple[int, ...]:
    return parallel.tp, parallel.pp, parallel.vpp, parallel.cp, parallel.dp


def _screen(spec: StrategySpec, runs: list[_Run], lengths: list[int], cost: CostModel, rejected: list[Rejection],
            recompute_cascade: bool, keep: int, screened: tuple[_Run, ...] | list[_Run] = (),
            ticker: _Ticker | None = None) -> tuple[list[_Run], list[tuple[_Run, Rejection]]]:
    """Plan and simulate the first batch on each layout, most promising (lowest bound) first. The
    plans of all but the `keep` fastest so far are shelved (`_Run.shelve`). `screened`: runs
    screened before, which the cascades and the bound count. Returns the runs that fit and the
    (run, rejection) of those not evaluated because they could not win. `ticker` counts each
    layout as it is decided. Only stateless strategies are screened: they plan exactly the batch,
    so its bound holds."""
    _set_bounds(spec, runs, lengths, cost)
    bounds = {id(run): cast(float, run.bound) for run in runs}
    order = _CascadeOrder(_in_shape_order(runs, bounds))
    cascade = _RecomputeCascade() if recompute_cascade and not spec.sizes_to_memory else None
    if cascade:
        for run in screened:
            cascade.fits(run.parallel)
    # vpp = 1 layouts that fit -> their simulated busy time
    plain = {run.parallel: run.reports[0].work_bound_s for run in screened if run.parallel.vpp == 1}
    best = min((run.reports[0].iteration_time_s for run in screened), default=math.inf)
    deferred: list[tuple[_Run, Rejection]] = []
    feasible: list[_Run] = []
    fastest: list[tuple[float, int]] = []  # (first-batch time, index in feasible) of the `keep` fastest
    # The ticker reads `best` as each layout's turn ends: late binding is what it needs.
    for run in ticker.each(order, lambda: best) if ticker else order:  # noqa: B023
        not_worth = _not_worth_evaluating(run.parallel, cascade, plain, best, bounds[id(run)])
        if not_worth:
            order.went_lower(_more_recompute_cannot_win(not_worth, plain))
            rejected.append(not_worth)
            if not not_worth.infeasible:
                deferred.append((run, not_worth))
            continue
        run.planner = spec.new_planner()
        # Not validated here: every layout that fits is, once among the fastest (`_finish_run`);
        # validation is a fifth to a third of a baseline's screening of a ~10^5-document batch.
        rejection = _plan_and_simulate(run, lengths, cost, 0, validate=False)
        order.went_lower(rejection is None)
        if rejection:
            if cascade and rejection.kind in MEMORY_FAILURES:
                cascade.does_not_fit(run.parallel)
            rejected.append(rejection)
            continue
        if cascade:
            cascade.fits(run.parallel)
        feasible.append(run)
        best = min(best, run.reports[0].iteration_time_s)
        bisect.insort(fastest, (run.reports[0].iteration_time_s, len(feasible) - 1))
        if len(fastest) > keep:
            feasible[fastest.pop()[1]].shelve()
        if run.parallel.vpp == 1:
            plain[run.parallel] = run.reports[0].work_bound_s
    return feasible, deferred


def _in_shape_order(runs: list[_Run], bounds: dict[int, float]) -> list[_Run]:
    """Bound order, a plain 1F1B shape (tp, pp, cp, dp) at a time, at the lowest bound of its
    layouts. Within it the lighter recompute modes come first, as the recompute cascade needs
    (a lighter mode's bound can be the higher one: more activations per token leave room for
    smaller packs only; ordered by bound alone, a heavier mode that fit turned the lighter one
    away), and an interleaved layout right after its plain twin, which the interleave cascade
    needs evaluated first, although its bound is lower (a chunk's activations leave room for
    larger packs). `bounds`: id(run) -> its lower bound."""

    def plain_shape(parallel: ParallelConfig) -> tuple[int, ...]:
        return _shape(parallel.with_(vpp=1))

    shape_bound: dict[tuple[int, ...], float] = {}
    for run in runs:
        key = plain_shape(run.parallel)
        shape_bound[key] = min(shape_bound.get(key, math.inf), bounds[id(run)])

    def order(run: _Run) -> tuple:
        key = plain_shape(run.parallel)
        mode, layers = recompute_order(run.parallel.recompute)
        # a vpp's block-N layouts together, N rising (`_CascadeOrder` visits them by bisection)
        return shape_bound[key], key, mode, run.parallel.vpp, layers

    return sorted(runs, key=order)


class _CascadeOrder:
    """The layouts in the order given, except that each run of block-N layouts of one shape
    (consecutive, N rising: `_in_shape_order`) is visited by bisection on N for the smallest N that
    fits and could win, then the rest of them in N order. More layers recomputed hold less and take
    longer on the same plans, so fitting is monotone in N and the smallest fitting N is the fastest
    of them; the loop tells, after each layout it decides, whether it went lower (`went_lower`: it
    fit, or neither it nor a larger N could win) or not (it did not fit). The layouts left after the
    bisection are then ruled out by the cascade (`_RecomputeCascade`) or the bound, as the loop decides
    them: about log2(N) plannings instead of N."""

    def __init__(self, runs: list[_Run]) -> None:
        self.runs = runs
        self.lower = False

    def went_lower(self, lower: bool) -> None:
        self.lower = lower

    def __iter__(self) -> Iterator[_Run]:
        start = 0
        while start < len(self.runs):
            end = start + 1
            if block_recompute_layers(self.runs[start].parallel.recompute):
                shape = _shape(self.runs[start].parallel)
                while (end < len(self.runs) and _shape(self.runs[end].parallel) == shape
                       and block_recompute_layers(self.runs[end].parallel.recompute)):
                    end += 1
                yield from self._bisection(self.runs[start:end])
            else:
                yield self.runs[start]
            start = end

    def _bisection(self, family: list[_Run]) -> Iterator[_Run]:
        low, high, visited = 0, len(family), set()
        while low < high:
            middle = (low + high) // 2
            self.lower = False
            yield family[middle]
            visited.add(middle)
            low, high = (low, middle) if self.lower else (middle + 1, high)
        yield from (run for index, run in enumerate(family) if index not in visited)


# Rejections that say a layout needs more memory than it has: more recompute could make it fit.
MEMORY_FAILURES = ("planner", "simulated-memory")


class _RecomputeCascade:
    """What the layouts of each shape (tp, pp, vpp, cp, dp) evaluated so far say of its other
    recompute modes. On the same plans more recompute only adds time (`specs.recompute_includes`),
    so a mode that includes one that fits, or one that could not win, is not evaluated; and block-N
    holds more than block-M for N < M, so where block-M did not fit, no block-N fits either. For
    strategies whose plans do not depend on the memory left (not `StrategySpec.sizes_to_memory`)."""

    def __init__(self) -> None:
        self.fitting: dict[tuple[int, ...], list[str]] = {}
        self.largest_not_fitting: dict[tuple[int, ...], int] = {}  # block layers

    def fits(self, parallel: ParallelConfig) -> None:
        """The layout fit (or, for a stateful strategy, stopped because it could not win)."""
        self.fitting.setdefault(_shape(parallel), []).append(parallel.recompute)

    def does_not_fit(self, parallel: ParallelConfig) -> None:
        layers = block_recompute_layers(parallel.recompute)
        shape = _shape(parallel)
        self.largest_not_fitting[shape] = max(self.largest_not_fitting.get(shape, 0), layers)

    def rejection(self, parallel: ParallelConfig) -> Rejection | None:
        shape, mode = _shape(parallel), parallel.recompute
        lighter = next((m for m in self.fitting.get(shape, ()) if m != mode and recompute_includes(mode, m)), None)
        if lighter is not None:
            return Rejection(parallel, "recompute-cascade",
                             f"not evaluated: recompute {lighter} fits this layout (or could not win), and "
                             f"{mode} re-runs all it re-runs: recompute only adds time")
        layers, more = block_recompute_layers(mode), self.largest_not_fitting.get(shape, 0)
        if 0 < layers < more:
            return Rejection(parallel, "recompute-memory",
                             f"memory: not evaluated, recompute block-{more} does not fit this layout, and "
                             f"block-{layers} recomputes fewer layers, so holds more")
        return None


def _run_in_bound_order(spec: StrategySpec, runs: list[_Run], batches: list[list[int]], cost: CostModel,
                        rejected: list[Rejection], recompute_cascade: bool, finalists: int,
                        ticker: _Ticker, validate: bool = True) -> tuple[list[_Run], dict[int, LayoutEvaluation]]:
    """A stateful strategy that flushes (it trains every document): each layout runs every batch
    and the flush, one layout after another in the order of a lower bound on its mean
    (`_RemainingWork`: every document is trained in some step, and the bound is superadditive),
    lightest recompute mode and plain 1F1B of a shape first (`_in_shape_order`). Its first batch
    is a poor guide to its mean (WLB-LLM's queue fills over the steps: at llama-70b 128K GitHub on
    256 H100s its fastest layout over 10 batches is the 18th fastest on the first), so nothing is
    decided on it. A layout whose bound is not below the `finalists`-th fastest mean so far is not
    run ("bound"), nor one the cascades rule out (a lighter recompute mode of its shape ran every
    batch, or stopped because it could not win; an interleaved one whose plain twin failed, or whose
    busy time per device per batch, where it stopped its busy time so far and the bound of the rest,
    is not below that mean); a layout being run stops once its plans
    so far and the bound on the rest put its mean there ("finish-bound"). Every bound is a lower
    bound, so the `finalists` fastest means are those of running every layout the cascades leave
    to the end.
    A planner that does not flush may leave documents untrained: nothing bounds its mean, and
    every layout the cascades leave runs every batch.
    `validate` False: no plan is validated (the caller checks the finalists').
    Returns the runs that fit the first batch and the evaluations of those that ran every batch."""
    remaining = _RemainingWork.of(spec, batches, cost) if _flushes(spec.new_planner()) else None
    bounds = {id(run): remaining.at_start(run.parallel, run.config) if remaining else 0.0 for run in runs}
    evaluations: dict[int, LayoutEvaluation] = {}
    # modes that ran every batch (or stopped: they could not win), and those that did not fit
    cascade = _RecomputeCascade() if recompute_cascade and not spec.sizes_to_memory else None
    busy: dict[ParallelConfig, float] = {}  # plain 1F1B layouts that ran every batch -> busy seconds per batch
    started: list[_Run] = []

    def beat_s() -> float:
        means = sorted(evaluation.mean_iteration_time_s for evaluation in evaluations.values())
        return means[finalists - 1] if len(means) >= finalists else math.inf

    def best_mean_s() -> float:
        return min((evaluation.mean_iteration_time_s for evaluation in evaluations.values()), default=math.inf)

    order = _CascadeOrder(_in_shape_order(runs, bounds))
    for run in ticker.each(order, best_mean_s):
        not_worth = _not_worth_evaluating(run.parallel, cascade, busy, beat_s(), bounds[id(run)], "mean")
        if not_worth:
            order.went_lower(_more_recompute_cannot_win(not_worth, busy))
            rejected.append(not_worth)
            continue
        run.planner = spec.new_planner()
        rejection = (_plan_and_simulate(run, batches[0], cost, 0, validate=validate)
                     or _finish_run(run, batches, cost, remaining, beat_s(), validate))
        if run.reports:
            started.append(run)
        stopped = rejection is not None and rejection.kind == "finish-bound"
        order.went_lower(stopped or not rejection)
        if run.parallel.vpp == 1 and (stopped or not rejection):
            # busy per device per batch: of the batches run, and at least the bound of the rest
            rest = remaining.rest_at_least(run) if stopped and remaining else 0.0
            busy[run.parallel] = (sum(report.work_bound_s for report in run.reports) + rest) / len(batches)
        if cascade and (stopped or not rejection):
            cascade.fits(run.parallel)
        elif cascade and rejection and rejection.kind in MEMORY_FAILURES:
            cascade.does_not_fit(run.parallel)
        if rejection:
            rejected.append(rejection)
            run.plans.clear()
            continue
        evaluations[id(run)] = run.evaluation(len(batches))
        _drop_plans_of_slower(evaluations, finalists)
    return started, evaluations


def _not_worth_evaluating(parallel: ParallelConfig, cascade: _RecomputeCascade | None,
                          plain: dict[ParallelConfig, float], best: float, bound: float,
                          compared: str = "first-batch") -> Rejection | None:
    """Why a layout cannot beat the best screened one, or cannot fit (None: evaluate it): the
    recompute cascade (None: none), the interleave cascade, or its lower bound.
    `compared`: what `best` and the bound are, "first-batch" time or "mean" over every batch."""
    recompute = cascade.rejection(parallel) if cascade else None
    if recompute:
        return recompute
    why_not = _interleave_cascade(parallel, plain, best, compared)
    if why_not:
        return Rejection(parallel, "interleave-cascade", why_not)
    if bound >= best:
        return Rejection(parallel, "bound", f"not evaluated: its lower bound {bound:.3f} s is above the best "
                                            f"{compared} time {best:.3f} s")
    return None


def _more_recompute_cannot_win(rejection: Rejection, plain: dict[ParallelConfig, float]) -> bool:
    """Whether a layout turned away before it was evaluated says that the same shape with more
    layers recomputed cannot win either (its bound, a lighter mode that fits, a plain twin too busy),
    rather than that it may not fit (a block-M that does not fit, a plain twin that does not)."""
    if rejection.kind == "interleave-cascade":
        return _plain_twin(rejection.parallel) in plain
    return rejection.kind in ("bound", "recompute-cascade")


def _plain_twin(parallel: ParallelConfig) -> ParallelConfig:
    """The plain 1F1B layout holding the same layers per rank, recomputing the same ones: block-N of
    each of vpp chunks is block-(vpp N) of one."""
    layers = block_recompute_layers(parallel.recompute)
    recompute = f"block-{parallel.vpp * layers}" if layers else parallel.recompute
    return parallel.with_(vpp=1, recompute=recompute)


def _interleave_cascade(parallel: ParallelConfig, plain: dict[ParallelConfig, float], best: float,
                        compared: str = "first-batch") -> str | None:
    """Why an interleaved layout is not worth evaluating (None: evaluate it): its plain 1F1B twin
    (`_plain_twin`) did not fit, or already spends more time busy than the best screened layout
    takes in all."""
    if parallel.vpp == 1:
        return None
    twin = _plain_twin(parallel)
    if twin not in plain:
        return f"not evaluated: {twin.describe()} does not fit (or was not evaluated), and interleaving holds more"
    if plain[twin] >= best:
        return (f"not evaluated: {twin.describe()} is busy {plain[twin]:.3f} s per device, above the best {compared} "
                f"time {best:.3f} s, and interleaving removes only idle time")
    return None


def _no_layout_message(spec: StrategySpec, gpus: int, rejected: list[Rejection]) -> str:
    """Rejections counted by kind, with the last (most parallel or most recompute) example of each."""
    by_kind: dict[str, list[Rejection]] = {}
    for rejection in rejected:
        by_kind.setdefault(rejection.kind, []).append(rejection)
    parts = [f"{len(items)} {kind} (e.g. {items[-1]})" for kind, items in by_kind.items()]
    return (f"no feasible layout of {gpus} GPUs for {spec.name}; {len(rejected)} rejected: " + "; ".join(parts)
            + ". Use more GPUs, activation recompute, a shorter context or a smaller model")


__all__ = [
    "LayoutConstraints", "Rejection", "LayoutEvaluation", "LayoutResult", "SearchProgress", "ProgressCallback",
    "NoFeasibleLayout", "enumerate_layouts", "minimum_memory_bytes", "attention_pairs_bound", "largest_pack_tokens",
    "iteration_lower_bound", "SortedBatch", "merged_work_bound", "cheap_rejection", "best_layout",
]
