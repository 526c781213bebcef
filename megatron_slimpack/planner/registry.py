"""The strategy registry: what a strategy is (`StepPlanner`, `StrategySpec`) and how one registers.

A strategy turns one global batch of document lengths into a validated `Plan`. Each registers
once, where it is implemented, with every fact the rest of the package needs about it:

    @register("bfd", role="baseline", trainable=True, description="...", minimum_in_flight="document")
    def plan_bfd(lengths, parallel, cost, config, *, sources=None) -> Plan: ...

    @register_stateful("wlb-llm", ...)          # a StepPlanner subclass that keeps state across batches
    class WlbLlmPlanner(StepPlanner): ...

Code outside the strategies asks the spec (`strategies.strategy_spec(name)`) instead of
branching on a name: whether the SlimPack runtime trains with it (`trainable`; the others are
simulated for comparison only), whether it keeps state between batches (`stateful`), and the
layout facts the layout search needs (`constraints`, `minimum_in_flight`, `sizes_to_memory`,
`splits_documents`, `cp_is_base_merge`), the plan format's (`renumbers_samples`), and whether it
trains what the others train (`different_semantics`: a reference such as megatron-stock, which
comparisons show apart and never count as the best other strategy).

Dependencies: this module imports no other planner module; `baselines/` and `strategies.py`
import it to register, and `strategies.py` imports every module that registers, so the complete
registry is `strategies.strategy_specs()` (this module's `REGISTRY` holds only what has been
imported so far).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from ..config import SlimPackConfig
from ..costmodel import CostModel
from ..costmodel.overlaps import SERIAL, Overlaps
from ..costmodel.overlaps import declare as declare_overlaps
from ..plan import Plan, PlanError, check_sources, overlapping_documents
from ..specs import ParallelConfig

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
    `state_dict()` / `load_state_dict()` (empty for stateless strategies).

    A planner plans with the cost its strategy's run is priced at (`overlaps`, set from the
    strategy's `StrategySpec.overlaps` by `new_planner`): the communication its run hides is not
    what its balancing trades against compute, as the simulator will not charge it either. A
    stateful subclass prices the cost it is given with `priced` in each of its methods."""

    overlaps: Overlaps = SERIAL

    def __init__(self, function: Strategy | None = None):
        self.function = function

    def priced(self, cost: CostModel) -> CostModel:
        """`cost` pricing communication as this strategy's run does."""
        return cost.with_overlaps(self.overlaps)

    def plan(self, lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig, *,
             sources: Sources = None) -> Plan:
        """The plan of one global batch; `sources[i]` = (document, offset) of `lengths[i]` (default
        (i, 0)), recorded for every sample of the plan in `Plan.sample_sources`."""
        assert self.function is not None
        return self.function(lengths, parallel, self.priced(cost), config, sources=sources)

    def advance(self, lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig, *,
                sources: Sources = None) -> None:
        """Update the state exactly as `plan` on this batch would, without building the plan
        (stateless strategies: nothing to do)."""

    def untrained_lengths(self) -> list[int]:
        """Lengths of the documents given so far that no plan holds yet (a stateful planner's
        delayed ones; stateless strategies plan every batch whole: none)."""
        return []

    def state_dict(self) -> dict:
        """The planner's state between batches, JSON-able (stateless strategies: empty)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise PlanError(f"{type(self).__name__} is stateless but was given the state {sorted(state)}")


def with_input_sources(plan: Plan, sources, count: int) -> Plan:
    """`plan` (whose samples are the input lengths: sample id i is lengths[i]) with sample i's
    source `sources[i]` (None: the default (i, 0), which the Plan already holds) and the documents
    the input holds twice. Every strategy records its samples' sources (docs/design.md section 2)."""
    if sources is not None:
        sources = check_sources(sources, count)
        ids = [sample_id for sample_id, _ in plan.samples]
        plan.sample_sources = sources if ids == list(range(count)) else [sources[i] for i in ids]
        plan.repeated_documents = overlapping_documents(plan.sample_sources, [n for _, n in plan.samples])
    return plan


# ==== layout facts ===============================================================================


@dataclass(frozen=True)
class LayoutConstraints:
    """Values a strategy allows (None: any the hardware and model allow), and why. Virtual
    pipeline stages (`vpp`) are opt-in: a strategy runs plain 1F1B unless it lists them."""

    pp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    vpp: tuple[int, ...] | None = (1,)
    reason: str = ""

    def allows(self, parallel: ParallelConfig) -> bool:
        return ((self.pp is None or parallel.pp in self.pp) and (self.cp is None or parallel.cp in self.cp)
                and (self.vpp is None or parallel.vpp in self.vpp))


# What a strategy must hold in activation memory at once, at least (`layouts.minimum_memory_bytes`):
#   sequence:        one full fixed-length sequence (min(context, batch tokens) tokens)
#   document:        the longest document, whole
#   half-document:   the larger piece of the longest document (it may be cut at a sequence boundary)
#   merged-document: the longest document, whole, shared by the largest DP-Merge group (SlimPack's
#                    own memory rule, `memory.document_memory_bytes`, with CP widened by the group)
#   none:            nothing fixed (the strategy sizes its work to memory itself)
MINIMUM_IN_FLIGHT_RULES = ("sequence", "document", "half-document", "merged-document", "none")

# What a strategy is to the project: SlimPack itself, an ablation of it, or a peer it is compared with.
ROLES = ("method", "ablation", "baseline")


