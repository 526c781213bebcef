"""What one planned step is, and how a worker (thread or process) plans one: shared by the planner
iterator (data.py) and its worker process (planner_process.py), which import it, not each other."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from ..plan import Plan
from ..workload import GlobalBatch


@dataclass
class PlannedBatch:
    """One step: the global batch, its plan and the planning figures."""

    step: int
    batch: GlobalBatch
    plan: Plan
    planning_time_s: float  # wall time the planner spent on this batch (source rank)
    exposed_s: float = 0.0  # how long next() waited for the planner on the source rank (not hidden)
    broadcast_s: float = 0.0  # time in the plan broadcast (includes waiting for the other ranks)
    sampler_state: dict = field(default_factory=dict)  # sampler state after this batch
    planner_state: dict = field(default_factory=dict)  # the plan function's planner state after it

    @property
    def hidden_s(self) -> float:
        return max(0.0, self.planning_time_s - self.exposed_s)

    def replica_plans(self, dp_rank: int):
        return self.plan.replicas_of_rank(dp_rank)

    def stage_order(self, dp_rank: int, pp_rank: int):
        return [replica.stage_orders[pp_rank] for replica in self.replica_plans(dp_rank)]

    def token_source(self, corpus) -> "BatchTokenSource":
        return BatchTokenSource(corpus, self.plan)


class BatchTokenSource:
    """The runtime's `TokenSource` over a plan: sample s of the plan is tokens [offset, offset +
    length) of corpus document `document`, as the plan records it (`Plan.sample_sources`; a piece
    that a strategy cut or carried over from an earlier batch included). `tokens(s, start, end)`
    returns [start, end + 1) of that piece, clipped at the piece's end (a piece split off a
    document is its own sample: its last token has no label)."""

    def __init__(self, corpus, plan: Plan):
        self.corpus = corpus
        self.where = plan.source_of()

    def tokens(self, sample_id: int, start: int, end: int):
        try:
            document, offset, length = self.where[sample_id]
        except KeyError:
            raise KeyError(f"sample {sample_id} is not in the plan this token source was built from") from None
        stop = min(end + 1, length)
        return self.corpus.tokens(document, offset + start, offset + stop)


class PlannerError(RuntimeError):
    pass


DONE = object()  # the worker's "no more batches"


def planner_of(plan_fn):
    """The stateful planner behind `plan_fn` (`plan_function` keeps it), if any."""
    return getattr(plan_fn, "planner", None)


def planner_state_of(plan_fn) -> dict:
    planner = planner_of(plan_fn)
    return planner.state_dict() if planner is not None else {}


def restore_position(sampler, plan_fn, sampler_state: dict, planner_state: Optional[dict]) -> None:
    """Put `sampler` and the planner behind `plan_fn` in the state after the last consumed batch
    (a worker's first act: it continues exactly where the iterator's checkpoint says)."""
    sampler.load_state_dict(sampler_state)
    planner = planner_of(plan_fn)
    if planner is not None and planner_state is not None:
        planner.load_state_dict(planner_state)


def plan_one(sampler, plan_fn) -> PlannedBatch:
    batch = sampler.next_batch()
    state = sampler.state_dict()
    began = time.perf_counter()
    plan = plan_fn(batch)
    elapsed = time.perf_counter() - began
    plan.metadata.setdefault("planning_time_s", elapsed)
    return PlannedBatch(batch.step, batch, plan, elapsed, sampler_state=state, planner_state=planner_state_of(plan_fn))
