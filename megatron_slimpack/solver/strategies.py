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
from typing import Callable, Optional, Sequence

from ..config import SlimPackConfig
from ..costmodel import CostModel
from ..plan import Plan, PlanError, check_sources, overlapping_documents
from ..specs import ParallelConfig
# SlimPack's memory rules and search live in their own modules; these names stay importable here.
from .memory import activation_budget, auto_token_cap, document_memory_bytes  # noqa: F401
from .outcomes import DoesNotFit  # noqa: F401
from .search import SlimPackSearch, shared_by_groups  # noqa: F401

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

def plan_slimpack(
    lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig,
    *, symmetric: bool = False, dp_merge: bool | None = None, sources=None,
) -> Plan:
    """SlimPack's plan of one global batch (`search.SlimPackSearch`). With `config.base_merge`
    k > 1, or where no plan of the layout fits memory (then k = 2, 4, ...), every MicroPack is
    shared by a DP-Merge group of k replicas: planned as k-fold context parallelism over dp / k
    replicas (`base_merge` in the metadata), run as DP-Merge groups."""
    plan = SlimPackSearch(lengths, parallel, cost, config, symmetric=symmetric, dp_merge=dp_merge).plan()
    return with_input_sources(plan, sources, len(lengths))


@register("slimpack")
def _slimpack(lengths, parallel, cost, config, *, sources=None):
    return plan_slimpack(lengths, parallel, cost, config, sources=sources)


@register("slimpack-sym")
def _slimpack_symmetric(lengths, parallel, cost, config, *, sources=None):
    return plan_slimpack(lengths, parallel, cost, config, symmetric=True, sources=sources)


@register("slimpack-nomerge")
def _slimpack_no_merge(lengths, parallel, cost, config, *, sources=None):
    return plan_slimpack(lengths, parallel, cost, config, dp_merge=False, sources=sources)
