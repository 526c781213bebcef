"""`SlimPackConfig`: the planner's knobs, one dataclass shared by the Python API, CLI and flags."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace


@dataclass(frozen=True)
class PlannerTunables:
    """How hard the SlimPack planner searches, not what it plans for: the defaults are the values
    docs/history.md measured plans with (tests/golden/plans.json holds their plans)."""

    # Phase 1: the heaviest documents CP-SAT decides one by one; the rest is sand poured after it.
    max_model_items: int = 160
    # Phase 1: integer resolution of costs inside CP-SAT (seconds times this).
    cost_scale: int = 1_000_000
    # Phase 1: sand documents per replica dealt one at a time (the heavy head of the sand); the
    # rest is poured in contiguous runs.
    dealt_sand_per_replica: int = 256
    # The smallest MicroPack (tokens) the planner tries.
    min_micropack_tokens: int = 1024
    # Unit candidates of one packing, best quick estimates first, that get a full replay.
    replayed_candidates: int = 3
    # MicroPack sizes found by bisection are multiples of this many tokens.
    size_granule: int = 256
    # The heaviest replica's bisection between two ladder sizes stops within 1/this of the size
    # that fits (1: no bisection between sizes a ladder step apart).
    refine_fraction: int = 16
    # With a pipeline, a slice may cost this much more than a typical full MicroPack.
    even_cost_tolerance: float = 1.1
    # Slices added at most to balance seconds or meet an even cost (each try costs a cut).
    extra_slices: int = 8
    # Reweighting rounds that balance a document's slices on seconds rather than work.
    balancing_rounds: int = 3

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            least = 0 if item.name == "extra_slices" else 1
            if item.type in ("int", int):
                if isinstance(value, bool) or not isinstance(value, int) or value < least:
                    raise ValueError(f"PlannerTunables.{item.name} must be an integer >= {least}, got {value!r}")
            elif not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1:
                raise ValueError(f"PlannerTunables.{item.name} must be a finite number >= 1, got {value!r}")


@dataclass(frozen=True)
class SlimPackConfig:
    strategy: str = "slimpack"
    context_length: int = 65536
    # Token cap of one MicroPack; None: the largest that fits memory (cost model), at most the context.
    max_micropack_tokens: int | None = None
    # Target slice size for long documents; None: the planner tries several and simulates each.
    slice_tokens: int | None = None
    dp_merge: bool = True
    # Every MicroPack shared by a DP-Merge group of this many replicas (planned as that much
    # context parallelism over dp / base_merge replicas); 1: only outliers are shared (and every
    # MicroPack only where no other plan fits memory).
    base_merge: int = 1
    # A sample whose cost exceeds this multiple of the mean replica load is shared by a merge group.
    merge_threshold: float = 1.25
    solver_time_limit_s: float = 0.5
    # CP-SAT's deterministic-time budget (its work units, about seconds): with one worker the plan is
    # then the same on any machine under any load, which a wall-clock limit alone cannot promise.
    # None: the wall-clock limit only. Whichever limit is hit first stops the search.
    solver_deterministic_limit: float | None = None
    seed: int = 0
    solver_workers: int = 1
    # The search's effort knobs (not exposed as flags).
    tunables: PlannerTunables = field(default_factory=PlannerTunables)

    def with_(self, **changes) -> "SlimPackConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)
