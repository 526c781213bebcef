"""`SlimPackConfig`: the planner's knobs, one dataclass shared by the Python API, CLI and flags."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace


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

    def with_(self, **changes) -> "SlimPackConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)
