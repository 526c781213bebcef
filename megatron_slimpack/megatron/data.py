"""The planner iterator: global batches in, one identical plan per step on every rank out.

`PlannerIterator` wraps a `workload.GlobalBatchSampler` (document lengths of each global batch
and where their tokens live) and a planning function. It

* plans ahead: a background worker thread draws batch n+1.. n+plan_ahead and plans them while
  step n trains, so planning is off the critical path. Per step it records the planning time and
  how long `next()` actually waited for it (`exposed_s`); `hidden_s = planning - exposed`;
* makes every rank run the same plan: only the source rank (rank 0 of `group`) samples and
  plans; in `next()` (main thread, same order on every rank) it broadcasts the plan JSON, the
  batch and the sampler state with `torch.distributed.broadcast_object_list`. Without an
  initialised process group the iterator plans locally;
* serves each rank its metadata: `PlannedBatch.replica_plans(dp_rank)` / `.stage_order(dp, pp)`
  (the plan fixes every shape: cu_seqlens and units come from it, no shape exchange);
* checkpoints exactly: `state_dict()` holds the sampler state *after the last batch consumed*
  (batches planned ahead but not consumed are drawn again after `load_state_dict`), so a resumed
  run sees exactly the batches an uninterrupted run would have; with a planning function from
  `plan_function`, also its planner's state after that batch (WLB-LLM's delayed documents).

`plan_function(planner, parallel, cost, config)` is the planning function a run gives it: each
batch is planned with its samples' sources (`GlobalBatch.sources`), which the plan records per
sample (`Plan.sample_sources`); `BatchTokenSource(corpus, plan)` reads tokens through exactly that
mapping. `fast_forward(sampler, planner, ...)` brings sampler and planner to their state after N
batches (a run resumed at step N), including a stateful strategy's delayed documents.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..plan import Plan, Sample
from ..workload import GlobalBatch, GlobalBatchSampler, TextCorpus

PlanFunction = Callable[[GlobalBatch], Plan]


def plan_function(planner, parallel, cost, config) -> PlanFunction:
    """`plan_batch(batch) -> Plan` for a planner iterator: the batch's lengths (checked against the
    context length) planned by `planner` (a `solver.strategies.StepPlanner`, e.g. from
    `new_planner(config.strategy)`) with `sources=batch.sources`, then validated. The function
    keeps the planner as `plan_batch.planner` (its state is the state after the batches planned)."""
    from ..solver.strategies import check_plan_input

    def plan_batch(batch: GlobalBatch) -> Plan:
        lengths = check_plan_input(batch.lengths, config.context_length)
        return planner.plan(lengths, parallel, cost, config, sources=batch.sources).validate()

    plan_batch.planner = planner
    return plan_batch


def fast_forward(sampler: GlobalBatchSampler, planner, parallel, cost, config, steps: int) -> None:
    """Draw `steps` batches from `sampler` and bring `planner` to its state after planning them
    (`StepPlanner.advance`: nothing for stateless strategies; WLB-LLM's delay queues and carried
    documents as planning would leave them), without building plans. A run resumed at step N calls
    this with steps=N, then plans batch N as the uninterrupted run did."""
    from ..solver.strategies import check_plan_input

    for _ in range(int(steps)):
        batch = sampler.next_batch()
        planner.advance(check_plan_input(batch.lengths, config.context_length), parallel, cost, config,
                        sources=batch.sources)


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


_DONE = object()


class PlannerIterator:
    """Iterator of `PlannedBatch`; see the module docstring.

    `plan_fn(batch) -> Plan` runs on the source rank only (in the worker thread when
    `plan_ahead >= 1`, inline with `plan_ahead=0`). `steps`: stop after that many batches (None:
    endless). `group`: the process group over which plans are broadcast (default: the world when
    torch.distributed is initialised). Call `close()` (or use it as a context manager) to stop
    the worker.
    """

    def __init__(
        self,
        sampler: GlobalBatchSampler,
        plan_fn: PlanFunction,
        *,
        plan_ahead: int = 1,
        steps: Optional[int] = None,
        group=None,
        broadcast: Optional[bool] = None,
    ):
        import torch.distributed as dist

        if plan_ahead < 0:
            raise ValueError(f"plan_ahead must be >= 0, got {plan_ahead}")
        self.sampler = sampler
        self.plan_fn = plan_fn
        self.plan_ahead = plan_ahead
        self.steps = steps
        self.group = group
        self.distributed = dist.is_initialized() if broadcast is None else broadcast
        if self.distributed:
            self.rank = dist.get_rank(group)
            self.source = dist.get_global_rank(group, 0) if group is not None else 0
        else:
            self.rank, self.source = 0, 0
        self.is_source = self.rank == 0
        self._consumed = 0
        self._state = sampler.state_dict()  # after the last consumed batch
        self._planner_state = self._planner_state_now()  # likewise
        self.history: list[PlannedBatch] = []
        self._queue: Optional[queue.Queue] = None
        self._worker: Optional[threading.Thread] = None
        self._stop = threading.Event()

    # ---- worker ----------------------------------------------------------------------------
    def _remaining(self, drawn: int) -> bool:
        return self.steps is None or drawn < self.steps

    def _planner(self):
        """The stateful planner behind `plan_fn` (`plan_function` keeps it), if any."""
        return getattr(self.plan_fn, "planner", None)

    def _planner_state_now(self) -> dict:
        planner = self._planner()
        return planner.state_dict() if planner is not None else {}

    def _plan_one(self) -> PlannedBatch:
        batch = self.sampler.next_batch()
        state = self.sampler.state_dict()
        began = time.perf_counter()
        plan = self.plan_fn(batch)
        elapsed = time.perf_counter() - began
        plan.metadata.setdefault("planning_time_s", elapsed)
        return PlannedBatch(batch.step, batch, plan, elapsed, sampler_state=state,
                            planner_state=self._planner_state_now())

    def _put(self, item) -> None:
        """Queue `item`, giving up when close() asks the worker to stop (never blocks forever)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _work(self, drawn: int) -> None:
        try:
            while self._remaining(drawn) and not self._stop.is_set():
                item = self._plan_one()
                drawn += 1
                self._put(item)
            self._put(_DONE)
        except BaseException as error:  # surfaced by next()
            self._put(error)

    def _start(self) -> None:
        if self._worker is None and self.is_source and self.plan_ahead > 0:
            self._queue = queue.Queue(maxsize=self.plan_ahead)
            self._stop.clear()
            self._worker = threading.Thread(target=self._work, args=(self._consumed,), name="slimpack-planner",
                                            daemon=True)
            self._worker.start()

    def close(self) -> None:
        if self._worker is not None:
            self._stop.set()
            self._worker.join()
            self._worker = None
            self._queue = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- iteration -------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> PlannedBatch:
        began = time.perf_counter()
        item = None
        if self.is_source:
            if not self._remaining(self._consumed):
                item = _DONE
            elif self.plan_ahead == 0:
                item = self._plan_one()
            else:
                self._start()
                item = self._queue.get()
                if isinstance(item, BaseException):
                    self.close()
                    raise PlannerError(f"planning failed: {item!r}") from item
        waited = time.perf_counter() - began
        if self.distributed:
            item = self._broadcast(item)
        if item is _DONE or item is None:
            self.close()
            raise StopIteration
        item.exposed_s = waited if self.is_source else 0.0
        item.broadcast_s = time.perf_counter() - began - waited
        self._consumed += 1
        self._state = item.sampler_state
        self._planner_state = item.planner_state
        self.history.append(item)
        return item

    def _broadcast(self, item):
        import torch.distributed as dist

        if self.is_source:
            payload = ["done"] if item is _DONE else [{
                "step": item.step, "plan": item.plan.to_json(), "planning_time_s": item.planning_time_s,
                "sampler_state": item.sampler_state, "planner_state": item.planner_state,
                "batch": _batch_to_dict(item.batch),
            }]
        else:
            payload = [None]
        dist.broadcast_object_list(payload, src=self.source, group=self.group)
        data = payload[0]
        if data == "done":
            return _DONE
        if self.is_source:
            return item
        return PlannedBatch(data["step"], _batch_from_dict(data["batch"]), Plan.from_json(data["plan"]),
                            data["planning_time_s"], sampler_state=data["sampler_state"],
                            planner_state=data.get("planner_state", {}))

    # ---- figures and checkpointing ------------------------------------------------------------
    def planning_summary(self) -> dict:
        planning = sum(item.planning_time_s for item in self.history)
        exposed = sum(min(item.exposed_s, item.planning_time_s) for item in self.history)
        return {"steps": len(self.history), "planning_s": planning, "exposed_s": exposed,
                "broadcast_s": sum(item.broadcast_s for item in self.history),
                "hidden_s": max(0.0, planning - exposed),
                "hidden_fraction": (planning - exposed) / planning if planning > 0 else 1.0}

    def state_dict(self) -> dict:
        return {"consumed": self._consumed, "sampler": dict(self._state), "planner": self._planner_state}

    def load_state_dict(self, state: dict) -> None:
        """Continue after the batches consumed when `state` was saved (call before iterating); the
        planner behind a `plan_function` gets its state after them too."""
        self.close()
        self.sampler.load_state_dict(state["sampler"])
        planner = self._planner()
        if planner is not None and "planner" in state:
            planner.load_state_dict(state["planner"])
        self._consumed = int(state["consumed"])
        self._state = dict(state["sampler"])
        self._planner_state = self._planner_state_now() if planner is not None else {}


def _batch_to_dict(batch: GlobalBatch) -> dict:
    from dataclasses import asdict

    return {"step": batch.step, "lengths": batch.lengths, "sample_ids": batch.sample_ids,
            "sources": [list(s) for s in batch.sources], "stats": asdict(batch.stats)}


def _batch_from_dict(data: dict) -> GlobalBatch:
    from ..workload import BatchStats

    return GlobalBatch(step=data["step"], lengths=list(data["lengths"]), sample_ids=list(data["sample_ids"]),
                       sources=[tuple(s) for s in data["sources"]], stats=BatchStats(**data["stats"]))


def samples_of(batch: GlobalBatch) -> list[Sample]:
    return batch.samples()


__all__ = ["PlannedBatch", "BatchTokenSource", "PlannerIterator", "PlannerError", "TextCorpus", "plan_function",
           "fast_forward"]