@dataclass(frozen=True)
class StrategySpec:
    """One registered strategy and every fact about it that code outside it needs."""

    name: str
    # A fresh planner (stateless strategies: a StepPlanner around the function; stateful: the class).
    factory: Callable[[], StepPlanner]
    # It keeps state between batches (delayed documents roll into later steps): its step may hold
    # other documents than the batch, and a layout search runs each layout over every batch.
    stateful: bool
    # The SlimPack runtime trains with it (`--slimpack-strategy` accepts it); otherwise it is
    # simulated for comparison only.
    trainable: bool
    role: str
    description: str
    # Parallel layouts it supports (`layouts.enumerate_layouts`).
    constraints: LayoutConstraints = field(default_factory=LayoutConstraints)
    # What it must hold in memory at once (one of MINIMUM_IN_FLIGHT_RULES).
    minimum_in_flight: str = "none"
    # Its plan grows into the memory left (MicroPack size, units in flight, DP-Merge groups follow
    # the activation budget): a heavier recompute mode can make it faster, so the layout search's
    # recompute cascade does not apply, and its packs never exceed its own MicroPack cap.
    sizes_to_memory: bool = False
    # It cuts documents at sequence boundaries: its attention pairs can be fewer than the
    # documents' (a document in two pieces keeps at least its halves' pairs).
    splits_documents: bool = False
    # Its samples are not the input lengths (it cuts documents or carries them across steps): its
    # plans must say where every sample comes from (plan.py's check; tests/test_baselines.py keeps them equal).
    renumbers_samples: bool = False
    # Each rank runs exactly global-batch-size / dp sequences per step (Megatron's GPTDataset), so
    # with virtual stages that count must be a multiple of pp: checked when the flags are parsed.
    fixed_sequences_per_rank: bool = False
    # Its plan depends on the layout only through dp, pp and vpp (and the config), never on the
    # cost model, tp, cp or the recompute mode: a layout search plans and validates each batch once
    # per (dp, pp, vpp) and gives the other layouts of that shape the same plan.
    plans_by_shape: bool = False
    # Its layout's cp k is a base merge (every MicroPack shared by a DP-Merge group of k replicas),
    # which Megatron runs with --context-parallel-size 1, dp x k replicas and --slimpack-base-merge k.
    cp_is_base_merge: bool = False
    # What it trains differently from the others, in words (empty: what every other strategy trains,
    # causal attention within each document, or within each piece of one where a strategy cuts it).
    # Such a strategy (megatron-stock: attention across the documents packed into a sequence) is a
    # reference: compared with, labelled with this note, never counted as a competing strategy.
    different_semantics: str = ""
    # The communication its real run hides behind compute (costmodel/overlaps.py); the simulator
    # prices its plans with these, and comparisons print them with the flags that give them.
    overlaps: Overlaps = SERIAL

    @property
    def is_reference(self) -> bool:
        """It trains a different semantic (`different_semantics`): a reference, not a competitor."""
        return bool(self.different_semantics)

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"a strategy needs a name, got {self.name!r}")
        if self.minimum_in_flight not in MINIMUM_IN_FLIGHT_RULES:
            raise ValueError(f"strategy {self.name!r}: minimum_in_flight must be one of {MINIMUM_IN_FLIGHT_RULES}, "
                             f"got {self.minimum_in_flight!r}")
        if self.role not in ROLES:
            raise ValueError(f"strategy {self.name!r}: role must be one of {ROLES}, got {self.role!r}")
        if self.plans_by_shape and self.stateful:
            raise ValueError(f"strategy {self.name!r}: a stateful planner's step depends on the batches before it, "
                             "so it cannot plan by shape")

    def new_planner(self) -> StepPlanner:
        planner = self.factory()
        planner.overlaps = self.overlaps
        return planner


# name -> spec, in registration order. Complete only once every registering module is imported:
# ask `strategies.strategy_specs()`, which imports them.
REGISTRY: dict[str, StrategySpec] = {}


def _add(spec: StrategySpec) -> None:
    if spec.name in REGISTRY:
        raise ValueError(f"strategy {spec.name!r} is registered twice")
    REGISTRY[spec.name] = spec
    declare_overlaps(spec.name, spec.overlaps)


def register(name: str, *, role: str, trainable: bool, description: str, **facts):
    """Register a stateless strategy function `f(lengths, parallel, cost, config, *, sources=None)`
    (it records every sample's (document, offset) source in the plan). `facts`: the other
    `StrategySpec` fields."""
    def wrap(function: Strategy) -> Strategy:
        _add(StrategySpec(name, lambda: StepPlanner(function), stateful=False, trainable=trainable, role=role,
                          description=description, **facts))
        return function

    return wrap


def register_stateful(name: str, *, role: str, trainable: bool, description: str, **facts):
    """Register a StepPlanner subclass; each planning run (a training run, a layout's
    evaluation) gets a fresh instance."""
    def wrap(cls: type[StepPlanner]) -> type[StepPlanner]:
        if not (isinstance(cls, type) and issubclass(cls, StepPlanner)):
            raise TypeError(f"register_stateful({name!r}) needs a StepPlanner subclass, got {cls!r}")
        _add(StrategySpec(name, cls, stateful=True, trainable=trainable, role=role, description=description,
                          **facts))
        cls.overlaps = REGISTRY[name].overlaps  # an instance made from the class directly prices as its runs
        return cls

    return wrap


__all__ = ["Strategy", "Sources", "StepPlanner", "with_input_sources", "LayoutConstraints", "StrategySpec",
           "MINIMUM_IN_FLIGHT_RULES", "ROLES", "REGISTRY", "register", "register_stateful"]
