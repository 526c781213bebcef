"""What the SlimPack planner's search gets back: typed failures and outcomes.

A failure to fit memory is a `DoesNotFit` carrying what did not fit; the search falls back on
its type, never on its message. Phase 1's CP-SAT solve is a `CpSatOutcome`, a planned replica a
`ReplicaOutcome` and a planned batch a `PlannedBatch`; the search compares batches by the
outcomes, not by the plan's metadata (which only reports them, as `to_dict()`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence, TypeVar

from ..plan import Plan, PlanError

# `kept` gives back the failure it was given, of its own class.
PlanErrorT = TypeVar("PlanErrorT", bound=PlanError)


class DoesNotFit(PlanError):
    """No plan of this part of the batch fits device memory.

    `sample_ids`: the documents concerned (empty: the MicroPacks alone); `group_ranks`: the ranks
    that shared them in the attempt that failed; `bytes_needed` and `bytes_available`: per device,
    all memory counted (weights, optimizer state, activations and KV caches) against what is
    usable, or None where the shortfall is counted in ranks rather than bytes."""

    def __init__(self, message: str, *, sample_ids: Sequence[int] = (), group_ranks: int = 1,
                 bytes_needed: float | None = None, bytes_available: float | None = None):
        super().__init__(message)
        self.sample_ids = tuple(int(i) for i in sample_ids)
        self.group_ranks = group_ranks
        self.bytes_needed = bytes_needed
        self.bytes_available = bytes_available

    def __reduce__(self):
        # Keeps the fields across processes (the default would call __init__ with the message only).
        return _restored, (type(self), self.args, self.__dict__)


def _restored(cls: type[DoesNotFit], args: tuple, state: dict) -> DoesNotFit:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


def kept(error: PlanErrorT) -> PlanErrorT:
    """A caught failure to keep past its `except` block (the first of several attempts, a
    replica's), without its traceback: the traceback holds the catching frame, whose locals hold
    the failure, a cycle that kept every plan in those frames alive while a layout search pauses
    the cyclic collector. The message and the fields say what did not fit."""
    return error.with_traceback(None)


class ReplicasDoNotFit(DoesNotFit):
    """Every replica (or merge group) of one planning that did not fit memory; it reads as the
    first of them."""

    def __init__(self, failures: Sequence[DoesNotFit]):
        first = failures[0]
        super().__init__(str(first), sample_ids=first.sample_ids, group_ranks=first.group_ranks,
                         bytes_needed=first.bytes_needed, bytes_available=first.bytes_available)
        self.failures = list(failures)


@dataclass(frozen=True)
class CpSatOutcome:
    """What phase 1's CP-SAT solve returned and which assignment was used.

    `status`: CP-SAT's status name (OPTIMAL, FEASIBLE, INFEASIBLE, MODEL_INVALID or UNKNOWN);
    HINT_AT_BOUND where the LPT hint's makespan is already a lower bound of every assignment's,
    so CP-SAT is not run (the hint is used, `bound` is that lower bound); or TRIVIAL where one
    replica leaves nothing to solve (then only `time_s` and `imbalance` are set). `source`:
    "cp-sat" where CP-SAT's assignment beat its hint, else "hint" (the LPT assignment);
    `fallback` says why the hint was used where CP-SAT gave none or a worse one.
    Makespans and bounds are in seconds of the busiest replica's load."""

    status: str
    source: str | None = None
    heavy_items: int | None = None  # documents CP-SAT decides one by one
    sand_items: int | None = None  # documents poured into the amounts it gives each replica
    hint_makespan: float | None = None
    makespan: float | None = None  # CP-SAT's objective; None without a solution
    bound: float | None = None  # CP-SAT's best objective bound; None without a solution
    gap: float | None = None  # (makespan - bound) / makespan
    fallback: str | None = None
    time_s: float = 0.0  # phase 1 in all, merge groups and sand included
    imbalance: float = 1.0  # the busiest replica's load over the mean

    TRIVIAL: ClassVar[str] = "trivial"
    HINT_AT_BOUND: ClassVar[str] = "hint-at-bound"

    @property
    def solved(self) -> bool:
        """CP-SAT returned a solution (OPTIMAL or FEASIBLE)."""
        return self.makespan is not None

    def to_dict(self) -> dict:
        """The plan metadata's "phase1" entry: the fields that are set, CP-SAT's makespan as
        "objective" and the hint's as "hint"."""
        if self.status == self.TRIVIAL:
            return {"status": self.status, "time_s": self.time_s, "imbalance": self.imbalance}
        entry: dict = {"status": self.status, "heavy_items": self.heavy_items, "sand_items": self.sand_items,
                       "hint": self.hint_makespan}
        if self.solved:
            entry.update(objective=self.makespan, bound=self.bound, gap=self.gap)
        entry["source"] = self.source
        if self.fallback is not None:
            entry["fallback"] = self.fallback
        entry.update(time_s=self.time_s, imbalance=self.imbalance)
        return entry


@dataclass(frozen=True)
class ReplicaOutcome:
    """What the replica search chose for one replica or merge group, and its predicted makespan
    (stage orders replayed, no gradient reduction)."""

    dp_ranks: tuple[int, ...]
    makespan_s: float
    micropack_tokens: int | None = None  # None: the rank has no documents of its own
    units: int | None = None  # the unit count its forward and backward units were segmented for
    leaner_level: int = 0  # interleaved: the lowest level at which a schedule fit (`LEANER_SCHEDULES`; 0: Megatron's)

    def to_dict(self) -> dict:
        """The entry of the plan metadata's "replicas" list."""
        entry = {"dp_ranks": list(self.dp_ranks), "makespan_s": self.makespan_s}
        if self.micropack_tokens is not None:
            entry.update(micropack_tokens=self.micropack_tokens, units=self.units)
        return entry

    @property
    def sort_key(self) -> tuple:
        """Merge groups first, then each rank's own replica, by ranks."""
        return len(self.dp_ranks) == 1, self.dp_ranks


@dataclass
class PlannedBatch:
    """A plan of the batch and the outcomes of its replicas, in `ReplicaOutcome.sort_key` order."""

    plan: Plan
    outcomes: list[ReplicaOutcome]

    @property
    def leaner_level_needed(self) -> int:
        """The highest `LEANER_SCHEDULES` level a replica needed (0: Megatron's schedules fit all)."""
        return max((outcome.leaner_level for outcome in self.outcomes), default=0)

    @property
    def predicted_iteration_s(self) -> float:
        """The search's own estimate of the plan's time: the busiest rank's replica makespans
        (its merge groups', then its own)."""
        busy = [0.0] * self.plan.parallel.dp
        for outcome in self.outcomes:
            for rank in outcome.dp_ranks:
                busy[rank] += outcome.makespan_s
        return max(busy)


__all__ = ["DoesNotFit", "ReplicasDoNotFit", "CpSatOutcome", "ReplicaOutcome", "PlannedBatch"]
