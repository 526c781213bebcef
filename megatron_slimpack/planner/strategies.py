"""The SlimPack planner entry point and the complete strategy registry.

A strategy turns one global batch of document lengths into a validated `Plan`. `slimpack` is the
full method (phase 1 DP balance with DP-Merge, phase 2 cost-balanced slicing and asymmetric
units, candidates scored by simulation); `slimpack-sym` and `slimpack-nomerge` are its
ablations. Each registers in `registry.py` with its `StrategySpec` (the baselines from
`baselines/`); this module imports every registering module, so its lookups
(`strategy_spec`, `strategy_specs`, `strategy_names`, `new_planner`) see them all.
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import replace

from ..config import SlimPackConfig
from ..costmodel import SLIMPACK_RUNTIME, CostModel
from ..plan import Plan, PlanError, check_sources
from ..simulator import SimulationError, busiest_device_s, simulate
from ..specs import ParallelConfig
from ..workload import check_lengths
from .outcomes import DoesNotFit  # noqa: F401
from .registry import (  # noqa: F401
    REGISTRY,
    ROLES,
    LayoutConstraints,
    Sources,
    StepPlanner,
    Strategy,
    StrategySpec,
    register,
    register_stateful,
    with_input_sources,
)

# SlimPack's memory rules and search live in their own modules; these names stay importable here.
from .slimpack.memory import activation_budget, auto_token_cap, document_memory_bytes  # noqa: F401
from .slimpack.search import SlimPackSearch, shared_by_groups  # noqa: F401

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
    if not symmetric and dp_merge is None and config.fixed_grouping_floor:
        plan = no_slower_than_fixed_grouping(plan, lengths, parallel, cost, config)
    return with_input_sources(plan, sources, len(lengths))


def no_slower_than_fixed_grouping(plan: Plan, lengths: list[int], parallel: ParallelConfig, cost: CostModel,
                                  config: SlimPackConfig) -> Plan:
    """`plan`, or Megatron's fixed-length grouping with prefixes kept (`prefix_keeping_fixed_plan`)
    where the simulator prices that faster and it fits: SlimPack never plans a step its own model
    prices slower than fixed-length packing's (the same objective, run by the same runtime, priced
    with SlimPack's overlaps). On a layout with cp k, or a plan with a base merge k, the grouping
    is made for the view SlimPack planned (dp / k replicas, k-fold context parallelism) and shared
    by the same DP-Merge groups (`shared_by_groups`): each sequence's MicroPack is held by k ranks,
    as Megatron's context parallelism holds it."""
    base_merge = int(plan.metadata.get("base_merge", 1))
    view = parallel.with_(dp=parallel.dp // base_merge, cp=parallel.cp * base_merge)
    try:
        grouping_plan = baselines.fixed.prefix_keeping_fixed_plan(lengths, view, cost, config)
        if base_merge > 1:
            grouping_plan = shared_by_groups(grouping_plan.validate(), parallel, base_merge)
    except PlanError:  # the batch does not deal evenly over the ranks
        return plan
    candidate = replace(grouping_plan, strategy=plan.strategy)
    planned = simulate(plan, cost, detail=False)
    # Where the grouping's busiest device alone takes longer, it cannot be faster: neither
    # validated nor simulated (the margin covers the order of float sums).
    try:
        if busiest_device_s(candidate, cost) > planned.iteration_time_s * (1 + 1e-9):
            return plan
        grouping_plan.validate()
    except (PlanError, SimulationError):  # a rule the grouping breaks
        return plan
    grouping = simulate(candidate, cost, detail=False)
    if grouping.fits_memory and grouping.iteration_time_s < planned.iteration_time_s:
        candidate.metadata.update(cost_model=cost.describe(), planned_search_s=planned.iteration_time_s)
        return candidate
    return plan


# The SlimPack runtime runs virtual pipeline stages (runtime/pipeline/schedule.py): its layouts include vpp.
INTERLEAVED = LayoutConstraints(vpp=None, reason="the SlimPack schedule runs any vpp dividing the layers per stage")


@register("slimpack", overlaps=SLIMPACK_RUNTIME, role="method", trainable=True,
          description="SlimPack: cost-balanced slices, asymmetric units, DP-Merge",
          minimum_in_flight="merged-document", sizes_to_memory=True, cp_is_base_merge=True, constraints=INTERLEAVED)
def _slimpack(lengths, parallel, cost, config, *, sources=None):
    return plan_slimpack(lengths, parallel, cost, config, sources=sources)


@register("slimpack-sym", overlaps=SLIMPACK_RUNTIME, role="ablation", trainable=True,
          description="SlimPack with symmetric units (same grouping for forward and backward)",
          minimum_in_flight="merged-document", sizes_to_memory=True, cp_is_base_merge=True, constraints=INTERLEAVED)
def _slimpack_symmetric(lengths, parallel, cost, config, *, sources=None):
    return plan_slimpack(lengths, parallel, cost, config, symmetric=True, sources=sources)


# SlimPack's cp k is its base merge: every MicroPack shared by a DP-Merge group of k replicas
# (planned as cp k, `plan_slimpack`; run with Megatron's --context-parallel-size 1, dp x k replicas
# and --slimpack-base-merge k). Without DP-Merge there is no such group.
@register("slimpack-nomerge", overlaps=SLIMPACK_RUNTIME, role="ablation", trainable=True,
          description="SlimPack without DP-Merge",
          minimum_in_flight="document", sizes_to_memory=True,
          constraints=LayoutConstraints(
              cp=(1,), vpp=None, reason="slimpack-nomerge has no DP-Merge, so no base merge (SlimPack's cp) either"))
def _slimpack_no_merge(lengths, parallel, cost, config, *, sources=None):
    return plan_slimpack(lengths, parallel, cost, config, dp_merge=False, sources=sources)


# Every other registering module (it imports `registry`, never this module).
from . import baselines  # noqa: E402,F401

# ---- the complete registry ---------------------------------------------------------------------

def strategy_specs() -> dict[str, StrategySpec]:
    """Every registered strategy's spec: the method, its ablations, then the baselines (each group
    in registration order, whichever module was imported first)."""
    ordered = sorted(enumerate(REGISTRY.values()), key=lambda item: (ROLES.index(item[1].role), item[0]))
    return {spec.name: spec for _, spec in ordered}


def strategy_spec(name: str) -> StrategySpec:
    """The spec of `name`; PlanError naming the known strategies if there is none."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise PlanError(f"unknown strategy {name!r}; known: {', '.join(strategy_names())}") from None


def as_spec(strategy: StrategySpec | str) -> StrategySpec:
    """A strategy given by its spec or its name, resolved once where it enters (a public call);
    below that, code passes the spec."""
    return strategy if isinstance(strategy, StrategySpec) else strategy_spec(strategy)


def strategy_names() -> list[str]:
    return sorted(REGISTRY)


def trainable_strategy_names() -> tuple[str, ...]:
    """The strategies the SlimPack runtime trains with (`--slimpack-strategy`), in registration order;
    the others are simulated for comparison only."""
    return tuple(name for name, spec in strategy_specs().items() if spec.trainable)


def strategy_help(*, trainable_only: bool = False) -> str:
    """The strategies by role for a help text: "slimpack; ablations slimpack-sym, ...; baselines ..."
    (`trainable_only`: those the SlimPack runtime trains with)."""
    groups: dict[str, list[str]] = {}
    for spec in strategy_specs().values():
        if spec.trainable or not trainable_only:
            groups.setdefault(spec.role, []).append(spec.name)
    labels = {"method": "", "ablation": "ablations ", "baseline": "baselines "}
    return "; ".join(labels[role] + ", ".join(names) for role, names in groups.items())


def new_planner(name: str) -> StepPlanner:
    return strategy_spec(name).new_planner()


def planning_view(parallel: ParallelConfig, config: SlimPackConfig) -> tuple[ParallelConfig, int]:
    """The layout `config.strategy` plans a run of `parallel` on, and the base merge k its plans are
    then shared by (`shared_by_groups`; 1: none). A run with --slimpack-base-merge k has cp 1 and
    dp times k replicas in Megatron: a strategy that reads the base merge itself (SlimPack's,
    `cp_is_base_merge`) plans `parallel`; any other plans dp / k replicas with k-fold context
    parallelism, the layout `slimpack compare` chose and priced for it, run as DP-Merge groups."""
    k = 1 if strategy_spec(config.strategy).cp_is_base_merge else config.base_merge
    return parallel.with_(dp=parallel.dp // k, cp=parallel.cp * k), k


def plan_on_view(planner: StepPlanner, lengths: list[int], parallel: ParallelConfig, cost: CostModel,
                 config: SlimPackConfig, sources: Sources = None) -> Plan:
    """`planner`'s plan of one batch for a run of `parallel`, planned on its `planning_view`."""
    view, base_merge = planning_view(parallel, config)
    plan = planner.plan(lengths, view, cost, config, sources=sources)
    return plan if base_merge == 1 else shared_by_groups(plan, parallel, base_merge)


def get_strategy(name: str) -> Strategy:
    """A one-shot function for `name` (stateful strategies start from an empty state)."""
    planner = new_planner(name)
    return planner.plan


@contextlib.contextmanager
def cyclic_gc_paused():
    """Planning allocates ~10^5 small tuples (samples, slices) that hold no reference cycles; the
    cyclic collector would rescan them over and over (a third of the planning time at 256K), and
    with them everything else alive (a layout search keeps every finalist's plans). Paused for one
    planning (`plan()`) or one layout search (`best_layout`); what cycles there are go in the next
    pass after it. A planner thread beside training does not pause it (that would pause it for the
    training loop too); the planner worker process pauses its own, and the training process pauses
    it while it unpickles a plan (megatron/planner_process.py)."""
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
    return check_lengths(lengths, context_length)

